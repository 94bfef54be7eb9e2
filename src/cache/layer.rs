//! One cached layer: sparse data files, presence bits in memory, and the durable bitmap.
//!
//! Invariant: a bit in the on-disk bitmap is set only after the chunk's bytes were written and
//! `fdatasync`ed ([`LayerCache::flush`]). In memory, a chunk is present as soon as its bytes
//! are in the data file's page cache, which is what reads (and passthrough) see.
//!
//! The files are the node's, and disks fail and people edit: a present chunk is also
//! *checked* once this process wrote it from verified bytes or read it back and found its
//! digest ([`LayerCache::mark_checked`]); the engine checks every other present chunk before it
//! serves it. A data file changed by anyone else ([`LayerCache::changed_since_checked`]) loses
//! its checks. A chunk that cannot be written (a full disk) is kept in memory, bounded by the
//! node's budget ([`Spill`], [`MemoryBudget`]), and answered from there.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::memory::MemoryBudget;
use crate::error::{Error, Result};
use crate::oci::digest::Digest;

const BITMAP_MAGIC: &[u8; 8] = b"VMDKBMP1";
const BITMAP_HEADER: u64 = 16;

#[derive(Default)]
struct Pending {
    chunks: Vec<usize>,
    files: BTreeSet<usize>,
    /// Whether `sums` was written since the last flush.
    sums: bool,
}

struct Durable {
    file: File,
    bits: Vec<u8>,
}

/// What identifies a data file's content as this process last left it: a write by anyone
/// else changes its change time (which no one can set back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    ino: u64,
    ctime: (i64, i64),
    len: u64,
}

fn stamp_of(file: &File) -> Option<Stamp> {
    let m = file.metadata().ok()?;
    Some(Stamp {
        ino: m.ino(),
        ctime: (m.ctime(), m.ctime_nsec()),
        len: m.len(),
    })
}

/// Verified chunks that could not be written to their data file (no space left), kept in
/// memory so the reads waiting for them are answered; the oldest go first past what the node's
/// budget leaves this layer ([`MemoryBudget::room`]).
struct Spill {
    chunks: HashMap<usize, Arc<[u8]>>,
    order: VecDeque<usize>,
    bytes: u64,
    budget: Arc<MemoryBudget>,
}

impl Spill {
    fn new(budget: Arc<MemoryBudget>) -> Self {
        Spill {
            chunks: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            budget,
        }
    }

    /// Keeps chunk `idx` within `room` bytes for this layer (the oldest go first); what it
    /// holds now, for the budget's ledger (noted by the caller, outside the lock).
    fn put(&mut self, idx: usize, bytes: &[u8], room: u64) -> u64 {
        if !self.chunks.contains_key(&idx) {
            self.bytes += bytes.len() as u64;
            self.chunks.insert(idx, Arc::from(bytes));
            self.order.push_back(idx);
        }
        while self.bytes > room {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(gone) = self.chunks.remove(&old) {
                self.bytes -= gone.len() as u64;
            }
        }
        self.bytes
    }

    /// Lets chunk `idx` go (it reached its data file); what it holds now, if that changed.
    fn take(&mut self, idx: usize) -> Option<u64> {
        let gone = self.chunks.remove(&idx)?;
        self.bytes -= gone.len() as u64;
        self.order.retain(|&i| i != idx);
        Some(self.bytes)
    }
}

/// Where a present chunk's bytes are.
pub enum Kept {
    /// In the data file.
    File,
    /// Only in memory: the disk had no room.
    Memory(Arc<[u8]>),
}

/// The cache of one layer. Shared between FUSE threads and fetch tasks.
pub struct LayerCache {
    dir: PathBuf,
    data: Vec<File>,
    present: Vec<AtomicU64>,
    present_count: AtomicUsize,
    /// Present chunks whose bytes in the data file this process wrote from verified bytes or
    /// read back and verified.
    checked: Vec<AtomicU64>,
    /// Per data file: its stamp after this process's last write or check.
    stamps: Vec<Mutex<Option<Stamp>>>,
    /// Per data file: changed by someone else since the last pass over the cache took note
    /// ([`LayerCache::take_changed`]).
    changed: Vec<AtomicBool>,
    /// The digests of stored chunks that carry none of their own (a part of a seekable
    /// index's span), 32 bytes per chunk, synced with the data before the bitmap.
    sums: File,
    spill: Mutex<Spill>,
    /// Whether the last write of a chunk found no space left.
    full: AtomicBool,
    /// Chunks that found no space left, ever.
    unstored: AtomicU64,
    chunks: usize,
    pending: Mutex<Pending>,
    /// Held for a whole flush, so a flush that returns has made durable everything stored
    /// before it began, including what a flush running meanwhile had taken.
    flushing: Mutex<()>,
    durable: Mutex<Durable>,
    _lock: File,
}

/// The durable presence bits in a bitmap file, if its header matches `chunks`.
fn read_bitmap(file: &File, chunks: usize) -> Option<Vec<u8>> {
    let mut header = [0u8; BITMAP_HEADER as usize];
    file.read_exact_at(&mut header, 0).ok()?;
    if &header[..8] != BITMAP_MAGIC
        || u64::from_le_bytes(header[8..].try_into().ok()?) != chunks as u64
    {
        return None;
    }
    let mut bits = vec![0u8; chunks.div_ceil(8)];
    file.read_exact_at(&mut bits, BITMAP_HEADER).ok()?;
    Some(bits)
}

/// The durable presence bits of the layer cached in `dir`, without opening it for use (dedup
/// looks at other layers this way).
pub fn durable_bits(dir: &Path, chunks: usize) -> Option<Vec<u8>> {
    read_bitmap(&File::open(dir.join(super::names::BITMAP)).ok()?, chunks)
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::io(what, e)
}

/// `path` opened for reading and writing, made if missing (never truncated).
fn open_rw(path: &Path) -> Result<File> {
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(path)
        .map_err(io(format!("opening {}", path.display())))
}

impl LayerCache {
    /// Opens the cache of a layer in `dir` with one data file per size in `files` and
    /// `chunks` chunks. Takes the layer's lock shared, so eviction leaves it alone while it is
    /// open.
    pub fn open(dir: &Path, files: &[u64], chunks: usize) -> Result<Self> {
        std::fs::create_dir_all(dir.join(super::names::DATA))
            .map_err(io(format!("creating {}", dir.display())))?;
        let lock = open_rw(&dir.join(super::names::LOCK))?;
        lock.lock_shared()
            .map_err(io(format!("locking {}", dir.display())))?;
        let _ = File::create(dir.join(super::names::LAST_USED));
        let mut data = Vec::with_capacity(files.len());
        for (n, &size) in files.iter().enumerate() {
            let path = super::names::data_file(dir, n);
            let f = open_rw(&path)?;
            if f.metadata().map(|m| m.len()).unwrap_or(0) != size {
                f.set_len(size)
                    .map_err(io(format!("sizing {}", path.display())))?;
            }
            data.push(f);
        }
        let sums_path = dir.join(super::names::SUMS);
        let sums = open_rw(&sums_path)?;
        if sums.metadata().map(|m| m.len()).unwrap_or(0) != chunks as u64 * 32 {
            // For another layout: no sum is known (a hole reads as none).
            sums.set_len(0)
                .and_then(|()| sums.set_len(chunks as u64 * 32))
                .map_err(io(format!("sizing {}", sums_path.display())))?;
        }
        let bitmap_path = dir.join(super::names::BITMAP);
        let bitmap = open_rw(&bitmap_path)?;
        let bits = match read_bitmap(&bitmap, chunks) {
            Some(bits) => bits,
            None => {
                // Missing, or for another layout: start empty.
                let bits = vec![0u8; chunks.div_ceil(8)];
                let mut header = [0u8; BITMAP_HEADER as usize];
                header[..8].copy_from_slice(BITMAP_MAGIC);
                header[8..].copy_from_slice(&(chunks as u64).to_le_bytes());
                let reset = |e| Error::io(format!("resetting {}", bitmap_path.display()), e);
                bitmap.set_len(0).map_err(reset)?;
                bitmap.write_all_at(&header, 0).map_err(reset)?;
                bitmap.write_all_at(&bits, BITMAP_HEADER).map_err(reset)?;
                bitmap.sync_all().map_err(reset)?;
                bits
            }
        };
        let zeroed = || -> Vec<AtomicU64> {
            (0..chunks.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect()
        };
        let stamps = data.iter().map(|f| Mutex::new(stamp_of(f))).collect();
        let changed = data.iter().map(|_| AtomicBool::new(false)).collect();
        let cache = LayerCache {
            dir: dir.to_path_buf(),
            data,
            present: zeroed(),
            present_count: AtomicUsize::new(0),
            checked: zeroed(),
            stamps,
            changed,
            sums,
            spill: Mutex::new(Spill::new(Arc::new(MemoryBudget::alone(
                super::memory::DEFAULT_BUDGET,
            )))),
            full: AtomicBool::new(false),
            unstored: AtomicU64::new(0),
            chunks,
            pending: Mutex::new(Pending::default()),
            flushing: Mutex::new(()),
            durable: Mutex::new(Durable { file: bitmap, bits }),
            _lock: lock,
        };
        let durable_bits: Vec<usize> = {
            let d = cache.durable.lock();
            (0..chunks)
                .filter(|&i| d.bits[i / 8] & (1 << (i % 8)) != 0)
                .collect()
        };
        for i in durable_bits {
            cache.mark(i);
        }
        Ok(cache)
    }

    fn mark(&self, idx: usize) -> bool {
        let bit = 1u64 << (idx % 64);
        let was = self.present[idx / 64].fetch_or(bit, Ordering::AcqRel);
        let newly = was & bit == 0;
        if newly {
            self.present_count.fetch_add(1, Ordering::AcqRel);
        }
        newly
    }

    /// The layer's cache directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether chunk `idx` can be read from the data file.
    pub fn is_present(&self, idx: usize) -> bool {
        self.present[idx / 64].load(Ordering::Acquire) & (1 << (idx % 64)) != 0
    }

    /// How many chunks are present.
    pub fn present_count(&self) -> usize {
        self.present_count.load(Ordering::Acquire)
    }

    /// Whether every chunk is present.
    pub fn complete(&self) -> bool {
        self.present_count() == self.chunks
    }

    /// Stores a verified chunk: writes it at `offset` of data file `file`, then marks it
    /// present (and checked) in memory and queues it for the durable bitmap. A chunk the disk
    /// has no room for is kept in memory instead ([`LayerCache::kept`], [`LayerCache::full`]).
    /// `sum`: the digest to keep for a chunk that carries none of its own
    /// ([`LayerCache::sum`]), written first.
    pub fn write_chunk(
        &self,
        idx: usize,
        file: usize,
        offset: u64,
        bytes: &[u8],
        sum: Option<&Digest>,
    ) -> Result<()> {
        let written = sum
            .map_or(Ok(()), |d| {
                self.pending.lock().sums = true;
                self.sums.write_all_at(d.bytes(), idx as u64 * 32)
            })
            .and_then(|()| {
                let mut stamp = self.stamps[file].lock();
                let written = self.data[file].write_all_at(bytes, offset);
                *stamp = stamp_of(&self.data[file]);
                written
            });
        match written {
            Ok(()) => {
                if self.full.swap(false, Ordering::AcqRel) {
                    tracing::info!(cache = %self.dir.display(), "the cache has room again; chunks are stored");
                }
                let held = self.spill.lock().take(idx);
                if let Some(held) = held {
                    self.memory_budget().note(held);
                }
                self.now_present(idx, file);
                self.mark_checked(idx);
                Ok(())
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
                if !self.full.swap(true, Ordering::AcqRel) {
                    tracing::warn!(cache = %self.dir.display(), chunk = idx, "no space left for the cache: verified chunks are answered from memory (the node's budget: {} MiB for all layers) until there is room; unused layers are evicted", self.memory_budget().bytes() >> 20);
                }
                self.unstored.fetch_add(1, Ordering::AcqRel);
                // The ledger is read and written outside the lock reads take.
                let budget = self.memory_budget();
                let held = self.spill.lock().put(idx, bytes, budget.room());
                budget.note(held);
                Ok(())
            }
            Err(e) => Err(Error::io(
                format!("writing chunk {idx} to {}/data/{file}", self.dir.display()),
                e,
            )),
        }
    }

    /// Shares the node's budget `budget` for chunks kept in memory (by default this layer has
    /// one of [`super::memory::DEFAULT_BUDGET`] of its own). Called before anything is kept.
    pub fn with_memory_budget(self, budget: Arc<MemoryBudget>) -> Self {
        *self.spill.lock() = Spill::new(budget);
        self
    }

    /// Bytes of verified chunks held in memory because the disk had no room
    /// (`memory_held`).
    pub fn memory_held(&self) -> u64 {
        self.spill.lock().bytes
    }

    /// Keeps what this layer holds in memory counted in the node's budget
    /// ([`MemoryBudget::renew`]); each second.
    pub fn renew_memory_note(&self) {
        self.memory_budget().renew();
    }

    fn memory_budget(&self) -> Arc<MemoryBudget> {
        Arc::clone(&self.spill.lock().budget)
    }

    /// Whether the last chunk written found no space left (`cache_full`).
    pub fn full(&self) -> bool {
        self.full.load(Ordering::Acquire)
    }

    /// How many chunks found no space left since the layer was opened.
    pub fn unstored(&self) -> u64 {
        self.unstored.load(Ordering::Acquire)
    }

    /// Where chunk `idx`'s verified bytes are, if anywhere: the data file (present) or memory.
    pub fn kept(&self, idx: usize) -> Option<Kept> {
        if self.is_present(idx) {
            return Some(Kept::File);
        }
        self.spill
            .lock()
            .chunks
            .get(&idx)
            .cloned()
            .map(Kept::Memory)
    }

    /// Whether chunk `idx` is present or held in memory.
    pub fn is_kept(&self, idx: usize) -> bool {
        self.is_present(idx) || self.spill.lock().chunks.contains_key(&idx)
    }

    /// Whether present chunk `idx`'s bytes in its data file were checked in this process.
    pub fn is_checked(&self, idx: usize) -> bool {
        self.checked[idx / 64].load(Ordering::Acquire) & (1 << (idx % 64)) != 0
    }

    /// Notes that chunk `idx`'s bytes in its data file were found to be its verified bytes.
    pub fn mark_checked(&self, idx: usize) {
        self.checked[idx / 64].fetch_or(1 << (idx % 64), Ordering::AcqRel);
    }

    /// Forgets present chunk `idx`, whose bytes in the data file are not what was verified: it
    /// is fetched again (its durable bit stays until then; a restart checks it again). Whether
    /// it was present (false: someone forgot it first).
    pub fn forget(&self, idx: usize) -> bool {
        let bit = 1u64 << (idx % 64);
        self.checked[idx / 64].fetch_and(!bit, Ordering::AcqRel);
        let was = self.present[idx / 64].fetch_and(!bit, Ordering::AcqRel) & bit != 0;
        if was {
            self.present_count.fetch_sub(1, Ordering::AcqRel);
        }
        was
    }

    /// Whether data file `file` was changed by anyone but this process since its last write or
    /// check; if it was, the checks of its chunks (`chunks`) are dropped, so each is checked
    /// again before it is served.
    pub fn changed_since_checked(&self, file: usize, chunks: std::ops::Range<usize>) -> bool {
        let mut stamp = self.stamps[file].lock();
        let now = stamp_of(&self.data[file]);
        if now == *stamp {
            return false;
        }
        *stamp = now;
        for idx in chunks {
            self.checked[idx / 64].fetch_and(!(1 << (idx % 64)), Ordering::AcqRel);
        }
        self.changed[file].store(true, Ordering::Release);
        true
    }

    /// Whether data file `file` was found changed by someone else since this was last asked
    /// ([`LayerCache::changed_since_checked`]); the note is taken.
    pub fn take_changed(&self, file: usize) -> bool {
        self.changed[file].swap(false, Ordering::AcqRel)
    }

    /// Whether every present chunk was checked in this process.
    pub fn all_checked(&self) -> bool {
        self.present
            .iter()
            .zip(&self.checked)
            .all(|(p, c)| p.load(Ordering::Acquire) & !c.load(Ordering::Acquire) == 0)
    }

    /// The digest kept for chunk `idx` when it was written ([`LayerCache::write_chunk`]), if
    /// one was.
    pub fn sum(&self, idx: usize) -> Option<Digest> {
        let mut bytes = [0u8; 32];
        self.sums.read_exact_at(&mut bytes, idx as u64 * 32).ok()?;
        (bytes != [0u8; 32]).then(|| Digest::from_bytes(bytes))
    }

    /// Marks chunk `idx` (of data file `file`) present in memory and queues it for the durable
    /// bitmap.
    fn now_present(&self, idx: usize, file: usize) {
        if self.mark(idx) {
            let mut p = self.pending.lock();
            p.chunks.push(idx);
            p.files.insert(file);
        }
    }

    /// Marks verified all-zero chunk `idx` of data file `file` present without writing it:
    /// the data file's hole there already reads as zeros (only chunk `idx`'s own verified
    /// bytes are ever written there).
    pub fn mark_hole(&self, idx: usize, file: usize) {
        self.now_present(idx, file);
        self.mark_checked(idx);
    }

    /// Reads present data of file `file` at `offset`.
    pub fn read_at(&self, file: usize, buf: &mut [u8], offset: u64) -> Result<()> {
        self.data[file]
            .read_exact_at(buf, offset)
            .map_err(io(format!(
                "reading {}/data/{file} at {offset}",
                self.dir.display()
            )))
    }

    /// The data file of regular file `file` (for passthrough once complete).
    pub fn data_file(&self, file: usize) -> &File {
        &self.data[file]
    }

    /// Makes everything written so far durable: data first, then the bitmap bits for it.
    /// Waits for a flush already running (the server's last flush on unmount must not
    /// return while the upkeep's is still syncing the chunks it took).
    pub fn flush(&self) -> Result<()> {
        let _one_at_a_time = self.flushing.lock();
        let pending = std::mem::take(&mut *self.pending.lock());
        if pending.chunks.is_empty() {
            return Ok(());
        }
        for &f in &pending.files {
            self.data[f]
                .sync_data()
                .map_err(io(format!("syncing {}/data/{f}", self.dir.display())))?;
        }
        if pending.sums {
            self.sums
                .sync_data()
                .map_err(io(format!("syncing {}/sums", self.dir.display())))?;
        }
        let mut d = self.durable.lock();
        let (mut lo, mut hi) = (usize::MAX, 0);
        for &idx in &pending.chunks {
            d.bits[idx / 8] |= 1 << (idx % 8);
            lo = lo.min(idx / 8);
            hi = hi.max(idx / 8);
        }
        let span = d.bits[lo..=hi].to_vec();
        d.file
            .write_all_at(&span, BITMAP_HEADER + lo as u64)
            .map_err(io(format!("writing {}/bitmap", self.dir.display())))?;
        d.file
            .sync_data()
            .map_err(io(format!("syncing {}/bitmap", self.dir.display())))
    }
}

impl Drop for LayerCache {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e.chain(), "flushing the cache on close failed; recent chunks will be fetched again");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presence_survives_reopen_only_after_flush() {
        let dir = tempfile::tempdir().unwrap();
        {
            let c = LayerCache::open(dir.path(), &[4096 * 4], 4).unwrap();
            c.mark_hole(3, 0);
            assert!(c.is_present(3) && !c.is_present(0));
            c.write_chunk(0, 0, 0, &[1u8; 4096], None).unwrap();
            c.flush().unwrap();
            c.write_chunk(1, 0, 4096, &[2u8; 4096], None).unwrap();
            assert!(c.is_present(1));
            // Simulate a crash: the process dies before the second flush.
            std::mem::forget(c);
        }
        let c = LayerCache::open(dir.path(), &[4096 * 4], 4).unwrap();
        assert!(
            c.is_present(0) && c.is_present(3),
            "flushed chunks are durable"
        );
        assert!(
            !c.is_present(1),
            "an unflushed chunk is never marked present after a crash"
        );
        assert_eq!(c.present_count(), 2);
        let mut hole = [1u8; 4096];
        c.read_at(0, &mut hole, 3 * 4096).unwrap();
        assert_eq!(hole, [0u8; 4096], "a hole reads as zeros");
        let mut buf = [0u8; 4096];
        c.read_at(0, &mut buf, 0).unwrap();
        assert_eq!(buf, [1u8; 4096]);
    }

    #[test]
    fn a_flush_returns_only_once_a_flush_running_meanwhile_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let c = Arc::new(LayerCache::open(dir.path(), &[4096 * 2], 2).unwrap());
        c.write_chunk(0, 0, 0, &[1u8; 4096], None).unwrap();
        c.write_chunk(1, 0, 4096, &[2u8; 4096], None).unwrap();
        // The first flush takes the chunks, then waits to write their bits.
        let holding = c.durable.lock();
        let first = std::thread::spawn({
            let c = Arc::clone(&c);
            move || c.flush().unwrap()
        });
        while !c.pending.lock().chunks.is_empty() {
            std::thread::yield_now();
        }
        // A second flush (the last one, on unmount) must not return before those bits are
        // on disk: the process may end as soon as it does.
        let second = std::thread::spawn({
            let c = Arc::clone(&c);
            let dir = dir.path().to_path_buf();
            move || {
                c.flush().unwrap();
                durable_bits(&dir, 2)
            }
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        drop(holding);
        first.join().unwrap();
        assert_eq!(second.join().unwrap(), Some(vec![0b11]));
    }

    #[test]
    fn a_bitmap_for_another_layout_is_discarded() {
        let dir = tempfile::tempdir().unwrap();
        {
            let c = LayerCache::open(dir.path(), &[8192], 2).unwrap();
            c.write_chunk(0, 0, 0, &[1u8; 4096], None).unwrap();
        }
        let c = LayerCache::open(dir.path(), &[8192], 3).unwrap();
        assert_eq!(c.present_count(), 0);
    }
}
