//! `vmdisk-snapshotter`: a containerd proxy snapshotter that serves VM-disk layers lazily.
//!
//! Ordinary layers and containers get what containerd's built-in overlayfs snapshotter gives
//! them: a directory per snapshot (`snapshots/<id>/fs`, plus `work` for active ones) and
//! overlay or bind mounts over the parent chain, with the metadata in a transactional store
//! ([`store`]). During a CRI pull, `Prepare` with `containerd.io/snapshot.ref` has
//! [`prepare::Pulls::judge`] decide the layer (the signature policy, then
//! [`prepare::classify`]: whether it is a lazily loadable disk); if so, a mount server
//! ([`mount_server`], run by the [`servers::supervisor`]) mounts it through FUSE, the committed snapshot is recorded with that mount as its
//! directory, and containerd is told the target exists, so it neither downloads nor unpacks
//! the layer. Every decision is logged and counted.
//!
//! Laid out by the process that runs each part: the daemon's own work ([`daemon`]: start-up,
//! the gRPC services, the store, counters and metrics), a Prepare in the daemon ([`prepare`]:
//! classification, tenants, the CRI proxy), the per-layer mount server process
//! ([`mount_server`]), and the link between them, run by the daemon ([`servers`]: the
//! supervisor and the control channel).
//!
//! All changes to the store and the snapshot directories happen under one lock, on blocking
//! threads, in an order that leaves at worst an unreferenced directory after a crash (removed
//! by `Cleanup`): directories are created before the record and removed after it. A remote
//! layer's server is started or stopped under that layer's own lock
//! ([`servers::supervisor::LayerLocks`]), never under a lock other layers wait for.

pub mod args;
pub mod config;
pub mod counters;
pub mod daemon;
pub mod mount_server;
pub mod prepare;
mod remote;
pub mod servers;
pub mod store;

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use counters::Counters;
use parking_lot::Mutex;
use prepare::Pulls;
use servers::control;
use servers::supervisor::{LayerLocks, Supervisor};
use store::{Kind, Record, RemoteLayerRef, Store, Usage};

use crate::error::{Error, ErrorKind, Result};

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
    /// How images are read, trusted, classified and granted: a Prepare's and the management
    /// API's alike.
    pub pulls: Pulls,
    /// Decisions, calls and the servers' engine counters.
    pub counters: Counters,
    overlay_index_off: bool,
    cache: CacheSettings,
    /// What each layer's server said last ([`Snapshotter::statuses`]).
    recent: parking_lot::Mutex<HashMap<crate::oci::digest::Digest, control::LayerStatus>>,
    /// Notified at each lazy pull ([`prepare::pods::watch`] looks for pods it will not serve).
    pub lazily_pulled: std::sync::Arc<tokio::sync::Notify>,
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
    /// The node's budget for chunks held in memory (`[cache] memory_budget`), in bytes.
    pub memory_budget: u64,
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
        pulls: Pulls,
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
            pulls,
            counters: Counters::load(&root.join("counters.json")),
            overlay_index_off: Path::new("/sys/module/overlay/parameters/index").exists(),
            cache,
            recent: parking_lot::Mutex::new(HashMap::new()),
            lazily_pulled: Default::default(),
        })
    }

    /// The node's budget for chunks held in memory, in bytes.
    pub fn memory_budget(&self) -> u64 {
        self.cache.memory_budget
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

    /// The remote layers of `key` and its parents whose files are not mounted now.
    fn unserved_layers(&self, key: &str) -> Result<Vec<RemoteLayerRef>> {
        let own = self.store.must_get(key)?;
        let parents = self.store.ancestors(key)?.into_iter().map(|(_, r)| r);
        Ok(std::iter::once(own)
            .chain(parents)
            .filter_map(|r| r.remote)
            .filter(|r| !self.servers.mounted(&r.layer))
            .collect())
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
    pub fn remove(&self, key: &str) -> Result<Option<crate::oci::digest::Digest>> {
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
    pub fn cleanup(&self) -> Result<Vec<crate::oci::digest::Digest>> {
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
    ) -> Result<BTreeMap<crate::oci::digest::Digest, (RemoteLayerRef, Vec<String>)>> {
        let mut out: BTreeMap<crate::oci::digest::Digest, (RemoteLayerRef, Vec<String>)> =
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

#[cfg(test)]
mod tests;
