//! Serving one lazily loaded layer through FUSE until a signal says stop: the body of
//! `vmdisk mount` and of the snapshotter's per-layer mount servers.
//!
//! Besides the FUSE session it runs the layer's background work, in order and off the start-up
//! path: flushing the presence bitmap every second (and the counters, when asked, to a file a
//! supervisor can read), indexing other cached layers for dedup, fetching qcow2 metadata, then
//! hydrating if asked. It never unmounts a busy mount: a SIGTERM while files are open is
//! refused and the layer keeps serving.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cache::{CacheRoot, Integrity};
use crate::engine::stats::StatsSnapshot;
use crate::engine::Engine;
use crate::error::{Error, ErrorKind, Result};
use crate::format::qcow2::ReadAt;
use crate::format::qcow2_raw::RawView;
use crate::fuse::{EngineFile, RawSource};

/// How a mount fetches what nobody read yet.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Hydrate {
    /// Only what is read (plus read-ahead and qcow2 metadata).
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
    /// Where to write the counters (JSON) every second.
    pub stats_file: Option<PathBuf>,
    /// Print `hydrated: …` on stdout when hydration completes (the interactive mount does).
    pub announce: bool,
    /// Also mount the layer's ready-disk directory.
    pub ready: Option<ReadyDir>,
    /// A file whose appearance asks for the whole disk to be fetched (`vmdisk prefetch`).
    pub hydrate_request: Option<PathBuf>,
}

/// Where a layer's ready-disk directory goes (see [`crate::fuse::LayerFs::ready`]).
#[derive(Clone, Debug)]
pub struct ReadyDir {
    /// The mount point, e.g. `/run/vmdisk/disks/<manifest digest hex>`.
    pub dir: PathBuf,
    /// A readable name for it (a symlink to `dir`), e.g. `/run/vmdisk/disks/by-name/<ref>`.
    pub alias: Option<PathBuf>,
    /// Links for a libvirt `dir` pool: `<volumes>.raw` and `<volumes>.<format>` point at the
    /// raw view and the published disk, e.g. `/run/vmdisk/disks/volumes/<ref>`.
    pub volumes: Option<PathBuf>,
    /// The reference the layer was resolved from, for `metadata.json`.
    pub reference: String,
    /// The image's platform, for `metadata.json`.
    pub platform: String,
}

/// `metadata.json` of a ready-disk directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReadyMetadata {
    pub reference: String,
    pub layer_digest: String,
    pub platform: String,
    /// `qcow2` or `raw`.
    pub format: String,
    pub virtual_size: u64,
    /// Size of the disk file as published.
    pub disk_size: u64,
    /// The published disk's file name in this directory; the raw view is `disk.raw`.
    pub disk: String,
    /// The disk's path inside the image.
    pub path_in_image: String,
    /// Why there is no `disk.raw`, when there is none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_error: Option<String>,
}

/// Names a ready-disk directory generates; a published disk never shadows them.
pub const GENERATED_NAMES: [&str; 2] = ["disk.raw", "metadata.json"];

/// The name the published disk at `path_in_layer` has in its ready-disk directory: its own
/// file name, unless that is one of the [`GENERATED_NAMES`] (then `image-<name>`), so
/// `disk.raw` is always the raw view and `metadata.json` always the metadata.
pub fn published_name(path_in_layer: &str) -> String {
    let name = path_in_layer.rsplit('/').next().unwrap_or("disk");
    if GENERATED_NAMES.contains(&name) {
        format!("image-{name}")
    } else {
        name.to_string()
    }
}

/// The `disk.raw` of a ready-disk directory, or the reason it has none.
pub fn raw_view_path(ready_dir: &Path) -> Result<PathBuf> {
    let raw = ready_dir.join("disk.raw");
    if raw.exists() {
        return Ok(raw);
    }
    let why = std::fs::read(ready_dir.join("metadata.json"))
        .ok()
        .and_then(|m| serde_json::from_slice::<ReadyMetadata>(&m).ok())
        .and_then(|m| m.raw_error)
        .unwrap_or_else(|| format!("{} is not mounted", ready_dir.display()));
    Err(Error::unsupported(format!("no raw view: {why}")))
}

/// The raw view and the metadata of `engine`'s disk; reads the disk's first bytes and, for
/// qcow2, its L1 table. A qcow2 the raw view cannot map is still served as published, without
/// `disk.raw`. Blocks: call from a blocking thread.
fn describe(
    engine: &Arc<Engine>,
    runtime: &tokio::runtime::Handle,
    ready: &ReadyDir,
) -> Result<(RawSource, ReadyMetadata)> {
    let layer = &engine.layer;
    let disk = layer.disk;
    let path = layer.nodes[layer.files[disk].node].path.clone();
    let file = EngineFile::new(Arc::clone(engine), disk, runtime.clone());
    let disk_size = file.size();
    let mut magic = [0u8; 4];
    if disk_size >= 4 {
        file.read_exact_at(&mut magic, 0)
            .map_err(|e| Error::io(format!("reading the first bytes of /{path}"), e))?;
    }
    let mut raw_error = None;
    let (raw, format, virtual_size) = if magic == crate::format::qcow2::MAGIC {
        match RawView::open(file) {
            Ok(view) => {
                let size = view.size();
                (RawSource::View(Arc::new(view)), "qcow2", size)
            }
            Err(e) => {
                tracing::warn!(error = %e.chain(), "no raw view of /{path}; serving it as published only");
                raw_error = Some(e.chain());
                (RawSource::Unavailable, "qcow2", 0)
            }
        }
    } else {
        (RawSource::Disk, "raw", disk_size)
    };
    let metadata = ReadyMetadata {
        reference: ready.reference.clone(),
        layer_digest: layer.meta.layer_digest.to_string(),
        platform: ready.platform.clone(),
        format: format.into(),
        virtual_size,
        disk_size,
        disk: published_name(&path),
        path_in_image: format!("/{path}"),
        raw_error,
    };
    Ok((raw, metadata))
}

/// A mounted ready-disk directory: its session, where it is, and the links (link, target)
/// pointing into it.
type ReadyMount = (fuser::BackgroundSession, ReadyDir, Vec<(PathBuf, PathBuf)>);

/// A layer being served.
pub struct Serving {
    engine: Arc<Engine>,
    session: fuser::BackgroundSession,
    ready: Option<ReadyMount>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    dir: PathBuf,
    stats_file: Option<PathBuf>,
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
    let mut tasks = Vec::new();
    let e = Arc::clone(&engine);
    let stats_file = opts.stats_file.clone();
    let hydrate_request = opts.hydrate_request.clone();
    let check_cache = cache.clone();
    tasks.push(tokio::spawn(async move {
        let mut requested = false;
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
            if let Some(request) = hydrate_request
                .as_ref()
                .filter(|r| !requested && r.exists())
            {
                requested = true;
                let _ = std::fs::remove_file(request);
                let e = Arc::clone(&e);
                tokio::spawn(async move {
                    tracing::info!("fetching the whole disk, as asked");
                    match e.hydrate(4, None).await {
                        Ok(()) => tracing::info!(chunks = e.cache.present_count(), "hydrated"),
                        Err(err) => tracing::warn!(error = %err.chain(), "hydration stopped"),
                    }
                });
            }
            let e = Arc::clone(&e);
            let stats_file = stats_file.clone();
            let flushed = tokio::task::spawn_blocking(move || {
                e.cache.flush()?;
                match &stats_file {
                    Some(path) => write_stats(path, &e),
                    None => Ok(()),
                }
            })
            .await;
            if let Ok(Err(err)) = flushed {
                tracing::warn!(error = %err.chain(), "flushing the cache or the counters failed");
            }
        }
    }));
    let e = Arc::clone(&engine);
    let index_cache = cache.clone();
    let verify_cache = cache.clone();
    let limit = (opts.hydrate == Hydrate::Background).then_some(opts.hydrate_rate * 1_000_000);
    let hydrate = opts.hydrate != Hydrate::Off;
    let announce = opts.announce;
    tasks.push(tokio::spawn(async move {
        let indexer = Arc::clone(&e);
        let _ = tokio::task::spawn_blocking(move || indexer.index_other_layers(&index_cache)).await;
        if let Err(err) = e.prefetch_qcow2().await {
            tracing::warn!(error = %err.chain(), "qcow2 metadata prefetch failed");
        }
        if hydrate {
            let concurrency = if limit.is_some() { 2 } else { 4 };
            match e.hydrate(concurrency, limit).await {
                Ok(()) => {
                    let integrity = e.check_integrity(&verify_cache).await;
                    if announce {
                        println!(
                            "hydrated: {} chunks cached; integrity {integrity}",
                            e.cache.present_count()
                        )
                    }
                    tracing::info!(chunks = e.cache.present_count(), %integrity, "hydrated")
                }
                Err(err) => tracing::warn!(error = %err.chain(), "hydration stopped"),
            }
        }
    }));
    Ok(Serving {
        engine,
        session,
        ready,
        tasks,
        dir: dir.to_path_buf(),
        stats_file: opts.stats_file.clone(),
    })
}

/// Mounts the ready-disk directory and points its alias at it.
async fn mount_ready(
    engine: &Arc<Engine>,
    ready: &ReadyDir,
    passthrough: bool,
) -> Result<(fuser::BackgroundSession, Vec<(PathBuf, PathBuf)>)> {
    let runtime = tokio::runtime::Handle::current();
    let (e, rt, r) = (Arc::clone(engine), runtime.clone(), ready.clone());
    let (raw, metadata) = tokio::task::spawn_blocking(move || describe(&e, &rt, &r))
        .await
        .map_err(|e| Error::new(ErrorKind::Io, "describing the disk").with_source(e))??;
    let json = serde_json::to_vec_pretty(&metadata).expect("metadata serialises");
    let links = ready_links(ready, &metadata);
    let fs = crate::fuse::LayerFs::ready(Arc::clone(engine), runtime, passthrough, raw, json);
    let _ = nix::mount::umount2(&ready.dir, nix::mount::MntFlags::MNT_DETACH);
    std::fs::create_dir_all(&ready.dir)
        .map_err(|e| Error::io(format!("creating {}", ready.dir.display()), e))?;
    let session = crate::fuse::mount(fs, &ready.dir)?;
    for (link, target) in &links {
        replace_symlink(link, target)?;
    }
    Ok((session, links))
}

/// The symlinks of a ready-disk directory: its alias and its libvirt volumes.
fn ready_links(ready: &ReadyDir, metadata: &ReadyMetadata) -> Vec<(PathBuf, PathBuf)> {
    let mut links = Vec::new();
    if let Some(alias) = &ready.alias {
        links.push((alias.clone(), ready.dir.clone()));
    }
    if let Some(volumes) = &ready.volumes {
        let with = |ext: &str| {
            let mut name = volumes.as_os_str().to_owned();
            name.push(format!(".{ext}"));
            PathBuf::from(name)
        };
        if metadata.raw_error.is_none() {
            links.push((with("raw"), ready.dir.join("disk.raw")));
        }
        if metadata.format != "raw" {
            links.push((with(&metadata.format), ready.dir.join(&metadata.disk)));
        }
    }
    links
}

/// Points `link` at `target`, replacing what was there atomically.
fn replace_symlink(link: &Path, target: &Path) -> Result<()> {
    if let Some(parent) = link.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
    }
    let mut tmp = link.as_os_str().to_owned();
    tmp.push(".new");
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)
        .and_then(|()| std::fs::rename(&tmp, link))
        .map_err(|e| Error::io(format!("linking {}", link.display()), e))
}

/// What a server reports about its layer (the stats file).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LayerStatus {
    pub counters: StatsSnapshot,
    pub chunks: u64,
    pub chunks_cached: u64,
    /// The disk's path inside the layer, e.g. `disk/disk.qcow2`.
    pub disk_path: String,
    /// Size of the disk file.
    #[serde(default)]
    pub disk_size: u64,
    /// The layer's integrity check ([`Integrity`]): `pending`, `verified` or `failed: …`.
    #[serde(default)]
    pub integrity: String,
    /// The layer's key ([`crate::cache::LayerId::key`]) and blob digest.
    #[serde(default)]
    pub layer_key: String,
    #[serde(default)]
    pub layer_digest: String,
}

impl LayerStatus {
    fn of(engine: &Engine) -> Self {
        let layer = &engine.layer;
        LayerStatus {
            counters: engine.stats.snapshot(),
            chunks: layer.chunks.len() as u64,
            chunks_cached: engine.cache.present_count() as u64,
            disk_path: layer.nodes[layer.files[layer.disk].node].path.clone(),
            disk_size: layer.file_size(layer.disk),
            integrity: engine.integrity().to_string(),
            layer_key: layer.id().key().to_string(),
            layer_digest: layer.meta.layer_digest.to_string(),
        }
    }
}

/// Writes `engine`'s status to `path` atomically (a reader never sees half a file).
pub fn write_stats(path: &Path, engine: &Engine) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_vec(&LayerStatus::of(engine)).expect("status serialises");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

impl Serving {
    /// The path of the layer's disk file on the mount.
    pub fn disk_path(&self) -> PathBuf {
        self.dir.join(LayerStatus::of(&self.engine).disk_path)
    }

    /// Waits for SIGINT or SIGTERM and unmounts; while files on the mount are open the
    /// unmount is refused, a message says so, and the layer keeps serving.
    pub async fn serve_until_signalled(&self) -> Result<()> {
        loop {
            wait_for_signal().await?;
            if let Some((_, ready, _)) = &self.ready {
                match nix::mount::umount2(&ready.dir, nix::mount::MntFlags::empty()) {
                    Ok(()) | Err(nix::errno::Errno::EINVAL) => {}
                    Err(nix::errno::Errno::EBUSY) => {
                        eprintln!(
                            "vmdisk: {} is busy (a VM uses the disk); signal again when it is closed",
                            ready.dir.display()
                        );
                        continue;
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
                Ok(()) => return Ok(()),
                Err(nix::errno::Errno::EBUSY) => eprintln!(
                    "vmdisk: {} is busy; close the files using it (`fuser -vm {}`) and signal again",
                    self.dir.display(),
                    self.dir.display()
                ),
                Err(e) => {
                    return Err(Error::io(
                        format!("unmounting {}", self.dir.display()),
                        e.into(),
                    ))
                }
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
        self.engine.cache.flush()?;
        if let Some(path) = &self.stats_file {
            write_stats(path, &self.engine)?;
        }
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
