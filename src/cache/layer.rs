//! One cached layer: sparse data files, presence bits in memory, and the durable bitmap.
//!
//! Invariant: a bit in the on-disk bitmap is set only after the chunk's bytes were written and
//! `fdatasync`ed ([`LayerCache::flush`]). In memory, a chunk is present as soon as its bytes
//! are in the data file's page cache, which is what reads (and passthrough) see.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::error::{Error, Result};

const BITMAP_MAGIC: &[u8; 8] = b"VMDKBMP1";
const BITMAP_HEADER: u64 = 16;

#[derive(Default)]
struct Pending {
    chunks: Vec<usize>,
    files: BTreeSet<usize>,
}

struct Durable {
    file: File,
    bits: Vec<u8>,
}

/// The cache of one layer. Shared between FUSE threads and fetch tasks.
pub struct LayerCache {
    dir: PathBuf,
    data: Vec<File>,
    present: Vec<AtomicU64>,
    present_count: AtomicUsize,
    chunks: usize,
    pending: Mutex<Pending>,
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

impl LayerCache {
    /// Opens the cache of a layer in `dir` with one data file per size in `files` and
    /// `chunks` chunks. Takes the layer's lock shared, so eviction leaves it alone while it is
    /// open.
    pub fn open(dir: &Path, files: &[u64], chunks: usize) -> Result<Self> {
        std::fs::create_dir_all(dir.join(super::names::DATA))
            .map_err(io(format!("creating {}", dir.display())))?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(super::names::LOCK))
            .map_err(io(format!("opening {}/lock", dir.display())))?;
        lock.lock_shared()
            .map_err(io(format!("locking {}", dir.display())))?;
        let _ = File::create(dir.join(super::names::LAST_USED));
        let mut data = Vec::with_capacity(files.len());
        for (n, &size) in files.iter().enumerate() {
            let path = super::data_file(dir, n);
            let f = OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&path)
                .map_err(io(format!("opening {}", path.display())))?;
            if f.metadata().map(|m| m.len()).unwrap_or(0) != size {
                f.set_len(size)
                    .map_err(io(format!("sizing {}", path.display())))?;
            }
            data.push(f);
        }
        let bitmap_path = dir.join(super::names::BITMAP);
        let bitmap = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&bitmap_path)
            .map_err(io(format!("opening {}", bitmap_path.display())))?;
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
        let present: Vec<AtomicU64> = (0..chunks.div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect();
        let cache = LayerCache {
            dir: dir.to_path_buf(),
            data,
            present,
            present_count: AtomicUsize::new(0),
            chunks,
            pending: Mutex::new(Pending::default()),
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
    /// present in memory and queues it for the durable bitmap.
    pub fn write_chunk(&self, idx: usize, file: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        self.data[file]
            .write_all_at(bytes, offset)
            .map_err(io(format!(
                "writing chunk {idx} to {}/data/{file}",
                self.dir.display()
            )))?;
        self.now_present(idx, file);
        Ok(())
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
    pub fn flush(&self) -> Result<()> {
        let pending = std::mem::take(&mut *self.pending.lock());
        if pending.chunks.is_empty() {
            return Ok(());
        }
        for &f in &pending.files {
            self.data[f]
                .sync_data()
                .map_err(io(format!("syncing {}/data/{f}", self.dir.display())))?;
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
            c.write_chunk(0, 0, 0, &[1u8; 4096]).unwrap();
            c.flush().unwrap();
            c.write_chunk(1, 0, 4096, &[2u8; 4096]).unwrap();
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
    fn a_bitmap_for_another_layout_is_discarded() {
        let dir = tempfile::tempdir().unwrap();
        {
            let c = LayerCache::open(dir.path(), &[8192], 2).unwrap();
            c.write_chunk(0, 0, 0, &[1u8; 4096]).unwrap();
        }
        let c = LayerCache::open(dir.path(), &[8192], 3).unwrap();
        assert_eq!(c.present_count(), 0);
    }
}
