//! The qcow2 header and cluster tables: enough to validate an image before publishing it
//! (version, features, no backing file, no encryption, every referenced cluster inside the
//! file) and to report its virtual size. The reader works on any [`ReadAt`] source.

use crate::error::{Error, Result};

/// qcow2 magic, `QFI\xfb`.
pub const MAGIC: [u8; 4] = *b"QFI\xfb";

/// Whether an image starting with `head` is qcow2 (the one place its magic is checked).
pub fn is_qcow2(head: &[u8]) -> bool {
    head.starts_with(&MAGIC)
}

/// Positioned reads from a disk image.
pub trait ReadAt {
    /// Fills `buf` from `offset`; fails if the source is shorter.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
    /// Total length in bytes.
    fn size(&self) -> u64;
}

impl<T: ReadAt + ?Sized> ReadAt for &T {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        (**self).read_exact_at(buf, offset)
    }

    fn size(&self) -> u64 {
        (**self).size()
    }
}

impl ReadAt for std::fs::File {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(self, buf, offset)
    }

    fn size(&self) -> u64 {
        self.metadata().map(|m| m.len()).unwrap_or(0)
    }
}

impl ReadAt for [u8] {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| std::io::ErrorKind::UnexpectedEof)?;
        let src = self
            .get(start..start.saturating_add(buf.len()))
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }

    fn size(&self) -> u64 {
        self.len() as u64
    }
}

/// The fields of a qcow2 header we use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub cluster_bits: u32,
    pub virtual_size: u64,
    pub l1_size: u32,
    pub l1_table_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
    pub backing_file_offset: u64,
    pub crypt_method: u32,
    pub incompatible_features: u64,
    /// How compressed clusters are compressed (v3 header extension byte 104).
    pub compression: Compression,
}

/// The compression of compressed clusters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    Deflate,
    Zstd,
}

/// The host offset bits of an L1 or a standard L2 entry.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// L2 entry: the cluster is compressed (then the other bits are offset and sector count).
const COMPRESSED_FLAG: u64 = 1 << 62;
/// Standard L2 entry, v3: the cluster reads as zeros.
const ZERO_FLAG: u64 = 1;
/// Incompatible feature bits we can read: compression type (bit 3).
const KNOWN_INCOMPATIBLE: u64 = 1 << 3;

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Header {
    /// Parses and checks the header at the start of `src`.
    pub fn read(src: &(impl ReadAt + ?Sized)) -> Result<Self> {
        let mut b = [0u8; 104];
        let short = src.size() < 72;
        if short || src.read_exact_at(&mut b[..72], 0).is_err() {
            return Err(Error::corrupt("qcow2 header is truncated"));
        }
        if !is_qcow2(&b) {
            return Err(Error::corrupt("not a qcow2 image (no QFI\\xfb magic)"));
        }
        let version = be32(&b, 4);
        let mut h = Header {
            version,
            backing_file_offset: be64(&b, 8),
            cluster_bits: be32(&b, 20),
            virtual_size: be64(&b, 24),
            crypt_method: be32(&b, 32),
            l1_size: be32(&b, 36),
            l1_table_offset: be64(&b, 40),
            refcount_table_offset: be64(&b, 48),
            refcount_table_clusters: be32(&b, 56),
            incompatible_features: 0,
            compression: Compression::Deflate,
        };
        match version {
            2 => {}
            3 => {
                src.read_exact_at(&mut b[72..104], 72)
                    .map_err(|_| Error::corrupt("qcow2 v3 header is truncated"))?;
                h.incompatible_features = be64(&b, 72);
            }
            v => {
                return Err(Error::unsupported(format!(
                    "qcow2 version {v} (only 2 and 3)"
                )))
            }
        }
        if !(9..=21).contains(&h.cluster_bits) {
            return Err(Error::corrupt(format!(
                "qcow2 cluster_bits {} outside 9..=21",
                h.cluster_bits
            )));
        }
        if h.backing_file_offset != 0 {
            return Err(Error::unsupported(
                "qcow2 image has a backing file; flatten it first with `qemu-img convert -O qcow2 IN OUT`",
            ));
        }
        if h.crypt_method != 0 {
            return Err(Error::unsupported(
                "qcow2 image is encrypted; decrypt it with qemu-img convert first",
            ));
        }
        if h.incompatible_features & 1 != 0 {
            return Err(Error::corrupt("qcow2 image is marked dirty (not closed cleanly); run `qemu-img check -r all` on it"));
        }
        if h.incompatible_features & 2 != 0 {
            return Err(Error::corrupt(
                "qcow2 image is marked corrupt; repair it with `qemu-img check -r all`",
            ));
        }
        if h.incompatible_features & 4 != 0 {
            return Err(Error::unsupported(
                "qcow2 image keeps its data in an external file; convert it first",
            ));
        }
        let unknown = h.incompatible_features & !(KNOWN_INCOMPATIBLE | 7);
        if unknown != 0 {
            return Err(Error::unsupported(format!(
                "qcow2 incompatible features {unknown:#x} are not supported"
            )));
        }
        if h.incompatible_features & KNOWN_INCOMPATIBLE != 0 {
            // v3 headers longer than 104 bytes carry the compression type at byte 104.
            let mut t = [0u8; 1];
            src.read_exact_at(&mut t, 104).map_err(|_| {
                Error::corrupt("qcow2 header is truncated before its compression type")
            })?;
            h.compression = match t[0] {
                0 => Compression::Deflate,
                1 => Compression::Zstd,
                t => {
                    return Err(Error::unsupported(format!(
                        "qcow2 compression type {t} (only deflate and zstd)"
                    )))
                }
            };
        }
        Ok(h)
    }

    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Where the L1 and refcount tables are, checked against the virtual size, against qemu's
    /// own limits (32 MiB of L1 table, 8 MiB of refcount table) and against a file of
    /// `file_len` bytes. The one place that bounds what a header makes a reader allocate.
    pub fn tables(&self, file_len: u64) -> Result<Tables> {
        let cs = self.cluster_size();
        let needed_l1 = self.virtual_size.div_ceil(cs * (cs / 8));
        let l1_bytes = u64::from(self.l1_size) * 8;
        if u64::from(self.l1_size) < needed_l1 || l1_bytes > MAX_L1_BYTES {
            return Err(Error::corrupt(format!(
                "qcow2 L1 table size {} does not fit the virtual size {} (at most {MAX_L1_BYTES} bytes of L1 table)",
                self.l1_size, self.virtual_size
            )));
        }
        let refcount_bytes = u64::from(self.refcount_table_clusters) * cs;
        if refcount_bytes > MAX_REFCOUNT_TABLE_BYTES {
            return Err(Error::corrupt(format!(
                "qcow2 refcount table of {} clusters is larger than the {MAX_REFCOUNT_TABLE_BYTES} bytes qemu accepts",
                self.refcount_table_clusters
            )));
        }
        let truncated = |what: String| {
            Error::corrupt(format!("qcow2 image is truncated or damaged: {what} lies beyond the end of the file ({file_len} bytes)"))
        };
        let l1 = self.l1_table_offset..self.l1_table_offset.saturating_add(l1_bytes);
        if l1.end > file_len {
            return Err(truncated(format!("the L1 table at {}", l1.start)));
        }
        let refcount =
            self.refcount_table_offset..self.refcount_table_offset.saturating_add(refcount_bytes);
        if refcount.end > file_len {
            return Err(truncated(format!(
                "the refcount table at {}",
                refcount.start
            )));
        }
        Ok(Tables { l1, refcount })
    }
}

/// qemu's bound on the L1 table (`QCOW_MAX_L1_SIZE`).
pub const MAX_L1_BYTES: u64 = 32 << 20;
/// qemu's bound on the refcount table (`QCOW_MAX_REFTABLE_SIZE`).
pub const MAX_REFCOUNT_TABLE_BYTES: u64 = 8 << 20;

/// Byte ranges of an image's tables, inside the file and within qemu's bounds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tables {
    pub l1: std::ops::Range<u64>,
    pub refcount: std::ops::Range<u64>,
}

/// The big-endian 64-bit entries of a table.
pub fn entries(table: &[u8]) -> impl Iterator<Item = u64> + '_ {
    table
        .chunks_exact(8)
        .map(|e| u64::from_be_bytes(e.try_into().expect("8 bytes")))
}

/// The L2 table an L1 entry points at (0: none).
pub fn l2_offset(l1_entry: u64) -> u64 {
    l1_entry & OFFSET_MASK
}

/// The offsets of the L2 tables an L1 table (big-endian entries) points at.
pub fn l2_offsets(l1: &[u8]) -> impl Iterator<Item = u64> + '_ {
    entries(l1).map(l2_offset).filter(|&o| o != 0)
}

/// What an L2 entry says about one guest cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cluster {
    /// Reads as zeros: unallocated, or (v3) marked zero.
    Zero,
    /// Stored as is at this host offset.
    Data(u64),
    /// Compressed at `offset`, in at most `max_len` bytes (its sectors, less the offset into
    /// the first one).
    Compressed { offset: u64, max_len: u64 },
}

impl Header {
    /// L2 entries per table (one cluster of 8-byte entries).
    pub fn l2_entries(&self) -> u64 {
        1 << (self.cluster_bits - 3)
    }

    /// Decodes an L2 entry (the one place that knows its bits).
    pub fn cluster(&self, entry: u64) -> Cluster {
        if entry & COMPRESSED_FLAG != 0 {
            let bits = 62 - (self.cluster_bits - 8);
            let offset = entry & ((1u64 << bits) - 1);
            let sectors = ((entry >> bits) & ((1u64 << (self.cluster_bits - 8)) - 1)) + 1;
            return Cluster::Compressed {
                offset,
                max_len: sectors * 512 - (offset & 511),
            };
        }
        if entry & ZERO_FLAG != 0 && self.version >= 3 {
            return Cluster::Zero;
        }
        match entry & OFFSET_MASK {
            0 => Cluster::Zero,
            o => Cluster::Data(o),
        }
    }
}

/// Checks that the image's tables and every cluster they reference lie inside `src`; a
/// truncated or damaged image fails with a message that says where. Reads only metadata.
pub fn check_complete(src: &(impl ReadAt + ?Sized)) -> Result<Header> {
    let h = Header::read(src)?;
    let len = src.size();
    let cs = h.cluster_size();
    let truncated = |what: String| {
        Error::corrupt(format!("qcow2 image is truncated or damaged: {what} lies beyond the end of the file ({len} bytes)"))
    };
    let tables = h.tables(len)?;
    let mut l1 = vec![0u8; (tables.l1.end - tables.l1.start) as usize];
    src.read_exact_at(&mut l1, tables.l1.start)
        .map_err(|e| Error::io("reading the qcow2 L1 table", e))?;
    let mut l2 = vec![0u8; cs as usize];
    for l2_offset in l2_offsets(&l1) {
        if l2_offset.saturating_add(cs) > len {
            return Err(truncated(format!("an L2 table at {l2_offset}")));
        }
        src.read_exact_at(&mut l2, l2_offset)
            .map_err(|e| Error::io("reading a qcow2 L2 table", e))?;
        for entry in entries(&l2) {
            match h.cluster(entry) {
                Cluster::Compressed { offset, .. } if offset >= len => {
                    return Err(truncated(format!("a compressed cluster at {offset}")));
                }
                Cluster::Data(offset) if offset.saturating_add(cs) > len => {
                    return Err(truncated(format!("a data cluster at {offset}")));
                }
                _ => {}
            }
        }
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal valid v3 image: header, L1 at cluster 1, refcount table at 2, one L2 at 3
    /// mapping guest cluster 0 to host cluster 4. 512-byte clusters.
    fn image() -> Vec<u8> {
        let cs = 512usize;
        let mut img = vec![0u8; cs * 5];
        img[..4].copy_from_slice(&MAGIC);
        img[4..8].copy_from_slice(&3u32.to_be_bytes());
        img[20..24].copy_from_slice(&9u32.to_be_bytes());
        img[24..32].copy_from_slice(&(64u64 * 512).to_be_bytes());
        img[36..40].copy_from_slice(&1u32.to_be_bytes());
        img[40..48].copy_from_slice(&(cs as u64).to_be_bytes());
        img[48..56].copy_from_slice(&(2 * cs as u64).to_be_bytes());
        img[56..60].copy_from_slice(&1u32.to_be_bytes());
        img[100..104].copy_from_slice(&104u32.to_be_bytes());
        img[cs..cs + 8].copy_from_slice(&((3 * cs as u64) | (1 << 63)).to_be_bytes());
        img[3 * cs..3 * cs + 8].copy_from_slice(&((4 * cs as u64) | (1 << 63)).to_be_bytes());
        img
    }

    #[test]
    fn accepts_complete_image() {
        let h = check_complete(&image()[..]).unwrap();
        assert_eq!(
            (h.version, h.cluster_size(), h.virtual_size),
            (3, 512, 32768)
        );
    }

    #[test]
    fn rejects_truncation_backing_and_flags() {
        let img = image();
        let err = check_complete(&img[..img.len() - 100]).unwrap_err();
        assert!(err.to_string().contains("data cluster at 2048"), "{err}");
        assert!(check_complete(&img[..50]).is_err());
        let mut backing = img.clone();
        backing[8..16].copy_from_slice(&1000u64.to_be_bytes());
        assert!(Header::read(&backing[..])
            .unwrap_err()
            .to_string()
            .contains("backing file"));
        let mut dirty = img.clone();
        dirty[72..80].copy_from_slice(&1u64.to_be_bytes());
        assert!(Header::read(&dirty[..])
            .unwrap_err()
            .to_string()
            .contains("dirty"));
        let mut v9 = img;
        v9[4..8].copy_from_slice(&9u32.to_be_bytes());
        assert!(Header::read(&v9[..]).is_err());
    }

    #[test]
    fn table_claims_are_bounded_before_anything_is_allocated() {
        let img = image();
        let len = img.len() as u64;
        let mut huge_l1 = img.clone();
        huge_l1[36..40].copy_from_slice(&(1u32 << 31).to_be_bytes());
        let err = Header::read(&huge_l1[..])
            .unwrap()
            .tables(64 << 30)
            .unwrap_err();
        assert!(err.to_string().contains("L1 table size"), "{err}");
        assert!(check_complete(&huge_l1[..]).is_err());
        let mut huge_refcount = img.clone();
        huge_refcount[56..60].copy_from_slice(&u32::MAX.to_be_bytes());
        let err = Header::read(&huge_refcount[..])
            .unwrap()
            .tables(u64::MAX)
            .unwrap_err();
        assert!(err.to_string().contains("refcount table"), "{err}");
        let mut beyond = img.clone();
        beyond[40..48].copy_from_slice(&(len - 4).to_be_bytes());
        let err = Header::read(&beyond[..]).unwrap().tables(len).unwrap_err();
        assert!(err.to_string().contains("beyond the end"), "{err}");
        let tables = Header::read(&img[..]).unwrap().tables(len).unwrap();
        assert_eq!(tables.l1, 512..520);
        assert_eq!(tables.refcount, 1024..1536);
    }
}
