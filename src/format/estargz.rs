//! eStargz layers (stargz-snapshotter's lazily pullable gzip layers), read lazily from their
//! own TOC: a gzip stream of many members, where each chunk of a file's content is its own
//! member, the TOC (`stargz.index.json`, a tar entry) is the last member before a 51-byte
//! footer, and the layer annotation `containerd.io/snapshot/stargz/toc.digest` pins the TOC
//! JSON. The TOC's entries have the fields containers/storage's zstd:chunked TOC took from it,
//! so they are validated by the same validator ([`super::toc::TocValidator`]) once
//! each file's compressed end is known.

use std::io::Read;

use crate::error::{Error, Result};
use crate::format::toc::Toc;
use crate::format::tree::{Chunk, Node};
use crate::oci::digest::Digest;

/// The layer annotation pinning the TOC JSON's sha256.
pub const ANN_TOC_DIGEST: &str = "containerd.io/snapshot/stargz/toc.digest";
/// The footer of an eStargz layer: an empty gzip member whose extra field holds the TOC offset.
pub const FOOTER_SIZE: u64 = 51;
/// The TOC's name in its tar entry.
pub const TOC_NAME: &str = "stargz.index.json";
/// Most bytes of the TOC's gzip member, and of its JSON.
pub const MAX_TOC_MEMBER: u64 = 64 << 20;
const MAX_TOC_JSON: u64 = 128 << 20;

/// The TOC offset a layer's footer (its last [`FOOTER_SIZE`] bytes) gives, checked to lie
/// before the footer of a `blob_size`-byte blob.
pub fn toc_offset(footer: &[u8], blob_size: u64) -> Result<u64> {
    let bad = |why: &str| Err(Error::corrupt(format!("the eStargz footer {why}")));
    if footer.len() as u64 != FOOTER_SIZE || blob_size < FOOTER_SIZE {
        return bad("is missing");
    }
    // gzip header with FEXTRA, XLEN 26, one subfield "SG" of 22 bytes: "%016x" + "STARGZ".
    if footer[..4] != [0x1f, 0x8b, 8, 4] || footer[10..16] != [26, 0, b'S', b'G', 22, 0] {
        return bad("is not an eStargz footer (legacy stargz layers are not read)");
    }
    let payload = &footer[16..38];
    if &payload[16..] != b"STARGZ" {
        return bad("has no STARGZ mark");
    }
    let offset = std::str::from_utf8(&payload[..16])
        .ok()
        .and_then(|h| u64::from_str_radix(h, 16).ok());
    match offset {
        Some(o) if o < blob_size - FOOTER_SIZE => Ok(o),
        _ => bad("gives a TOC offset outside the layer"),
    }
}

/// The TOC JSON from its gzip member (the blob bytes from the TOC offset to the footer),
/// checked against the annotation's `digest`.
pub fn toc_json(member: &[u8], digest: &Digest) -> Result<Vec<u8>> {
    if member.len() as u64 > MAX_TOC_MEMBER {
        return Err(Error::corrupt(format!(
            "the eStargz TOC member is {} bytes, more than the {MAX_TOC_MEMBER} accepted",
            member.len()
        )));
    }
    let corrupt = |e: std::io::Error| Error::corrupt(format!("the eStargz TOC is not valid: {e}"));
    let tar = flate2::read::GzDecoder::new(member);
    let mut archive = tar::Archive::new(tar);
    let mut entries = archive.entries().map_err(corrupt)?;
    let mut entry = entries
        .next()
        .ok_or_else(|| Error::corrupt("the eStargz TOC member holds no tar entry"))?
        .map_err(corrupt)?;
    if entry.path_bytes().as_ref() != TOC_NAME.as_bytes() || entry.size() > MAX_TOC_JSON {
        return Err(Error::corrupt(format!(
            "the eStargz TOC member holds {:?} ({} bytes), not {TOC_NAME}",
            String::from_utf8_lossy(&entry.path_bytes()),
            entry.size()
        )));
    }
    let mut json = Vec::with_capacity(entry.size() as usize);
    entry.read_to_end(&mut json).map_err(corrupt)?;
    digest.verify(&json, "eStargz TOC")?;
    Ok(json)
}

/// The validated nodes of TOC `json` (verified), for a layer whose TOC member starts at
/// `toc_offset`: each chunk's compressed range ends where the next entry with content starts
/// (the last at the TOC), as eStargz readers take it.
pub fn nodes(json: &[u8], toc_offset: u64) -> Result<Vec<Node>> {
    // Small files sharing a member (`innerOffset`, eStargz v2) would be misread as whole
    // members: refused until read.
    if json.windows(13).any(|w| w == b"\"innerOffset\"") {
        return Err(Error::unsupported(
            "the eStargz TOC places files inside shared gzip members (innerOffset); convert the image with `vmdisk convert`",
        ));
    }
    let mut toc: Toc = serde_json::from_slice(json)
        .map_err(|e| Error::corrupt(format!("the eStargz TOC is not valid JSON: {e}")))?;
    if toc.version != 1 {
        return Err(Error::unsupported(format!(
            "eStargz TOC version {}",
            toc.version
        )));
    }
    // A regular file's last chunk ends where the next file with content begins (or the TOC).
    let mut next_start = toc_offset;
    for e in toc.entries.iter_mut().rev() {
        if e.kind == "chunk" {
            continue;
        }
        if e.kind == "reg" && e.size > 0 {
            e.end_offset = i64::try_from(next_start).unwrap_or(i64::MAX);
        }
        if e.offset > 0 {
            next_start = e.offset as u64;
        }
    }
    toc.nodes(toc_offset)
}

/// The tar padding after a file of `size` bytes.
pub fn padding(size: u64) -> u64 {
    size.next_multiple_of(512) - size
}

/// The content of `chunk` from its compressed range `members`: its gzip member, inflated to
/// exactly the chunk's size and matching its digest. A file's last chunk (`last` = the file's
/// tar padding, which eStargz writes into that member, checked to be zeros) may be followed by
/// the next entry's members (the TOC does not say where its member ends); any other chunk's
/// member must fill its range.
pub fn decode_chunk(members: &[u8], chunk: &Chunk, last: Option<u64>) -> Result<Vec<u8>> {
    let pad = last.unwrap_or(0);
    let mut rest = members;
    let mut data = Vec::with_capacity((chunk.size + pad) as usize);
    flate2::bufread::GzDecoder::new(&mut rest)
        .take(chunk.size + pad + 1)
        .read_to_end(&mut data)
        .map_err(|e| Error::corrupt(format!("the gzip member is not valid: {e}")))?;
    if last.is_none() && !rest.is_empty() {
        return Err(Error::corrupt(format!(
            "chunk at {}: {} bytes follow its gzip member inside its range",
            chunk.offset,
            rest.len()
        )));
    }
    if data.len() as u64 != chunk.size + pad || data[chunk.size as usize..].iter().any(|&b| b != 0)
    {
        return Err(Error::corrupt(format!(
            "chunk at {} decompressed to {} bytes, expected {} and {pad} bytes of tar padding",
            chunk.offset,
            data.len(),
            chunk.size
        )));
    }
    let digest = chunk
        .digest
        .ok_or_else(|| Error::corrupt(format!("chunk at {} has no digest", chunk.offset)))?;
    data.truncate(chunk.size as usize);
    digest.verify(&data, &format!("chunk at offset {}", chunk.offset))?;
    Ok(data)
}

/// Whole gzip members inflated as an ordinary gzip reader would, to at most `limit` bytes
/// (more is an error): a region of an eStargz layer between chunks.
pub fn inflate_members(members: &[u8], limit: u64) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(members)
        .take(limit + 1)
        .read_to_end(&mut out)
        .map_err(|e| Error::corrupt(format!("the gzip members are not valid: {e}")))?;
    if out.len() as u64 > limit {
        return Err(Error::corrupt(format!(
            "gzip members inflate to more than {limit} bytes"
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_reads_back_through_its_toc() {
        let disk: Vec<u8> = (0..700_000u32).map(|i| (i % 251) as u8).collect();
        let written = vmdisk_testing::estargz::layer(&[("disk/d.raw", disk.clone())], 256 << 10);
        let (blob, toc, diff_id): (_, Digest, Digest) = (
            written.blob,
            written.toc_digest.parse().unwrap(),
            written.diff_id.parse().unwrap(),
        );
        // An ordinary gzip reader sees the tar, TOC entry included.
        let mut stream = Vec::new();
        flate2::read::MultiGzDecoder::new(blob.as_slice())
            .read_to_end(&mut stream)
            .unwrap();
        assert_eq!(Digest::of(&stream), diff_id);
        let size = blob.len() as u64;
        let offset = toc_offset(&blob[blob.len() - 51..], size).unwrap();
        let json = toc_json(&blob[offset as usize..blob.len() - 51], &toc).unwrap();
        let nodes = nodes(&json, offset).unwrap();
        let chunks = &nodes[0].chunks;
        assert_eq!(chunks.len(), 3);
        let mut read = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            let range = c.compressed.start as usize..c.compressed.end as usize;
            let last = (i == 2).then(|| padding(disk.len() as u64));
            read.extend(decode_chunk(&blob[range], c, last).unwrap());
        }
        assert_eq!(read, disk);
        // The wrong digest, footer or member bytes are refused.
        assert!(toc_json(&blob[offset as usize..blob.len() - 51], &Digest::of(b"x")).is_err());
        let mut footer = blob[blob.len() - 51..].to_vec();
        footer[20] = b'z';
        assert!(toc_offset(&footer, size).is_err());
        let c = &chunks[1];
        let mut bad = blob[c.compressed.start as usize..c.compressed.end as usize].to_vec();
        let mid = bad.len() / 2;
        bad[mid] ^= 1;
        assert!(decode_chunk(&bad, c, None).is_err());
        let two = &blob[chunks[0].compressed.start as usize..chunks[1].compressed.end as usize];
        assert!(
            decode_chunk(two, &chunks[0], None).is_err(),
            "a member too many"
        );
        let last = &chunks[2];
        let members = &blob[last.compressed.start as usize..last.compressed.end as usize];
        assert!(
            decode_chunk(members, last, Some(0)).is_err(),
            "the padding is expected"
        );
    }
}
