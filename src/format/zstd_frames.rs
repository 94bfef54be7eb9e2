//! zstd frames as the layer formats use them: bounded decompression, regular and skippable
//! frames told apart (zstd:chunked's chunks and the regions between them; the seekable
//! index's JSON and windows).

use crate::error::{Error, Result};

/// The magic number that starts a skippable frame (its low nibble may be anything).
pub const SKIPPABLE_MAGIC: [u8; 4] = [0x50, 0x2a, 0x4d, 0x18];
/// A skippable frame's header: magic and length.
pub const SKIPPABLE_HEADER: u64 = 8;
/// The magic number that starts a regular zstd frame (little-endian 0xFD2FB528).
pub const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

/// Decompresses all zstd frames of `data`, failing if the output would exceed `limit` bytes.
pub fn decompress_bounded(data: &[u8], limit: u64) -> Result<Vec<u8>> {
    // One call into the bulk decoder (every frame, into a buffer of exactly `limit` bytes:
    // pages are only touched as they are written) instead of a stream that regrows its output.
    let capacity = usize::try_from(limit)
        .map_err(|_| Error::corrupt(format!("{limit} bytes cannot be held in memory")))?;
    zstd::bulk::decompress(data, capacity).map_err(|e| {
        Error::corrupt(format!(
            "zstd data is corrupt or decompresses to more than the expected {limit} bytes ({e})"
        ))
    })
}

/// The length of the zstd frame (regular or skippable) at the start of `data`, if a whole one
/// is there.
pub fn frame_len(data: &[u8]) -> Option<usize> {
    zstd::zstd_safe::find_frame_compressed_size(data)
        .ok()
        .filter(|&n| n > 0 && n <= data.len())
}

/// Whether `data` starts with a skippable frame's magic.
pub fn is_skippable(data: &[u8]) -> bool {
    data.len() >= 4 && data[1..4] == SKIPPABLE_MAGIC[1..] && data[0] & 0xf0 == 0x50
}

/// Checks that `data` is one or more whole regular zstd frames and nothing else. A chunk must
/// be: a skippable frame (which every ordinary decoder ignores) or trailing bytes would let the
/// lazy view serve bytes an extracted layer does not contain.
pub fn check_regular_frames(data: &[u8]) -> Result<()> {
    if data.is_empty() {
        return Err(Error::corrupt("empty chunk frame"));
    }
    let mut at = 0;
    while at < data.len() {
        let rest = &data[at..];
        if rest.len() < 4 || rest[..4] != ZSTD_MAGIC {
            return Err(Error::corrupt(format!(
                "byte {at} of the chunk's range does not start a regular zstd frame{}: an ordinary decoder would not read it as file content",
                if is_skippable(rest) { " (it is a skippable frame)" } else { "" }
            )));
        }
        at += frame_len(rest).ok_or_else(|| {
            Error::corrupt(format!(
                "the zstd frame at byte {at} of the chunk's range is incomplete or corrupt"
            ))
        })?;
    }
    Ok(())
}

/// Decodes a region of the layer that lies between chunks exactly as an ordinary decoder
/// would: regular frames are decompressed, skippable frames skipped; the region must be whole
/// frames. Fails if the output would exceed `limit` bytes.
pub fn decode_region(data: &[u8], limit: u64) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let rest = &data[at..];
        let len = frame_len(rest).ok_or_else(|| {
            Error::corrupt(format!(
                "the layer holds no whole zstd frame at byte {at} of a region between chunks"
            ))
        })?;
        if !is_skippable(rest) {
            let left = limit.saturating_sub(out.len() as u64);
            out.extend(decompress_bounded(&rest[..len], left)?);
        }
        at += len;
    }
    Ok(out)
}

/// Whether `buf` holds only zeros (16 bytes at a time).
pub fn all_zero(buf: &[u8]) -> bool {
    let mut words = buf.chunks_exact(16);
    words.all(|w| u128::from_ne_bytes(w.try_into().expect("16 bytes")) == 0)
        && words.remainder().iter().all(|&b| b == 0)
}

/// Whether `data` (regular zstd frames) decompresses to exactly `len` zeros, read a piece at a
/// time: memory stays at one buffer however long the run, and decoding stops at the first byte
/// that is not zero or past `len`.
pub fn decodes_to_zeros(data: &[u8], len: u64) -> Result<bool> {
    use std::io::Read;
    let mut decoder = zstd::stream::read::Decoder::with_buffer(data)
        .map_err(|e| Error::corrupt(format!("zstd frame: {e}")))?;
    let mut buf = vec![0u8; 256 << 10];
    let mut total = 0u64;
    loop {
        let n = match decoder.read(&mut buf) {
            Ok(0) => return Ok(total == len),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::corrupt(format!("zstd frame: {e}"))),
        };
        total += n as u64;
        if total > len || !all_zero(&buf[..n]) {
            return Ok(false);
        }
    }
}
