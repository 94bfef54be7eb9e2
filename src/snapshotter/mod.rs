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

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::{Error, ErrorKind, Result};
use classify::{Classifier, Decision, LABEL_REMOTE, LABEL_TARGET};
use counters::Counters;
use store::{Kind, Record, RemoteLayerRef, Store, Usage};
use supervisor::{LayerLocks, Supervisor};

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
        let started = std::time::Instant::now();
        match self.classifier.classify(labels).await {
            Decision::Remote { reference, layer } => {
                match self
                    .prepare_remote(target, parent, labels, &reference, layer)
                    .await
                {
                    Ok(outcome) => {
                        self.counters.add(&format!("decision/{outcome}"), 1);
                        let ms = started.elapsed().as_millis() as u64;
                        tracing::info!(%layer, %reference, outcome, ms, "layer is served lazily");
                        return true;
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
                        reason,
                        detail,
                        "a published VM-disk layer is pulled normally"
                    );
                } else {
                    self.counters.add(&format!("decision/ordinary:{reason}"), 1);
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
        let lock = self.layer_locks.lock(&layer).await;
        self.servers
            .ensure(&layer, &reference.to_string(), alias.as_deref())
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

    /// What each of `layers`' servers says now (`None`: no server answered within the call
    /// deadline), asked all at once; their counters are taken in.
    /// Hands the running servers of `repository` of `registry` the credentials kubelet sent
    /// with a PullImage of it; a server that does not answer gets them at its next start.
    pub async fn hand_credentials(
        self: &Arc<Self>,
        registry: &str,
        repository: &str,
        credential: crate::registry::auth::Credential,
        ttl: std::time::Duration,
    ) -> Result<()> {
        let me = Arc::clone(self);
        let layers = blocking(move || me.remote_layers()).await?;
        for (layer, (remote, _)) in layers {
            let same = remote
                .reference
                .parse::<crate::reference::Reference>()
                .is_ok_and(|r| r.registry == registry && r.repository == repository);
            if !same {
                continue;
            }
            let message =
                control::credentials_message(registry, repository, credential.clone(), ttl);
            if let Err(e) = self.servers.hand_credentials(&layer, message).await {
                tracing::debug!(%layer, error = %e.chain(), "the layer's server did not take the credentials");
            }
        }
        Ok(())
    }

    pub async fn statuses(
        &self,
        layers: impl IntoIterator<Item = crate::digest::Digest>,
    ) -> HashMap<crate::digest::Digest, Option<control::LayerStatus>> {
        let asked = layers.into_iter().map(|layer| async move {
            let status = self.servers.status(&layer).await;
            (layer, status)
        });
        let answers = futures_util::future::join_all(asked).await;
        for status in answers.iter().filter_map(|(_, s)| s.as_ref()) {
            self.observe(status);
        }
        answers.into_iter().collect()
    }

    /// Writes the counters if they changed, off the async workers.
    pub async fn save_counters(self: &Arc<Self>) -> Result<()> {
        let me = Arc::clone(self);
        blocking(move || me.counters.save()).await
    }
}

/// Disks made ready through the management API (`vmdisk path`, `prefetch`, `rm`, `gc`).
impl Snapshotter {
    /// Makes `reference`'s disk ready and keeps it until [`Snapshotter::remove_disk`]; returns
    /// its layer. With the registry unreachable, a reference kept before is served from the
    /// cache.
    pub async fn ensure_disk(self: &Arc<Self>, reference: &str) -> Result<crate::digest::Digest> {
        let parsed: crate::reference::Reference = reference.parse()?;
        let (client, cache) = (self.classifier.client(), self.classifier.cache());
        let remote = match crate::remote::platform_manifest(client, cache, &parsed).await {
            Ok((manifest, digest, _)) => {
                let pinned = parsed.with_digest(digest);
                let (_, meta) =
                    crate::remote::disk_layer_id(client, cache, &pinned, &manifest, digest).await?;
                RemoteLayerRef {
                    reference: pinned.to_string(),
                    layer: meta.id().key(),
                    alias: Some(reference.to_string()),
                }
            }
            Err(e) if e.kind() == ErrorKind::Network => {
                let me = Arc::clone(self);
                let pins = blocking(move || me.store.pins()).await?;
                let known = pins.into_iter().find(|(n, _)| n == reference);
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
        let layer = remote.layer;
        let lock = self.layer_locks.lock(&layer).await;
        self.servers
            .ensure(&layer, &remote.reference, remote.alias.as_deref())
            .await?;
        let (me, name) = (Arc::clone(self), reference.to_string());
        blocking(move || me.store.pin(&name, &remote)).await?;
        drop(lock);
        Ok(layer)
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
                .ensure(layer, &remote.reference, remote.alias.as_deref())
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
