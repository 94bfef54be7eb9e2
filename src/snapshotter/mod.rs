//! `vmdisk-snapshotter`: a containerd proxy snapshotter that serves VM-disk layers lazily.
//!
//! Ordinary layers and containers get what containerd's built-in overlayfs snapshotter gives
//! them: a directory per snapshot (`snapshots/<id>/fs`, plus `work` for active ones) and
//! overlay or bind mounts over the parent chain, with the metadata in a transactional store
//! ([`store`]). During a CRI pull, `Prepare` with `containerd.io/snapshot.ref` asks
//! [`classify`] whether the layer is a lazily loadable disk; if so, a mount server
//! ([`server`], run by the [`supervisor`]) mounts it through FUSE, the committed snapshot is recorded with that mount as its
//! directory, and containerd is told the target exists, so it neither downloads nor unpacks
//! the layer. Every decision is logged and counted.
//!
//! All changes to the store and the snapshot directories happen under one lock, on blocking
//! threads, in an order that leaves at worst an unreferenced directory after a crash (removed
//! by `Cleanup`): directories are created before the record and removed after it. A remote
//! layer's server is started or stopped under that layer's own lock
//! ([`supervisor::LayerLocks`]), never under a lock other layers wait for.

pub mod args;
pub mod classify;
pub mod config;
pub mod control;
pub mod counters;
pub mod cri;
pub mod daemon;
pub mod filter;
pub mod grpc;
pub mod metrics;
pub mod server;
pub mod store;
pub mod supervisor;
pub mod tenants;

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use classify::{Classifier, Decision, LABEL_REMOTE, LABEL_TARGET};
use counters::Counters;
use parking_lot::Mutex;
use store::{Kind, Record, RemoteLayerRef, Store, Usage};
use supervisor::{Ahead, LayerLocks, Supervisor};
use tenants::Tenants;

use crate::error::{Error, ErrorKind, Result};
use crate::reference::Reference;
use crate::registry::granted::{Grant, Granted};
use crate::registry::Registry;

/// How [`Snapshotter::remote_layers`] names a disk kept by EnsureDisk among a layer's users.
const PIN_USER: &str = "pin:";

/// A mount for containerd to perform (`containerd.types.Mount`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub kind: String,
    pub source: String,
    pub options: Vec<String>,
}

/// The snapshotter's state.
pub struct Snapshotter {
    root: PathBuf,
    store: Store,
    /// Serialises every change to the store and the snapshot directories.
    lock: Mutex<()>,
    pub servers: Box<dyn Supervisor>,
    /// Held while a layer's server is started or stopped with the records that use it.
    layer_locks: LayerLocks,
    classifier: Classifier,
    /// Decisions, calls and the servers' engine counters.
    pub counters: Counters,
    overlay_index_off: bool,
    cache: CacheSettings,
    /// Which namespace's pulls granted what.
    pub tenants: Tenants,
    /// What each layer's server said last ([`Snapshotter::statuses`]).
    recent: parking_lot::Mutex<HashMap<crate::digest::Digest, control::LayerStatus>>,
}

/// How long to wait for the statuses of layers' servers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freshness {
    /// Until each answers (or its call deadline): what is about to be acted on.
    Now,
    /// At most this long: a server busy serving reads that has not answered by then is shown
    /// as it answered the daemon's collector last, at most [`daemon::COLLECT_EVERY`] before
    /// (`vmdisk ls`, `/metrics`: a loaded node answers at once). A server with no such answer
    /// is waited for.
    Prompt(std::time::Duration),
}

/// Who asks for a disk through the management API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requester {
    /// The node's operator (`vmdisk path`): the node's own credentials.
    Node,
    /// A pod of this Kubernetes namespace (the shim): what the namespace may pull.
    Namespace(String),
}

impl Requester {
    /// The requester a `DiskRequest`'s namespace names (empty: the node's operator).
    pub fn of(namespace: &str) -> Self {
        if namespace.is_empty() {
            Requester::Node
        } else {
            Requester::Namespace(namespace.to_string())
        }
    }
}

/// The block cache the mount servers share, for garbage collection.
#[derive(Debug, Clone)]
pub struct CacheSettings {
    pub dir: PathBuf,
    /// The configured bound, if any.
    pub limit: Option<u64>,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |e| Error::io(what, e)
}

impl Snapshotter {
    /// Opens the store under `root` and prepares the directory layout.
    pub fn open(
        root: &Path,
        servers: Box<dyn Supervisor>,
        classifier: Classifier,
        cache: CacheSettings,
        tenants: Tenants,
    ) -> Result<Self> {
        crate::dirs::private(root)?;
        crate::dirs::private(&root.join("snapshots"))?;
        control::LayerPaths::prepare_root(root)?;
        let store = Store::open(&root.join("metadata.db"))?;
        Ok(Snapshotter {
            root: root.to_path_buf(),
            store,
            lock: Mutex::new(()),
            servers,
            layer_locks: LayerLocks::default(),
            classifier,
            counters: Counters::load(&root.join("counters.json")),
            overlay_index_off: Path::new("/sys/module/overlay/parameters/index").exists(),
            cache,
            tenants,
            recent: parking_lot::Mutex::new(HashMap::new()),
        })
    }

    fn guard(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.lock.lock()
    }

    fn snapshot_dir(&self, id: u64) -> PathBuf {
        self.root.join("snapshots").join(id.to_string())
    }

    /// The directory holding a snapshot's files: its `fs`, or its layer's FUSE mount.
    fn fs_dir(&self, record: &Record) -> PathBuf {
        match &record.remote {
            Some(r) => self.servers.mountpoint(&r.layer),
            None => self.snapshot_dir(record.id).join("fs"),
        }
    }

    /// Every snapshot, for Walk.
    pub fn list(&self) -> Result<Vec<(String, Record)>> {
        self.store.list()
    }

    /// The record of `key`.
    pub fn stat(&self, key: &str) -> Result<Record> {
        self.store.must_get(key)
    }

    /// Updates labels (see [`Store::update_labels`]).
    pub fn update(
        &self,
        key: &str,
        labels: &BTreeMap<String, String>,
        paths: &[String],
    ) -> Result<Record> {
        let _g = self.guard();
        self.store.update_labels(key, labels, paths)
    }

    /// Creates an active or view snapshot with its directories and returns its mounts.
    pub fn create(
        &self,
        key: &str,
        parent: &str,
        kind: Kind,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>> {
        let _g = self.guard();
        let parent_owner = if parent.is_empty() {
            None
        } else {
            let p = self.store.must_get(parent).map_err(|e| {
                Error::new(
                    e.kind(),
                    format!("parent snapshot {parent:?} does not exist"),
                )
            })?;
            let dir = self.fs_dir(&p);
            let m = std::fs::metadata(&dir).map_err(io(format!("reading {}", dir.display())))?;
            Some((m.uid(), m.gid()))
        };
        // Build the directories aside, record the snapshot, then move them into place.
        let tmp = tempfile::Builder::new()
            .prefix("new-")
            .tempdir_in(self.root.join("snapshots"))
            .map_err(io("creating a snapshot directory"))?;
        let fs = tmp.path().join("fs");
        std::fs::create_dir(&fs).map_err(io(format!("creating {}", fs.display())))?;
        set_mode(&fs, 0o755)?;
        set_mode(tmp.path(), 0o700)?;
        if kind == Kind::Active {
            let work = tmp.path().join("work");
            std::fs::create_dir(&work).map_err(io(format!("creating {}", work.display())))?;
            set_mode(&work, 0o711)?;
        }
        if let Some((uid, gid)) = parent_owner {
            std::os::unix::fs::chown(&fs, Some(uid), Some(gid))
                .map_err(io(format!("chown {}", fs.display())))?;
        }
        let record = self.store.create(key, kind, parent, labels, None)?;
        let dir = self.snapshot_dir(record.id);
        let tmp = tmp.keep();
        if let Err(e) = std::fs::rename(&tmp, &dir) {
            let _ = self.store.remove(key);
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(Error::io(format!("moving {} into place", dir.display()), e));
        }
        self.mounts_of(key, &record)
    }

    /// The mounts of `key`.
    pub fn mounts(&self, key: &str) -> Result<Vec<Mount>> {
        let record = self.store.must_get(key)?;
        self.mounts_of(key, &record)
    }

    /// containerd's overlayfs rules: no parent → a bind mount of the own directory; a view of
    /// one parent → a read-only bind of it; otherwise overlay with the chain as lower dirs.
    fn mounts_of(&self, key: &str, record: &Record) -> Result<Vec<Mount>> {
        let lowers: Vec<String> = self
            .store
            .ancestors(key)?
            .iter()
            .map(|(_, r)| self.fs_dir(r).display().to_string())
            .collect();
        let own = self.fs_dir(record).display().to_string();
        if lowers.is_empty() {
            let mode = if record.kind == Kind::Active {
                "rw"
            } else {
                "ro"
            };
            return Ok(vec![Mount {
                kind: "bind".into(),
                source: own,
                options: vec![mode.into(), "rbind".into()],
            }]);
        }
        let mut options = Vec::new();
        if self.overlay_index_off {
            options.push("index=off".to_string());
        }
        if record.kind == Kind::Active {
            let dir = self.snapshot_dir(record.id);
            options.push(format!("workdir={}", dir.join("work").display()));
            options.push(format!("upperdir={own}"));
        } else if lowers.len() == 1 {
            return Ok(vec![Mount {
                kind: "bind".into(),
                source: lowers[0].clone(),
                options: vec!["ro".into(), "rbind".into()],
            }]);
        }
        options.push(format!("lowerdir={}", lowers.join(":")));
        Ok(vec![Mount {
            kind: "overlay".into(),
            source: "overlay".into(),
            options,
        }])
    }

    /// Commits active `key` as `name`, freezing its usage.
    pub fn commit(
        &self,
        name: &str,
        key: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Record> {
        let _g = self.guard();
        let record = self.store.must_get(key)?;
        let usage = disk_usage(&self.fs_dir(&record))?;
        self.store.commit(key, name, labels, usage)
    }

    /// Removes `key` and its directory; returns its remote layer, for
    /// [`Snapshotter::stop_unused`] to stop if nothing else uses it.
    pub fn remove(&self, key: &str) -> Result<Option<crate::digest::Digest>> {
        let _g = self.guard();
        let record = self.store.remove(key)?;
        if let Some(remote) = record.remote {
            return Ok(Some(remote.layer));
        }
        let dir = self.snapshot_dir(record.id);
        let doomed = self
            .root
            .join("snapshots")
            .join(format!("rm-{}", record.id));
        if std::fs::rename(&dir, &doomed).is_ok() {
            if let Err(e) = std::fs::remove_dir_all(&doomed) {
                tracing::warn!(dir = %doomed.display(), error = %e, "removing a snapshot directory failed; Cleanup retries");
            }
        }
        Ok(None)
    }

    /// Usage of `key`: frozen at commit, measured for active snapshots. For a remote snapshot,
    /// what the node stores of its layer once it is read whole: its cache directory with each
    /// data file at its full size (they are sparse until then). containerd asks once for a
    /// committed snapshot and keeps the answer for its image filesystem stats, so a lazily
    /// loaded disk is counted at what it will take, not at what a first read left.
    pub fn usage(&self, key: &str) -> Result<Usage> {
        let record = self.store.must_get(key)?;
        match (record.kind, record.usage, &record.remote) {
            (Kind::Committed, Some(u), _) => Ok(u),
            (_, _, Some(remote)) => {
                let dir = crate::cache::CacheRoot::open(&self.cache.dir)?.layer_dir(&remote.layer);
                match tree_usage(&dir, Counted::Apparent) {
                    Err(e) if e.kind() == ErrorKind::NotFound => Ok(Usage::default()),
                    other => other,
                }
            }
            _ => disk_usage(&self.fs_dir(&record)),
        }
    }

    /// Removes snapshot directories no record names (left by crashes or failed removals) and
    /// returns the remote layers no snapshot uses.
    pub fn cleanup(&self) -> Result<Vec<crate::digest::Digest>> {
        let _g = self.guard();
        let records = self.store.list()?;
        let ids: std::collections::HashSet<String> =
            records.iter().map(|(_, r)| r.id.to_string()).collect();
        let dir = self.root.join("snapshots");
        for entry in std::fs::read_dir(&dir).map_err(io(format!("listing {}", dir.display())))? {
            let entry = entry.map_err(io(format!("listing {}", dir.display())))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !ids.contains(&name) {
                tracing::info!(dir = %entry.path().display(), "cleanup: removing an unreferenced snapshot directory");
                std::fs::remove_dir_all(entry.path())
                    .map_err(io(format!("removing {}", entry.path().display())))?;
            }
        }
        let used: std::collections::HashSet<String> = records
            .iter()
            .filter_map(|(_, r)| r.remote.as_ref().map(|x| x.layer.hex()))
            .collect();
        let mounts = self.root.join("mounts");
        // Logs of layers no record uses and no mount serves (and the directories the servers
        // of earlier versions kept their files in).
        let servers = self.root.join("servers");
        for entry in
            std::fs::read_dir(&servers).map_err(io(format!("listing {}", servers.display())))?
        {
            let entry = entry.map_err(io(format!("listing {}", servers.display())))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let hex = name.strip_suffix(".log").unwrap_or(&name);
            if !used.contains(hex) && !mounts.join(hex).exists() {
                let path = entry.path();
                let removed = if path.is_dir() {
                    std::fs::remove_dir_all(&path)
                } else {
                    std::fs::remove_file(&path)
                };
                removed.map_err(io(format!("removing {}", path.display())))?;
            }
        }
        let mut unused = Vec::new();
        for entry in
            std::fs::read_dir(&mounts).map_err(io(format!("listing {}", mounts.display())))?
        {
            let entry = entry.map_err(io(format!("listing {}", mounts.display())))?;
            let hex = entry.file_name().to_string_lossy().into_owned();
            if !used.contains(&hex) {
                if let Ok(d) = format!("sha256:{hex}").parse() {
                    unused.push(d);
                }
            }
        }
        Ok(unused)
    }

    /// The remote layers recorded in the store (each with the first record's reference and
    /// alias) and the snapshots using them (a disk kept by EnsureDisk as `pin:<reference>`).
    pub fn remote_layers(
        &self,
    ) -> Result<BTreeMap<crate::digest::Digest, (RemoteLayerRef, Vec<String>)>> {
        let mut out: BTreeMap<crate::digest::Digest, (RemoteLayerRef, Vec<String>)> =
            BTreeMap::new();
        let pins = self
            .store
            .pins()?
            .into_iter()
            .map(|(name, r)| (format!("{PIN_USER}{name}"), r));
        let snapshots = self
            .store
            .list()?
            .into_iter()
            .filter_map(|(key, r)| r.remote.map(|remote| (key, remote)));
        for (user, remote) in snapshots.chain(pins) {
            out.entry(remote.layer)
                .or_insert_with(|| (remote.clone(), Vec::new()))
                .1
                .push(user);
        }
        Ok(out)
    }

    /// Prepare with containerd's remote-snapshot handshake. `Ok(None)`: the target snapshot
    /// now exists (answer AlreadyExists); `Ok(Some(mounts))`: an ordinary active snapshot.
    pub async fn prepare(
        self: &Arc<Self>,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Option<Vec<Mount>>> {
        if let Some(target) = labels.get(LABEL_TARGET).cloned() {
            use tracing::Instrument;
            let span = tracing::info_span!("prepare", key, target = %target);
            if self
                .try_remote(&target, parent, &labels)
                .instrument(span)
                .await?
            {
                return Ok(None);
            }
        }
        let me = Arc::clone(self);
        let (key, parent) = (key.to_string(), parent.to_string());
        blocking(move || me.create(&key, &parent, Kind::Active, labels))
            .await
            .map(Some)
    }

    /// Checks the image against the signature policy, classifies the layer and, if it is a
    /// disk, serves it remotely; whether the target snapshot now exists. An image the policy
    /// refuses fails the Prepare (and so containerd's pull), whatever the layer: an ordinary
    /// pull of it would unpack the same unverified bytes. Every outcome is counted and
    /// logged. The classification may use the credentials of the CRI pulls of this image in
    /// flight (containerd is pulling it with them: that is why it asks).
    async fn try_remote(
        self: &Arc<Self>,
        target: &str,
        parent: &str,
        labels: &BTreeMap<String, String>,
    ) -> Result<bool> {
        let started = std::time::Instant::now();
        let image = labels.get(classify::LABEL_IMAGE_REF);
        let pending = image.map_or_else(Vec::new, |i| self.tenants.pending_for(i));
        let client = self.client_with(image.and_then(|i| i.parse().ok()), &pending);
        // The signatures are fetched while the layer is classified (manifest, config, TOC:
        // nothing of the disk), and nothing is served before both are done.
        let (checked, decision) = tokio::join!(
            self.check_policy(labels, client.as_ref()),
            self.classifier.classify(labels, client.as_ref())
        );
        if let Err(e) = checked {
            self.counters.add("decision/refused:policy", 1);
            tracing::warn!(error = %e.chain(), "the signature policy refuses the image; the pull fails");
            return Err(e);
        }
        match decision {
            Decision::Remote { reference, layer } => {
                if let (Some(image), Some(digest)) = (image, reference.digest) {
                    self.tenants.note_classified(image, digest);
                }
                match self
                    .prepare_remote(
                        target,
                        parent,
                        labels,
                        (&reference, layer),
                        PullAccess {
                            client: &client,
                            pending: &pending,
                        },
                    )
                    .await
                {
                    Ok(outcome) => {
                        self.counters.add(&format!("decision/{outcome}"), 1);
                        let ms = started.elapsed().as_millis() as u64;
                        tracing::info!(%layer, %reference, outcome, ms, "layer is served lazily");
                        return Ok(true);
                    }
                    Err(e) => {
                        self.counters.add("decision/fallback:mount_failed", 1);
                        tracing::warn!(%layer, error = %e.chain(), "lazy mount failed; containerd pulls the layer normally");
                    }
                }
            }
            Decision::Ordinary {
                reason,
                detail,
                candidate,
            } => {
                if candidate {
                    self.counters.add(&format!("decision/fallback:{reason}"), 1);
                    tracing::warn!(
                        reason = reason.as_str(),
                        detail,
                        "a published VM-disk layer is pulled normally"
                    );
                } else {
                    self.counters.add(&format!("decision/ordinary:{reason}"), 1);
                    tracing::info!(
                        reason = reason.as_str(),
                        detail,
                        "ordinary layer; containerd pulls it"
                    );
                }
            }
        }
        Ok(false)
    }

    /// Whether the signature policy accepts the image a Prepare with `labels` unpacks (its
    /// CRI labels name it: the reference as pulled and the platform manifest digest). Without
    /// those labels containerd pulls outside CRI (`ctr`), and nothing is checked here.
    async fn check_policy(
        &self,
        labels: &BTreeMap<String, String>,
        client: &dyn crate::registry::Registry,
    ) -> Result<()> {
        let trust = self.classifier.trust();
        if !trust.is_set() {
            return Ok(());
        }
        let (Some(image), Some(manifest)) = (
            labels.get(classify::LABEL_IMAGE_REF),
            labels.get(classify::LABEL_MANIFEST),
        ) else {
            return Ok(());
        };
        let image: Reference = image.parse()?;
        let digest: crate::digest::Digest = manifest.parse()?;
        trust
            .check_image(client, self.classifier.cache(), &image, digest)
            .await
    }

    /// The registry client acting with the node's credentials and `credentials` for the
    /// repository of `image` (tried after the node's, in order).
    fn client_with(
        &self,
        image: Option<Reference>,
        credentials: &[crate::registry::auth::Credential],
    ) -> Arc<dyn Registry> {
        let base = Arc::clone(self.classifier.client());
        match image {
            Some(image) if !credentials.is_empty() => {
                base.with_grants(Arc::new(Granted::of(credentials.iter().map(|c| {
                    Grant::new(
                        &image.registry,
                        &image.repository,
                        c.clone(),
                        self.tenants.ttl(),
                    )
                }))))
            }
            _ => base,
        }
    }

    /// Starts fetching the blob bytes the structure check of `layer`'s server reads, with
    /// `client` (one that read the image's manifest and TOC), when a cache keeps its record and
    /// TOC: from before the server is started, so that they come while it starts.
    fn fetch_ahead(
        &self,
        client: &Arc<dyn Registry>,
        layer: crate::digest::Digest,
    ) -> Option<Ahead> {
        self.classifier
            .cache()
            .map(|cache| Ahead::fetch(Arc::clone(client), cache.clone(), layer))
    }

    /// What a new mount server of `reference` (pinned by digest) may fetch with: the grants of
    /// succeeded pulls that covered it, and, if the node's own credentials do not read it, the
    /// first credential of a pull in flight that does (asked of the registry now, so a wrong
    /// one is never handed over).
    async fn grants_for_server(
        &self,
        reference: &Reference,
        pending: &[crate::registry::auth::Credential],
    ) -> Vec<Grant> {
        let Some(digest) = reference.digest else {
            return Vec::new();
        };
        let mut grants = self.tenants.covering(reference, &digest);
        if pending.is_empty() {
            return grants;
        }
        match self.classifier.client().check_manifest(reference).await {
            Ok(_) => return grants,
            Err(e) if e.kind() == ErrorKind::Auth => {}
            Err(e) => {
                tracing::warn!(%reference, error = %e.chain(), "cannot tell which credentials read the image");
                return grants;
            }
        }
        for credential in pending {
            let client =
                self.client_with(Some(reference.clone()), std::slice::from_ref(credential));
            if client.check_manifest(reference).await.is_ok() {
                grants.push(Grant::new(
                    &reference.registry,
                    &reference.repository,
                    credential.clone(),
                    self.tenants.ttl(),
                ));
                break;
            }
        }
        grants
    }

    /// Serves `layer` of `reference` (classified remote) as snapshot `target`, with what the
    /// `pull` in flight may read.
    async fn prepare_remote(
        self: &Arc<Self>,
        target: &str,
        parent: &str,
        labels: &BTreeMap<String, String>,
        (reference, layer): (&Reference, crate::digest::Digest),
        pull: PullAccess<'_>,
    ) -> Result<&'static str> {
        let ahead = self.fetch_ahead(pull.client, layer);
        let me = Arc::clone(self);
        let name = target.to_string();
        if let Some(existing) = blocking(move || me.store.get(&name)).await? {
            if existing.kind == Kind::Committed && existing.parent == parent {
                return Ok("reused");
            }
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!("a different snapshot is named {target:?} already"),
            ));
        }
        let alias = labels.get(classify::LABEL_IMAGE_REF).cloned();
        let grants = self.grants_for_server(reference, pull.pending).await;
        let lock = self.layer_locks.lock(&layer).await;
        self.servers
            .ensure(
                &layer,
                &reference.to_string(),
                alias.as_deref(),
                &grants,
                control::Need::Layer,
                ahead,
            )
            .await?;
        let mut labels = labels.clone();
        labels.insert(LABEL_REMOTE.to_string(), "vmdisk".to_string());
        let remote = RemoteLayerRef {
            reference: reference.to_string(),
            layer,
            alias,
        };
        let (me, target, parent) = (Arc::clone(self), target.to_string(), parent.to_string());
        let created = blocking(move || {
            let _g = me.guard();
            match me
                .store
                .create(&target, Kind::Committed, &parent, labels, Some(remote))
            {
                Ok(_) => Ok("remote"),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok("reused"),
                Err(e) => Err(e),
            }
        })
        .await;
        drop(lock);
        created
    }
}

/// What a Prepare may read the image with: a client with the node's credentials and those of
/// the CRI pulls of the image in flight, and those credentials.
#[derive(Clone, Copy)]
struct PullAccess<'a> {
    client: &'a Arc<dyn Registry>,
    pending: &'a [crate::registry::auth::Credential],
}

impl Snapshotter {
    /// Stops the servers of `layers` that no snapshot or pin uses (after Remove, RemoveDisk or
    /// Cleanup); returns how many it stopped. Each layer is checked and stopped under its own
    /// lock, and its server's final counters are kept.
    pub async fn stop_unused(self: &Arc<Self>, layers: Vec<crate::digest::Digest>) -> Result<u32> {
        let mut stopped = 0;
        for layer in layers {
            let _lock = self.layer_locks.lock(&layer).await;
            let me = Arc::clone(self);
            if blocking(move || me.remote_layers())
                .await?
                .contains_key(&layer)
            {
                continue;
            }
            match self.servers.stop(&layer).await {
                Ok(Some(last)) => {
                    self.observe(&last);
                    self.counters.forget(&last.instance);
                    stopped += 1;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(%layer, error = %e.chain(), "the unused layer's server keeps serving")
                }
            }
        }
        Ok(stopped)
    }

    /// Takes in a server's counters.
    pub fn observe(&self, status: &control::LayerStatus) {
        if let Some(counters) = &status.counters {
            self.counters.observe(&status.instance, counters);
        }
    }

    /// Hands the running servers of the images `digests` of `grant`'s repository covers the
    /// credentials of a pull of them that succeeded; a server that does not answer gets them
    /// at its next start.
    pub async fn hand_grant(
        self: &Arc<Self>,
        grant: &Grant,
        digests: &std::collections::BTreeSet<crate::digest::Digest>,
    ) -> Result<()> {
        let me = Arc::clone(self);
        let layers = blocking(move || me.remote_layers()).await?;
        for (layer, (remote, _)) in layers {
            let covered = remote.reference.parse::<Reference>().is_ok_and(|r| {
                r.registry == grant.registry
                    && r.repository == grant.repository
                    && r.digest.is_some_and(|d| digests.contains(&d))
            });
            if !covered {
                continue;
            }
            if let Err(e) = self.servers.hand_grant(&layer, grant).await {
                tracing::debug!(%layer, error = %e.chain(), "the layer's server did not take the credentials");
            }
        }
        Ok(())
    }

    /// What each of `layers`' servers says now (`None`: no server answered within the call
    /// deadline), asked all at once; their counters are taken in. `fresh`: how long to wait
    /// for them. `layers` are every recorded layer (the answers kept for others are dropped).
    pub async fn statuses(
        &self,
        layers: impl IntoIterator<Item = crate::digest::Digest>,
        fresh: Freshness,
    ) -> HashMap<crate::digest::Digest, Option<control::LayerStatus>> {
        let asked = layers.into_iter().map(|layer| async move {
            let recent = match fresh {
                Freshness::Prompt(wait) => {
                    self.recent.lock().get(&layer).cloned().map(|r| (wait, r))
                }
                Freshness::Now => None,
            };
            let status = match recent {
                Some((wait, recent)) => {
                    match tokio::time::timeout(wait, self.servers.status(&layer)).await {
                        Ok(status) => status,
                        Err(_) => return (layer, Some(recent), false),
                    }
                }
                None => self.servers.status(&layer).await,
            };
            (layer, status, true)
        });
        let answers = futures_util::future::join_all(asked).await;
        let mut recent = self.recent.lock();
        let statuses: HashMap<_, _> = answers
            .into_iter()
            .map(|(layer, status, answered)| {
                if answered {
                    match &status {
                        Some(status) => {
                            self.observe(status);
                            recent.insert(layer, status.clone());
                        }
                        None => {
                            recent.remove(&layer);
                        }
                    }
                }
                (layer, status)
            })
            .collect();
        // Callers ask for every recorded layer: what no longer is one is forgotten.
        recent.retain(|layer, _| statuses.contains_key(layer));
        statuses
    }

    /// Writes the counters if they changed, off the async workers.
    pub async fn save_counters(self: &Arc<Self>) -> Result<()> {
        let me = Arc::clone(self);
        blocking(move || me.counters.save()).await
    }
}

/// How a requester may read a disk ([`Snapshotter::authorize`]).
enum Access {
    /// Through the registry with `client` (the node's credentials, or the namespace's `grant`).
    Fetch {
        client: Arc<dyn Registry>,
        grant: Option<tenants::PullGrant>,
    },
    /// What the node holds for the reference, without asking the registry.
    Held(RemoteLayerRef),
}

/// Disks made ready through the management API (`vmdisk path`, `prefetch`, `rm`, `gc`).
impl Snapshotter {
    /// Makes `reference`'s disk ready for `requester` and keeps it until
    /// [`Snapshotter::remove_disk`]; returns its layer. A namespace gets it only if it may pull
    /// the image ([`tenants`]). With the registry unreachable, a reference kept before is
    /// served from the cache to the node's operator, and to a namespace as the verification
    /// policy allows.
    pub async fn ensure_disk(
        self: &Arc<Self>,
        reference: &str,
        requester: &Requester,
    ) -> Result<crate::digest::Digest> {
        let parsed: Reference = reference.parse()?;
        let cache = self.classifier.cache();
        let (remote, grants, checked_now, ahead) = match self
            .authorize(reference, &parsed, requester)
            .await?
        {
            Access::Fetch { client, grant } => {
                match crate::resolve::platform_manifest(client.as_ref(), cache, &parsed).await {
                    Ok((manifest, digest, _)) => {
                        let trust = self.classifier.trust();
                        let pinned = parsed.with_digest(digest);
                        // Signatures and the layer's TOC at once; the disk only if both hold.
                        let (checked, layer) = tokio::join!(
                            trust.check_image(client.as_ref(), cache, &parsed, digest),
                            crate::resolve::disk_layer_id(
                                client.as_ref(),
                                cache,
                                trust,
                                &pinned,
                                &manifest,
                                digest,
                                None,
                            )
                        );
                        checked?;
                        let (_, meta) = layer?;
                        let mut grants = self.tenants.covering(&parsed, &digest);
                        match (&grant, requester) {
                            (Some(g), Requester::Namespace(ns)) => {
                                // The platform manifest joins the grant it was read through.
                                for top in &g.digests {
                                    self.tenants.extend(ns, &parsed, top, digest);
                                }
                                if !grants.iter().any(|h| h.credential == g.credential) {
                                    grants.push(g.grant());
                                }
                            }
                            _ => self.tenants.note_open(digest),
                        }
                        (
                            RemoteLayerRef {
                                reference: pinned.to_string(),
                                layer: meta.id().key(),
                                alias: Some(reference.to_string()),
                            },
                            grants,
                            true,
                            self.fetch_ahead(&client, meta.id().key()),
                        )
                    }
                    Err(e) if matches!(e.kind(), ErrorKind::Network | ErrorKind::Timeout) => {
                        let known = self.known(reference, &parsed).await?;
                        let allowed = match requester {
                            Requester::Node => true,
                            Requester::Namespace(ns) => {
                                self.may_serve_held(ns, &parsed, known.as_ref())
                            }
                        };
                        match known.filter(|_| allowed) {
                            Some(r) => {
                                tracing::warn!(reference, error = %e.chain(), "registry unreachable; serving the disk kept before");
                                (r, Vec::new(), false, None)
                            }
                            None => return Err(e),
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
            Access::Held(r) => (r, Vec::new(), false, None),
        };
        if !checked_now {
            // Served from what the node holds: it must have been accepted under the policy in
            // force.
            self.held_accepted(&remote).await?;
        }
        let layer = remote.layer;
        let lock = self.layer_locks.lock(&layer).await;
        self.servers
            .ensure(
                &layer,
                &remote.reference,
                remote.alias.as_deref(),
                &grants,
                control::Need::ReadyDisk,
                ahead,
            )
            .await?;
        let (me, name) = (Arc::clone(self), reference.to_string());
        blocking(move || me.store.pin(&name, &remote)).await?;
        drop(lock);
        Ok(layer)
    }

    /// Refuses a disk the node holds unless the signature policy in force accepted it (as its
    /// pinned reference or the name it was pulled as) on this node.
    async fn held_accepted(&self, remote: &RemoteLayerRef) -> Result<()> {
        let trust = self.classifier.trust();
        if !trust.is_set() {
            return Ok(());
        }
        let accepted = trust.accepted_offline();
        let (cache, held) = (self.classifier.cache().cloned(), remote.clone());
        let ok = blocking(move || {
            let remote = held;
            let Some(cache) = cache else { return Ok(false) };
            let pinned: Reference = remote.reference.parse()?;
            let Some(digest) = pinned.digest else {
                return Ok(false);
            };
            let names = std::iter::once(pinned.clone()).chain(
                remote
                    .alias
                    .as_deref()
                    .and_then(|a| a.parse::<Reference>().ok()),
            );
            Ok(names.into_iter().any(|n| accepted(&cache, &n, &digest)))
        })
        .await?;
        if ok {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::Refused,
                format!(
                    "{}: the registry was not asked and the signature policy in force has not accepted this image on this node",
                    remote.reference
                ),
            ))
        }
    }

    /// Whether `requester` may have `reference`'s disk, and how to read it. The node's
    /// operator reads with the node's credentials. A namespace may if its own pull of that
    /// digest succeeded, if the node's own credentials read the image, or if a grant of its
    /// own reads the digest it pulled; failing that, under [`tenants::Verification::Never`],
    /// it gets what the node holds for the reference.
    async fn authorize(
        self: &Arc<Self>,
        reference: &str,
        parsed: &Reference,
        requester: &Requester,
    ) -> Result<Access> {
        let base = Arc::clone(self.classifier.client());
        let Requester::Namespace(ns) = requester else {
            return Ok(Access::Fetch {
                client: base,
                grant: None,
            });
        };
        let scoped = |g: &tenants::PullGrant| -> Arc<dyn Registry> {
            Arc::clone(&base).with_grants(Arc::new(Granted::of([g.grant()])))
        };
        let grants = self.tenants.grants_of(ns, parsed);
        // The namespace's own pull of this very digest succeeded.
        if let Some(g) = parsed
            .digest
            .and_then(|d| grants.iter().find(|g| g.digests.contains(&d)))
        {
            return Ok(Access::Fetch {
                client: scoped(g),
                grant: Some(g.clone()),
            });
        }
        // The node's own credentials read it: anyone may have it.
        match base.check_manifest(parsed).await {
            Ok(digest) => {
                self.tenants.note_open(digest);
                return Ok(Access::Fetch {
                    client: base,
                    grant: None,
                });
            }
            Err(e) if e.kind() == ErrorKind::Auth => {}
            Err(e) if matches!(e.kind(), ErrorKind::Network | ErrorKind::Timeout) => {
                let known = self.known(reference, parsed).await?;
                return match known.filter(|k| self.may_serve_held(ns, parsed, Some(k))) {
                    Some(k) => {
                        tracing::warn!(reference, namespace = ns, error = %e.chain(), "registry unreachable; serving the disk kept before");
                        Ok(Access::Held(k))
                    }
                    None => Err(e.context(format!(
                        "cannot tell whether namespace {ns} may read {reference}"
                    ))),
                };
            }
            Err(e) => return Err(e),
        }
        // A grant of the namespace's own reads it, and its pull fetched that digest.
        let mut other = None;
        for g in &grants {
            match scoped(g).check_manifest(parsed).await {
                Ok(d) if g.digests.contains(&d) => {
                    return Ok(Access::Fetch {
                        client: scoped(g),
                        grant: Some(g.clone()),
                    })
                }
                Ok(d) => other = Some(d),
                Err(e) if e.kind() == ErrorKind::Auth => {}
                Err(e) => return Err(e),
            }
        }
        if self.tenants.policy == tenants::Verification::Never {
            if let Some(k) = self.known(reference, parsed).await? {
                return Ok(Access::Held(k));
            }
        }
        let why = match other {
            Some(d) => format!(
                "namespace {ns} pulled other digests of {}/{}, not {d}",
                parsed.registry, parsed.repository
            ),
            None => format!("no PullImage of it by a pod of namespace {ns} succeeded"),
        };
        Err(Error::new(
            ErrorKind::Auth,
            format!(
                "namespace {ns} may not read {reference}: the registry requires credentials, the node's own do not read it, and {why}; pull the image in a pod of that namespace (with its imagePullSecret) first, or give the node credentials for it"
            ),
        ))
    }

    /// What the node holds for `reference`: a disk kept by that name, or a remote snapshot's
    /// layer pulled by that name or pinned to that digest.
    async fn known(
        self: &Arc<Self>,
        reference: &str,
        parsed: &Reference,
    ) -> Result<Option<RemoteLayerRef>> {
        let (me, reference, parsed) = (Arc::clone(self), reference.to_string(), parsed.clone());
        blocking(move || {
            if let Some((_, r)) = me.store.pins()?.into_iter().find(|(n, _)| *n == reference) {
                return Ok(Some(r));
            }
            Ok(me.remote_layers()?.into_values().map(|(r, _)| r).find(|r| {
                r.alias.as_deref() == Some(reference.as_str())
                    || parsed.digest.is_some_and(|d| {
                        r.reference.parse::<Reference>().is_ok_and(|p| {
                            p.digest == Some(d)
                                && p.registry == parsed.registry
                                && p.repository == parsed.repository
                        })
                    })
            }))
        })
        .await
    }

    /// Whether namespace `ns` may be served what the node holds (`held`) without the registry
    /// confirming it: as the verification policy says.
    fn may_serve_held(&self, ns: &str, parsed: &Reference, held: Option<&RemoteLayerRef>) -> bool {
        let Some(digest) = held.and_then(|h| h.reference.parse::<Reference>().ok()?.digest) else {
            return false;
        };
        let own = self
            .tenants
            .grants_of(ns, parsed)
            .iter()
            .any(|g| g.digests.contains(&digest));
        match self.tenants.policy {
            tenants::Verification::Never => true,
            tenants::Verification::IfPrivate => own || self.tenants.is_open(&digest),
            tenants::Verification::Always => own,
        }
    }

    /// Forgets a disk kept by [`Snapshotter::ensure_disk`]; returns whether its mount stopped.
    pub async fn remove_disk(self: &Arc<Self>, reference: &str) -> Result<bool> {
        let (me, name) = (Arc::clone(self), reference.to_string());
        let Some(pin) = blocking(move || me.store.unpin(&name)).await? else {
            return Err(Error::not_found(format!(
                "{reference} is not a disk kept by `vmdisk path` or `vmdisk prefetch` (see `vmdisk ls`)"
            )));
        };
        self.stop_unused(vec![pin.layer]).await?;
        Ok(self.servers.status(&pin.layer).await.is_none())
    }

    /// Stops unused mounts, removes stale directories, evicts unused cached layers down to
    /// `limit` (or the configured bound). Returns the bytes freed and the mounts stopped.
    pub async fn gc(self: &Arc<Self>, limit: Option<u64>) -> Result<(u64, u32)> {
        let me = Arc::clone(self);
        let unused = blocking(move || me.cleanup()).await?;
        let stopped = self.stop_unused(unused).await?;
        let freed = match limit.or(self.cache.limit) {
            Some(limit) => {
                let dir = self.cache.dir.clone();
                blocking(move || crate::cache::CacheRoot::open(&dir)?.evict(limit)).await?
            }
            None => 0,
        };
        Ok((freed, stopped))
    }

    /// The cache directory.
    pub fn cache_dir(&self) -> &Path {
        &self.cache.dir
    }
}

pub use crate::task::blocking;

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io(format!("chmod {}", path.display())))
}

/// Bytes allocated and inodes under `dir`, each inode counted once (as containerd's du).
pub fn disk_usage(dir: &Path) -> Result<Usage> {
    tree_usage(dir, Counted::Allocated)
}

/// What [`tree_usage`] counts of a file.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Counted {
    /// The blocks it holds now.
    Allocated,
    /// Its length, or its blocks if more (a sparse file at its full size).
    Apparent,
}

/// Bytes and inodes under `dir`, each inode counted once.
fn tree_usage(dir: &Path, counted: Counted) -> Result<Usage> {
    let mut seen = std::collections::HashSet::new();
    let mut usage = Usage::default();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        let m =
            std::fs::symlink_metadata(&path).map_err(io(format!("reading {}", path.display())))?;
        if seen.insert((m.dev(), m.ino())) {
            usage.inodes += 1;
            usage.size += match counted {
                Counted::Allocated => m.blocks() * 512,
                Counted::Apparent if m.is_file() => (m.blocks() * 512).max(m.len()),
                Counted::Apparent => m.blocks() * 512,
            };
        }
        if m.is_dir() {
            for entry in
                std::fs::read_dir(&path).map_err(io(format!("listing {}", path.display())))?
            {
                stack.push(
                    entry
                        .map_err(io(format!("listing {}", path.display())))?
                        .path(),
                );
            }
        }
    }
    Ok(usage)
}

impl Snapshotter {
    /// Mounts every layer the store records (adopting running servers), all at once; a layer
    /// that cannot be mounted is logged and left for a later start.
    pub async fn mount_recorded(self: &Arc<Self>) -> Result<usize> {
        let me = Arc::clone(self);
        let layers = blocking(move || me.remote_layers()).await?;
        let mounted = layers.iter().map(|(layer, (remote, snapshots))| async move {
            let _lock = self.layer_locks.lock(layer).await;
            match self
                .servers
                .ensure(
                    layer,
                    &remote.reference,
                    remote.alias.as_deref(),
                    &[],
                    // A disk kept by EnsureDisk wants its ready-disk directory back.
                    match snapshots.iter().any(|u| u.starts_with(PIN_USER)) {
                        true => control::Need::ReadyDisk,
                        false => control::Need::Layer,
                    },
                    // Recorded layers were checked when first served: nothing to fetch ahead.
                    None,
                )
                .await
            {
                Ok(mnt) => {
                    tracing::info!(%layer, mountpoint = %mnt.display(), snapshots = snapshots.len(), "remote snapshot layer mounted")
                }
                Err(e) => {
                    tracing::error!(%layer, error = %e.chain(), "cannot mount a remote snapshot's layer; reads of it fail until a restart mounts it")
                }
            }
        });
        futures_util::future::join_all(mounted).await;
        Ok(layers.len())
    }
}

#[cfg(test)]
mod tests;
