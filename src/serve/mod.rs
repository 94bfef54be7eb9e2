//! Serving one lazily loaded layer through FUSE until a signal says stop: the body of
//! `vmdisk mount` and of the snapshotter's per-layer mount servers, and the one place a lazily
//! loaded layer is composed ([`open_engine`]: resolution, sources, engine, structure check).
//!
//! Besides the FUSE session it runs the layer's background work, in order and off the start-up
//! path: flushing the presence bitmap every second, checking the layer once it is complete,
//! indexing other cached layers for dedup, then hydrating if asked
//! (or later, when [`Serving::hydrate`] is called). It never unmounts a busy mount: an unmount
//! while files are open is refused and the layer keeps serving.

pub mod connection;
pub mod fuse;
pub mod ready;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Deserialize;

use crate::blob::Sources;
use crate::cache::{CacheRoot, Integrity};
use crate::engine::stats::StatsSnapshot;
use crate::engine::{Engine, EngineOptions};
use crate::error::{Error, ErrorKind, Result};
use crate::layer::Held;
use crate::oci::digest::Digest;
use crate::policy::Verifier;
use crate::registry::Registry;
use crate::resolve::Wanted;
use crate::serve::connection::{Connection, Inherited, Registrations, Role};
use crate::serve::ready::{ReadyDir, ReadyMetadata};
use crate::view::file::LayerFile;
use crate::view::qcow2::RawDisk;

/// What a mount fetches while its layer's structure is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Warm {
    /// Nothing beyond the check.
    Nothing,
    /// The disk's head (qcow2 header, L1 and refcount tables), a round trip sooner, for a
    /// mount whose ready-disk directory is wanted at once (EnsureDisk), which describing the
    /// disk reads. Those chunks are then fetched before other cached layers are indexed for
    /// dedup, and a pull that only needs the layer would fetch them for nobody: it leaves it
    /// off.
    DiskHead,
}

/// How a mount finds its layer.
#[derive(Clone, Copy, Debug)]
pub enum Opening<'a> {
    /// Resolved from the image ([`crate::resolve::resolve`]: the registry, or the cache when
    /// the registry is unreachable), once the signature policy accepts it and its index.
    Resolve(Wanted<'a>),
    /// Decided just now by whoever started the mount (the daemon checked the image and kept
    /// the layer's record and TOC): opened from the cache by `key`
    /// ([`crate::resolve::kept`]); resolved as [`Opening::Resolve`] when the cache no longer
    /// has it.
    Decided { key: Digest, wanted: Wanted<'a> },
}

/// The one composition of a lazily loaded layer, for `vmdisk mount` and the mount servers:
/// finds the layer as `opening` says, starts an engine over its cache and its blobs in the
/// registry, and checks the layer's structure before anything is served. The check reads the
/// blob bytes fetched with the TOC and those `handed` yields (fetched for it by the snapshotter
/// while this process started; awaited once the engine is open) before it asks the registry;
/// the chunks whose frames they hold whole are kept.
pub async fn open_engine(
    client: Arc<dyn Registry>,
    cache: &CacheRoot,
    trust: &Verifier,
    opening: Opening<'_>,
    opts: EngineOptions,
    warm: Warm,
    handed: impl std::future::Future<Output = Held>,
) -> Result<Arc<Engine>> {
    let kept = match opening {
        Opening::Decided { key, wanted } => {
            crate::resolve::kept(cache, wanted.reference, key).await?
        }
        Opening::Resolve(_) => None,
    };
    let (layer, mut held) = match (kept, opening) {
        (Some(layer), _) => (layer, Held::default()),
        (None, Opening::Resolve(wanted) | Opening::Decided { wanted, .. }) => {
            crate::resolve::resolve(client.as_ref(), cache, trust, wanted).await?
        }
    };
    // A gzip layer's windows blob sits beside its index.
    let windows = match (layer.codec().windows_blob(), layer.meta.index_source()) {
        (Some(digest), Some(source)) => Some((source.repository.clone(), digest)),
        _ => None,
    };
    let sources = Sources::in_registry(client, &layer.reference, layer.meta.layer_digest, windows);
    let engine = Engine::open(layer, cache, sources, opts).await?;
    let checked = async {
        held.join(handed.await);
        // The disk's first chunks, fetched with the TOC or by the snapshotter.
        let kept = engine.keep_held(&held);
        if kept > 0 {
            tracing::debug!(chunks = kept, "kept the chunks fetched ahead");
        }
        engine.check_structure(Some(cache), &held).await
    };
    match warm {
        // Verified as always; nothing is served before the check passes.
        Warm::DiskHead => {
            let disk = LayerFile::disk(Arc::clone(&engine));
            let (checked, _) = tokio::join!(checked, crate::view::qcow2::read_head(&disk));
            checked?;
        }
        Warm::Nothing => checked.await?,
    }
    Ok(engine)
}

/// How a mount fetches what nobody read yet.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Hydrate {
    /// Only what is read (plus read-ahead).
    Off,
    /// Everything, in the background, at most the hydration rate.
    Background,
    /// Everything, at full speed.
    Eager,
}

/// How fast chunks cached before a server started are read back and checked by default, MB/s
/// ([`ServeOptions::verify_rate`]): about a quarter of a SATA SSD's read rate, so guests that
/// boot meanwhile keep most of the disk.
pub const DEFAULT_VERIFY_RATE: u64 = 128;

/// What [`start`] runs besides the FUSE session.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub hydrate: Hydrate,
    /// Bandwidth limit of background hydration, MB/s of disk data.
    pub hydrate_rate: u64,
    /// Hand complete files to the kernel with FUSE passthrough.
    pub passthrough: bool,
    /// How fast chunks cached before this process started are read back and checked in the
    /// background, MB/s (one layer of the cache at a time; 0: as fast as the disk goes).
    pub verify_rate: u64,
    /// Print `hydrated: …` on stdout when hydration completes (the interactive mount does).
    pub announce: bool,
    /// The layer's ready-disk directory, mounted when asked ([`Serving::mount_ready`]).
    pub ready: Option<ReadyDir>,
    /// Where each mount records its passthrough registrations for a successor
    /// (`<prefix>.<role>.passthrough`, [`Registrations`]); none where no successor takes over.
    pub registrations: Option<PathBuf>,
}

/// Where a hydration (fetching every chunk nobody read yet) stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HydrationState {
    /// Never asked for.
    Idle,
    Running,
    /// Every chunk is cached (and the complete layer was checked).
    Done,
    /// The last one stopped, for this reason; asking again starts a new one.
    Failed(String),
}

/// The raw view and the metadata of `engine`'s disk ([`crate::view::qcow2::describe`]).
async fn describe(engine: &Arc<Engine>, ready: &ReadyDir) -> Result<(RawDisk, ReadyMetadata)> {
    let disk = LayerFile::disk(Arc::clone(engine));
    let disk_size = crate::view::DiskView::size(&disk);
    let path = engine.layer().disk_path().to_string();
    let described = crate::view::qcow2::describe(disk)
        .await
        .map_err(|e| e.context(format!("reading the first bytes of /{path}")))?;
    let raw_error = match &described.raw {
        RawDisk::Unavailable(e) => {
            tracing::warn!(error = %e.chain(), "no raw view of /{path}; serving it as published only");
            Some(e.chain())
        }
        _ => None,
    };
    let metadata = ReadyMetadata {
        reference: ready.reference.clone(),
        layer_digest: engine.layer().meta.layer_digest.to_string(),
        platform: ready.platform.clone(),
        format: described.format,
        virtual_size: described.virtual_size,
        disk_size,
        disk: crate::serve::ready::published_name(&path),
        path_in_image: format!("/{path}"),
        raw_error,
    };
    Ok((described.raw, metadata))
}

/// A mounted ready-disk directory: its session, its connection and the links (link, target)
/// pointing into it.
struct ReadyMount {
    session: fuser::BackgroundSession,
    connection: Connection,
    links: Vec<(PathBuf, PathBuf)>,
}

/// A layer's ready-disk directory, mounted when first asked for: describing the disk reads its
/// head, which a pull that only needs the layer's files never asks for.
struct ReadyDisk {
    dir: ReadyDir,
    passthrough: bool,
    state: Mutex<ReadyState>,
    /// Mounts unmounted by [`Serving::unmount`], their sessions ended by [`Serving::finish`].
    ended: Mutex<Vec<ReadyMount>>,
    /// The connection of the directory an earlier server mounted, taken over at its first
    /// mount ([`crate::serve::connection`]).
    inherited: Mutex<Option<Connection>>,
    /// How many servers of the same connections were before this one.
    generation: u32,
    /// [`ServeOptions::registrations`].
    registrations: Option<PathBuf>,
}

enum ReadyState {
    /// Not mounted: nobody asked for it yet (or the layer stayed busy when it was stopped).
    Unmounted,
    Mounted(ReadyMount),
    /// Unmounted while the server stops: not mounted again.
    Closed,
}

/// A layer being served.
pub struct Serving {
    engine: Arc<Engine>,
    cache: CacheRoot,
    session: fuser::BackgroundSession,
    /// The layer mount's connection, handed to whoever keeps it for a successor.
    connection: Connection,
    /// How many servers of the same connections were before this one.
    generation: u32,
    ready: Option<Arc<ReadyDisk>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    dir: PathBuf,
    hydration: Arc<Mutex<HydrationState>>,
    /// The running hydration, stopped before the cache's last flush.
    hydrating: Arc<Mutex<Option<tokio::task::JoinHandle<()>>>>,
    announce: bool,
    /// When serving started (Unix seconds).
    started: i64,
}

/// What a mount whose cache disk is full evicts of layers nobody has open, at most, each second.
const FREE_WHEN_FULL: u64 = 256 << 20;

/// Mounts `engine`'s layer at `dir` (and its ready-disk directory, if asked) and starts its
/// background work; or, `inherited`, serves the connections of the mounts an earlier server
/// made there, which then died ([`crate::serve::connection`]).
pub async fn start(
    engine: Arc<Engine>,
    cache: &CacheRoot,
    dir: &Path,
    opts: &ServeOptions,
    inherited: Option<Inherited>,
) -> Result<Serving> {
    let generation = inherited.as_ref().map_or(0, |i| i.generation);
    let mut fs = crate::serve::fuse::LayerFs::new(
        Arc::clone(&engine),
        tokio::runtime::Handle::current(),
        opts.passthrough,
    )
    .handles_after(generation);
    if let Some(prefix) = &opts.registrations {
        fs = fs.registered_in(registrations(prefix, Role::Layer, inherited.is_some()));
    }
    let (session, connection, ready_connection) = match inherited {
        None => {
            let mounted = crate::serve::fuse::mount(fs, dir)?;
            (mounted.session, mounted.connection, None)
        }
        Some(inherited) => {
            let session = crate::serve::fuse::take_over(fs, &inherited.layer)?;
            tracing::info!(
                generation,
                "took over the layer's FUSE connection from the server that died"
            );
            (session, inherited.layer, inherited.ready_disk)
        }
    };
    let ready = opts.ready.as_ref().map(|dir| {
        Arc::new(ReadyDisk {
            dir: dir.clone(),
            passthrough: opts.passthrough,
            state: Mutex::new(ReadyState::Unmounted),
            ended: Mutex::new(Vec::new()),
            inherited: Mutex::new(ready_connection),
            generation,
            registrations: opts.registrations.clone(),
        })
    });
    let mut serving = Serving {
        engine: Arc::clone(&engine),
        cache: cache.clone(),
        session,
        connection,
        generation,
        ready,
        tasks: Vec::new(),
        dir: dir.to_path_buf(),
        hydration: Arc::new(Mutex::new(HydrationState::Idle)),
        hydrating: Arc::new(Mutex::new(None)),
        announce: opts.announce,
        started: time::OffsetDateTime::now_utc().unix_timestamp(),
    };
    serving.tasks.push(tokio::spawn(upkeep(
        Arc::clone(&engine),
        cache.clone(),
        opts.announce,
        opts.verify_rate * 1_000_000,
    )));
    let e = Arc::clone(&engine);
    let index_cache = cache.clone();
    let hydrate = (opts.hydrate != Hydrate::Off).then(|| {
        let limit = (opts.hydrate == Hydrate::Background).then_some(opts.hydrate_rate * 1_000_000);
        serving.hydrator(limit)
    });
    serving.tasks.push(tokio::spawn(async move {
        let _ = tokio::task::spawn_blocking(move || e.index_other_layers(&index_cache)).await;
        if let Some(hydrate) = hydrate {
            hydrate();
        }
    }));
    Ok(serving)
}

/// What a served layer needs each second while it is mounted: cached chunks not checked in
/// this process checked in the background (those of a changed data file at once, the rest at
/// `verify_rate` bytes/s in the node's turn), the integrity check once the layer is complete,
/// unused layers evicted when the cache's disk is full (and what it holds in memory meanwhile
/// kept counted in the node's budget), the cache flushed.
async fn upkeep(e: Arc<Engine>, cache: CacheRoot, announce: bool, verify_rate: u64) {
    let mut checking: Option<tokio::task::JoinHandle<()>> = None;
    let mut checking_cache: Option<tokio::task::JoinHandle<()>> = None;
    // Whether a pass left every present chunk checked once (announced then).
    let all_checked_once = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut unstored = 0;
    loop {
        // Chunks cached before this process started (and those of a data file someone
        // else changed) are checked in the background, so a complete file becomes fit for
        // passthrough; reads check what they touch first.
        if checking_cache.as_ref().is_none_or(|c| c.is_finished()) {
            let e = Arc::clone(&e);
            let (checking, root) = (Arc::clone(&e), cache.clone());
            let all_checked_once = Arc::clone(&all_checked_once);
            checking_cache = Some(tokio::spawn(async move {
                let check = move || {
                    // Chunks cached before this process started are read back one layer of
                    // the node at a time, at the verify rate.
                    let turn = match checking.all_checked() {
                        true => None,
                        false => root.verify_turn(),
                    };
                    checking.check_cache(turn.as_ref().map(|_| verify_rate))
                };
                let Ok(found) = tokio::task::spawn_blocking(check).await else {
                    return;
                };
                let (checked, damaged) = (found.checked, found.damaged.len());
                // Damaged chunks are fetched again at once: readers holding a passthrough
                // open read the data file without asking, so it is mended where they read.
                e.repair(&found.damaged).await;
                let first_complete = found.complete
                    && !all_checked_once.swap(true, std::sync::atomic::Ordering::AcqRel);
                if checked > 0 || first_complete {
                    if announce {
                        println!(
                            "checked: {} cached chunks sound, {damaged} damaged",
                            checked - damaged
                        );
                    }
                    tracing::info!(checked, damaged, "checked the cached chunks");
                }
            }));
        }
        // However the layer became complete (reads, hydration, dedup), check it (once:
        // the engine runs one check at a time and keeps the verdict).
        if e.complete()
            && e.integrity() == Integrity::Pending
            && checking.as_ref().is_none_or(|c| c.is_finished())
        {
            let (e, cache) = (Arc::clone(&e), cache.clone());
            checking = Some(tokio::spawn(async move {
                e.check_integrity(&cache).await;
            }));
        }
        if e.unstored() > unstored {
            unstored = e.unstored();
            // Room for the mounted layer first: layers nobody has open go.
            let cache = cache.clone();
            match crate::task::blocking(move || cache.free_unused(FREE_WHEN_FULL)).await {
                Ok(0) => {}
                Ok(freed) => {
                    tracing::info!(freed, "evicted unused layers: the cache's disk was full")
                }
                Err(err) => {
                    tracing::warn!(error = %err.chain(), "evicting unused layers failed")
                }
            }
        }
        let flushing = Arc::clone(&e);
        let flushed = tokio::task::spawn_blocking(move || {
            flushing.renew_memory_note();
            flushing.flush()
        })
        .await;
        if let Ok(Err(err)) = flushed {
            tracing::warn!(error = %err.chain(), "flushing the cache failed");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Mounts `ready`'s directory for `engine`'s disk, described as (`raw`, `metadata`), and points
/// its links at it, unless it is mounted or closed. Blocking (directories, mounts, links).
fn mount_ready(
    engine: Arc<Engine>,
    ready: &ReadyDisk,
    runtime: tokio::runtime::Handle,
    (raw, metadata): (RawDisk, ReadyMetadata),
) -> Result<()> {
    let mut state = ready.state.lock();
    match &*state {
        ReadyState::Mounted(_) => return Ok(()),
        ReadyState::Closed => {
            return Err(Error::new(
                ErrorKind::FailedPrecondition,
                "the layer's server is stopping; ask again once the layer is served",
            ))
        }
        ReadyState::Unmounted => {}
    }
    let dir = &ready.dir;
    let json = serde_json::to_vec_pretty(&metadata).expect("metadata serialises");
    let links = dir.links(&metadata);
    let mut fs = crate::serve::fuse::LayerFs::ready(
        engine,
        runtime,
        ready.passthrough,
        raw,
        json,
        dir.group,
    )
    .handles_after(ready.generation);
    let inherited = ready.inherited.lock().take();
    if let Some(prefix) = &ready.registrations {
        fs = fs.registered_in(registrations(prefix, Role::ReadyDisk, inherited.is_some()));
    }
    let (session, connection) = match inherited {
        Some(connection) => {
            let session = crate::serve::fuse::take_over(fs, &connection)?;
            tracing::info!(dir = %dir.dir.display(), "took over the ready-disk directory's FUSE connection from the server that died");
            (session, connection)
        }
        None => {
            let _ = nix::mount::umount2(&dir.dir, nix::mount::MntFlags::MNT_DETACH);
            crate::serve::ready::prepare_root(&dir.root, dir.group)?;
            crate::dirs::shared(&dir.dir, dir.group)?;
            let mounted = crate::serve::fuse::mount(fs, &dir.dir)?;
            (mounted.session, mounted.connection)
        }
    };
    for (link, target) in &links {
        crate::serve::ready::replace_symlink(link, target)?;
    }
    *state = ReadyState::Mounted(ReadyMount {
        session,
        connection,
        links,
    });
    Ok(())
}

/// The record of a mount's passthrough registrations under `prefix`: the earlier servers' when
/// `taken_over`, else a new one.
fn registrations(prefix: &Path, role: Role, taken_over: bool) -> Registrations {
    let path = role.registrations(prefix);
    match taken_over {
        true => Registrations::taken_over(path),
        false => Registrations::new_mount(path),
    }
}

impl Serving {
    /// The engine serving the layer (its counters, cache and integrity verdict).
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The path of the layer's disk file on the mount.
    pub fn disk_path(&self) -> PathBuf {
        self.dir.join(self.engine.layer().disk_path())
    }

    /// Describes the disk and mounts its ready-disk directory unless it is mounted; where it
    /// is. Concurrent callers each describe (their fetches are shared) and the first to finish
    /// mounts; no lock is held while describing.
    pub async fn mount_ready(&self) -> Result<PathBuf> {
        let ready = self.ready.as_ref().ok_or_else(|| {
            Error::new(
                ErrorKind::FailedPrecondition,
                "this mount has no ready-disk directory",
            )
        })?;
        if !matches!(*ready.state.lock(), ReadyState::Mounted(_)) {
            let described = describe(&self.engine, &ready.dir).await?;
            let (engine, ready) = (Arc::clone(&self.engine), Arc::clone(ready));
            let runtime = tokio::runtime::Handle::current();
            crate::task::blocking(move || mount_ready(engine, &ready, runtime, described)).await?;
        }
        Ok(ready.dir.dir.clone())
    }

    /// Descriptors of the mounts' FUSE connections, for whoever keeps them for a successor
    /// ([`crate::serve::connection`]).
    pub fn connections(&self) -> Result<Vec<(Role, Connection)>> {
        let mut connections = vec![(Role::Layer, self.connection.try_clone()?)];
        if let Some(ready) = &self.ready {
            if let ReadyState::Mounted(mount) = &*ready.state.lock() {
                connections.push((Role::ReadyDisk, mount.connection.try_clone()?));
            }
        }
        Ok(connections)
    }

    /// How many servers of the same connections were before this one.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Whether this server took over connections it has not served yet: the ready-disk
    /// directory an earlier server had mounted waits for [`Serving::mount_ready`].
    pub fn ready_inherited(&self) -> bool {
        self.ready
            .as_ref()
            .is_some_and(|r| r.inherited.lock().is_some())
    }

    /// Whether the ready-disk directory is mounted.
    pub fn ready_mounted(&self) -> bool {
        self.ready
            .as_ref()
            .is_some_and(|r| matches!(*r.state.lock(), ReadyState::Mounted(_)))
    }

    /// Since when (Unix seconds) reads may need the registry, while some chunk is not cached.
    pub fn registry_needed_since(&self) -> Option<i64> {
        (!self.engine.complete()).then_some(self.started)
    }

    /// Where hydration stands.
    pub fn hydration(&self) -> HydrationState {
        self.hydration.lock().clone()
    }

    /// Starts fetching the whole disk at full speed unless a hydration is running; whether
    /// this call started one. After a failed hydration it starts a new one.
    pub fn hydrate(&self) -> bool {
        self.hydrator(None)()
    }

    /// A function that starts a hydration limited to `limit` bytes/s (see [`Serving::hydrate`]).
    fn hydrator(&self, limit: Option<u64>) -> impl FnOnce() -> bool + Send + 'static {
        let (engine, cache) = (Arc::clone(&self.engine), self.cache.clone());
        let (state, announce) = (Arc::clone(&self.hydration), self.announce);
        let hydrating = Arc::clone(&self.hydrating);
        move || {
            {
                let mut s = state.lock();
                if *s == HydrationState::Running {
                    return false;
                }
                *s = HydrationState::Running;
            }
            *hydrating.lock() = Some(tokio::spawn(async move {
                tracing::info!("fetching the whole disk");
                let concurrency = if limit.is_some() { 2 } else { 4 };
                // In the background a failed pass (a registry down, a link a fleet congests)
                // pauses the hydration, which goes on later where it stopped; a hydration
                // asked for (`vmdisk prefetch`) says it failed, and the caller asks again.
                let hydrated = match limit {
                    Some(_) => {
                        crate::retry::RetryPolicy::background()
                            .run("background hydration", || {
                                engine.hydrate(concurrency, limit)
                            })
                            .await
                    }
                    None => engine.hydrate(concurrency, limit).await,
                };
                let outcome = match hydrated {
                    Ok(()) => {
                        let integrity = engine.check_integrity(&cache).await;
                        let chunks = engine.present_count();
                        if announce {
                            println!("hydrated: {chunks} chunks cached; integrity {integrity}");
                        }
                        tracing::info!(chunks, %integrity, "hydrated");
                        HydrationState::Done
                    }
                    Err(err) => {
                        tracing::warn!(error = %err.chain(), "hydration stopped");
                        HydrationState::Failed(err.chain())
                    }
                };
                *state.lock() = outcome;
            }));
            true
        }
    }

    /// Unmounts the ready-disk directory and the layer; refused with `FailedPrecondition`
    /// (naming what is busy) while files on either are open, and the layer keeps serving.
    pub fn unmount(&self) -> Result<()> {
        let busy = |dir: &Path, hint: &str| {
            Error::new(
                ErrorKind::FailedPrecondition,
                format!("{} is busy; {hint}", dir.display()),
            )
        };
        if let Some(ready) = &self.ready {
            let mut state = ready.state.lock();
            if let ReadyState::Mounted(_) = &*state {
                match nix::mount::umount2(&ready.dir.dir, nix::mount::MntFlags::empty()) {
                    Ok(()) | Err(nix::errno::Errno::EINVAL) => {}
                    Err(nix::errno::Errno::EBUSY) => {
                        return Err(busy(&ready.dir.dir, "a VM uses the disk; stop it first"))
                    }
                    Err(e) => {
                        return Err(Error::io(
                            format!("unmounting {}", ready.dir.dir.display()),
                            e.into(),
                        ))
                    }
                }
            }
            if let ReadyState::Mounted(mount) = std::mem::replace(&mut *state, ReadyState::Closed) {
                ready.ended.lock().push(mount);
            }
        }
        let reopen = || {
            // The layer keeps serving: its ready-disk directory may be asked for again.
            if let Some(ready) = &self.ready {
                *ready.state.lock() = ReadyState::Unmounted;
            }
        };
        match nix::mount::umount2(&self.dir, nix::mount::MntFlags::empty()) {
            Ok(()) => Ok(()),
            Err(nix::errno::Errno::EBUSY) => {
                reopen();
                Err(busy(
                    &self.dir,
                    &format!(
                        "close the files using it (`fuser -vm {}`) first",
                        self.dir.display()
                    ),
                ))
            }
            Err(e) => {
                reopen();
                Err(Error::io(
                    format!("unmounting {}", self.dir.display()),
                    e.into(),
                ))
            }
        }
    }

    /// Waits for SIGINT or SIGTERM and unmounts; while files on the mount are open the
    /// unmount is refused, a message says so, and the layer keeps serving.
    pub async fn serve_until_signalled(&self) -> Result<()> {
        loop {
            wait_for_signal().await?;
            match self.unmount() {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == ErrorKind::FailedPrecondition => {
                    eprintln!("vmdisk: {}; signal again then", e.chain())
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Ends the session after the unmount, flushes the cache and returns the counters. Its
    /// tasks and a running hydration are stopped first, and waited for: a chunk one of them
    /// stores after the last flush would be fetched again by the next server.
    pub async fn finish(mut self) -> Result<StatsSnapshot> {
        let hydrating = self.hydrating.lock().take();
        let tasks: Vec<_> = std::mem::take(&mut self.tasks)
            .into_iter()
            .chain(hydrating)
            .collect();
        for task in &tasks {
            task.abort();
        }
        for task in tasks {
            let _ = task.await;
        }
        let dir = self.dir.clone();
        if let Some(ready) = self.ready {
            let mut mounts = std::mem::take(&mut *ready.ended.lock());
            // Still mounted when the server ends without a successful `unmount`: detach it.
            if let ReadyState::Mounted(mount) =
                std::mem::replace(&mut *ready.state.lock(), ReadyState::Closed)
            {
                let _ = nix::mount::umount2(&ready.dir.dir, nix::mount::MntFlags::MNT_DETACH);
                mounts.push(mount);
            }
            let dir = ready.dir.dir.clone();
            let _ = tokio::task::spawn_blocking(move || {
                if mounts.is_empty() {
                    return;
                }
                for ReadyMount { session, links, .. } in mounts {
                    // Remove the links still pointing at us (another server may have taken a
                    // name).
                    for (link, target) in links {
                        if std::fs::read_link(&link).is_ok_and(|t| t == target) {
                            let _ = std::fs::remove_file(&link);
                        }
                    }
                    let _ = session.join();
                }
                let _ = std::fs::remove_dir(&dir);
            })
            .await;
        }
        tokio::task::spawn_blocking(move || self.session.join())
            .await
            .map_err(|e| Error::new(ErrorKind::Io, "unmounting").with_source(e))?
            .map_err(|e| Error::io(format!("ending the FUSE session of {}", dir.display()), e))?;
        let engine = Arc::clone(&self.engine);
        tokio::task::spawn_blocking(move || engine.flush())
            .await
            .map_err(|e| Error::new(ErrorKind::Io, "flushing the cache").with_source(e))??;
        Ok(self.engine.counters())
    }
}

/// Waits for SIGINT or SIGTERM.
pub async fn wait_for_signal() -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| Error::io("installing the SIGTERM handler", e))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}
