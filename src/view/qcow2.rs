//! The raw view of a qcow2 disk over any other view, and what qemu reads first from one.
//!
//! Kata boots its guest from a raw, partitioned image given by path; publishers ship qcow2.
//! [`Qcow2View`] serves the guest's bytes at guest offsets, mapped through the image's L1/L2
//! tables ([`crate::format::qcow2_raw`]) as they are read, without converting or copying the
//! image: only the clusters a guest reads are fetched, cached reads answer at once, misses of
//! one read are fetched together, and a sequential reader's read-ahead becomes the image
//! clusters behind it.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures_util::future::BoxFuture;
use parking_lot::Mutex;

use super::file::LayerFile;
use super::{clipped, DiskView};
use crate::error::{Error, Result};
use crate::format::disk::DiskFormat;
use crate::format::qcow2;
use crate::format::qcow2_raw::{GuestPiece, Qcow2Map, Source, HEADER_BYTES};

/// L2 tables a view keeps (each one cluster): 64 GiB of guest at 64 KiB clusters.
const L2_TABLES: usize = 128;

/// An L2 table's entries and when it was last used.
type Kept = (Arc<Vec<u64>>, u64);

/// The L2 tables a view has read, by image offset; when full, the least recently used one
/// makes room.
#[derive(Default)]
struct L2Cache {
    tables: Mutex<HashMap<u64, Kept>>,
    clock: AtomicU64,
}

impl L2Cache {
    fn get(&self, offset: u64) -> Option<Arc<Vec<u64>>> {
        let now = self.clock.fetch_add(1, Ordering::Relaxed);
        let mut tables = self.tables.lock();
        let (table, used) = tables.get_mut(&offset)?;
        *used = now;
        Some(Arc::clone(table))
    }

    fn insert(&self, offset: u64, table: Arc<Vec<u64>>) {
        let now = self.clock.fetch_add(1, Ordering::Relaxed);
        let mut tables = self.tables.lock();
        if tables.len() >= L2_TABLES && !tables.contains_key(&offset) {
            let oldest = tables
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(&o, _)| o);
            if let Some(o) = oldest {
                tables.remove(&o);
            }
        }
        tables.insert(offset, (table, now));
    }
}

/// The raw view of the qcow2 image `inner` holds.
pub struct Qcow2View<V> {
    inner: V,
    map: Qcow2Map,
    l2: L2Cache,
}

/// The L2 tables one read needs, by image offset.
type Tables = Vec<(u64, Arc<Vec<u64>>)>;

impl<V: DiskView> Qcow2View<V> {
    /// Reads and checks the image's header and L1 table.
    pub async fn open(inner: V) -> Result<Self> {
        let head = inner.read(0, HEADER_BYTES).await?;
        let header = Qcow2Map::header(&head)?;
        let tables = header.tables(inner.size())?;
        let l1 = read_exact(&inner, tables.l1.clone(), "the L1 table").await?;
        let map = Qcow2Map::new(header, &l1, inner.size());
        Ok(Qcow2View {
            inner,
            map,
            l2: L2Cache::default(),
        })
    }

    /// What the image is read from.
    pub fn inner(&self) -> &V {
        &self.inner
    }

    /// The distinct L2 tables (image ranges) guest bytes `range` are mapped by.
    fn tables_for(&self, range: Range<u64>) -> Vec<Range<u64>> {
        let mut wanted: Vec<Range<u64>> = Vec::new();
        for index in self.map.clusters(range) {
            if let Some(table) = self.map.l2_table(index) {
                if wanted.last() != Some(&table) {
                    wanted.push(table);
                }
            }
        }
        wanted
    }

    fn keep_table(&self, range: &Range<u64>, bytes: Vec<u8>) -> Result<Arc<Vec<u64>>> {
        if bytes.len() as u64 != range.end - range.start {
            return Err(self.beyond(range, "an L2 table"));
        }
        let table = Arc::new(Qcow2Map::l2_entries(&bytes));
        self.l2.insert(range.start, Arc::clone(&table));
        Ok(table)
    }

    fn beyond(&self, range: &Range<u64>, what: &str) -> Error {
        Error::corrupt(format!(
            "qcow2 {what} at {} lies beyond the end of the image ({} bytes)",
            range.start,
            self.inner.size()
        ))
    }

    /// The L2 tables of `range` from memory or the cache; `None` if one must be fetched.
    fn tables_cached(&self, range: Range<u64>) -> Option<Result<Tables>> {
        let mut tables = Vec::new();
        for r in self.tables_for(range) {
            let table = match self.l2.get(r.start) {
                Some(t) => t,
                None => {
                    let read = self
                        .map
                        .check_inside(&r, "an L2 table")
                        .map(|()| self.inner.read_cached(r.start, r.end - r.start));
                    match read {
                        Err(e) => return Some(Err(e)),
                        Ok(None) => return None,
                        Ok(Some(bytes)) => match bytes.and_then(|b| self.keep_table(&r, b)) {
                            Ok(t) => t,
                            Err(e) => return Some(Err(e)),
                        },
                    }
                }
            };
            tables.push((r.start, table));
        }
        Some(Ok(tables))
    }

    /// The L2 tables of `range`, fetched where needed.
    async fn tables(&self, range: Range<u64>) -> Result<Tables> {
        let mut tables = Vec::new();
        for r in self.tables_for(range) {
            let table = match self.l2.get(r.start) {
                Some(t) => t,
                None => {
                    self.map.check_inside(&r, "an L2 table")?;
                    let bytes = self.inner.read(r.start, r.end - r.start).await?;
                    self.keep_table(&r, bytes)?
                }
            };
            tables.push((r.start, table));
        }
        Ok(tables)
    }

    /// The pieces of guest bytes `range`, mapped through `tables`.
    fn pieces(&self, range: Range<u64>, tables: &Tables) -> Result<Vec<GuestPiece>> {
        let pieces = self.map.pieces(range, |index| {
            let start = self.map.l2_table(index)?.start;
            tables
                .iter()
                .find(|(s, _)| *s == start)
                .map(|(_, t)| t.as_slice())
        });
        for piece in &pieces {
            if let Some(r) = self.map.image_range(&piece.source) {
                let what = match piece.source {
                    Source::Compressed { .. } => "a compressed cluster",
                    _ => "a data cluster",
                };
                self.map.check_inside(&r, what)?;
            }
        }
        Ok(pieces)
    }

    /// A piece's guest bytes from the image bytes it needs (`bytes`; nothing for zeros).
    fn fill(&self, piece: &GuestPiece, bytes: Option<Vec<u8>>, out: &mut Vec<u8>) -> Result<()> {
        match (&piece.source, bytes) {
            (Source::Zero, _) => out.resize(out.len() + piece.len as usize, 0),
            (Source::Data(r), Some(data)) => {
                if data.len() as u64 != piece.len {
                    return Err(self.beyond(r, "a data cluster"));
                }
                out.extend_from_slice(&data);
            }
            (Source::Compressed { offset, within, .. }, Some(input)) => {
                let cluster = self.map.decompress(*offset, &input)?;
                let from = *within as usize;
                out.extend_from_slice(&cluster[from..from + piece.len as usize]);
            }
            (_, None) => unreachable!("image bytes are read for every piece but zeros"),
        }
        Ok(())
    }
}

impl<V: DiskView> DiskView for Qcow2View<V> {
    fn size(&self) -> u64 {
        self.map.size()
    }

    fn read_cached(&self, offset: u64, len: u64) -> Option<Result<Vec<u8>>> {
        let range = offset..offset + clipped(offset, len, self.size());
        let tables = match self.tables_cached(range.clone())? {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        let pieces = match self.pieces(range.clone(), &tables) {
            Ok(p) => p,
            Err(e) => return Some(Err(e)),
        };
        let mut out = Vec::with_capacity((range.end - range.start) as usize);
        for piece in &pieces {
            let result = match (&piece.source, self.map.image_range(&piece.source)) {
                // Data straight into the answer: one copy from the cache.
                (Source::Data(r), _) => {
                    let start = out.len();
                    match self
                        .inner
                        .read_cached_into(r.start, r.end - r.start, &mut out)?
                    {
                        Ok(()) if (out.len() - start) as u64 == piece.len => Ok(()),
                        Ok(()) => Err(self.beyond(r, "a data cluster")),
                        Err(e) => Err(e),
                    }
                }
                (_, Some(r)) => match self.inner.read_cached(r.start, r.end - r.start)? {
                    Ok(b) => self.fill(piece, Some(b), &mut out),
                    Err(e) => Err(e),
                },
                (_, None) => self.fill(piece, None, &mut out),
            };
            if let Err(e) = result {
                return Some(Err(e));
            }
        }
        Some(Ok(out))
    }

    /// Every piece's image bytes are fetched at once: a read's misses wait one round trip.
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Vec<u8>>> {
        Box::pin(async move {
            let range = offset..offset + clipped(offset, len, self.size());
            let tables = self.tables(range.clone()).await?;
            let pieces = self.pieces(range.clone(), &tables)?;
            let reads = pieces.iter().map(|piece| async move {
                match self.map.image_range(&piece.source) {
                    Some(r) => self.inner.read(r.start, r.end - r.start).await.map(Some),
                    None => Ok(None),
                }
            });
            let bytes = futures_util::future::try_join_all(reads).await?;
            let mut out = Vec::with_capacity((range.end - range.start) as usize);
            for (piece, bytes) in pieces.iter().zip(bytes) {
                self.fill(piece, bytes, &mut out)?;
            }
            Ok(out)
        })
    }

    /// The image clusters behind guest bytes `range` (and their L2 tables).
    fn prefetch(&self, range: Range<u64>) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let tables = self.tables(range.clone()).await?;
            let pieces = self.pieces(range, &tables)?;
            let fetches = pieces
                .iter()
                .filter_map(|p| self.map.image_range(&p.source))
                .map(|r| self.inner.prefetch(r));
            futures_util::future::try_join_all(fetches).await?;
            Ok(())
        })
    }
}

/// Bytes `range` of `view`, all of them.
async fn read_exact(view: &impl DiskView, range: Range<u64>, what: &str) -> Result<Vec<u8>> {
    let bytes = view.read(range.start, range.end - range.start).await?;
    if bytes.len() as u64 != range.end - range.start {
        return Err(Error::corrupt(format!(
            "qcow2 {what} at {} lies beyond the end of the image ({} bytes)",
            range.start,
            view.size()
        )));
    }
    Ok(bytes)
}

/// What a ready directory serves as `disk.raw`.
pub enum RawDisk {
    /// The raw view of the qcow2 disk.
    View(Arc<Qcow2View<LayerFile>>),
    /// The disk itself (it is raw).
    Disk,
    /// No raw view (the qcow2 cannot be mapped, e.g. it has a backing file), and why.
    Unavailable(Error),
}

/// A layer's disk as a ready directory describes it: its format, its raw view and the
/// guest's size.
pub struct Described {
    pub format: DiskFormat,
    pub raw: RawDisk,
    pub virtual_size: u64,
}

/// Describes `disk` from its first bytes and, for qcow2, its L1 table (read by the raw view).
/// A qcow2 the raw view cannot map is still served as published, without a raw view.
pub async fn describe(disk: LayerFile) -> Result<Described> {
    let head = disk.read_unrecorded(0, 4).await?;
    if !qcow2::is_qcow2(&head) {
        let size = disk.size();
        return Ok(Described {
            format: DiskFormat::Raw,
            raw: RawDisk::Disk,
            virtual_size: size,
        });
    }
    Ok(match Qcow2View::open(disk).await {
        Ok(view) => Described {
            format: DiskFormat::Qcow2,
            virtual_size: view.size(),
            raw: RawDisk::View(Arc::new(view)),
        },
        Err(e) => Described {
            format: DiskFormat::Qcow2,
            raw: RawDisk::Unavailable(e),
            virtual_size: 0,
        },
    })
}

/// Reads the disk's qcow2 header, then its L1 and refcount tables together (two round trips):
/// what qemu and [`describe`] read first. Nothing more for a raw disk. Not recorded in boot
/// traces. L2 tables are left to the reads that need them: each costs a whole chunk or span,
/// most of it guest data nobody asked for.
pub async fn read_head(disk: &LayerFile) -> Result<()> {
    let head = disk.read_unrecorded(0, HEADER_BYTES).await?;
    if !qcow2::is_qcow2(&head) {
        return Ok(());
    }
    let header = Qcow2Map::header(&head)?;
    let tables = header.tables(disk.size())?;
    let (l1, _) = futures_util::future::join(
        disk.read_unrecorded(tables.l1.start, tables.l1.end - tables.l1.start),
        disk.read_unrecorded(
            tables.refcount.start,
            tables.refcount.end - tables.refcount.start,
        ),
    )
    .await;
    l1?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLUSTER: u64 = 64 << 10;

    /// A qcow2 image of a 4-cluster guest at 64 KiB clusters, in memory: header, L1 table
    /// (cluster 1), refcount table (2), L2 table (3); guest cluster 0 at image cluster 4 (all
    /// 0xaa), guest cluster 2 at image cluster 5 (0xbb); guest clusters 1 and 3 unallocated.
    fn image() -> Vec<u8> {
        let mut b = vec![0u8; 6 * CLUSTER as usize];
        b[..4].copy_from_slice(&qcow2::MAGIC);
        b[4..8].copy_from_slice(&3u32.to_be_bytes());
        b[20..24].copy_from_slice(&16u32.to_be_bytes());
        b[24..32].copy_from_slice(&(4 * CLUSTER).to_be_bytes());
        b[36..40].copy_from_slice(&1u32.to_be_bytes());
        b[40..48].copy_from_slice(&CLUSTER.to_be_bytes());
        b[48..56].copy_from_slice(&(2 * CLUSTER).to_be_bytes());
        b[56..60].copy_from_slice(&1u32.to_be_bytes());
        b[100..104].copy_from_slice(&104u32.to_be_bytes());
        let at = |n: u64| n as usize;
        let copied = 1u64 << 63;
        b[at(CLUSTER)..at(CLUSTER) + 8].copy_from_slice(&(copied | (3 * CLUSTER)).to_be_bytes());
        let l2 = at(3 * CLUSTER);
        b[l2..l2 + 8].copy_from_slice(&(copied | (4 * CLUSTER)).to_be_bytes());
        b[l2 + 16..l2 + 24].copy_from_slice(&(copied | (5 * CLUSTER)).to_be_bytes());
        b[at(4 * CLUSTER)..at(5 * CLUSTER)].fill(0xaa);
        b[at(5 * CLUSTER)..].fill(0xbb);
        b
    }

    /// An image whose bytes count as cached only once read or prefetched (in clusters), and
    /// which counts what it was asked to fetch.
    struct Fetched {
        bytes: Vec<u8>,
        cached: Mutex<Vec<bool>>,
        fetches: AtomicU64,
    }

    impl Fetched {
        fn new(bytes: Vec<u8>) -> Self {
            let clusters = bytes.len().div_ceil(CLUSTER as usize);
            Fetched {
                bytes,
                cached: Mutex::new(vec![false; clusters]),
                fetches: AtomicU64::new(0),
            }
        }

        fn clusters(range: Range<u64>) -> Range<usize> {
            (range.start / CLUSTER) as usize..range.end.div_ceil(CLUSTER) as usize
        }

        fn fetch(&self, range: Range<u64>) {
            self.fetches.fetch_add(1, Ordering::Relaxed);
            self.cached.lock()[Self::clusters(range)].fill(true);
        }
    }

    impl DiskView for Fetched {
        fn size(&self) -> u64 {
            self.bytes.len() as u64
        }

        fn read_cached(&self, offset: u64, len: u64) -> Option<Result<Vec<u8>>> {
            let range = offset..offset + clipped(offset, len, self.size());
            let cached = self.cached.lock()[Self::clusters(range.clone())]
                .iter()
                .all(|c| *c);
            cached.then(|| Ok(self.bytes[range.start as usize..range.end as usize].to_vec()))
        }

        fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Vec<u8>>> {
            let range = offset..offset + clipped(offset, len, self.size());
            self.fetch(range.clone());
            let bytes = self.bytes[range.start as usize..range.end as usize].to_vec();
            Box::pin(async move { Ok(bytes) })
        }

        fn prefetch(&self, range: Range<u64>) -> BoxFuture<'_, Result<()>> {
            self.fetch(range);
            Box::pin(async { Ok(()) })
        }
    }

    #[tokio::test]
    async fn guest_bytes_come_from_the_clusters_the_tables_map_and_holes_are_zeros() {
        let view = Qcow2View::open(Fetched::new(image())).await.unwrap();
        assert_eq!(view.size(), 4 * CLUSTER);
        // A read across all four guest clusters: data, hole, data, hole.
        let got = view.read(CLUSTER - 10, 2 * CLUSTER + 20).await.unwrap();
        assert_eq!(got.len() as u64, 2 * CLUSTER + 20);
        assert!(got[..10].iter().all(|b| *b == 0xaa));
        assert!(got[10..10 + CLUSTER as usize].iter().all(|b| *b == 0));
        let (c, end) = (CLUSTER as usize, got.len());
        assert!(got[10 + c..end - 10].iter().all(|b| *b == 0xbb));
        assert!(got[end - 10..].iter().all(|b| *b == 0));
        // Past the guest's end: fewer bytes, then none.
        assert_eq!(view.read(4 * CLUSTER - 5, 100).await.unwrap(), [0; 5]);
        assert!(view.read(4 * CLUSTER, 100).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_cached_read_fetches_nothing_and_answers_only_what_is_cached() {
        let view = Qcow2View::open(Fetched::new(image())).await.unwrap();
        let opened = view.inner().fetches.load(Ordering::Relaxed);
        // Nothing of the L2 table or the data is cached yet: no answer, and no fetch.
        assert!(view.read_cached(2 * CLUSTER, 4096).is_none());
        assert_eq!(view.inner().fetches.load(Ordering::Relaxed), opened);
        // Prefetching the guest range fetches its L2 table and data cluster; then the cached
        // read answers the same bytes a read does, without fetching.
        view.prefetch(2 * CLUSTER..2 * CLUSTER + 4096)
            .await
            .unwrap();
        let fetched = view.inner().fetches.load(Ordering::Relaxed);
        let cached = view.read_cached(2 * CLUSTER, 4096).unwrap().unwrap();
        assert_eq!(cached, vec![0xbb; 4096]);
        assert_eq!(view.inner().fetches.load(Ordering::Relaxed), fetched);
        // A hole needs its L2 table only, which is kept now; guest cluster 0's data is not
        // cached.
        assert_eq!(
            view.read_cached(CLUSTER, 4096).unwrap().unwrap(),
            vec![0; 4096]
        );
        assert!(view.read_cached(0, 4096).is_none());
    }
}
