//! Where a disk's chunks end besides every `chunk_size` bytes: around a qcow2 image's tables
//! (its header cluster, L1 table, refcount table and L2 tables), so that each is a chunk of its
//! own. qemu and the raw view read a table before the data it maps; an L2 table that shares a
//! chunk with data that does not compress costs a reader the whole chunk (about 200 KiB for a
//! 64 KiB table that compresses to a few KiB), and a boot reads one L2 table per 512 MiB of
//! disk it touches. Learned while the disk streams by: the header names the L1 table, which
//! (qemu writes it before the L2 tables) names them; the reader splits the chunk that taught it
//! cuts inside itself (the first holds the header and, as qemu lays images out, the refcount
//! and L1 tables). A table met before it was learned, or any image that is not qcow2, is cut as
//! any data is. The blob stays the disk's bytes in order.

use std::collections::BTreeSet;
use std::ops::Range;

use crate::format::qcow2::{self, Header};

/// Most L2 tables given chunks of their own (with 64 KiB clusters, 32 TiB of disk); past it
/// they are cut as data, so a crafted L1 table cannot make the set large.
const MAX_TABLES: usize = 1 << 16;

/// The cuts learned so far of one disk `size` bytes long.
pub struct Cuts {
    size: u64,
    cuts: BTreeSet<u64>,
    /// The L1 table's range and its bytes as they stream by, until it is whole.
    l1: Option<(Range<u64>, Vec<u8>, u64)>,
    cluster: u64,
}

impl Cuts {
    pub fn new(size: u64) -> Self {
        Cuts {
            size,
            cuts: BTreeSet::new(),
            l1: None,
            cluster: 0,
        }
    }

    /// Where the chunk starting at `at` must end at the latest: the first cut after it.
    pub fn next_after(&self, at: u64) -> u64 {
        self.cuts
            .range(at + 1..)
            .next()
            .copied()
            .unwrap_or(self.size)
    }

    /// Learns from `data`, the disk's bytes at `at` (read in order; holes are not passed).
    pub fn learn(&mut self, at: u64, data: &[u8]) {
        if at == 0 {
            self.header(data);
        }
        let Some((range, bytes, got)) = &mut self.l1 else {
            return;
        };
        let start = range.start.max(at);
        let end = range.end.min(at + data.len() as u64);
        if start >= end {
            return;
        }
        bytes[(start - range.start) as usize..(end - range.start) as usize]
            .copy_from_slice(&data[(start - at) as usize..(end - at) as usize]);
        *got += end - start;
        if *got == range.end - range.start {
            let (_, bytes, _) = self.l1.take().expect("just matched");
            self.l2_tables(&bytes);
        }
    }

    /// The header's own cluster and the tables it names.
    fn header(&mut self, data: &[u8]) {
        if !qcow2::is_qcow2(data) {
            return;
        }
        let Ok(header) = Header::read(data) else {
            return;
        };
        let Ok(tables) = header.tables(self.size) else {
            return;
        };
        self.cluster = header.cluster_size();
        self.table(0..self.cluster);
        self.table(tables.refcount);
        if !tables.l1.is_empty() {
            self.table(tables.l1.clone());
            let len = (tables.l1.end - tables.l1.start) as usize;
            self.l1 = Some((tables.l1, vec![0; len], 0));
        }
    }

    fn l2_tables(&mut self, l1: &[u8]) {
        for offset in qcow2::l2_offsets(l1).take(MAX_TABLES) {
            self.table(offset..offset.saturating_add(self.cluster));
        }
    }

    /// Cuts around `range`, widened to whole clusters, if it lies inside the disk.
    fn table(&mut self, range: Range<u64>) {
        let start = range.start - range.start % self.cluster;
        let end = range
            .end
            .div_ceil(self.cluster)
            .saturating_mul(self.cluster);
        if start < end && end <= self.size {
            self.cuts.insert(start);
            self.cuts.insert(end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A qcow2 image as `qemu-img create -f qcow2 -o cluster_size=65536` lays out a 2 GiB disk
    /// and writes its L2 tables as data comes: header at 0, refcount table at 64 KiB, L1 at
    /// 192 KiB, L2 tables at 1 MiB and 600 MiB.
    fn image() -> (Vec<u8>, u64) {
        let size = 700 << 20;
        let mut head = vec![0u8; 256 << 10];
        head[..4].copy_from_slice(&qcow2::MAGIC);
        head[4..8].copy_from_slice(&3u32.to_be_bytes()); // version
        head[20..24].copy_from_slice(&16u32.to_be_bytes()); // cluster bits
        head[24..32].copy_from_slice(&(2u64 << 30).to_be_bytes()); // virtual size
        head[36..40].copy_from_slice(&4u32.to_be_bytes()); // l1 size
        head[40..48].copy_from_slice(&(192u64 << 10).to_be_bytes()); // l1 offset
        head[48..56].copy_from_slice(&(64u64 << 10).to_be_bytes()); // refcount table offset
        head[56..60].copy_from_slice(&1u32.to_be_bytes()); // refcount table clusters
        head[100..104].copy_from_slice(&104u32.to_be_bytes()); // header length
        let l1 = 192 << 10;
        head[l1..l1 + 8].copy_from_slice(&((1u64 << 63) | (1 << 20)).to_be_bytes());
        head[l1 + 8..l1 + 16].copy_from_slice(&((1u64 << 63) | (600 << 20)).to_be_bytes());
        (head, size)
    }

    #[test]
    fn a_qcow2s_tables_are_cut_out_once_the_l1_table_streamed_by() {
        let (head, size) = image();
        let mut cuts = Cuts::new(size);
        assert_eq!(cuts.next_after(0), size, "nothing known before the header");
        cuts.learn(0, &head[..128 << 10]);
        assert_eq!(cuts.next_after(0), 64 << 10, "the header's cluster");
        assert_eq!(cuts.next_after(64 << 10), 128 << 10, "the refcount table");
        assert_eq!(cuts.next_after(128 << 10), 192 << 10);
        assert_eq!(cuts.next_after(192 << 10), 256 << 10, "the L1 table");
        assert_eq!(cuts.next_after(256 << 10), size, "L2 tables not known yet");
        cuts.learn(128 << 10, &head[128 << 10..]);
        assert_eq!(cuts.next_after(256 << 10), 1 << 20);
        assert_eq!(cuts.next_after(1 << 20), (1 << 20) + (64 << 10));
        assert_eq!(cuts.next_after((1 << 20) + (64 << 10)), 600 << 20);
        assert_eq!(cuts.next_after(600 << 20), (600 << 20) + (64 << 10));
        assert_eq!(cuts.next_after((600 << 20) + (64 << 10)), size);
    }

    #[test]
    fn other_disks_and_damaged_headers_are_cut_as_data() {
        let mut cuts = Cuts::new(1 << 30);
        cuts.learn(0, &[0xab; 4096]);
        assert_eq!(cuts.next_after(0), 1 << 30);
        let (mut head, size) = image();
        head[40..48].copy_from_slice(&(u64::MAX - 5).to_be_bytes()); // L1 beyond the file
        let mut cuts = Cuts::new(size);
        cuts.learn(0, &head);
        assert_eq!(cuts.next_after(0), size);
    }
}
