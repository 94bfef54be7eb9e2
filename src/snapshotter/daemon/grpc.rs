//! The gRPC faces of the daemon: containerd's snapshots service and vmdisk's management API.
//! Requests are translated to [`Snapshotter`] calls; errors become gRPC status through the one
//! mapping in [`crate::api`].

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};

use crate::api::containerd::services::snapshots::v1 as pb;
use crate::api::containerd::types::Mount as PbMount;
use crate::api::vmdisk::v1 as mpb;
use crate::snapshotter::counters::Counted;
use crate::snapshotter::daemon::filter;
use crate::snapshotter::prepare::classify::Outcome;
use crate::snapshotter::servers::control;
use crate::snapshotter::store::{Kind, Record};
use crate::snapshotter::{blocking, Freshness, Mount, Snapshotter};

/// A method of containerd's snapshots API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Prepare,
    View,
    Mounts,
    Commit,
    Remove,
    Stat,
    Update,
    List,
    Usage,
    Cleanup,
}

impl Method {
    pub const ALL: [Method; 10] = [
        Method::Prepare,
        Method::View,
        Method::Mounts,
        Method::Commit,
        Method::Remove,
        Method::Stat,
        Method::Update,
        Method::List,
        Method::Usage,
        Method::Cleanup,
    ];

    /// Its name, as the API and the `method` label of the call metrics spell it.
    pub fn name(self) -> &'static str {
        match self {
            Method::Prepare => "Prepare",
            Method::View => "View",
            Method::Mounts => "Mounts",
            Method::Commit => "Commit",
            Method::Remove => "Remove",
            Method::Stat => "Stat",
            Method::Update => "Update",
            Method::List => "List",
            Method::Usage => "Usage",
            Method::Cleanup => "Cleanup",
        }
    }
}

/// A snapshots API call (`call/<method>` in the daemon's counters), or its failure
/// (`call_error/<method>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    Made(Method),
    Failed(Method),
}

impl Counted for Call {
    fn key(&self) -> String {
        match self {
            Call::Made(m) => format!("call/{}", m.name()),
            Call::Failed(m) => format!("call_error/{}", m.name()),
        }
    }
}

/// Counts a snapshots API call and, if it failed, the failure.
fn count_call<T>(s: &Snapshotter, method: Method, r: &Result<T, Status>) {
    s.counters.add(&Call::Made(method), 1);
    if let Err(e) = r {
        // AlreadyExists from Prepare is the remote-snapshot handshake, not a failure.
        if !(method == Method::Prepare && e.code() == tonic::Code::AlreadyExists) {
            s.counters.add(&Call::Failed(method), 1);
        }
    }
}

/// The snapshots service.
pub struct SnapshotsService {
    pub snapshotter: Arc<Snapshotter>,
}

fn mounts(ms: Vec<Mount>) -> Vec<PbMount> {
    ms.into_iter()
        .map(|m| PbMount {
            r#type: m.kind,
            source: m.source,
            target: String::new(),
            options: m.options,
        })
        .collect()
}

fn timestamp(nanos: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: nanos.div_euclid(1_000_000_000),
        nanos: nanos.rem_euclid(1_000_000_000) as i32,
    }
}

fn info(name: String, r: &Record) -> pb::Info {
    pb::Info {
        name,
        parent: r.parent.clone(),
        kind: match r.kind {
            Kind::View => pb::Kind::View,
            Kind::Active => pb::Kind::Active,
            Kind::Committed => pb::Kind::Committed,
        } as i32,
        created_at: Some(timestamp(r.created)),
        updated_at: Some(timestamp(r.updated)),
        labels: r.labels.clone().into_iter().collect(),
    }
}

fn sorted(labels: std::collections::HashMap<String, String>) -> BTreeMap<String, String> {
    labels.into_iter().collect()
}

type ListStream =
    Pin<Box<dyn futures_util::Stream<Item = Result<pb::ListSnapshotsResponse, Status>> + Send>>;

impl SnapshotsService {
    async fn run<T: Send + 'static>(
        &self,
        method: Method,
        f: impl FnOnce(Arc<Snapshotter>) -> crate::error::Result<T> + Send + 'static,
    ) -> Result<T, Status> {
        let s = Arc::clone(&self.snapshotter);
        let r = blocking(move || f(s)).await.map_err(Status::from);
        count_call(&self.snapshotter, method, &r);
        if let Err(e) = &r {
            tracing::debug!(method = method.name(), error = %e.message(), "snapshots call failed");
        }
        r
    }

    /// [`Self::run`] once every remote layer under snapshot `under` is served
    /// ([`Snapshotter::serve_chain`]): mounts that use a layer are never handed out while its
    /// mountpoint is empty.
    async fn run_served<T: Send + 'static>(
        &self,
        method: Method,
        under: &str,
        f: impl FnOnce(Arc<Snapshotter>) -> crate::error::Result<T> + Send + 'static,
    ) -> Result<T, Status> {
        if let Err(e) = self.snapshotter.serve_chain(under).await {
            let r = Err(Status::from(e));
            count_call(&self.snapshotter, method, &r);
            return r;
        }
        self.run(method, f).await
    }
}

#[tonic::async_trait]
impl pb::snapshots_server::Snapshots for SnapshotsService {
    async fn prepare(
        &self,
        request: Request<pb::PrepareSnapshotRequest>,
    ) -> Result<Response<pb::PrepareSnapshotResponse>, Status> {
        let req = request.into_inner();
        let r = self
            .snapshotter
            .prepare(&req.key, &req.parent, sorted(req.labels))
            .await
            .map_err(Status::from)
            .and_then(|m| match m {
                Some(m) => Ok(m),
                None => Err(Status::already_exists(format!(
                    "target snapshot of {:?}: already exists (served lazily by vmdisk)",
                    req.key
                ))),
            });
        count_call(&self.snapshotter, Method::Prepare, &r);
        Ok(Response::new(pb::PrepareSnapshotResponse {
            mounts: mounts(r?),
        }))
    }

    async fn view(
        &self,
        request: Request<pb::ViewSnapshotRequest>,
    ) -> Result<Response<pb::ViewSnapshotResponse>, Status> {
        let req = request.into_inner();
        let parent = req.parent.clone();
        let m = self
            .run_served(Method::View, &parent, move |s| {
                s.create(&req.key, &req.parent, Kind::View, sorted(req.labels))
            })
            .await?;
        Ok(Response::new(pb::ViewSnapshotResponse {
            mounts: mounts(m),
        }))
    }

    async fn mounts(
        &self,
        request: Request<pb::MountsRequest>,
    ) -> Result<Response<pb::MountsResponse>, Status> {
        let key = request.into_inner().key;
        let under = key.clone();
        let m = self
            .run_served(Method::Mounts, &under, move |s| s.mounts(&key))
            .await?;
        Ok(Response::new(pb::MountsResponse { mounts: mounts(m) }))
    }

    async fn commit(
        &self,
        request: Request<pb::CommitSnapshotRequest>,
    ) -> Result<Response<()>, Status> {
        let req = request.into_inner();
        self.run(Method::Commit, move |s| {
            s.commit(&req.name, &req.key, sorted(req.labels))
                .map(|_| ())
        })
        .await?;
        Ok(Response::new(()))
    }

    async fn remove(
        &self,
        request: Request<pb::RemoveSnapshotRequest>,
    ) -> Result<Response<()>, Status> {
        let key = request.into_inner().key;
        let unused = self.run(Method::Remove, move |s| s.remove(&key)).await?;
        self.snapshotter
            .stop_unused(unused.into_iter().collect())
            .await
            .map_err(Status::from)?;
        Ok(Response::new(()))
    }

    async fn stat(
        &self,
        request: Request<pb::StatSnapshotRequest>,
    ) -> Result<Response<pb::StatSnapshotResponse>, Status> {
        let key = request.into_inner().key;
        let (key, r) = self
            .run(Method::Stat, move |s| s.stat(&key).map(|r| (key, r)))
            .await?;
        Ok(Response::new(pb::StatSnapshotResponse {
            info: Some(info(key, &r)),
        }))
    }

    async fn update(
        &self,
        request: Request<pb::UpdateSnapshotRequest>,
    ) -> Result<Response<pb::UpdateSnapshotResponse>, Status> {
        let req = request.into_inner();
        let Some(new) = req.info else {
            return Err(Status::invalid_argument("Update needs the snapshot's info"));
        };
        let paths = req.update_mask.map(|m| m.paths).unwrap_or_default();
        let (key, r) = self
            .run(Method::Update, move |s| {
                let labels = sorted(new.labels);
                s.update(&new.name, &labels, &paths).map(|r| (new.name, r))
            })
            .await?;
        Ok(Response::new(pb::UpdateSnapshotResponse {
            info: Some(info(key, &r)),
        }))
    }

    type ListStream = ListStream;

    async fn list(
        &self,
        request: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<Self::ListStream>, Status> {
        let filters = request.into_inner().filters;
        let infos = self
            .run(Method::List, move |s| {
                let filters = filter::parse_all(&filters)?;
                Ok(s.list()?
                    .into_iter()
                    .filter(|(k, r)| {
                        filter::any_matches(
                            &filters,
                            &filter::Fields {
                                name: k,
                                parent: &r.parent,
                                kind: r.kind.name(),
                                labels: &r.labels,
                            },
                        )
                    })
                    .map(|(k, r)| info(k, &r))
                    .collect::<Vec<_>>())
            })
            .await?;
        // Batches keep each message far below gRPC's 4 MiB limit.
        let batches: Vec<Result<pb::ListSnapshotsResponse, Status>> = infos
            .chunks(100)
            .map(|c| Ok(pb::ListSnapshotsResponse { info: c.to_vec() }))
            .collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(batches))))
    }

    async fn usage(
        &self,
        request: Request<pb::UsageRequest>,
    ) -> Result<Response<pb::UsageResponse>, Status> {
        let key = request.into_inner().key;
        let u = self.run(Method::Usage, move |s| s.usage(&key)).await?;
        Ok(Response::new(pb::UsageResponse {
            size: i64::try_from(u.size).unwrap_or(i64::MAX),
            inodes: i64::try_from(u.inodes).unwrap_or(i64::MAX),
        }))
    }

    async fn cleanup(&self, _request: Request<pb::CleanupRequest>) -> Result<Response<()>, Status> {
        let unused = self.run(Method::Cleanup, |s| s.cleanup()).await?;
        self.snapshotter
            .stop_unused(unused)
            .await
            .map_err(Status::from)?;
        Ok(Response::new(()))
    }
}

/// The management service.
pub struct ManageService {
    pub snapshotter: Arc<Snapshotter>,
}

impl ManageService {
    /// Makes the requested disk ready (EnsureDisk); its layer key.
    async fn ensure(
        &self,
        request: Request<mpb::DiskRequest>,
    ) -> Result<crate::oci::digest::Digest, Status> {
        let request = request.into_inner();
        self.snapshotter
            .ensure_disk(
                &request.reference,
                &crate::snapshotter::Requester::of(&request.namespace),
            )
            .await
            .map_err(Status::from)
    }

    async fn disk(
        &self,
        layer: &crate::oci::digest::Digest,
    ) -> Result<Response<mpb::Disk>, Status> {
        let want = layer.to_string();
        disks(&self.snapshotter, Freshness::Now)
            .await
            .map_err(Status::from)?
            .into_iter()
            .find(|d| d.layer_key == want)
            .map(Response::new)
            .ok_or_else(|| {
                Status::internal(format!("layer {want} vanished while being made ready"))
            })
    }
}

/// How long `vmdisk ls` and `/metrics` wait for each server before they show what it told the
/// daemon's collector last.
pub const LISTED: Freshness = Freshness::Prompt(Duration::from_millis(50));

/// What the management API and the metrics report about remote layers: the records, and
/// what each layer's server says (asked all at once, each under the call deadline, or as
/// `fresh` says).
pub async fn disks(s: &Arc<Snapshotter>, fresh: Freshness) -> crate::error::Result<Vec<mpb::Disk>> {
    let me = Arc::clone(s);
    let layers = blocking(move || me.remote_layers()).await?;
    let mut statuses = s.statuses(layers.keys().copied(), fresh).await;
    let cache_dir = s.cache_dir().to_path_buf();
    let keys: Vec<_> = layers.keys().copied().collect();
    let last_used = blocking(move || {
        let cache = crate::cache::CacheRoot::open(&cache_dir).ok();
        Ok(keys
            .iter()
            .map(|k| {
                cache
                    .as_ref()
                    .and_then(|c| c.last_used(k))
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_secs() as i64)
            })
            .collect::<Vec<_>>())
    })
    .await?;
    let mut out = Vec::new();
    for ((layer, (remote, snapshots)), last_used) in layers.into_iter().zip(last_used) {
        let status = statuses.remove(&layer).flatten();
        let serving = status
            .as_ref()
            .is_some_and(|st| st.state() == control::ServerState::Serving);
        let hydration = status
            .as_ref()
            .map(control::hydration_text)
            .unwrap_or_default();
        let server_state = match &status {
            None => "down".into(),
            Some(st) if st.state() == control::ServerState::Failed => {
                format!("failed: {}", st.error)
            }
            Some(st) => st.state().as_str_name()["SERVER_STATE_".len()..].to_lowercase(),
        };
        let st = status.unwrap_or_default();
        // Mounted when asked (EnsureDisk); a server from before that asked mounted it at start.
        let ready_mounted = serving
            && matches!(
                st.ready_dir_state(),
                control::ReadyDirState::Mounted | control::ReadyDirState::Unspecified
            );
        let ready_dir = s
            .servers
            .ready_dir(&remote.reference)
            .filter(|_| ready_mounted)
            .map(|d| d.display().to_string())
            .unwrap_or_default();
        out.push(mpb::Disk {
            ready_dir,
            disk_size: st.disk_size,
            last_used,
            reference: remote.reference.to_string(),
            layer_digest: if st.layer_digest.is_empty() {
                layer.to_string()
            } else {
                st.layer_digest
            },
            layer_key: layer.to_string(),
            integrity: if st.integrity.is_empty() {
                "pending".into()
            } else {
                st.integrity
            },
            mountpoint: s.servers.mountpoint(&layer).display().to_string(),
            disk_path: st.disk_path,
            chunks: st.chunks,
            chunks_cached: st.chunks_cached,
            registry_bytes: st.counters.as_ref().map_or(0, |c| c.bytes_fetched),
            cache_full: st.counters.as_ref().is_some_and(|c| c.cache_full > 0),
            memory_held: st.counters.as_ref().map_or(0, |c| c.memory_held),
            registry_needed_since: st.registry_needed_since,
            snapshots,
            serving,
            server_pid: st.pid,
            hydration,
            server_state,
        });
    }
    Ok(out)
}

#[tonic::async_trait]
impl mpb::manage_server::Manage for ManageService {
    async fn status(
        &self,
        _request: Request<mpb::StatusRequest>,
    ) -> Result<Response<mpb::StatusResponse>, Status> {
        let s = Arc::clone(&self.snapshotter);
        let (count, remote) =
            blocking(move || Ok((s.list()?.len() as u64, s.remote_layers()?.len() as u64)))
                .await
                .map_err(Status::from)?;
        // What is shown is kept: no later restart reports less.
        self.snapshotter
            .save_counters()
            .await
            .map_err(Status::from)?;
        Ok(Response::new(mpb::StatusResponse {
            version: env!("CARGO_PKG_VERSION").to_string(),
            decisions: self
                .snapshotter
                .counters
                .counted(Outcome::all())
                .into_iter()
                .map(|(outcome, n)| (outcome.name(), n))
                .collect(),
            snapshots: count,
            remote_layers: remote,
        }))
    }

    async fn ensure_disk(
        &self,
        request: Request<mpb::DiskRequest>,
    ) -> Result<Response<mpb::Disk>, Status> {
        let layer = self.ensure(request).await?;
        self.disk(&layer).await
    }

    async fn prefetch_disk(
        &self,
        request: Request<mpb::DiskRequest>,
    ) -> Result<Response<mpb::Disk>, Status> {
        let layer = self.ensure(request).await?;
        let started = self
            .snapshotter
            .servers
            .hydrate(&layer)
            .await
            .map_err(Status::from)?;
        tracing::info!(%layer, started, "hydration asked for");
        // Report the hydration this call started (or found running).
        self.disk(&layer).await
    }

    async fn remove_disk(
        &self,
        request: Request<mpb::DiskRequest>,
    ) -> Result<Response<mpb::RemoveDiskResponse>, Status> {
        let reference = request.into_inner().reference;
        let unmounted = self
            .snapshotter
            .remove_disk(&reference)
            .await
            .map_err(Status::from)?;
        Ok(Response::new(mpb::RemoveDiskResponse { unmounted }))
    }

    async fn gc(
        &self,
        request: Request<mpb::GcRequest>,
    ) -> Result<Response<mpb::GcResponse>, Status> {
        let limit = request.into_inner().limit_bytes;
        let (freed_bytes, stopped_mounts) =
            self.snapshotter.gc(limit).await.map_err(Status::from)?;
        Ok(Response::new(mpb::GcResponse {
            freed_bytes,
            stopped_mounts,
        }))
    }

    async fn list_disks(
        &self,
        _request: Request<mpb::ListDisksRequest>,
    ) -> Result<Response<mpb::ListDisksResponse>, Status> {
        let disks = disks(&self.snapshotter, LISTED)
            .await
            .map_err(Status::from)?;
        Ok(Response::new(mpb::ListDisksResponse { disks }))
    }
}
