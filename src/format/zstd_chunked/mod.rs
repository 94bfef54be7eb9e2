//! The zstd:chunked layer layout (containers/storage), written by `vmdisk push` and read by
//! everything that fetches lazily.
//!
//! A layer is an ordinary `tar+zstd` stream made of many zstd frames: tar headers and padding
//! sit in "metadata" frames, every chunk of file content is a frame of its own, so a chunk can
//! be fetched with one HTTP Range request and decompressed alone. After the end-of-archive
//! blocks come three zstd *skippable* frames, which every zstd decoder ignores:
//!
//! ```text
//! [meta frame: tar header(s)] [chunk frame]... [meta frame: padding, next header]...
//! [meta frame: padding + 1024 zero bytes]
//! [skippable: zstd(TOC JSON)] [skippable: zstd(tar-split)] [skippable: 64-byte footer]
//! ```
//!
//! The TOC (`{"version":1,"entries":[...]}`) lists every tar entry; a regular file is a `reg`
//! entry followed by `chunk` entries, each with the compressed `offset` of its frame, its
//! uncompressed `chunkOffset`/`chunkSize` and the sha256 `chunkDigest` of its content. Layer
//! annotations locate the TOC and pin it by digest, so a reader trusts nothing it has not
//! checked: the TOC against the annotation, every chunk against its `chunkDigest`.
//! `docs/format.md` describes the bytes.

use super::toc::{parse_toc, Toc};
use super::tree::{Chunk, Node};
use super::zstd_frames::{
    check_regular_frames, decodes_to_zeros, decompress_bounded, SKIPPABLE_HEADER,
};
use crate::error::{Error, Result};

/// Verifies the compressed TOC against its pinned checksum, decompresses it within bounds and
/// parses it whole into its JSON model: for those who edit a TOC (the hostile-registry tests
/// craft layers from one); a mount reads TOCs with [`read_toc`].
pub fn decode_toc(compressed: &[u8], loc: &TocLocation) -> Result<Toc> {
    loc.checksum.verify(compressed, "zstd:chunked TOC")?;
    let limit = if loc.uncompressed_length > 0 {
        loc.uncompressed_length
    } else {
        MAX_TOC_UNCOMPRESSED
    };
    let json =
        decompress_bounded(compressed, limit).map_err(|e| e.context("decompressing the TOC"))?;
    if loc.uncompressed_length > 0 && json.len() as u64 != loc.uncompressed_length {
        return Err(Error::corrupt(format!(
            "TOC decompressed to {} bytes, the annotation says {}",
            json.len(),
            loc.uncompressed_length
        )));
    }
    let toc: Toc = serde_json::from_slice(&json)
        .map_err(|e| Error::corrupt(format!("TOC is not valid JSON: {e}")))?;
    if toc.version != 1 {
        return Err(Error::unsupported(format!(
            "TOC version {} is not supported (only 1)",
            toc.version
        )));
    }
    Ok(toc)
}

/// The content of `chunk` from its `frame` (the compressed range): the range must be whole
/// regular zstd frames (what an ordinary decoder reads as file content), decompress within the
/// chunk's size to exactly that size, and match the chunk's digest. Only the zstd:chunked
/// codec (`layer::codec`) turns registry bytes into chunk content with it.
pub fn decode_chunk(frame: &[u8], chunk: &Chunk) -> Result<Vec<u8>> {
    check_regular_frames(frame)?;
    let data = decompress_bounded(frame, chunk.size)?;
    if data.len() as u64 != chunk.size {
        return Err(Error::corrupt(format!(
            "chunk at {} decompressed to {} bytes, expected {}",
            chunk.offset,
            data.len(),
            chunk.size
        )));
    }
    match chunk.digest {
        Some(d) => d.verify(&data, &format!("chunk at offset {}", chunk.offset))?,
        None => {
            return Err(Error::corrupt(format!(
                "chunk at {} has no digest",
                chunk.offset
            )))
        }
    }
    Ok(data)
}

/// Verifies a chunk the TOC marks as zeros without holding its content (a run of zeros may be
/// the largest chunk a TOC allows): its range must be whole regular zstd frames that decode to
/// exactly `chunk.size` zeros, and its digest must be that of as many zeros — which is then
/// what its content hashes to, so it is verified as [`decode_chunk`] verifies a chunk.
pub fn check_zeros(frame: &[u8], chunk: &Chunk) -> Result<()> {
    check_regular_frames(frame)?;
    let Some(digest) = chunk.digest else {
        return Err(Error::corrupt(format!(
            "chunk at {} has no digest",
            chunk.offset
        )));
    };
    if digest != zeros_digest(chunk.size) {
        return Err(Error::corrupt(format!(
            "chunk at {} is marked zeros, but its digest is not that of {} zeros",
            chunk.offset, chunk.size
        )));
    }
    if !decodes_to_zeros(frame, chunk.size)? {
        return Err(Error::corrupt(format!(
            "chunk at {} is marked zeros, but its frames do not decode to {} zeros",
            chunk.offset, chunk.size
        )));
    }
    Ok(())
}

/// Verifies a compressed TOC against its pinned checksum, then decompresses, parses and
/// validates it in one pass: entries are checked and folded into nodes as they are decoded, so
/// memory holds the chunk table and never the JSON or its parsed entries (a 50 GiB disk's TOC
/// is about 40 MB of JSON). `data_end` is where the layer's data region ends (the TOC offset).
pub fn read_toc(compressed: &[u8], loc: &TocLocation) -> Result<Vec<Node>> {
    loc.checksum.verify(compressed, "zstd:chunked TOC")?;
    let data_end = loc.offset.saturating_sub(SKIPPABLE_HEADER);
    if loc.uncompressed_length > 0 && loc.uncompressed_length <= TOC_IN_MEMORY {
        // Small enough to hold: parsing a slice is a third faster than parsing a stream.
        let json = decompress_bounded(compressed, loc.uncompressed_length).map_err(|e| {
            e.context(format!(
                "decompressing the TOC (the annotation says {} bytes)",
                loc.uncompressed_length
            ))
        })?;
        if json.len() as u64 != loc.uncompressed_length {
            return Err(Error::corrupt(format!(
                "TOC decompressed to {} bytes, the annotation says {}",
                json.len(),
                loc.uncompressed_length
            )));
        }
        return parse_toc(serde_json::Deserializer::from_slice(&json), data_end);
    }
    let decoder = zstd::stream::read::Decoder::with_buffer(compressed)
        .map_err(|e| Error::io("starting the TOC decompressor", e))?;
    let json = std::io::BufReader::with_capacity(
        64 << 10,
        Bounded {
            inner: decoder,
            read: 0,
            expected: loc.uncompressed_length,
        },
    );
    parse_toc(serde_json::Deserializer::from_reader(json), data_end)
        .map_err(|e| e.context("reading the TOC"))
}

/// Decompressed TOC bytes, failing past [`MAX_TOC_UNCOMPRESSED`] or, when the annotation
/// gives the uncompressed length (`expected` > 0), as soon as the length differs from it.
struct Bounded<R> {
    inner: R,
    read: u64,
    expected: u64,
}

impl<R: std::io::Read> std::io::Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        let limit = if self.expected > 0 {
            self.expected
        } else {
            MAX_TOC_UNCOMPRESSED
        };
        if self.read > limit || (n == 0 && self.expected > 0 && self.read != self.expected) {
            return Err(std::io::Error::other(format!(
                "the TOC decompresses to {} bytes, {}",
                if n == 0 {
                    self.read.to_string()
                } else {
                    format!("more than {limit}")
                },
                if self.expected > 0 {
                    format!("the annotation says {}", self.expected)
                } else {
                    format!("the most accepted is {MAX_TOC_UNCOMPRESSED}")
                }
            )));
        }
        Ok(n)
    }
}

mod layout;
mod write;
pub use layout::*;
pub use write::{
    zeros_digest, ChunkBytes, EncodedChunk, EntryMeta, LayerSummary, LayerWriter, ZeroFrames,
};

#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
mod tests;
