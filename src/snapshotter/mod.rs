//! `vmdisk-snapshotter`: a containerd proxy snapshotter that serves VM-disk layers lazily.
//!
//! Ordinary layers and containers get what containerd's built-in overlayfs snapshotter gives
//! them: a directory per snapshot (`snapshots/<id>/fs`, plus `work` for active ones) and
//! overlay or bind mounts over the parent chain, with the metadata in a transactional store
//! ([`store`]). During a CRI pull, `Prepare` with `containerd.io/snapshot.ref` asks
//! [`classify`] whether the layer is a lazily loadable disk; if so, a mount server
//! ([`layers`]) mounts it through FUSE, the committed snapshot is recorded with that mount as its
//! directory, and containerd is told the target exists, so it neither downloads nor unpacks
//! the layer. Every decision is logged and counted.
//!
//! All changes to the store and the snapshot directories happen under one lock, in an order
//! that leaves at worst an unreferenced directory after a crash (removed by `Cleanup`):
//! directories are created before the record and removed after it.

pub mod classify;
pub mod config;
pub mod daemon;
pub mod filter;
pub mod grpc;
pub mod layers;
pub mod metrics;
pub mod store;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::{Error, ErrorKind, Result};
use classify::{Classifier, Decision, Decisions, LABEL_REMOTE, LABEL_TARGET};
use layers::LayerServers;
use store::{Kind, Record, RemoteLayerRef, Store, Usage};

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
    pub servers: LayerServers,
    /// Held while a layer's server is started or stopped together with the records that use
    /// it, so a removal never stops a server a concurrent Prepare just recorded a use of.
    remote_lock: tokio::sync::Mutex<()>,
    classifier: Classifier,
    pub decisions: Decisions,
    overlay_index_off: bool,
    cache: CacheSettings,
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
        servers: LayerServers,
        classifier: Classifier,
        cache: CacheSettings,
    ) -> Result<Self> {
        for dir in ["snapshots", "mounts", "servers"] {
            let d = root.join(dir);
            std::fs::create_dir_all(&d).map_err(io(format!("creating {}", d.display())))?;
        }
        let store = Store::open(&root.join("metadata.db"))?;
        Ok(Snapshotter {
            root: root.to_path_buf(),
            store,
            lock: Mutex::new(()),
            servers,
            remote_lock: tokio::sync::Mutex::new(()),
            classifier,
            decisions: Decisions::default(),
            overlay_index_off: Path::new("/sys/module/overlay/parameters/index").exists(),
            cache,
        })
    }

    fn guard(&self) -> std::sync::MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn snapshot_dir(&self, id: u64) -> PathBuf {
        self.root.join("snapshots").join(id.to_string())
    }

    /// The directory holding a snapshot's files: its `fs`, or its layer's FUSE mount.
    fn fs_dir(&self, record: &Record) -> PathBuf {
        match &record.remote {
            Some(r) => self.servers.paths(&r.layer).mountpoint,
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

    /// Usage of `key`: frozen at commit, measured for active snapshots.
    pub fn usage(&self, key: &str) -> Result<Usage> {
        let record = self.store.must_get(key)?;
        match (record.kind, record.usage) {
            (Kind::Committed, Some(u)) => Ok(u),
            _ if record.remote.is_some() => Ok(Usage::default()),
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
    /// alias) and the snapshots using them.
    pub fn remote_layers(
        &self,
    ) -> Result<BTreeMap<crate::digest::Digest, (RemoteLayerRef, Vec<String>)>> {
        let mut out: BTreeMap<crate::digest::Digest, (RemoteLayerRef, Vec<String>)> =
            BTreeMap::new();
        let pins = self
            .store
            .pins()?
            .into_iter()
            .map(|(name, r)| (format!("pin:{name}"), r));
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
                .await
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

    /// Classifies the layer and, if it is a disk, serves it remotely; whether the target
    /// snapshot now exists. Every outcome is counted and logged.
    async fn try_remote(
        self: &Arc<Self>,
        target: &str,
        parent: &str,
        labels: &BTreeMap<String, String>,
    ) -> bool {
        match self.classifier.classify(labels).await {
            Decision::Remote { reference, layer } => {
                match self
                    .prepare_remote(target, parent, labels, &reference, layer)
                    .await
                {
                    Ok(outcome) => {
                        self.decisions.count(outcome);
                        tracing::info!(%layer, %reference, outcome, "layer is served lazily");
                        return true;
                    }
                    Err(e) => {
                        self.decisions.count("fallback:mount_failed");
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
                    self.decisions.count(&format!("fallback:{reason}"));
                    tracing::warn!(
                        reason,
                        detail,
                        "a published VM-disk layer is pulled normally"
                    );
                } else {
                    self.decisions.count(&format!("ordinary:{reason}"));
                    tracing::info!(reason, detail, "ordinary layer; containerd pulls it");
                }
            }
        }
        false
    }

    async fn prepare_remote(
        self: &Arc<Self>,
        target: &str,
        parent: &str,
        labels: &BTreeMap<String, String>,
        reference: &crate::reference::Reference,
        layer: crate::digest::Digest,
    ) -> Result<&'static str> {
        if let Some(existing) = self.store.get(target)? {
            if existing.kind == Kind::Committed && existing.parent == parent {
                return Ok("reused");
            }
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!("a different snapshot is named {target:?} already"),
            ));
        }
        let alias = labels.get(classify::LABEL_IMAGE_REF).cloned();
        let _remote = self.remote_lock.lock().await;
        self.servers
            .ensure(&reference.to_string(), &layer, alias.as_deref())
            .await?;
        let mut labels = labels.clone();
        labels.insert(LABEL_REMOTE.to_string(), "vmdisk".to_string());
        let remote = RemoteLayerRef {
            reference: reference.to_string(),
            layer,
            alias,
        };
        let _g = self.guard();
        match self
            .store
            .create(target, Kind::Committed, parent, labels, Some(remote))
        {
            Ok(_) => Ok("remote"),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok("reused"),
            Err(e) => Err(e),
        }
    }
}

impl Snapshotter {
    /// Stops the servers of `layers` that no snapshot or pin uses (after Remove, RemoveDisk or
    /// Cleanup); returns how many it stopped.
    pub async fn stop_unused(self: &Arc<Self>, layers: Vec<crate::digest::Digest>) -> Result<u32> {
        if layers.is_empty() {
            return Ok(0);
        }
        let _remote = self.remote_lock.lock().await;
        let me = Arc::clone(self);
        let used = blocking(move || me.remote_layers()).await?;
        let mut stopped = 0;
        for layer in layers.iter().filter(|l| !used.contains_key(l)) {
            self.servers.stop(layer).await;
            stopped += 1;
        }
        Ok(stopped)
    }
}

/// Disks made ready through the management API (`vmdisk path`, `prefetch`, `rm`, `gc`).
impl Snapshotter {
    /// Makes `reference`'s disk ready and keeps it until [`Snapshotter::remove_disk`]; returns
    /// its layer. With the registry unreachable, a reference kept before is served from the
    /// cache.
    pub async fn ensure_disk(self: &Arc<Self>, reference: &str) -> Result<crate::digest::Digest> {
        let parsed: crate::reference::Reference = reference.parse()?;
        let remote = match crate::remote::platform_manifest(self.classifier.client(), &parsed).await
        {
            Ok((manifest, digest, _)) => {
                let pinned = parsed.with_digest(digest);
                let (_, _, id) =
                    crate::remote::disk_layer_id(self.classifier.client(), &pinned, &manifest)
                        .await?;
                RemoteLayerRef {
                    reference: pinned.to_string(),
                    layer: id.key(),
                    alias: Some(reference.to_string()),
                }
            }
            Err(e) if e.kind() == ErrorKind::Network => {
                let known = self.store.pins()?.into_iter().find(|(n, _)| n == reference);
                match known {
                    Some((_, r)) => {
                        tracing::warn!(reference, error = %e.chain(), "registry unreachable; serving the disk kept before");
                        r
                    }
                    None => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        let _remote = self.remote_lock.lock().await;
        self.servers
            .ensure(&remote.reference, &remote.layer, remote.alias.as_deref())
            .await?;
        self.store.pin(reference, &remote)?;
        Ok(remote.layer)
    }

    /// Forgets a disk kept by [`Snapshotter::ensure_disk`]; returns whether its mount stopped.
    pub async fn remove_disk(self: &Arc<Self>, reference: &str) -> Result<bool> {
        let Some(pin) = self.store.unpin(reference)? else {
            return Err(Error::not_found(format!(
                "{reference} is not a disk kept by `vmdisk path` or `vmdisk prefetch` (see `vmdisk ls`)"
            )));
        };
        self.stop_unused(vec![pin.layer]).await?;
        Ok(self.servers.pid(&pin.layer).await.is_none())
    }

    /// Asks the mount server of `layer` to fetch the whole disk in the background.
    pub fn request_hydration(&self, layer: &crate::digest::Digest) -> Result<()> {
        let path = self.servers.paths(layer).hydrate_request();
        std::fs::write(&path, b"").map_err(io(format!("writing {}", path.display())))
    }

    /// Stops unused mounts, removes stale directories, evicts unused cached layers down to
    /// `limit` (or the configured bound). Returns the bytes freed and the mounts stopped.
    pub async fn gc(self: &Arc<Self>, limit: Option<u64>) -> Result<(u64, u32)> {
        let me = Arc::clone(self);
        let unused = blocking(move || me.cleanup()).await?;
        let stopped = self.stop_unused(unused).await?;
        let freed = match limit.or(self.cache.limit) {
            Some(limit) => {
                let cache = crate::cache::CacheRoot::open(&self.cache.dir)?;
                blocking(move || cache.evict(limit)).await?
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

/// Runs blocking store and file-system work off the async threads.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::new(ErrorKind::Io, "a snapshot operation panicked").with_source(e))?
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io(format!("chmod {}", path.display())))
}

/// Bytes allocated and inodes under `dir`, each inode counted once (as containerd's du).
pub fn disk_usage(dir: &Path) -> Result<Usage> {
    let mut seen = std::collections::HashSet::new();
    let mut usage = Usage::default();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        let m =
            std::fs::symlink_metadata(&path).map_err(io(format!("reading {}", path.display())))?;
        if seen.insert((m.dev(), m.ino())) {
            usage.inodes += 1;
            usage.size += m.blocks() * 512;
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
