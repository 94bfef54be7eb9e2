//! The mount server (`vmdisk-snapshotter serve-layer`): one process per remote layer, holding
//! the layer's FUSE mount and its ready-disk directory, driven by the daemon through its
//! control socket ([`crate::snapshotter::servers::control`]).
//!
//! It binds its control socket first, then resolves the image and mounts; the daemon watches
//! that through `Status` (starting → serving, or failed with the reason and its error kind).
//! `Stop` aborts a start that is still running, or unmounts (refused while busy) and exits.
//! A server that failed to start waits for the daemon's `Stop` (at most [`FAILED_LINGER`]), so
//! the daemon always learns why. SIGTERM and SIGINT stop it too, like `vmdisk mount`.
//!
//! A running daemon asks its servers' status every second. A server no daemon has asked after
//! for `orphan_grace` (its daemon uninstalled, not replaced) stops as `Stop` would, once no one
//! has its disk open: a VM still reading it keeps it served until it closes it.

pub mod cgroup;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status};

use crate::api::vmdisk::v1 as pb;
use crate::cache::CacheRoot;
use crate::error::{Error, Result};
use crate::layer::Held;
use crate::oci::digest::Digest;
use crate::oci::reference::{ImageName, Reference};
use crate::registry::granted::Granted;
use crate::registry::roots::Roots;
use crate::serve::connection::{Connection, Inherited, Role};
use crate::serve::Serving;
use crate::snapshotter::config::Config;
use crate::snapshotter::servers::control::{
    self, HydrationState, LayerPaths, LayerPlan, Need, ReadyDirState, ServerState, Verdict,
};

/// How long a server that failed to start waits for the daemon to collect the reason.
pub const FAILED_LINGER: Duration = Duration::from_secs(300);

/// Where the server is.
enum Phase {
    Starting,
    Serving(Arc<Serving>),
    Failed(Error),
    /// Unmounted; ending the session.
    Stopping,
}

/// What the control service shares with the serving loop.
struct Shared {
    layer: Digest,
    reference: String,
    instance: String,
    mountpoint: String,
    phase: Mutex<Phase>,
    /// Woken at every change of `phase`.
    phase_changed: tokio::sync::Notify,
    /// Stop requests, each answered with the final counters or why not.
    stops: mpsc::Sender<oneshot::Sender<Result<pb::LayerCounters>>>,
    /// Credentials of pulls of the image that succeeded, handed over by the daemon; memory
    /// only.
    granted: Arc<Granted>,
    /// When a daemon last called (any call of the control service).
    last_asked: Mutex<Instant>,
}

struct ControlService(Arc<Shared>);

impl Shared {
    /// Notes a daemon's call.
    fn asked(&self) {
        *self.last_asked.lock() = Instant::now();
    }

    /// Returns once no daemon has called for `grace`, and not before `not_before`; never if
    /// `grace` is zero.
    async fn orphaned(&self, grace: Duration, not_before: Instant) {
        if grace.is_zero() {
            return std::future::pending().await;
        }
        loop {
            let due = (*self.last_asked.lock() + grace).max(not_before);
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due.into()).await;
        }
    }

    fn set_phase(&self, phase: Phase) {
        *self.phase.lock() = phase;
        self.phase_changed.notify_waiters();
    }

    fn starting(&self) -> bool {
        matches!(*self.phase.lock(), Phase::Starting)
    }

    /// Returns once the server is no longer starting, or after `wait`.
    async fn wait_started(&self, wait: Duration) {
        let _ = tokio::time::timeout(wait, async {
            loop {
                // Registered before the check, so a change in between is not missed.
                let changed = self.phase_changed.notified();
                if !self.starting() {
                    return;
                }
                changed.await;
            }
        })
        .await;
    }

    /// The layer being served, or the answer to a call that needs one before it is.
    fn serving(&self) -> Result<Arc<Serving>, Status> {
        match &*self.phase.lock() {
            Phase::Serving(s) => Ok(Arc::clone(s)),
            _ => Err(Status::failed_precondition(
                "the layer is not mounted yet; ask again once it serves",
            )),
        }
    }

    fn status(&self) -> pb::LayerStatus {
        let mut status = pb::LayerStatus {
            layer_key: self.layer.to_string(),
            pid: std::process::id(),
            instance: self.instance.clone(),
            reference: self.reference.clone(),
            mountpoint: self.mountpoint.clone(),
            ..Default::default()
        };
        let serving = match &*self.phase.lock() {
            Phase::Starting => {
                status.set_state(ServerState::Starting);
                return status;
            }
            Phase::Stopping => {
                status.set_state(ServerState::Stopping);
                return status;
            }
            Phase::Failed(e) => {
                status.set_state(ServerState::Failed);
                status.error = e.chain();
                status.error_code = crate::api::code(e.kind()) as i32;
                return status;
            }
            Phase::Serving(s) => Arc::clone(s),
        };
        status.set_state(ServerState::Serving);
        let engine = serving.engine();
        let layer = engine.layer();
        status.layer_digest = layer.meta.layer_digest.to_string();
        status.disk_path = layer.disk_path().to_string();
        status.disk_size = layer.file_size(layer.disk);
        status.chunks = layer.chunks.len() as u64;
        status.chunks_cached = engine.present_count() as u64;
        status.registry_needed_since = serving.registry_needed_since().unwrap_or(0);
        status.integrity = engine.integrity().to_string();
        status.counters = Some(crate::snapshotter::servers::control::layer_counters(engine));
        status.set_ready_dir_state(if serving.ready_mounted() {
            ReadyDirState::Mounted
        } else {
            ReadyDirState::Unmounted
        });
        match serving.hydration() {
            crate::serve::HydrationState::Idle => status.set_hydration(HydrationState::Idle),
            crate::serve::HydrationState::Running => status.set_hydration(HydrationState::Running),
            crate::serve::HydrationState::Done => status.set_hydration(HydrationState::Done),
            crate::serve::HydrationState::Failed(why) => {
                status.set_hydration(HydrationState::Failed);
                status.hydration_error = why;
            }
        }
        status
    }
}

#[tonic::async_trait]
impl pb::layer_server_server::LayerServer for ControlService {
    async fn status(
        &self,
        request: Request<pb::LayerStatusRequest>,
    ) -> Result<Response<pb::LayerStatus>, Status> {
        self.0.asked();
        let wait = u64::from(request.into_inner().wait_started_ms).min(1000);
        if wait > 0 {
            self.0.wait_started(Duration::from_millis(wait)).await;
        }
        Ok(Response::new(self.0.status()))
    }

    async fn hydrate(
        &self,
        _request: Request<pb::HydrateRequest>,
    ) -> Result<Response<pb::HydrateResponse>, Status> {
        self.0.asked();
        let serving = self.0.serving()?;
        Ok(Response::new(pb::HydrateResponse {
            started: serving.hydrate(),
        }))
    }

    async fn mount_ready_dir(
        &self,
        _request: Request<pb::MountReadyDirRequest>,
    ) -> Result<Response<pb::MountReadyDirResponse>, Status> {
        self.0.asked();
        let serving = self.0.serving()?;
        // Its own task: a caller that gives up does not cut a description short.
        let ready_dir = tokio::spawn(async move { serving.mount_ready().await })
            .await
            .map_err(|e| Status::internal(format!("mounting the ready-disk directory: {e}")))??;
        Ok(Response::new(pb::MountReadyDirResponse {
            ready_dir: ready_dir.display().to_string(),
        }))
    }

    async fn set_credentials(
        &self,
        request: Request<pb::Credentials>,
    ) -> Result<Response<pb::SetCredentialsResponse>, Status> {
        self.0.asked();
        self.0
            .granted
            .add(crate::snapshotter::servers::control::grant_of(
                request.into_inner(),
            ));
        Ok(Response::new(pb::SetCredentialsResponse {}))
    }

    async fn stop(
        &self,
        _request: Request<pb::StopRequest>,
    ) -> Result<Response<pb::StopResponse>, Status> {
        let (tx, rx) = oneshot::channel();
        self.0
            .stops
            .send(tx)
            .await
            .map_err(|_| Status::unavailable("the server is stopping"))?;
        let counters = rx
            .await
            .map_err(|_| Status::unavailable("the server is stopping"))??;
        Ok(Response::new(pb::StopResponse {
            counters: Some(counters),
        }))
    }
}

/// How often a server no daemon asks after tries again to stop while its disk is in use.
const ORPHAN_RETRY: Duration = Duration::from_secs(2);

/// How long a server waits for the blob bytes the daemon fetches for it ([`control::hand_over`])
/// at most, once it needs them.
const BLOB_BYTES_WAIT: Duration = Duration::from_secs(3);

/// What the daemon hands a server on stdin when it starts it: credentials and its TLS roots
/// (read at once, within 5 s) and the blob bytes it fetches for it meanwhile (read in the
/// background; the returned receiver yields them, or none if they are not there in time).
async fn handover_from_stdin() -> Result<(pb::Handover, oneshot::Receiver<Held>)> {
    let mut stdin = tokio::io::stdin();
    let handover = tokio::time::timeout(Duration::from_secs(5), control::read_handover(&mut stdin))
        .await
        .map_err(|_| Error::invalid("no handover from the daemon on stdin within 5 s"))??;
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let held = match control::read_blob_bytes(&mut stdin).await {
            Ok(held) => held,
            Err(e) => {
                tracing::warn!(error = %e.chain(), "the blob bytes the daemon fetched are not used");
                Held::default()
            }
        };
        let _ = tx.send(held);
    });
    Ok((handover, rx))
}

/// The connections of a server that died, handed to this one as inherited descriptors
/// (`connections` of the handover; none: this server mounts).
fn inherited(handover: &pb::Handover) -> Result<Option<Inherited>> {
    let mut layer = None;
    let mut ready_disk = None;
    if handover.connections.len() > crate::snapshotter::servers::keeper::MAX_CONNECTIONS {
        return Err(Error::invalid(
            "more inherited FUSE connections than a server has",
        ));
    }
    let mut claimed = std::collections::BTreeSet::new();
    for c in &handover.connections {
        let (role, offer) = crate::snapshotter::servers::keeper::described(c);
        // The daemon started this process with the descriptor there (command-fds).
        let fd = std::os::fd::RawFd::try_from(c.fd)
            .ok()
            .filter(|fd| *fd > 2 && claimed.insert(*fd))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "inherited descriptor {} is not one, or named twice",
                    c.fd
                ))
            })?;
        // SAFETY: the daemon mapped this descriptor into this process for it alone, and each
        // number is claimed once (`claimed`).
        #[allow(unsafe_code)]
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Connection::check_device(&fd)?;
        // Inherited for this process only: nothing it starts gets it.
        nix::fcntl::fcntl(
            &fd,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )
        .map_err(|e| Error::io("keeping an inherited FUSE descriptor", e.into()))?;
        let slot = match role {
            Role::Layer => &mut layer,
            Role::ReadyDisk => &mut ready_disk,
        };
        if slot.replace(Connection { fd, offer }).is_some() {
            return Err(Error::invalid("an inherited FUSE connection named twice"));
        }
    }
    match (layer, ready_disk) {
        (None, None) => Ok(None),
        (Some(layer), ready_disk) => Ok(Some(Inherited {
            layer,
            ready_disk,
            generation: handover.generation,
        })),
        (None, Some(_)) => Err(Error::invalid(
            "an inherited ready-disk directory without its layer's connection",
        )),
    }
}

/// Runs the mount server of `layer` until stopped. The daemon hands it on stdin first the
/// plan it serves (`LayerPlan`: the image, the layer's key, what to do, whether the daemon
/// decided it just now), its TLS roots, the credentials of pulls of the image, and the
/// connections of a server of the layer that died, which this one takes over.
pub async fn serve_layer(config: &Config, layer: Digest) -> Result<()> {
    let (handed, ahead) = handover_from_stdin().await?;
    let inherited = inherited(&handed)?;
    let grants: Vec<_> = handed
        .credentials
        .into_iter()
        .map(crate::snapshotter::servers::control::grant_of)
        .collect();
    let plan = handed
        .plan
        .as_ref()
        .ok_or_else(|| Error::invalid("the daemon's handover names no layer to serve"))
        .and_then(|message| LayerPlan::from_message(message, grants))?;
    if plan.key != layer {
        return Err(Error::invalid(format!(
            "the daemon's plan is for layer {}, this server was started for {layer}",
            plan.key
        )));
    }
    let granted = Arc::new(Granted::default());
    for grant in &plan.grants {
        granted.add(grant.clone());
    }
    let roots = Roots::handed(handed.tls_roots)?;
    let (reference, layer) = (&plan.reference, &plan.key);
    let paths = LayerPaths::new(&config.root, layer);
    let listener = crate::api::unix::bind(&paths.control, 0o600)?;
    let (stops, mut stop_requests) = mpsc::channel(4);
    let shared = Arc::new(Shared {
        layer: *layer,
        reference: reference.to_string(),
        instance: Digest::of(
            format!(
                "{}/{:?}/{:?}",
                std::process::id(),
                std::time::SystemTime::now(),
                std::thread::current().id()
            )
            .as_bytes(),
        )
        .hex()[..16]
            .to_string(),
        mountpoint: paths.mountpoint.display().to_string(),
        phase: Mutex::new(Phase::Starting),
        phase_changed: tokio::sync::Notify::new(),
        stops,
        granted,
        last_asked: Mutex::new(Instant::now()),
    });
    let (done, done_rx) = tokio::sync::watch::channel(false);
    let control_task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::layer_server_server::LayerServerServer::new(
                ControlService(Arc::clone(&shared)),
            ))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(listener),
                async move {
                    let mut rx = done_rx;
                    let _ = rx.wait_for(|d| *d).await;
                },
            ),
    );
    let outcome = run(
        config,
        &plan,
        Parts {
            roots: &roots,
            ahead,
            inherited,
        },
        &paths,
        &shared,
        &mut stop_requests,
    )
    .await;
    let _ = done.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(2), control_task).await;
    let _ = std::fs::remove_file(&paths.control);
    outcome
}

/// What the daemon handed a server to start with.
struct Parts<'a> {
    roots: &'a Roots,
    /// The blob bytes it fetches for the structure check.
    ahead: oneshot::Receiver<Held>,
    /// The connections of the server that died, to take over.
    inherited: Option<Inherited>,
}

/// Starts serving (unless stopped first), then answers stop requests and signals.
async fn run(
    config: &Config,
    plan: &LayerPlan,
    parts: Parts<'_>,
    paths: &LayerPaths,
    shared: &Shared,
    stop_requests: &mut mpsc::Receiver<oneshot::Sender<Result<pb::LayerCounters>>>,
) -> Result<()> {
    let (reference, layer) = (&plan.reference, &plan.key);
    let started = tokio::select! {
        r = start(config, plan, parts, paths, Arc::clone(&shared.granted)) => r,
        Some(reply) = stop_requests.recv() => {
            let _ = reply.send(Ok(pb::LayerCounters::default()));
            tracing::info!(%layer, "stopped while starting");
            return Ok(());
        }
        r = crate::serve::wait_for_signal() => {
            r?;
            tracing::info!(%layer, "signalled while starting");
            return Ok(());
        }
    };
    let serving = match started {
        Ok(s) => Arc::new(s),
        Err(e) => {
            tracing::error!(%layer, error = %e.chain(), "the layer cannot be served");
            let (kind, why) = (e.kind(), e.chain());
            shared.set_phase(Phase::Failed(e));
            // Keep answering Status until the daemon has read why, then go.
            let _ = tokio::time::timeout(FAILED_LINGER, async {
                tokio::select! {
                    Some(reply) = stop_requests.recv() => {
                        let _ = reply.send(Ok(pb::LayerCounters::default()));
                    }
                    _ = crate::serve::wait_for_signal() => {}
                }
            })
            .await;
            return Err(Error::new(kind, why));
        }
    };
    // Offered before the daemon learns it serves: it collects them then.
    let offering =
        crate::snapshotter::servers::keeper::Offering::start(&paths.keeper, Arc::clone(&serving));
    if let Err(e) = &offering {
        tracing::warn!(error = %e.chain(), "the daemon cannot keep this server's FUSE connections: its readers would not survive its crash");
    }
    shared.set_phase(Phase::Serving(Arc::clone(&serving)));
    tracing::info!(%reference, %layer, mountpoint = %paths.mountpoint.display(), "serving");
    let grace = Duration::from_secs(config.orphan_grace);
    let mut orphan_not_before = Instant::now();
    let mut orphan_noted = false;
    loop {
        let reply = tokio::select! {
            Some(reply) = stop_requests.recv() => Some(reply),
            r = crate::serve::wait_for_signal() => { r?; None }
            () = shared.orphaned(grace, orphan_not_before) => {
                match serving.unmount() {
                    Ok(()) => {
                        tracing::info!(%layer, grace_secs = grace.as_secs(), "no daemon asked after this server and no one has its disk open: stopping");
                        break;
                    }
                    Err(e) => {
                        if !std::mem::replace(&mut orphan_noted, true) {
                            tracing::info!(%layer, grace_secs = grace.as_secs(), why = %e.chain(), "no daemon asked after this server: it stops once its disk is closed");
                        }
                        orphan_not_before = Instant::now() + ORPHAN_RETRY;
                        continue;
                    }
                }
            }
        };
        orphan_noted = false;
        match serving.unmount() {
            Ok(()) => {
                let counters =
                    crate::snapshotter::servers::control::layer_counters(serving.engine());
                if let Some(reply) = reply {
                    let _ = reply.send(Ok(counters));
                }
                break;
            }
            Err(e) => {
                tracing::warn!(%layer, error = %e.chain(), "not stopping: the mount is in use");
                if let Some(reply) = reply {
                    let _ = reply.send(Err(e));
                }
            }
        }
    }
    shared.set_phase(Phase::Stopping);
    if let Ok(offering) = offering {
        offering.bye().await;
    }
    // A status call may hold the serving state for a moment.
    let mut serving = serving;
    let serving = loop {
        match Arc::try_unwrap(serving) {
            Ok(s) => break s,
            Err(s) => serving = s,
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    serving.finish().await?;
    // Its mounts are gone: no successor needs their passthrough registrations.
    let prefix = paths.passthrough_records();
    for role in [Role::Layer, Role::ReadyDisk] {
        let _ = std::fs::remove_file(role.registrations(&prefix));
    }
    tracing::info!(%layer, "mount server stopped");
    Ok(())
}

/// Opens the plan's layer — from the cache when the daemon decided it just now, else by
/// resolving the image again (a layer served again from the daemon's records) —, checks that
/// it has the key planned, and mounts it (its ready-disk directory when asked:
/// `MountReadyDir`). `ahead`: the blob bytes the daemon fetches for the structure check while
/// this server starts.
async fn start(
    config: &Config,
    plan: &LayerPlan,
    parts: Parts<'_>,
    paths: &LayerPaths,
    granted: Arc<Granted>,
) -> Result<Serving> {
    let Parts {
        roots,
        ahead,
        inherited,
    } = parts;
    let (layer, alias, reference) = (&plan.key, plan.alias.as_ref(), &plan.reference);
    let digest = reference.digest.ok_or_else(|| {
        Error::invalid(format!(
            "{reference}: serve-layer needs a reference by digest"
        ))
    })?;
    let (cache, client, trust) = open_parts(config, roots, granted).await?;
    let opts = crate::engine::EngineOptions {
        fetch_deadline: Duration::from_secs(config.registry.fetch_timeout),
        memory_budget: config.memory_budget()?,
        memory_ledger: Some(config.memory_ledger()),
        ..Default::default()
    };
    // The ready directory, when wanted at once, is described right after serving: its head
    // comes with the structure check.
    let warm = match plan.need {
        Need::Layer => crate::serve::Warm::Nothing,
        Need::ReadyDisk => crate::serve::Warm::DiskHead,
    };
    // A layer resolved again is judged by the name the daemon checked (its decision is in the
    // cache).
    let wanted = crate::resolve::Wanted {
        named: alias.map_or(reference, ImageName::reference),
        reference,
        // Its record, kept when the daemon classified the layer, saves fetching its TOC.
        expected: Some(*layer),
    };
    let opening = match plan.verdict {
        Verdict::DecidedNow => crate::serve::Opening::Decided {
            key: *layer,
            wanted,
        },
        Verdict::Recorded => crate::serve::Opening::Resolve(wanted),
    };
    // The mount point and the VMM's group (a lookup in the node's group database) are made
    // ready while the layer opens.
    let (vmm_group, mountpoint) = (config.clone(), paths.mountpoint.clone());
    // A mount taken over is left as it is: its readers wait on it.
    let mounting = inherited.is_none();
    let mount_ready = crate::task::blocking(move || {
        if mounting {
            prepare_mountpoint(&mountpoint)?;
        }
        vmm_group.vmm_gid()
    });
    let opened = crate::serve::open_engine(
        Arc::clone(&client) as _,
        &cache,
        &trust,
        opening,
        opts,
        warm,
        held_ahead(ahead),
    );
    let (engine, vmm_gid) = tokio::join!(opened, mount_ready);
    let (engine, vmm_gid) = (engine?, vmm_gid?);
    let key = engine.layer().key();
    if key != *layer {
        return Err(Error::corrupt(format!(
            "{reference} resolves to disk layer {} with key {key}, not {layer}; the image changed since the snapshot was made",
            engine.layer().meta.layer_digest
        )));
    }
    let (c, name) = (cache.clone(), reference.to_string());
    let record = tokio::task::spawn_blocking(move || c.load_ref(&name))
        .await
        .ok()
        .flatten();
    let ready = ready_dir(config, vmm_gid, &digest, reference, alias, record.as_ref());
    let serving = crate::serve::start(
        Arc::clone(&engine),
        &cache,
        &paths.mountpoint,
        &crate::serve::ServeOptions {
            hydrate: config.cache.hydrate,
            hydrate_rate: config.cache.hydrate_rate,
            passthrough: config.cache.passthrough,
            verify_rate: config.cache.verify_rate,
            announce: false,
            ready: Some(ready),
            registrations: Some(paths.passthrough_records()),
        },
        inherited,
    )
    .await?;
    // Readers of an inherited ready-disk directory wait: it is served at once.
    if serving.ready_inherited() {
        serving.mount_ready().await?;
    }
    // After ready: the boot trace published for this image, if any, is fetched first.
    if let Some(record) = record.filter(|_| config.cache.boot_traces) {
        tokio::spawn(crate::trace::replay_published(
            client,
            engine,
            reference.clone(),
            record.manifest_digest,
        ));
    }
    Ok(serving)
}

/// The ready-disk directory of the image `reference` (manifest `digest`; `alias` the name it
/// was asked by), with the platform its kept record names.
fn ready_dir(
    config: &Config,
    vmm_gid: u32,
    digest: &crate::oci::digest::Digest,
    reference: &Reference,
    alias: Option<&ImageName>,
    record: Option<&crate::cache::RefRecord>,
) -> crate::serve::ready::ReadyDir {
    crate::serve::ready::ReadyDir::new(
        &config.ready_dir,
        vmm_gid,
        digest,
        alias,
        reference.to_string(),
        record.map(|r| r.platform.clone()).unwrap_or_default(),
    )
}

/// What a server reads its layer with: the node's cache, a registry client with the daemon's
/// TLS roots and the grants it handed over, and the signature policy.
async fn open_parts(
    config: &Config,
    roots: &Roots,
    granted: Arc<Granted>,
) -> Result<(
    CacheRoot,
    Arc<crate::registry::RegistryClient>,
    crate::policy::Verifier,
)> {
    let cache_dir = config.cache_dir();
    let cache = tokio::task::spawn_blocking(move || CacheRoot::open(&cache_dir))
        .await
        .map_err(|e| {
            Error::new(crate::error::ErrorKind::Io, "opening the cache").with_source(e)
        })??;
    let registry = crate::registry::RegistryConfig {
        roots: roots.clone(),
        agent: crate::registry::Agent::MountServer,
        ..config.registry_config()
    };
    let client = Arc::new(crate::registry::RegistryClient::new(registry)?.with_grants(granted));
    let signatures = config.signatures.clone();
    let trust = crate::task::blocking(move || crate::policy::Verifier::load(&signatures))
        .await
        .map_err(|e| e.context("configuration [signatures]"))?;
    Ok((cache, client, trust))
}

/// The blob bytes the daemon fetched ahead for the structure check (none when it sends none,
/// or not within [`BLOB_BYTES_WAIT`]: the check then fetches them itself).
async fn held_ahead(ahead: oneshot::Receiver<Held>) -> Held {
    match tokio::time::timeout(BLOB_BYTES_WAIT, ahead).await {
        Ok(Ok(held)) => held,
        _ => {
            tracing::warn!("no blob bytes from the daemon within {BLOB_BYTES_WAIT:?}; the structure check fetches them");
            Held::default()
        }
    }
}

/// Makes `dir` an empty directory to mount on, detaching a mount left by a server that died
/// (it answers ENOTCONN).
fn prepare_mountpoint(dir: &Path) -> Result<()> {
    if nix::sys::statfs::statfs(dir).is_err() || std::fs::metadata(dir).is_err() {
        let _ = nix::mount::umount2(dir, nix::mount::MntFlags::MNT_DETACH);
    }
    crate::dirs::private(dir)
}
