//! The raw view of a qcow2 image, without I/O: which bytes of the image hold a guest range,
//! computed from the image's L1/L2 tables, and the decoding of compressed clusters. The view
//! that reads them (`crate::view::qcow2`) drives this over any disk view, so the image itself
//! can be read lazily and only the clusters a guest reads are fetched.
//!
//! Unallocated and zero clusters read as zeros and need no bytes; compressed clusters
//! (deflate, or zstd when the header says so) are decompressed one cluster at a time and
//! bounded by the cluster size. qcow2 v2 and v3; images with a backing file, encryption, an
//! external data file or extended L2 entries are refused (by [`Header::read`]). A table or
//! cluster that points outside the image is an error, never zeros.

use std::ops::Range;

use super::qcow2::{self, Cluster, Header};
use crate::error::{Error, Result};

/// The first bytes of an image that hold its header (a v3 header with its compression type
/// and padding).
pub const HEADER_BYTES: u64 = 112;

/// Where a piece of a guest range comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// Reads as zeros.
    Zero,
    /// Image bytes, as they are (adjacent data clusters merged).
    Data(Range<u64>),
    /// A compressed cluster at `offset`, in at most `max_len` bytes; the piece is `within`
    /// bytes into its decompressed content.
    Compressed {
        offset: u64,
        max_len: u64,
        within: u64,
    },
}

/// A piece of a guest range: its length and where its bytes come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestPiece {
    pub len: u64,
    pub source: Source,
}

/// The mapping of one qcow2 image of `image_size` bytes: its header and L1 table.
#[derive(Debug)]
pub struct Qcow2Map {
    header: Header,
    l1: Vec<u64>,
    image_size: u64,
}

impl Qcow2Map {
    /// The header from the image's first [`HEADER_BYTES`] (fewer if the image is shorter).
    pub fn header(head: &[u8]) -> Result<Header> {
        Header::read(head)
    }

    /// The mapping from a checked header and the image's L1 table (the bytes of
    /// [`Header::tables`]'s `l1`).
    pub fn new(header: Header, l1: &[u8], image_size: u64) -> Self {
        Qcow2Map {
            header,
            l1: qcow2::entries(l1).collect(),
            image_size,
        }
    }

    /// The guest's size in bytes.
    pub fn size(&self) -> u64 {
        self.header.virtual_size
    }

    pub fn cluster_size(&self) -> u64 {
        self.header.cluster_size()
    }

    /// The image bytes of the L2 table that maps guest cluster `index`; `None` when its L1
    /// entry is empty (the cluster reads as zeros).
    pub fn l2_table(&self, index: u64) -> Option<Range<u64>> {
        let l1_entry = self
            .l1
            .get((index / self.header.l2_entries()) as usize)
            .copied()
            .unwrap_or(0);
        match qcow2::l2_offset(l1_entry) {
            0 => None,
            offset => Some(offset..offset + self.cluster_size()),
        }
    }

    /// An L2 table's entries from its bytes.
    pub fn l2_entries(table: &[u8]) -> Vec<u64> {
        qcow2::entries(table).collect()
    }

    /// What guest cluster `index` is, given its L2 table (`None`: no table, zeros).
    pub fn cluster(&self, index: u64, l2: Option<&[u64]>) -> Cluster {
        let Some(table) = l2 else {
            return Cluster::Zero;
        };
        let entry = table[(index % self.header.l2_entries()) as usize];
        match self.header.cluster(entry) {
            Cluster::Compressed { offset, max_len } => Cluster::Compressed {
                offset,
                max_len: max_len.min(self.image_size.saturating_sub(offset)),
            },
            c => c,
        }
    }

    /// The guest clusters of bytes `range` (clipped to the guest's size).
    pub fn clusters(&self, range: Range<u64>) -> Range<u64> {
        let end = range.end.min(self.size());
        if range.start >= end {
            return 0..0;
        }
        let cs = self.cluster_size();
        range.start / cs..end.div_ceil(cs)
    }

    /// The pieces of guest bytes `range` (clipped to the guest's size), in order, given the L2
    /// table of each of its clusters (`l2(index)`; `None`: no table). Adjacent data clusters
    /// that are adjacent in the image become one piece.
    pub fn pieces<'t>(
        &self,
        range: Range<u64>,
        l2: impl Fn(u64) -> Option<&'t [u64]>,
    ) -> Vec<GuestPiece> {
        let cs = self.cluster_size();
        let end = range.end.min(self.size());
        let mut pieces: Vec<GuestPiece> = Vec::new();
        let mut pos = range.start;
        while pos < end {
            let index = pos / cs;
            let within = pos % cs;
            let len = (cs - within).min(end - pos);
            let source = match self.cluster(index, l2(index)) {
                Cluster::Zero => Source::Zero,
                Cluster::Data(host) => Source::Data(host + within..host + within + len),
                Cluster::Compressed { offset, max_len } => Source::Compressed {
                    offset,
                    max_len,
                    within,
                },
            };
            match (pieces.last_mut(), &source) {
                (
                    Some(GuestPiece {
                        len: l,
                        source: Source::Data(prev),
                    }),
                    Source::Data(next),
                ) if prev.end == next.start => {
                    prev.end = next.end;
                    *l += len;
                }
                (
                    Some(GuestPiece {
                        len: l,
                        source: Source::Zero,
                    }),
                    Source::Zero,
                ) => *l += len,
                _ => pieces.push(GuestPiece { len, source }),
            }
            pos += len;
        }
        pieces
    }

    /// The image bytes a piece needs (`None` for zeros).
    pub fn image_range(&self, source: &Source) -> Option<Range<u64>> {
        match *source {
            Source::Zero => None,
            Source::Data(ref r) => Some(r.clone()),
            Source::Compressed {
                offset, max_len, ..
            } => Some(offset..offset + max_len),
        }
    }

    /// Checks that image bytes `range` lie inside the image: a table or cluster that points
    /// past its end is an error, never zeros.
    pub fn check_inside(&self, range: &Range<u64>, what: &str) -> Result<()> {
        if range.end > self.image_size {
            return Err(Error::corrupt(format!(
                "qcow2 {what} at {} lies beyond the end of the image ({} bytes)",
                range.start, self.image_size
            )));
        }
        Ok(())
    }

    /// The content of the compressed cluster at `offset` from its bytes `input`: exactly one
    /// cluster.
    pub fn decompress(&self, offset: u64, input: &[u8]) -> Result<Vec<u8>> {
        let cs = self.cluster_size() as usize;
        let mut out = vec![0u8; cs];
        let produced = if self.header.compression == qcow2::Compression::Zstd {
            // The stream may be followed by unrelated bytes up to the sector end.
            zstd::stream::read::Decoder::with_buffer(input)
                .map(|d| d.single_frame())
                .and_then(|mut d| read_full(&mut d, &mut out))
        } else {
            let mut d = flate2::Decompress::new(false);
            d.decompress(input, &mut out, flate2::FlushDecompress::Finish)
                .map(|_| d.total_out() as usize)
                .map_err(std::io::Error::other)
        }
        .map_err(|e| {
            Error::corrupt(format!(
                "qcow2 compressed cluster at {offset} does not decompress"
            ))
            .with_source(e)
        })?;
        if produced != cs {
            return Err(Error::corrupt(format!(
                "qcow2 compressed cluster at {offset} holds {produced} bytes, not {cs}"
            )));
        }
        Ok(out)
    }
}

fn read_full(r: &mut impl std::io::Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A v3 header of a 1 MiB guest at 64 KiB clusters, L1 at 64 KiB.
    fn header() -> Header {
        let mut b = vec![0u8; 104];
        b[..4].copy_from_slice(&qcow2::MAGIC);
        b[4..8].copy_from_slice(&3u32.to_be_bytes());
        b[20..24].copy_from_slice(&16u32.to_be_bytes());
        b[24..32].copy_from_slice(&(1u64 << 20).to_be_bytes());
        b[36..40].copy_from_slice(&1u32.to_be_bytes());
        b[40..48].copy_from_slice(&(64u64 << 10).to_be_bytes());
        b[48..56].copy_from_slice(&(128u64 << 10).to_be_bytes());
        b[56..60].copy_from_slice(&1u32.to_be_bytes());
        b[100..104].copy_from_slice(&104u32.to_be_bytes());
        Qcow2Map::header(&b).unwrap()
    }

    #[test]
    fn adjacent_data_clusters_are_one_piece_and_holes_read_as_zeros() {
        let l1 = (192u64 << 10).to_be_bytes();
        let map = Qcow2Map::new(header(), &l1, 1 << 30);
        assert_eq!(map.l2_table(3), Some(192 << 10..256 << 10));
        let cs = 64u64 << 10;
        // Clusters 0 and 1 adjacent in the image, 2 unallocated, 3 elsewhere.
        let mut table = vec![0u64; 8192];
        table[0] = 0x8000_0000_0000_0000 | (1 << 20);
        table[1] = 0x8000_0000_0000_0000 | ((1 << 20) + cs);
        table[3] = 0x8000_0000_0000_0000 | (4 << 20);
        let pieces = map.pieces(100..4 * cs - 10, |_| Some(&table[..]));
        assert_eq!(
            pieces,
            [
                GuestPiece {
                    len: 2 * cs - 100,
                    source: Source::Data((1 << 20) + 100..(1 << 20) + 2 * cs)
                },
                GuestPiece {
                    len: cs,
                    source: Source::Zero
                },
                GuestPiece {
                    len: cs - 10,
                    source: Source::Data((4 << 20)..(4 << 20) + cs - 10)
                },
            ]
        );
        // No L2 table: zeros; past the guest's end: nothing.
        assert_eq!(
            map.pieces(0..cs, |_| None),
            [GuestPiece {
                len: cs,
                source: Source::Zero
            }]
        );
        assert!(map.pieces(2 << 20..3 << 20, |_| None).is_empty());
        assert!(map
            .check_inside(&((1 << 30) - 10..(1 << 30) + 1), "a data cluster")
            .is_err());
    }
}
