//! What the zstd:chunked layout names and bounds — its annotations, magic numbers and where
//! its TOC is ([`TocLocation`]) — which its reader (`mod.rs`) and its writer (`write.rs`) share.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::error::{Error, Result};
use crate::oci::digest::Digest;

/// TOC checksum annotation (current containers/storage).
pub const ANN_TOC_CHECKSUM: &str = "io.github.containers.zstd-chunked.manifest-checksum";
/// TOC position annotation, `offset:length:uncompressedLength:type`.
pub const ANN_TOC_POSITION: &str = "io.github.containers.zstd-chunked.manifest-position";
/// tar-split position annotation, `offset:length:uncompressedLength`.
pub const ANN_TARSPLIT_POSITION: &str = "io.github.containers.zstd-chunked.tarsplit-position";
/// TOC checksum annotation written by older containers/storage (Debian 12's skopeo 1.9).
pub const ANN_TOC_CHECKSUM_OLD: &str = "io.containers.zstd-chunked.manifest-checksum";
/// TOC position annotation written by older containers/storage.
pub const ANN_TOC_POSITION_OLD: &str = "io.containers.zstd-chunked.manifest-position";

/// The only TOC type defined ("CRFS").
pub(super) const MANIFEST_TYPE_CRFS: u64 = 1;
/// Footer magic, "GNUlInUx".
pub(super) const FOOTER_MAGIC: &[u8; 8] = b"GNUlInUx";

/// Largest compressed TOC we fetch.
pub const MAX_TOC_COMPRESSED: u64 = 64 << 20;
/// Largest TOC we decompress (a 50 GiB disk at 256 KiB chunks is about 50 MB).
pub const MAX_TOC_UNCOMPRESSED: u64 = 128 << 20;
/// Largest TOC (uncompressed) parsed from memory; larger ones are parsed as they are
/// decompressed, so a TOC never takes more than this much memory (an 8 GiB disk's is 6 MB).
pub const TOC_IN_MEMORY: u64 = 8 << 20;

/// Where the TOC is in the blob and what it must hash to, from the layer annotations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TocLocation {
    pub offset: u64,
    pub length: u64,
    pub uncompressed_length: u64,
    pub checksum: Digest,
}

impl TocLocation {
    /// Checks that the TOC lies inside a blob of `blob_size` bytes, after at least the 8 bytes
    /// of the skippable frame header that precedes it.
    pub fn check_within(&self, blob_size: u64) -> Result<()> {
        if self.range().end > blob_size || self.offset < 8 {
            return Err(Error::corrupt(format!(
                "TOC range {:?} lies outside the {blob_size}-byte layer",
                self.range()
            )));
        }
        Ok(())
    }

    /// Reads the current or the older annotation generation; `Ok(None)` if neither is present.
    pub fn from_annotations(ann: &BTreeMap<String, String>) -> Result<Option<Self>> {
        let pair = [
            (ANN_TOC_POSITION, ANN_TOC_CHECKSUM),
            (ANN_TOC_POSITION_OLD, ANN_TOC_CHECKSUM_OLD),
        ]
        .into_iter()
        .find_map(|(p, c)| ann.get(p).map(|pos| (p, pos, ann.get(c))));
        let Some((key, position, checksum)) = pair else {
            return Ok(None);
        };
        let bad = |why: &str| Error::corrupt(format!("layer annotation {key}={position:?}: {why}"));
        let fields: Vec<u64> = position
            .split(':')
            .map(|f| f.parse::<u64>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| {
                bad("expected offset:length:uncompressedLength:type as decimal numbers")
            })?;
        let [offset, length, uncompressed_length, kind] = fields[..] else {
            return Err(bad("expected four fields"));
        };
        if kind != MANIFEST_TYPE_CRFS {
            return Err(Error::unsupported(format!(
                "zstd:chunked TOC type {kind} is not supported (only 1)"
            )));
        }
        if length == 0 || length > MAX_TOC_COMPRESSED || uncompressed_length > MAX_TOC_UNCOMPRESSED
        {
            return Err(bad(&format!(
                "TOC size {length} (uncompressed {uncompressed_length}) outside the accepted bounds ({MAX_TOC_COMPRESSED}, {MAX_TOC_UNCOMPRESSED})"
            )));
        }
        offset
            .checked_add(length)
            .ok_or_else(|| bad("offset overflows"))?;
        let checksum = checksum
            .ok_or_else(|| {
                bad("the TOC checksum annotation is missing; the TOC cannot be verified")
            })?
            .parse::<Digest>()
            .map_err(|e| bad(&e.to_string()))?;
        Ok(Some(TocLocation {
            offset,
            length,
            uncompressed_length,
            checksum,
        }))
    }

    /// The byte range of the compressed TOC in the blob.
    pub fn range(&self) -> Range<u64> {
        self.offset..self.offset + self.length
    }
}
