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

use crate::cache::CacheRoot;
use crate::engine::stats::StatsSnapshot;
use crate::engine::Engine;
use crate::error::{Error, ErrorKind, Result};

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
}

/// A layer being served.
pub struct Serving {
    engine: Arc<Engine>,
    session: fuser::BackgroundSession,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    dir: PathBuf,
    stats_file: Option<PathBuf>,
}

/// Mounts `engine`'s layer at `dir` and starts its background work.
pub fn start(
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
    let mut tasks = Vec::new();
    let e = Arc::clone(&engine);
    let stats_file = opts.stats_file.clone();
    tasks.push(tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
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
                Ok(()) if announce => {
                    println!("hydrated: {} chunks cached", e.cache.present_count())
                }
                Ok(()) => tracing::info!(chunks = e.cache.present_count(), "hydrated"),
                Err(err) => tracing::warn!(error = %err.chain(), "hydration stopped"),
            }
        }
    }));
    Ok(Serving {
        engine,
        session,
        tasks,
        dir: dir.to_path_buf(),
        stats_file: opts.stats_file.clone(),
    })
}

/// What a server reports about its layer (the stats file).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LayerStatus {
    pub counters: StatsSnapshot,
    pub chunks: u64,
    pub chunks_cached: u64,
    /// The disk's path inside the layer, e.g. `disk/disk.qcow2`.
    pub disk_path: String,
}

impl LayerStatus {
    fn of(engine: &Engine) -> Self {
        let layer = &engine.layer;
        LayerStatus {
            counters: engine.stats.snapshot(),
            chunks: layer.chunks.len() as u64,
            chunks_cached: engine.cache.present_count() as u64,
            disk_path: layer.nodes[layer.files[layer.disk].node].path.clone(),
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
