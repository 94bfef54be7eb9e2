//! The persistent local block cache: what is kept, and what is known to be present.
//!
//! Layout under the cache root (default `/var/lib/vmdisk/cache`):
//!
//! ```text
//! layers/<layer key hex>/
//!     meta.json     where the layer comes from and where its TOC is (see LayerMeta)
//!     toc.zst       the TOC exactly as fetched; re-verified against meta.json on load
//!     data/<n>      one sparse file per regular file n of the layer, full size
//!     bitmap        durable presence bits, one per chunk (written after the data: see below)
//!     sums          sha256 of each stored chunk that carries no digest of its own
//!     structure-checked  present once the tar headers were found to agree with the TOC
//!     integrity     the outcome of checking the complete layer against its diff_id
//!     lock          held shared while mounted, so eviction skips the layer
//!     last-used     its mtime orders eviction
//! refs/<sha256 of the reference>.json   the last resolution of an image reference
//! blobs/<digest hex>   manifests and image configs fetched by digest (re-verified on load)
//! ```
//!
//! **Identity.** A layer is keyed by what was verified about it ([`crate::layer::LayerId`]),
//! never by the blob digest alone: a lazily read blob is never hashed whole, so its digest is
//! only a claim.
//! Two images share a cache entry only if their manifests pin the same TOC (and so the same
//! chunk digests), claim the same blob and diff_id, and name the same disk file.
//!
//! **Crash ordering.** A chunk is written into its data file, and marked present in memory at
//! once (later reads in this process see the page cache). A flusher then `fdatasync`s the data
//! files and only afterwards writes the bitmap bytes and `fdatasync`s the bitmap. A crash can
//! therefore lose recently fetched chunks (they are fetched again) but can never leave a bit
//! set for data that did not reach the disk. `docs/cache.md` has the details.
//!
//! **Not trusted.** The cache is root-owned, but disks fail, backups are restored and people
//! edit files: a chunk read back is checked against the digest it was verified with before
//! it is served, once per process life of the layer and again after its data file changed
//! ([`layer`], the engine's read path).

pub mod layer;
pub mod memory;
pub mod names;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layer::LayerMeta;
use crate::oci::digest::Digest;

pub use layer::LayerCache;
pub use names::data_file;

/// The default cache root.
pub const DEFAULT_ROOT: &str = "/var/lib/vmdisk/cache";

/// Whether a layer, once complete, was found to be what its image config says.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase", tag = "state", content = "reason")]
pub enum Integrity {
    /// Not complete yet, or not checked yet.
    Pending,
    /// The complete layer's tar stream hashes to its diff_id and its entries are the TOC's.
    Verified,
    /// It does not: every read of the layer fails. The reason says what differed.
    Failed(String),
}

impl std::fmt::Display for Integrity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Integrity::Pending => f.write_str("pending"),
            Integrity::Verified => f.write_str("verified"),
            Integrity::Failed(why) => write!(f, "failed: {why}"),
        }
    }
}

/// The last resolution of an image reference, for offline re-mounts.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RefRecord {
    pub reference: String,
    pub manifest_digest: Digest,
    /// The layer's key ([`crate::layer::LayerId::key`]).
    pub layer_key: Digest,
    pub platform: String,
}

/// The cache root.
#[derive(Clone, Debug)]
pub struct CacheRoot {
    root: PathBuf,
}

/// The file in a cache's root whose lock is the turn to re-verify a layer's cached chunks in
/// the background ([`CacheRoot::verify_turn`]).
const VERIFY_TURN: &str = "verify-turn";

/// The regular file at `path` if it is at most `max` bytes and hashes to `digest` (a blob
/// kept by digest, here or in containerd's content store).
pub fn read_verified(path: &Path, digest: &Digest, max: u64) -> Option<Vec<u8>> {
    use std::io::Read;
    // Not a FIFO or device somebody put there: opening one could wait forever.
    if !std::fs::symlink_metadata(path).ok()?.is_file() {
        return None;
    }
    let file = std::fs::File::open(path).ok()?;
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes).ok()?;
    (bytes.len() as u64 <= max && digest.verify(&bytes, "kept blob").is_ok()).then_some(bytes)
}

/// Replaces `path` with `data` at once (written aside, then renamed). Not synced: everything
/// written this way is checked when read back (against a digest or a key, or parsed), so a
/// file a crash left torn is fetched or checked again, and the ready path waits on no flush.
fn write_atomically(path: &Path, data: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, data).map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(format!("renaming {}", tmp.display()), e))
}

impl CacheRoot {
    /// Opens (creating if needed) the cache at `root`, mode 0700.
    pub fn open(root: &Path) -> Result<Self> {
        for sub in ["layers", "refs", "blobs", "verified"] {
            std::fs::create_dir_all(root.join(sub)).map_err(|e| {
                Error::io(format!("creating cache directory {}", root.display()), e)
            })?;
        }
        use std::os::unix::fs::PermissionsExt;
        if let Err(e) = std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700)) {
            // Not ours to change (another user's directory): fine only if no one else may
            // read it already.
            let open_to_others = std::fs::metadata(root)
                .map(|m| m.permissions().mode() & 0o077 != 0)
                .unwrap_or(true);
            if open_to_others {
                return Err(Error::io(
                    format!(
                        "making the cache {} private (mode 0700); its owner can, or name another with --cache",
                        root.display()
                    ),
                    e,
                ));
            }
        }
        Ok(CacheRoot {
            root: root.to_path_buf(),
        })
    }

    /// The turn to re-verify a layer's cached chunks in the background, held while the
    /// returned file is open; `None` while another process (another layer's server) holds it.
    /// One layer at a time reads its cache back after a restart, so a node full of cached
    /// disks does not read them all at once while its guests boot.
    pub fn verify_turn(&self) -> Option<std::fs::File> {
        let turn = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.root.join(VERIFY_TURN))
            .ok()?;
        turn.try_lock().ok()?;
        Some(turn)
    }

    /// The directory of the layer with key `key` ([`crate::layer::LayerId::key`]).
    pub fn layer_dir(&self, key: &Digest) -> PathBuf {
        self.root.join("layers").join(key.hex())
    }

    fn ref_path(&self, reference: &str) -> PathBuf {
        self.root
            .join("refs")
            .join(format!("{}.json", Digest::of(reference.as_bytes()).hex()))
    }

    /// Remembers how `record.reference` resolved.
    pub fn save_ref(&self, record: &RefRecord) -> Result<()> {
        write_atomically(
            &self.ref_path(&record.reference),
            &serde_json::to_vec(record).expect("record serialises"),
        )
    }

    /// How `reference` resolved last time, if it did.
    pub fn load_ref(&self, reference: &str) -> Option<RefRecord> {
        let bytes = std::fs::read(self.ref_path(reference)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Keeps a manifest or image config that was fetched by `digest` (and so verified), for
    /// the next resolution of the same image on this node: the daemon's classification
    /// hands it to the mount server this way, and offline re-mounts find it.
    pub fn save_blob(&self, digest: &Digest, bytes: &[u8]) -> Result<()> {
        write_atomically(&self.root.join("blobs").join(digest.hex()), bytes)
    }

    /// A kept manifest or config, if it is there, at most `max` bytes and still hashes to
    /// `digest`.
    pub fn load_blob(&self, digest: &Digest, max: u64) -> Option<Vec<u8>> {
        read_verified(&self.root.join("blobs").join(digest.hex()), digest, max)
    }

    /// Records that a signature policy accepted what `key` names (policy, repository and
    /// digest: [`crate::policy`]) until `until` (seconds since the epoch).
    pub fn save_verdict(&self, key: &Digest, until: u64) -> Result<()> {
        write_atomically(
            &self.root.join("verified").join(key.hex()),
            until.to_string().as_bytes(),
        )
    }

    /// Until when a signature policy accepted what `key` names, if it did.
    pub fn verdict(&self, key: &Digest) -> Option<u64> {
        let text = std::fs::read_to_string(self.root.join("verified").join(key.hex())).ok()?;
        text.trim().parse().ok()
    }

    /// Stores a verified TOC and the layer's metadata (the TOC first, so `meta.json` only ever
    /// names a TOC that is on disk).
    pub fn save_layer_meta(&self, meta: &LayerMeta, toc: &[u8]) -> Result<()> {
        let dir = self.layer_dir(&meta.id().key());
        std::fs::create_dir_all(dir.join(names::DATA))
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        write_atomically(&dir.join(names::TOC), toc)?;
        write_atomically(
            &dir.join(names::META),
            &serde_json::to_vec_pretty(meta).expect("meta serialises"),
        )
    }

    /// Whether the layer with key `key` has its metadata stored (not checked).
    pub fn has_layer_meta(&self, key: &Digest) -> bool {
        self.layer_dir(key).join(names::META).is_file()
    }

    /// The stored metadata and TOC bytes of the layer with key `key`, if complete and
    /// consistent (the metadata is the key's, the TOC its pinned one).
    pub fn load_layer_meta(&self, key: &Digest) -> Option<(LayerMeta, Vec<u8>)> {
        let dir = self.layer_dir(key);
        let meta: LayerMeta =
            serde_json::from_slice(&std::fs::read(dir.join(names::META)).ok()?).ok()?;
        let toc = std::fs::read(dir.join(names::TOC)).ok()?;
        (meta.id().key() == *key && meta.toc_digest.verify(&toc, "cached TOC").is_ok())
            .then_some((meta, toc))
    }

    /// The keys of all cached layers.
    pub fn layers(&self) -> Vec<Digest> {
        let Ok(entries) = std::fs::read_dir(self.root.join("layers")) else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                format!("sha256:{}", e.file_name().to_string_lossy())
                    .parse()
                    .ok()
            })
            .collect()
    }

    /// Whether the layer with key `key` passed the structure check (its tar headers agree with
    /// its TOC; `engine::integrity`).
    pub fn structure_checked(&self, key: &Digest) -> bool {
        self.layer_dir(key).join(names::STRUCTURE_CHECKED).exists()
    }

    /// Records that the layer passed the structure check.
    pub fn save_structure_checked(&self, key: &Digest) -> Result<()> {
        write_atomically(&self.layer_dir(key).join(names::STRUCTURE_CHECKED), b"")
    }

    /// What the integrity check of the layer with key `key` found last, if it ran.
    pub fn load_integrity(&self, key: &Digest) -> Option<Integrity> {
        let bytes = std::fs::read(self.layer_dir(key).join(names::INTEGRITY)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Records the outcome of the layer's integrity check.
    pub fn save_integrity(&self, key: &Digest, integrity: &Integrity) -> Result<()> {
        write_atomically(
            &self.layer_dir(key).join(names::INTEGRITY),
            &serde_json::to_vec(integrity).expect("integrity serialises"),
        )
    }

    /// When a mount last opened the layer with key `key`.
    pub fn last_used(&self, key: &Digest) -> Option<std::time::SystemTime> {
        std::fs::metadata(self.layer_dir(key).join(names::LAST_USED))
            .and_then(|m| m.modified())
            .ok()
    }

    /// Evicts least recently used layers that are not mounted until the cache's data takes at
    /// most `limit` bytes. Returns the bytes freed.
    pub fn evict(&self, limit: u64) -> Result<u64> {
        self.evict_while(|total, _| total > limit)
    }

    /// Evicts layers nobody has open, least recently used first, until `bytes` are freed or
    /// none is left: room for a mounted layer on a full disk. Returns the bytes freed.
    pub fn free_unused(&self, bytes: u64) -> Result<u64> {
        self.evict_while(|_, freed| freed < bytes)
    }

    /// Evicts whole layers nobody has open, least recently used first, while `go_on(total
    /// allocated, freed so far)`.
    fn evict_while(&self, go_on: impl Fn(u64, u64) -> bool) -> Result<u64> {
        use std::os::unix::fs::MetadataExt;
        let mut layers: Vec<(std::time::SystemTime, u64, PathBuf)> = Vec::new();
        let mut total = 0;
        for digest in self.layers() {
            let dir = self.layer_dir(&digest);
            let mut size = 0;
            if let Ok(files) = std::fs::read_dir(dir.join(names::DATA)) {
                for f in files.filter_map(|f| f.ok()) {
                    size += f.metadata().map(|m| m.blocks() * 512).unwrap_or(0);
                }
            }
            let used = std::fs::metadata(dir.join(names::LAST_USED))
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH);
            total += size;
            layers.push((used, size, dir));
        }
        layers.sort();
        let mut freed = 0;
        for (_, size, dir) in layers {
            if !go_on(total, freed) {
                break;
            }
            // A mounted layer holds its lock shared; only an unused one can be locked here.
            let lock = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(dir.join(names::LOCK));
            let Ok(lock) = lock else { continue };
            if lock.try_lock().is_err() {
                continue;
            }
            std::fs::remove_dir_all(&dir)
                .map_err(|e| Error::io(format!("evicting {}", dir.display()), e))?;
            tracing::info!(layer = %dir.display(), bytes = size, "evicted");
            total -= size;
            freed += size;
        }
        Ok(freed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_layer_at_a_time_holds_the_turn_to_re_verify() {
        let dir = tempfile::tempdir().unwrap();
        let root = CacheRoot::open(dir.path()).unwrap();
        let turn = root.verify_turn().expect("free");
        assert!(root.verify_turn().is_none(), "held by the first");
        drop(turn);
        assert!(root.verify_turn().is_some(), "free again");
    }

    fn fill_layer(root: &CacheRoot, name: &[u8], bytes: usize) -> (Digest, PathBuf) {
        let digest = Digest::of(name);
        let dir = root.layer_dir(&digest);
        std::fs::create_dir_all(dir.join(names::DATA)).unwrap();
        std::fs::write(dir.join("data/0"), vec![1u8; bytes]).unwrap();
        std::fs::write(dir.join(names::LAST_USED), b"").unwrap();
        (digest, dir)
    }

    #[test]
    fn eviction_removes_least_recently_used_unmounted_layers_only() {
        let tmp = tempfile::tempdir().unwrap();
        let root = CacheRoot::open(tmp.path()).unwrap();
        let (_, oldest) = fill_layer(&root, b"oldest", 1 << 20);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let (_, mounted) = fill_layer(&root, b"mounted", 1 << 20);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let (_, newest) = fill_layer(&root, b"newest", 1 << 20);
        // "mounted" is open (its lock held shared) and older than "newest".
        let held = LayerCache::open(&mounted, &[1 << 20], 4).unwrap();
        std::fs::write(newest.join(names::LAST_USED), b"").unwrap();
        // Make "mounted" the least recently used on disk: eviction must still skip it.
        let old = std::fs::File::options()
            .write(true)
            .open(mounted.join(names::LAST_USED))
            .unwrap();
        old.set_modified(std::time::UNIX_EPOCH).unwrap();

        let freed = root.evict(2 << 20).unwrap();
        assert!(mounted.exists(), "a mounted layer is never evicted");
        assert!(
            !oldest.exists(),
            "the least recently used unmounted layer goes first"
        );
        assert!(newest.exists(), "eviction stops once under the limit");
        assert!(freed >= 1 << 20);
        drop(held);
        root.evict(0).unwrap();
        assert!(
            !mounted.exists() && !newest.exists(),
            "unmounted layers can all go"
        );
    }
}
