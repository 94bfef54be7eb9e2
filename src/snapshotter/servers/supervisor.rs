//! The supervisor of the mount servers: one process per remote layer
//! (`vmdisk-snapshotter serve-layer`, [`crate::snapshotter::mount_server`]), started, watched, adopted and stopped
//! through each server's control socket ([`crate::snapshotter::servers::control`]).
//!
//! Why processes: a FUSE mount dies with the process that serves it, and an overlay mount that
//! uses it as a lower directory keeps pointing at the dead connection. Serving each layer from
//! its own process, in its own process group, lets the daemon restart (upgrade, crash) while
//! containers keep reading: the new daemon asks each recorded layer's socket who is there
//! (layer key, pid, instance) and adopts a server that serves that layer. The systemd unit uses
//! `KillMode=process` for the same reason.
//!
//! [`Supervisor`] is the seam the snapshotter drives (a fake one in its unit tests);
//! [`LayerServers`] is the real one. Callers serialise the start and stop of one layer with
//! [`LayerLocks`]; nothing holds a lock over all layers across an await, so a mount stuck on
//! an unreachable registry delays only its own layer, and status queries take no lock at all.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use parking_lot::Mutex;

use crate::error::{Error, ErrorKind, Result};
use crate::layer::Held;
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::registry::granted::Grant;
use crate::serve::connection::{Connection, Role};
use crate::snapshotter::servers::control::{
    self, LayerPaths, LayerPlan, LayerStatus, Need, ServerState,
};
use crate::snapshotter::servers::keeper;

/// How long one status call waits for a starting server to serve (or fail): the daemon learns
/// the outcome as it happens instead of at its next poll.
const STARTED_WAIT: Duration = Duration::from_millis(250);

/// How to start servers.
#[derive(Debug, Clone)]
pub struct ServerCommand {
    /// The daemon's own executable.
    pub exe: PathBuf,
    pub config: Option<PathBuf>,
    pub root: PathBuf,
    /// Where servers mount ready-disk directories (`ready_dir` of the configuration).
    pub ready_dir: PathBuf,
    pub mount_timeout: Duration,
    /// The TLS roots the daemon read, handed to every server it starts.
    pub tls_roots: Arc<[rustls_pki_types::CertificateDer<'static>]>,
    /// The nice level servers run at when it is not the daemon's ([`crate::snapshotter::daemon::priority`]).
    pub nice: Option<i32>,
}

/// The blob bytes a server about to be started will read first, being fetched by the daemon
/// ([`crate::resolve::fetch_structure_ahead`]: its structure check's), handed to the server
/// once fetched. The fetch stops when it is dropped unused (no server was started).
pub struct Ahead(Option<tokio::task::JoinHandle<Held>>);

impl Ahead {
    /// Starts fetching layer `key`'s bytes with `client` (one that read the image's manifest
    /// and TOC), from the record and TOC `cache` keeps.
    pub fn fetch(
        client: Arc<dyn crate::registry::Registry>,
        cache: crate::cache::CacheRoot,
        key: Digest,
    ) -> Self {
        Ahead(Some(tokio::spawn(async move {
            crate::resolve::fetch_structure_ahead(client.as_ref(), &cache, key).await
        })))
    }

    /// The bytes, once fetched (none if the fetch failed).
    async fn bytes(mut self) -> Held {
        match self.0.take() {
            Some(task) => task.await.unwrap_or_default(),
            None => Held::default(),
        }
    }
}

impl Drop for Ahead {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

/// How many mount servers were started and adopted since the daemon last took the count
/// ([`Supervisor::take_events`]): the daemon keeps them as counters
/// (`vmdisk_mount_server_starts_total`, `vmdisk_mount_servers_adopted_total`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ServerEvents {
    /// Servers started for a layer no server of this daemon's served before (a first mount,
    /// the node's restart).
    pub started: u64,
    /// Servers started for a layer whose server this daemon knew had ended without being
    /// stopped (a crash, a kill, the OOM killer) or had failed.
    pub restarted: u64,
    /// Running servers this daemon took over, started by an earlier daemon (an update, the
    /// daemon's crash, the DaemonSet's pod replaced).
    pub adopted: u64,
    /// Layers whose servers kept dying ([`MAX_DEATHS`] within [`DEATH_WINDOW`]): their
    /// connections were let go, and their readers get errors until the layer is served again.
    pub given_up: u64,
}

impl ServerEvents {
    /// Each event's count.
    pub fn counted(&self) -> [(ServerEvent, u64); 4] {
        [
            (ServerEvent::Started, self.started),
            (ServerEvent::Restarted, self.restarted),
            (ServerEvent::Adopted, self.adopted),
            (ServerEvent::GivenUp, self.given_up),
        ]
    }
}

/// One of [`ServerEvents`]' counts, as the daemon counts it (`servers/<name>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerEvent {
    Started,
    Restarted,
    Adopted,
    GivenUp,
}

impl ServerEvent {
    /// Its name: `started`, `restarted` (the `why` of `vmdisk_mount_server_starts_total`),
    /// `adopted`, `given_up`.
    pub fn name(self) -> &'static str {
        match self {
            ServerEvent::Started => "started",
            ServerEvent::Restarted => "restarted",
            ServerEvent::Adopted => "adopted",
            ServerEvent::GivenUp => "given_up",
        }
    }
}

impl crate::snapshotter::counters::Counted for ServerEvent {
    fn key(&self) -> String {
        format!("servers/{}", self.name())
    }
}

/// What the snapshotter asks of whoever runs the mount servers.
pub trait Supervisor: Send + Sync {
    /// Where `layer`'s files are mounted.
    fn mountpoint(&self, layer: &Digest) -> PathBuf;
    /// Whether `layer`'s files are mounted and answer now (a look at the mountpoint, no call
    /// to its server). Unmounted, the mountpoint is an empty directory (after a reboot) or a
    /// dead connection (after its server died). Blocks on the mount: call it off the runtime.
    fn mounted(&self, layer: &Digest) -> bool;
    /// The ready-disk directory of the image `reference` (repository@manifest digest).
    fn ready_dir(&self, reference: &Reference) -> Option<PathBuf>;
    /// What `layer`'s server says about itself, if one answers in time.
    fn status<'a>(&'a self, layer: &'a Digest) -> BoxFuture<'a, Option<LayerStatus>>;
    /// Asks `layer`'s server to fetch its whole disk; whether a new hydration started.
    fn hydrate<'a>(&'a self, layer: &'a Digest) -> BoxFuture<'a, Result<bool>>;
    /// Makes sure a server serves `plan`'s layer as it `need`s, adopting a running one or
    /// starting one with the plan, and that it holds the plan's grants (credentials of pulls
    /// of that image that succeeded); returns the mount point. A server it starts is handed
    /// the bytes `ahead` fetches. The caller holds the layer's lock.
    fn ensure<'a>(
        &'a self,
        plan: &'a LayerPlan,
        ahead: Option<Ahead>,
    ) -> BoxFuture<'a, Result<PathBuf>>;
    /// Stops `layer`'s server; its last status with its final counters, or `None` if no server
    /// answered. A busy mount refuses (`FailedPrecondition`). The caller holds the layer's lock.
    fn stop<'a>(&'a self, layer: &'a Digest) -> BoxFuture<'a, Result<Option<LayerStatus>>>;
    /// Hands `layer`'s running server the credentials of a pull of its image that succeeded.
    fn hand_grant<'a>(
        &'a self,
        _layer: &'a Digest,
        _grant: &'a Grant,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async { Ok(()) })
    }
    /// The servers started and adopted since the last call (then counted from zero again).
    fn take_events(&self) -> ServerEvents {
        ServerEvents::default()
    }
    /// The next layer whose server died with its mounts up (never, for a supervisor that
    /// keeps no connections).
    fn died(&self) -> BoxFuture<'_, Option<Digest>> {
        Box::pin(std::future::pending())
    }
    /// Starts a successor to `layer`'s server that died, on the connections kept for it
    /// ([`crate::serve::connection`]), unless the layer's servers kept dying. The caller holds
    /// the layer's lock.
    fn revive<'a>(&'a self, _layer: &'a Digest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async { Ok(()) })
    }
}

/// A shared supervisor is one too (the daemon's tests keep a handle on their fake).
impl<T: Supervisor + ?Sized> Supervisor for Arc<T> {
    fn mountpoint(&self, layer: &Digest) -> PathBuf {
        (**self).mountpoint(layer)
    }
    fn mounted(&self, layer: &Digest) -> bool {
        (**self).mounted(layer)
    }
    fn ready_dir(&self, reference: &Reference) -> Option<PathBuf> {
        (**self).ready_dir(reference)
    }
    fn status<'a>(&'a self, layer: &'a Digest) -> BoxFuture<'a, Option<LayerStatus>> {
        (**self).status(layer)
    }
    fn hydrate<'a>(&'a self, layer: &'a Digest) -> BoxFuture<'a, Result<bool>> {
        (**self).hydrate(layer)
    }
    fn ensure<'a>(
        &'a self,
        plan: &'a LayerPlan,
        ahead: Option<Ahead>,
    ) -> BoxFuture<'a, Result<PathBuf>> {
        (**self).ensure(plan, ahead)
    }
    fn stop<'a>(&'a self, layer: &'a Digest) -> BoxFuture<'a, Result<Option<LayerStatus>>> {
        (**self).stop(layer)
    }
    fn hand_grant<'a>(&'a self, layer: &'a Digest, grant: &'a Grant) -> BoxFuture<'a, Result<()>> {
        (**self).hand_grant(layer, grant)
    }
    fn take_events(&self) -> ServerEvents {
        (**self).take_events()
    }
    fn died(&self) -> BoxFuture<'_, Option<Digest>> {
        (**self).died()
    }
    fn revive<'a>(&'a self, layer: &'a Digest) -> BoxFuture<'a, Result<()>> {
        (**self).revive(layer)
    }
}

/// One lock per layer, held while its server is started or stopped together with the records
/// that use it, so a removal never stops a server a concurrent Prepare just recorded a use of.
#[derive(Default)]
pub struct LayerLocks {
    locks: Mutex<HashMap<Digest, Arc<tokio::sync::Mutex<()>>>>,
}

impl LayerLocks {
    /// Waits for `layer`'s lock (only operations on the same layer wait).
    pub async fn lock(&self, layer: &Digest) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut locks = self.locks.lock();
            // Forget locks nobody holds or waits for, so the map stays as small as the work.
            locks.retain(|_, l| Arc::strong_count(l) > 1);
            Arc::clone(locks.entry(*layer).or_default())
        };
        lock.lock_owned().await
    }
}

/// How many times a layer's servers may die within [`DEATH_WINDOW`] before the daemon lets
/// its connections go.
pub const MAX_DEATHS: usize = 5;

/// The window [`MAX_DEATHS`] counts in.
pub const DEATH_WINDOW: Duration = Duration::from_secs(600);

/// How long the daemon waits before starting the successor of a server that died for the
/// `n`th time in a row within [`DEATH_WINDOW`]: at once the first time, then 0.5, 1, 2, 4 s.
fn revive_delay(n: usize) -> Duration {
    match n {
        0 | 1 => Duration::ZERO,
        n => Duration::from_millis(250 << (n - 1).min(5)),
    }
}

/// A layer's FUSE connections, kept for a successor of its server, and what it is started
/// with.
struct KeptLayer {
    connections: Vec<(Role, Connection)>,
    /// How many servers served them before the one serving now.
    generation: u32,
    /// What its servers are started with: the plan it was first served by, with the
    /// credentials of pulls of the image handed to its servers since (the latest few).
    plan: LayerPlan,
    /// Reads how the server ends; dropped with this record.
    watch: tokio::task::JoinHandle<()>,
    /// When its servers died, within [`DEATH_WINDOW`].
    deaths: Vec<std::time::Instant>,
    /// Which collection this is (the watch's ending names it).
    serial: u64,
    /// The server instance they were collected from.
    instance: Option<String>,
}

impl Drop for KeptLayer {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

/// What a successor of a layer's server is handed: the kept connections and how many servers
/// served them before it.
struct Succession {
    connections: Vec<(Role, Connection)>,
    generation: u32,
}

/// What a successor is started for, and when.
struct Revival {
    plan: LayerPlan,
    delay: Duration,
}

/// Most credentials kept per layer for its successors.
const KEPT_GRANTS: usize = 8;

/// Adds `grants` to those `held` for a layer's successors, keeping the latest [`KEPT_GRANTS`].
fn add_grants(held: &mut Vec<Grant>, grants: &[Grant]) {
    held.extend(grants.iter().cloned());
    let drop_first = held.len().saturating_sub(KEPT_GRANTS);
    held.drain(..drop_first);
}

/// The mount server processes.
pub struct LayerServers {
    command: ServerCommand,
    /// The server instance this daemon last saw serving each layer, until it stops it: an
    /// instance not seen before is an adoption, a start for a layer still here a restart.
    known: Mutex<HashMap<Digest, String>>,
    /// Counted since the daemon last took them.
    events: Mutex<ServerEvents>,
    /// Each served layer's connections, while this daemon keeps them.
    kept: Mutex<HashMap<Digest, KeptLayer>>,
    /// How the servers of `kept` ended (layer, collection), sent by their watches.
    endings: tokio::sync::mpsc::UnboundedSender<(Digest, u64, keeper::Ending)>,
    ended: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<(Digest, u64, keeper::Ending)>>,
    /// The last collection's serial.
    serial: std::sync::atomic::AtomicU64,
}

/// Whether the process `pid` exists (the pid a server reported about itself).
fn process_alive(pid: u32) -> bool {
    i32::try_from(pid)
        .is_ok_and(|pid| nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok())
}

impl LayerServers {
    pub fn new(command: ServerCommand) -> Self {
        let (endings, ended) = tokio::sync::mpsc::unbounded_channel();
        LayerServers {
            command,
            known: Mutex::new(HashMap::new()),
            events: Mutex::new(ServerEvents::default()),
            kept: Mutex::new(HashMap::new()),
            endings,
            ended: tokio::sync::Mutex::new(ended),
            serial: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Takes descriptors of the connections of `layer`'s serving server and watches how it
    /// ends ([`keeper`]), unless they are kept already (the same server, and its ready-disk
    /// directory's too if `need`s); a server that does not hand them out (one from before this
    /// version) is served as before, without a successor.
    async fn keep(&self, plan: &LayerPlan) {
        let layer = &plan.key;
        let instance = self.known.lock().get(layer).cloned();
        if let Some(k) = self.kept.lock().get_mut(layer) {
            let covered = plan.need == Need::Layer
                || k.connections.iter().any(|(r, _)| *r == Role::ReadyDisk);
            if covered && instance.is_some() && k.instance == instance {
                add_grants(&mut k.plan.grants, &plan.grants);
                return;
            }
        }
        let kept = match keeper::collect(&self.paths(layer).keeper).await {
            Ok(kept) => kept,
            Err(e) => {
                tracing::warn!(%layer, error = %e.chain(), "the mount server's FUSE connections are not kept: its readers would get errors if it died");
                return;
            }
        };
        let serial = self
            .serial
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (endings, layer_key) = (self.endings.clone(), *layer);
        let watch = tokio::spawn(async move {
            let ending = keeper::ended(kept.watch).await;
            let _ = endings.send((layer_key, serial, ending));
        });
        let mut all = self.kept.lock();
        let earlier = all.remove(layer);
        let (mut held, died) = earlier
            .map(|mut e| {
                (
                    std::mem::take(&mut e.plan.grants),
                    std::mem::take(&mut e.deaths),
                )
            })
            .unwrap_or_default();
        add_grants(&mut held, &plan.grants);
        all.insert(
            *layer,
            KeptLayer {
                connections: kept.connections,
                generation: kept.generation,
                plan: LayerPlan {
                    grants: held,
                    ..plan.clone()
                },
                watch,
                deaths: died,
                serial,
                instance,
            },
        );
    }

    /// Descriptors of the connections kept for `layer`, for a successor, and its generation.
    fn inherit(&self, layer: &Digest) -> Result<Option<Succession>> {
        let kept = self.kept.lock();
        let Some(k) = kept.get(layer) else {
            return Ok(None);
        };
        let connections = k
            .connections
            .iter()
            .map(|(role, c)| Ok((*role, c.try_clone()?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(Succession {
            connections,
            generation: k.generation + 1,
        }))
    }

    /// Counts a death of `layer`'s server; what to start its successor with and after how
    /// long, or `None` once its servers died [`MAX_DEATHS`] times within [`DEATH_WINDOW`] (its
    /// connections are then let go) or it is no longer kept.
    fn count_death(&self, layer: &Digest) -> Option<Revival> {
        let mut kept = self.kept.lock();
        let k = kept.get_mut(layer)?;
        let now = std::time::Instant::now();
        k.deaths.retain(|t| now.duration_since(*t) < DEATH_WINDOW);
        k.deaths.push(now);
        if k.deaths.len() > MAX_DEATHS {
            let deaths = k.deaths.len();
            // The last descriptors close: the kernel ends the connection, its waiting readers
            // get errors, and the mount answers ENOTCONN until the layer is served again.
            kept.remove(layer);
            self.known.lock().remove(layer);
            self.events.lock().given_up += 1;
            tracing::error!(%layer, deaths, window_secs = DEATH_WINDOW.as_secs(), log = %self.paths(layer).log.display(), "the layer's mount servers keep dying: its FUSE connections are let go and its readers get I/O errors; read the server's log, then make the layer be served again (a new pull or `vmdisk path`)");
            return None;
        }
        let need = match k.connections.iter().any(|(r, _)| *r == Role::ReadyDisk) {
            true => Need::ReadyDisk,
            false => Need::Layer,
        };
        Some(Revival {
            plan: LayerPlan {
                need,
                ..k.plan.clone()
            },
            delay: revive_delay(k.deaths.len()),
        })
    }

    pub fn paths(&self, layer: &Digest) -> LayerPaths {
        LayerPaths::new(&self.command.root, layer)
    }

    /// What `layer`'s server says about itself, if a server for that layer answers within
    /// [`control::CALL_DEADLINE`].
    async fn server_status(&self, layer: &Digest) -> Option<LayerStatus> {
        let status = control::status(&self.paths(layer).control).await.ok()?;
        (status.layer_key == layer.to_string()).then_some(status)
    }

    /// Remembers the server instance serving `layer`; whether it was new to this daemon.
    fn know(&self, layer: &Digest, instance: &str) -> bool {
        self.known
            .lock()
            .insert(*layer, instance.to_string())
            .as_deref()
            != Some(instance)
    }
}

impl Supervisor for LayerServers {
    fn mountpoint(&self, layer: &Digest) -> PathBuf {
        self.paths(layer).mountpoint
    }

    fn mounted(&self, layer: &Digest) -> bool {
        let mountpoint = self.paths(layer).mountpoint;
        nix::sys::statfs::statfs(&mountpoint)
            .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::FUSE_SUPER_MAGIC)
            && std::fs::metadata(&mountpoint).is_ok()
    }

    fn hand_grant<'a>(&'a self, layer: &'a Digest, grant: &'a Grant) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            control::set_credentials(
                &self.paths(layer).control,
                control::credentials_message(grant),
            )
            .await
        })
    }

    fn ready_dir(&self, reference: &Reference) -> Option<PathBuf> {
        Some(crate::serve::ready::dir_of(
            &self.command.ready_dir,
            &reference.digest?,
        ))
    }

    fn status<'a>(&'a self, layer: &'a Digest) -> BoxFuture<'a, Option<LayerStatus>> {
        Box::pin(self.server_status(layer))
    }

    fn hydrate<'a>(&'a self, layer: &'a Digest) -> BoxFuture<'a, Result<bool>> {
        let socket = self.paths(layer).control;
        Box::pin(async move { control::hydrate(&socket).await })
    }

    fn ensure<'a>(
        &'a self,
        plan: &'a LayerPlan,
        ahead: Option<Ahead>,
    ) -> BoxFuture<'a, Result<PathBuf>> {
        Box::pin(async move {
            let mountpoint = self.ensure_server(plan, ahead).await?;
            if plan.need == Need::ReadyDisk {
                self.mount_ready_dir(&plan.key, &plan.reference).await?;
            }
            self.keep(plan).await;
            Ok(mountpoint)
        })
    }

    fn died(&self) -> BoxFuture<'_, Option<Digest>> {
        Box::pin(async move {
            let mut ended = self.ended.lock().await;
            loop {
                let (layer, serial, ending) = ended.recv().await?;
                let mut kept = self.kept.lock();
                // An ending of a server whose connections are no longer the ones kept (stopped
                // by the daemon, or succeeded since) is old news.
                if kept.get(&layer).is_none_or(|k| k.serial != serial) {
                    continue;
                }
                match ending {
                    keeper::Ending::Died => return Some(layer),
                    // It unmounted: its connections ended with the mounts.
                    keeper::Ending::Stopped => {
                        kept.remove(&layer);
                    }
                }
            }
        })
    }

    fn revive<'a>(&'a self, layer: &'a Digest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            // A server that answers serves (the layer was served again meanwhile).
            if self
                .server_status(layer)
                .await
                .is_some_and(|s| s.state() == ServerState::Serving)
            {
                return Ok(());
            }
            loop {
                let Some(r) = self.count_death(layer) else {
                    return Ok(());
                };
                tracing::warn!(%layer, delay_ms = r.delay.as_millis() as u64, "the layer's mount server died with its mounts up: a successor takes them over");
                tokio::time::sleep(r.delay).await;
                match self.ensure(&r.plan, None).await {
                    Ok(_) => return Ok(()),
                    Err(e) => {
                        tracing::error!(%layer, error = %e.chain(), "the successor of the layer's mount server failed to start")
                    }
                }
            }
        })
    }

    fn stop<'a>(&'a self, layer: &'a Digest) -> BoxFuture<'a, Result<Option<LayerStatus>>> {
        Box::pin(self.stop_server(layer))
    }

    fn take_events(&self) -> ServerEvents {
        std::mem::take(&mut *self.events.lock())
    }
}

impl LayerServers {
    async fn ensure_server(&self, plan: &LayerPlan, ahead: Option<Ahead>) -> Result<PathBuf> {
        let (layer, reference, grants) = (&plan.key, &plan.reference, &plan.grants);
        let paths = self.paths(layer);
        // A server that failed or is stopping is replaced.
        let replaced = match self.server_status(layer).await {
            None => false,
            Some(status) => match status.state() {
                ServerState::Serving => {
                    if self.know(layer, &status.instance) {
                        self.events.lock().adopted += 1;
                        tracing::info!(%layer, pid = status.pid, instance = status.instance, "adopted the running mount server");
                    }
                    self.hand_grants(layer, grants).await;
                    return Ok(paths.mountpoint);
                }
                // A start begun by an earlier daemon: see it through.
                ServerState::Starting => {
                    let mountpoint = self.wait_serving(layer, reference, None).await?;
                    self.hand_grants(layer, grants).await;
                    return Ok(mountpoint);
                }
                _ => {
                    let _ = control::stop(&paths.control).await;
                    self.wait_gone(layer, status.pid).await;
                    true
                }
            },
        };
        if replaced || self.known.lock().contains_key(layer) {
            self.events.lock().restarted += 1;
            tracing::warn!(%layer, "the layer's mount server ended without being stopped, or failed: starting another");
        } else {
            self.events.lock().started += 1;
        }
        self.start(plan, ahead).await
    }

    /// Has `layer`'s serving server mount its ready-disk directory (describing the disk may
    /// fetch its head: within the mount timeout). A failure leaves the server serving the
    /// layer: snapshots may use it.
    async fn mount_ready_dir(&self, layer: &Digest, reference: &Reference) -> Result<()> {
        let paths = self.paths(layer);
        control::mount_ready_dir(&paths.control, self.command.mount_timeout)
            .await
            .map_err(|e| {
                e.context(format!(
                    "making the ready-disk directory of {reference} (layer {layer}; log: {})",
                    paths.log.display()
                ))
            })
    }

    /// Hands `layer`'s running server `grants` (it adds them to those it holds).
    async fn hand_grants(&self, layer: &Digest, grants: &[Grant]) {
        for grant in grants {
            if let Err(e) = self.hand_grant(layer, grant).await {
                tracing::warn!(%layer, error = %e.chain(), "the layer's server did not take the credentials of a pull");
            }
        }
    }

    async fn start(&self, plan: &LayerPlan, ahead: Option<Ahead>) -> Result<PathBuf> {
        let (layer, reference) = (&plan.key, &plan.reference);
        let command = &self.command;
        let paths = self.paths(layer);
        let log_path = paths.log.clone();
        // Its directory was made with the root (`LayerPaths::prepare_root`).
        let log = tokio::task::spawn_blocking(move || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log_path)
                .map_err(|e| Error::io(format!("opening {}", log_path.display()), e))
        })
        .await
        .map_err(|e| Error::new(ErrorKind::Io, "opening a server log").with_source(e))??;
        let mut cmd = tokio::process::Command::new(&command.exe);
        cmd.arg("serve-layer");
        if let Some(config) = &command.config {
            cmd.arg("--config").arg(config);
        }
        cmd.arg("--root")
            .arg(&command.root)
            .arg("--layer")
            .arg(plan.key.to_string());
        if let Some(level) = command.nice {
            cmd.arg(format!("--nice={level}"));
        }
        // The plan, the daemon's TLS roots and the credentials of pulls of this image go to the
        // server over a pipe, never in its arguments or environment (both readable in /proc).
        cmd.stdin(std::process::Stdio::piped());
        let mut handover = control::Handover {
            credentials: plan
                .grants
                .iter()
                .map(control::credentials_message)
                .collect(),
            tls_roots: command.tls_roots.iter().map(|c| c.to_vec()).collect(),
            plan: Some(plan.message()),
            ..Default::default()
        };
        // The connections of a server of this layer that died are taken over, not mounted
        // again: descriptors 3 and up of the successor.
        if let Some(Succession {
            connections,
            generation,
        }) = self.inherit(layer)?
        {
            let mut mappings = Vec::with_capacity(connections.len());
            for (n, (role, connection)) in connections.iter().enumerate() {
                let child_fd = 3 + n as u32;
                handover
                    .connections
                    .push(keeper::describe(*role, connection, child_fd));
                mappings.push(command_fds::FdMapping {
                    parent_fd: connection
                        .fd
                        .try_clone()
                        .map_err(|e| Error::io("duplicating a kept FUSE connection", e))?,
                    child_fd: child_fd as i32,
                });
            }
            handover.generation = generation;
            command_fds::CommandFdExt::fd_mappings(&mut cmd, mappings).map_err(|e| {
                Error::new(
                    ErrorKind::Io,
                    "handing kept FUSE connections to a successor",
                )
                .with_source(e)
            })?;
            tracing::info!(%layer, generation, connections = connections.len(), "starting a successor on the kept FUSE connections");
        }
        cmd.stdout(std::process::Stdio::null())
            .stderr(log)
            // systemd's notification socket is the daemon's to use, not its servers'.
            .env_remove("NOTIFY_SOCKET")
            // Its own process group: a signal to the daemon's group does not stop it.
            .process_group(0)
            .kill_on_drop(false);

        let mut child = cmd
            .spawn()
            .map_err(|e| Error::io(format!("starting {}", command.exe.display()), e))?;
        if let Some(stdin) = child.stdin.take() {
            let layer = *layer;
            let ahead = async move {
                match ahead {
                    Some(ahead) => ahead.bytes().await,
                    None => Held::default(),
                }
            };
            // More than a pipe holds (the roots: a few hundred KiB): written while the server
            // reads it, apart from waiting for it to serve; a server that exits or is stopped
            // without reading ends the write.
            tokio::spawn(async move {
                if let Err(e) = control::hand_over(stdin, &handover, ahead).await {
                    tracing::warn!(%layer, error = %e, "handing credentials, TLS roots and blob bytes to the mount server failed");
                }
            });
        }
        self.wait_serving(layer, reference, Some(child)).await
    }

    /// Waits until the layer's server serves, up to the mount timeout; a server that failed
    /// or timed out is stopped, and the error says why (the server's own reason, or the
    /// timeout and the log to read).
    async fn wait_serving(
        &self,
        layer: &Digest,
        reference: &Reference,
        mut child: Option<tokio::process::Child>,
    ) -> Result<PathBuf> {
        let paths = self.paths(layer);
        let timeout = self.command.mount_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let outcome = loop {
            if let Some(exit) = child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                break Err(Error::new(
                    ErrorKind::Io,
                    format!(
                        "the mount server of layer {layer} ({reference}) exited with {exit} before serving; see {}",
                        paths.log.display()
                    ),
                ));
            }
            let asked = tokio::time::Instant::now();
            let answer = control::wait_started(&paths.control, STARTED_WAIT).await;
            if let Ok(status) = answer {
                if status.layer_key != layer.to_string() {
                    // Another layer's server holds the socket (ours could not bind it): leave
                    // that one alone.
                    if let Some(mut child) = child {
                        let _ = child.start_kill();
                        let _ = child.wait().await;
                    }
                    return Err(Error::new(
                        ErrorKind::AlreadyExists,
                        format!(
                            "{} is served by pid {} for layer {}, not {layer}; stop that server",
                            paths.control.display(),
                            status.pid,
                            status.layer_key
                        ),
                    ));
                }
                match status.state() {
                    ServerState::Serving => {
                        self.know(layer, &status.instance);
                        tracing::info!(%layer, pid = status.pid, instance = status.instance, mountpoint = %paths.mountpoint.display(), "mount server ready");
                        break Ok(paths.mountpoint.clone());
                    }
                    ServerState::Failed => {
                        let cause = Error::from(tonic::Status::new(
                            tonic::Code::from(status.error_code),
                            status.error,
                        ));
                        break Err(cause.context(format!(
                            "mounting layer {layer} of {reference} failed (log: {})",
                            paths.log.display()
                        )));
                    }
                    _ => {}
                }
            }
            if tokio::time::Instant::now() >= deadline {
                break Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "mounting layer {layer} of {reference} did not finish within {}s (registry.mount_timeout); is the registry reachable? (log: {})",
                        timeout.as_secs(),
                        paths.log.display()
                    ),
                ));
            }
            // The socket is not bound yet, or the server answered at once without waiting
            // (one from before `wait_started_ms`): ask again shortly.
            if asked.elapsed() < Duration::from_millis(5) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        match (&outcome, child) {
            (Ok(_), Some(mut child)) => {
                // Reap it if it exits while this daemon lives; it keeps running if the daemon
                // goes.
                tokio::spawn(async move {
                    let _ = child.wait().await;
                });
            }
            (Err(_), child) => {
                let _ = control::stop(&paths.control).await;
                if let Some(mut child) = child {
                    if tokio::time::timeout(Duration::from_secs(5), child.wait())
                        .await
                        .is_err()
                    {
                        let _ = child.start_kill();
                        let _ = child.wait().await;
                    }
                }
            }
            (Ok(_), None) => {}
        }
        outcome
    }

    /// Waits (at most 10 s) until the stopped server `pid` of `layer` has exited and its socket
    /// no longer answers: it answers `Stop` before its session ends.
    async fn wait_gone(&self, layer: &Digest, pid: u32) {
        for _ in 0..100 {
            if !process_alive(pid) && self.server_status(layer).await.is_none() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tracing::warn!(%layer, pid, "mount server still running 10 s after it was stopped");
    }

    /// Stops the layer's server: it unmounts and exits (see [`Supervisor::stop`]).
    async fn stop_server(&self, layer: &Digest) -> Result<Option<LayerStatus>> {
        let Some(mut status) = self.server_status(layer).await else {
            return Ok(None);
        };
        let paths = self.paths(layer);
        // A server stopped on purpose is not succeeded: its connections are let go first (and
        // kept again if it refuses, busy).
        let kept = self.kept.lock().remove(layer);
        status.counters = match control::stop(&paths.control).await {
            Ok(counters) => Some(counters),
            Err(e) => {
                if let Some(kept) = kept {
                    self.kept.lock().insert(*layer, kept);
                }
                return Err(e);
            }
        };
        drop(kept);
        self.known.lock().remove(layer);
        self.wait_gone(layer, status.pid).await;
        let dir = paths.mountpoint.clone();
        let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir(dir)).await;
        tracing::info!(%layer, pid = status.pid, "mount server stopped");
        Ok(Some(status))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn successors_start_at_once_then_back_off_and_the_deaths_that_count_are_bounded() {
        let delays: Vec<u64> = (1..=MAX_DEATHS)
            .map(|n| revive_delay(n).as_millis() as u64)
            .collect();
        assert_eq!(delays, [0, 500, 1000, 2000, 4000]);
        assert_eq!(revive_delay(40), Duration::from_millis(8000), "bounded");
    }

    #[tokio::test]
    async fn one_layers_lock_holds_back_only_that_layer_and_the_map_keeps_only_live_locks() {
        let locks = LayerLocks::default();
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        let held = locks.lock(&a).await;
        // Another layer is not held back by it.
        let other = tokio::time::timeout(Duration::from_secs(5), locks.lock(&b))
            .await
            .expect("another layer's lock waits for nothing");
        drop(other);
        // The same layer waits until the holder lets go.
        let waiting = tokio::time::timeout(Duration::from_millis(100), locks.lock(&a)).await;
        assert!(
            waiting.is_err(),
            "a second lock of the same layer did not wait"
        );
        drop(held);
        let again = tokio::time::timeout(Duration::from_secs(5), locks.lock(&a))
            .await
            .expect("the lock is free once let go");
        // Locks nobody holds or waits for are forgotten at the next lock: `b`'s is gone.
        let kept = |locks: &LayerLocks| locks.locks.lock().keys().copied().collect::<Vec<_>>();
        assert_eq!(kept(&locks), [a]);
        drop(again);
        let c = Digest::of(b"c");
        let _c = locks.lock(&c).await;
        assert_eq!(kept(&locks), [c], "only the live lock is kept");
    }
}
