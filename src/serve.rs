//! Serving one lazily loaded layer through FUSE until a signal says stop: the body of
//! `vmdisk mount` and of the snapshotter's per-layer mount servers, and the one place a lazily
//! loaded layer is composed ([`open_engine`]: resolution, sources, engine, structure check).
//!
//! Besides the FUSE session it runs the layer's background work, in order and off the start-up
//! path: flushing the presence bitmap every second, checking the layer once it is complete,
//! indexing other cached layers for dedup, then hydrating if asked
//! (or later, when [`Serving::hydrate`] is called). It never unmounts a busy mount: an unmount
//! while files are open is refused and the layer keeps serving.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Deserialize;

use crate::cache::{CacheRoot, Integrity};
use crate::engine::source::Sources;
use crate::engine::stats::StatsSnapshot;
use crate::engine::{Engine, EngineOptions};
use crate::error::{Error, ErrorKind, Result};
use crate::policy::Verifier;
use crate::ready::{ReadyDir, ReadyMetadata};
use crate::reference::Reference;
use crate::registry::Registry;
use crate::view::file::LayerFile;
use crate::view::qcow2::RawDisk;

/// What a mount fetches while its layer's structure is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Warm {
    /// Nothing beyond the check.
    Nothing,
    /// The disk's head (qcow2 header, L1 and refcount tables), a round trip sooner, for a
    /// mount that describes its disk before it serves (ready directories). Those chunks are
    /// then fetched before other cached layers are indexed for dedup, so a mount without a
    /// ready directory leaves it off.
    DiskHead,
}

/// The one composition of a lazily loaded layer, for `vmdisk mount` and the mount servers:
/// resolves `reference` to its disk layer (once `trust` accepts the image as `named` and its
/// index: [`crate::resolve::resolve`]),
/// starts an engine over its cache and its blobs in the registry, and checks the layer's
/// structure before anything is served.
pub async fn open_engine(
    client: Arc<dyn Registry>,
    cache: &CacheRoot,
    trust: &Verifier,
    named: &Reference,
    reference: &Reference,
    opts: EngineOptions,
    warm: Warm,
) -> Result<Arc<Engine>> {
    let layer = crate::resolve::resolve(client.as_ref(), cache, trust, named, reference).await?;
    // A gzip layer's windows blob sits beside its index.
    let windows = match (layer.codec().windows_blob(), layer.meta.index_source()) {
        (Some(digest), Some(source)) => Some((source.repository.parse()?, digest)),
        _ => None,
    };
    let sources = Sources::in_registry(client, &layer.reference, layer.meta.layer_digest, windows);
    let engine = Engine::open(layer, cache, sources, opts).await?;
    match warm {
        // Verified as always; nothing is served before the check passes.
        Warm::DiskHead => {
            let disk = LayerFile::disk(Arc::clone(&engine));
            let (checked, _) = tokio::join!(
                engine.check_structure(Some(cache)),
                crate::view::qcow2::read_head(&disk)
            );
            checked?;
        }
        Warm::Nothing => engine.check_structure(Some(cache)).await?,
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

/// What [`start`] runs besides the FUSE session.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub hydrate: Hydrate,
    /// Bandwidth limit of background hydration, MB/s of disk data.
    pub hydrate_rate: u64,
    /// Hand complete files to the kernel with FUSE passthrough.
    pub passthrough: bool,
    /// Print `hydrated: …` on stdout when hydration completes (the interactive mount does).
    pub announce: bool,
    /// Also mount the layer's ready-disk directory.
    pub ready: Option<ReadyDir>,
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
    let path = engine.layer.disk_path().to_string();
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
        layer_digest: engine.layer.meta.layer_digest.to_string(),
        platform: ready.platform.clone(),
        format: described.format,
        virtual_size: described.virtual_size,
        disk_size,
        disk: crate::ready::published_name(&path),
        path_in_image: format!("/{path}"),
        raw_error,
    };
    Ok((described.raw, metadata))
}

/// A mounted ready-disk directory: its session, where it is, and the links (link, target)
/// pointing into it.
type ReadyMount = (fuser::BackgroundSession, ReadyDir, Vec<(PathBuf, PathBuf)>);

/// A layer being served.
pub struct Serving {
    engine: Arc<Engine>,
    cache: CacheRoot,
    session: fuser::BackgroundSession,
    ready: Option<ReadyMount>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    dir: PathBuf,
    hydration: Arc<Mutex<HydrationState>>,
    announce: bool,
}

/// Mounts `engine`'s layer at `dir` (and its ready-disk directory, if asked) and starts its
/// background work.
pub async fn start(
    engine: Arc<Engine>,
    cache: &CacheRoot,
    dir: &Path,
    opts: &ServeOptions,
) -> Result<Serving> {
    let fs = crate::fuse::LayerFs::new(
        Arc::clone(&engine),
        tokio::runtime::Handle::current(),
        opts.passthrough,
    );
    let session = crate::fuse::mount(fs, dir)?;
    let ready = match &opts.ready {
        Some(r) => {
            let (session, links) = mount_ready(&engine, r, opts.passthrough).await?;
            Some((session, r.clone(), links))
        }
        None => None,
    };
    let mut serving = Serving {
        engine: Arc::clone(&engine),
        cache: cache.clone(),
        session,
        ready,
        tasks: Vec::new(),
        dir: dir.to_path_buf(),
        hydration: Arc::new(Mutex::new(HydrationState::Idle)),
        announce: opts.announce,
    };
    let e = Arc::clone(&engine);
    let check_cache = cache.clone();
    serving.tasks.push(tokio::spawn(async move {
        let mut checking: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            // However the layer became complete (reads, hydration, dedup), check it (once:
            // the engine runs one check at a time and keeps the verdict).
            if e.cache.complete()
                && e.integrity() == Integrity::Pending
                && checking.as_ref().is_none_or(|c| c.is_finished())
            {
                let (e, cache) = (Arc::clone(&e), check_cache.clone());
                checking = Some(tokio::spawn(async move {
                    e.check_integrity(&cache).await;
                }));
            }
            let e = Arc::clone(&e);
            let flushed = tokio::task::spawn_blocking(move || e.cache.flush()).await;
            if let Ok(Err(err)) = flushed {
                tracing::warn!(error = %err.chain(), "flushing the cache failed");
            }
        }
    }));
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

/// Mounts the ready-disk directory and points its alias at it.
async fn mount_ready(
    engine: &Arc<Engine>,
    ready: &ReadyDir,
    passthrough: bool,
) -> Result<(fuser::BackgroundSession, Vec<(PathBuf, PathBuf)>)> {
    let runtime = tokio::runtime::Handle::current();
    let (raw, metadata) = describe(engine, ready).await?;
    let json = serde_json::to_vec_pretty(&metadata).expect("metadata serialises");
    let links = ready.links(&metadata);
    let fs = crate::fuse::LayerFs::ready(
        Arc::clone(engine),
        runtime,
        passthrough,
        raw,
        json,
        ready.group,
    );
    let _ = nix::mount::umount2(&ready.dir, nix::mount::MntFlags::MNT_DETACH);
    crate::ready::prepare_root(&ready.root, ready.group)?;
    crate::dirs::shared(&ready.dir, ready.group)?;
    let session = crate::fuse::mount(fs, &ready.dir)?;
    for (link, target) in &links {
        crate::ready::replace_symlink(link, target)?;
    }
    Ok((session, links))
}

impl Serving {
    /// The engine serving the layer (its counters, cache and integrity verdict).
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The path of the layer's disk file on the mount.
    pub fn disk_path(&self) -> PathBuf {
        self.dir.join(self.engine.layer.disk_path())
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
        move || {
            {
                let mut s = state.lock();
                if *s == HydrationState::Running {
                    return false;
                }
                *s = HydrationState::Running;
            }
            tokio::spawn(async move {
                tracing::info!("fetching the whole disk");
                let concurrency = if limit.is_some() { 2 } else { 4 };
                let outcome = match engine.hydrate(concurrency, limit).await {
                    Ok(()) => {
                        let integrity = engine.check_integrity(&cache).await;
                        let chunks = engine.cache.present_count();
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
            });
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
        if let Some((_, ready, _)) = &self.ready {
            match nix::mount::umount2(&ready.dir, nix::mount::MntFlags::empty()) {
                Ok(()) | Err(nix::errno::Errno::EINVAL) => {}
                Err(nix::errno::Errno::EBUSY) => {
                    return Err(busy(&ready.dir, "a VM uses the disk; stop it first"))
                }
                Err(e) => {
                    return Err(Error::io(
                        format!("unmounting {}", ready.dir.display()),
                        e.into(),
                    ))
                }
            }
        }
        match nix::mount::umount2(&self.dir, nix::mount::MntFlags::empty()) {
            Ok(()) => Ok(()),
            Err(nix::errno::Errno::EBUSY) => Err(busy(
                &self.dir,
                &format!(
                    "close the files using it (`fuser -vm {}`) first",
                    self.dir.display()
                ),
            )),
            Err(e) => Err(Error::io(
                format!("unmounting {}", self.dir.display()),
                e.into(),
            )),
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

    /// Ends the session after the unmount, flushes the cache and returns the counters.
    pub async fn finish(self) -> Result<StatsSnapshot> {
        for task in &self.tasks {
            task.abort();
        }
        let dir = self.dir.clone();
        if let Some((session, ready, links)) = self.ready {
            // Remove the links still pointing at us (another server may have taken a name).
            for (link, target) in links {
                if std::fs::read_link(&link).is_ok_and(|t| t == target) {
                    let _ = std::fs::remove_file(&link);
                }
            }
            let _ = tokio::task::spawn_blocking(move || session.join()).await;
            let _ = std::fs::remove_dir(&ready.dir);
        }
        tokio::task::spawn_blocking(move || self.session.join())
            .await
            .map_err(|e| Error::new(ErrorKind::Io, "unmounting").with_source(e))?
            .map_err(|e| Error::io(format!("ending the FUSE session of {}", dir.display()), e))?;
        let engine = Arc::clone(&self.engine);
        tokio::task::spawn_blocking(move || engine.cache.flush())
            .await
            .map_err(|e| Error::new(ErrorKind::Io, "flushing the cache").with_source(e))??;
        Ok(self.engine.stats.snapshot())
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
