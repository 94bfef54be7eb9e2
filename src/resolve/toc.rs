//! Fetching a layer's TOC (or seekable index) and checking it against the digest that pins
//! it: a zstd:chunked TOC by its annotation's range, an eStargz TOC through its footer, an index
//! by its blob digest. Ranges are read through the layer's [`Blob`]; cut or flipped bytes are
//! fetched again from the registry itself ([`crate::layer::fetch_checked`]); only the pinned
//! bytes pass.

use crate::blob::Blob;
use crate::cache::CacheRoot;
use crate::error::{Error, Result};
use crate::format::estargz;
use crate::format::seekable;
use crate::format::zstd_chunked::TocLocation;
use crate::layer::{fetch_checked, Held, LayerKind, LayerMeta};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::Descriptor;
use crate::registry::{Ask, Registry};
use crate::task::blocking;

/// How much of an eStargz blob's end one request fetches: the footer and, when it fits, the
/// TOC member before it (a disk's TOC is tens of KiB: one entry per chunk), so the TOC usually
/// costs one round trip; a larger member's head is fetched by a second request.
pub const ESTARGZ_TAIL: u64 = 64 << 10;

/// An eStargz layer's TOC offset (from its footer) and TOC JSON (checked against `digest`).
pub async fn fetch_estargz_toc(
    client: &dyn Registry,
    reference: &Reference,
    layer: Digest,
    size: u64,
    digest: Digest,
) -> Result<(u64, Vec<u8>)> {
    if size < estargz::FOOTER_SIZE {
        return Err(Error::corrupt(
            "the layer is too short for an eStargz footer",
        ));
    }
    // Footer and TOC member are fetched and checked again if what came does not hold up (cut,
    // flipped), from the registry itself: the TOC's digest is pinned, so only the published
    // TOC passes.
    let blob = Blob::layer(client, reference, layer);
    let what = format!("the eStargz TOC of layer {layer}");
    fetch_checked(&what, Ask::AnyEndpoint, |ask| {
        estargz_toc_once(&blob, size, digest, ask)
    })
    .await
    .map_err(|e| e.context(what))
}

/// One try of [`fetch_estargz_toc`], asking `ask`: the blob's tail (footer and, usually, the
/// TOC member), the member's head if it begins before the tail, the TOC checked.
async fn estargz_toc_once(
    blob: &Blob<'_>,
    size: u64,
    digest: Digest,
    ask: Ask,
) -> Result<(u64, Vec<u8>)> {
    let footer_at = size - estargz::FOOTER_SIZE;
    let tail_at = size.saturating_sub(ESTARGZ_TAIL);
    let tail = blob.fetch(tail_at..size, ask).await?;
    let footer = &tail[(footer_at - tail_at) as usize..];
    let offset = estargz::toc_offset(footer, size)?;
    if footer_at - offset > estargz::MAX_TOC_MEMBER {
        return Err(Error::corrupt(format!(
            "the eStargz footer puts a {}-byte TOC member before it, more than the {} accepted",
            footer_at - offset,
            estargz::MAX_TOC_MEMBER
        )));
    }
    let before_footer = &tail[..(footer_at - tail_at) as usize];
    let member = match offset.checked_sub(tail_at) {
        Some(start) => before_footer[start as usize..].to_vec(),
        // The member begins before the tail: its head is fetched, the rest is here.
        None => {
            let mut head = blob.fetch(offset..tail_at, ask).await?.to_vec();
            head.extend_from_slice(before_footer);
            head
        }
    };
    let json = blocking(move || estargz::toc_json(&member, &digest)).await?;
    Ok((offset, json))
}

/// The TOC (or seekable index) `meta` pins, verified against its digest, and the blob's bytes
/// fetched with it ([`fetch_toc_and_neighbours`]).
pub(super) async fn fetch_toc_of(
    client: &dyn Registry,
    meta: &LayerMeta,
) -> Result<(Vec<u8>, Held)> {
    match &meta.kind {
        LayerKind::Indexed(source) => {
            let desc = Descriptor {
                media_type: seekable::MEDIA_TYPE.into(),
                digest: meta.toc_digest,
                size: meta.toc_length,
                ..Descriptor::of(seekable::MEDIA_TYPE, b"")
            };
            let index = client
                .get_blob(&source.repository, &desc, seekable::MAX_INDEX_BYTES)
                .await?;
            Ok((index, Held::default()))
        }
        LayerKind::Estargz => {
            let (offset, json) = fetch_estargz_toc(
                client,
                &meta.reference,
                meta.layer_digest,
                meta.layer_size,
                meta.toc_digest,
            )
            .await?;
            if offset != meta.toc_offset {
                return Err(Error::corrupt(format!(
                    "the eStargz footer of layer {} now puts the TOC at {offset}, not {}",
                    meta.layer_digest, meta.toc_offset
                )));
            }
            Ok((json, Held::default()))
        }
        LayerKind::ZstdChunked => {
            fetch_toc_and_neighbours(
                client,
                &meta.reference,
                &meta.layer_digest,
                &meta.toc_location(),
            )
            .await
        }
    }
}

/// The TOC that `loc` places in blob `layer`, verified against its pinned checksum.
pub async fn fetch_toc(
    client: &dyn Registry,
    reference: &Reference,
    layer: &Digest,
    loc: &TocLocation,
) -> Result<Vec<u8>> {
    let blob = Blob::layer(client, reference, *layer);
    let (toc, _) = fetch_toc_from(&blob, loc, loc.offset).await?;
    Ok(toc)
}

/// How many bytes of a zstd:chunked blob's head, and of what precedes its TOC, come with the
/// TOC: a one-file layer's tar headers, its padding and the end of the archive take a few
/// hundred bytes of zstd frames.
pub const NEIGHBOURS: u64 = 4 << 10;

/// How many bytes of the blob's head come with the TOC (a request at the same time): the tar
/// headers the structure check reads and the disk's first chunks, which every boot reads (a
/// partition table, a qcow2's header and tables, a file system's superblock and group
/// descriptors) and which compress to a few KiB each; the engine keeps those whose frames
/// arrive whole ([`crate::engine::Engine::keep_held`]). 256 KiB takes about 10 ms of a
/// 200 Mbit/s link, beside the round trip the TOC costs anyway; `make demo`'s boot read every
/// chunk its first 256 KiB held.
pub const HEAD: u64 = 256 << 10;

/// How long the blob's head fetched with the TOC is waited for at most.
const NEIGHBOURS_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The TOC that `loc` places in blob `layer` (as [`fetch_toc`]) and, in the same round trip,
/// the [`NEIGHBOURS`] bytes before it (its request starts there) and the blob's first
/// [`HEAD`] bytes (a second request at the same time; left out if it fails or takes longer
/// than [`NEIGHBOURS_WAIT`]): what the structure check of a one-file layer reads and the
/// disk's first chunks, held for them.
pub(super) async fn fetch_toc_and_neighbours(
    client: &dyn Registry,
    reference: &Reference,
    layer: &Digest,
    loc: &TocLocation,
) -> Result<(Vec<u8>, Held)> {
    let from = loc.offset.saturating_sub(NEIGHBOURS);
    let head = 0..HEAD.min(from);
    let blob = Blob::layer(client, reference, *layer);
    let head_bytes = async {
        match head.is_empty() {
            true => None,
            false => blob.fetch(head.clone(), Ask::AnyEndpoint).await.ok(),
        }
    };
    // Only a guess: never waited for long (the check fetches what is missing under the
    // engine's deadlines).
    let (toc, head_bytes) = tokio::join!(
        fetch_toc_from(&blob, loc, from),
        tokio::time::timeout(NEIGHBOURS_WAIT, head_bytes)
    );
    let (toc, before) = toc?;
    let head_bytes = head_bytes.ok().flatten();
    let mut held = Held::default();
    held.add(from, before);
    if let Some(bytes) = head_bytes.filter(|b| b.len() as u64 == head.end) {
        held.add(0, bytes);
    }
    Ok((toc, held))
}

/// Most requests [`fetch_structure_ahead`] makes: a one-file layer's check reads two regions
/// (the tar headers before the file, what follows its last chunk); a layer of many files is
/// left to its server.
pub const AHEAD_RANGES: usize = 8;

/// How long [`fetch_structure_ahead`] waits for its bytes at most.
pub const AHEAD_WAIT: std::time::Duration = NEIGHBOURS_WAIT;

/// The bytes of layer `key`'s blob its structure check reads ([`Codec::structure_ranges`]),
/// the blob's first [`HEAD`] bytes among them, fetched by the snapshotter while the layer's
/// mount server starts, so that the check's round trip overlaps the server's start instead of
/// following it. The layer is opened from the
/// record and TOC `cache` keeps for `key` (classifying the layer kept them); nothing is fetched
/// when there are none, when the check already passed, or when the ranges are more than
/// [`AHEAD_RANGES`] or [`Held::MAX_BYTES`]. Each range is asked once, all at once; one that
/// fails is left out, all are if they do not come within [`AHEAD_WAIT`] (the server fetches
/// what is missing). The bytes are as unverified as any the registry sends: the server's check
/// reads them.
///
/// [`Codec::structure_ranges`]: crate::layer::Codec::structure_ranges
pub async fn fetch_structure_ahead(client: &dyn Registry, cache: &CacheRoot, key: Digest) -> Held {
    let c = cache.clone();
    let planned = blocking(move || {
        if c.structure_checked(&key) {
            return Ok(None);
        }
        let Some((meta, toc)) = c.load_layer_meta(&key) else {
            return Ok(None);
        };
        let (reference, digest) = (meta.reference.clone(), meta.layer_digest);
        let toc_offset = meta.toc_offset;
        let mut ranges = crate::layer::codec::structure_ranges(reference.clone(), meta, &toc)?;
        // The blob's head comes as the server's own TOC fetch brings it ([`HEAD`]).
        if let Some(head) = ranges.iter_mut().find(|r| r.start == 0) {
            head.end = head.end.max(HEAD.min(toc_offset));
        }
        let bytes: u64 = ranges.iter().map(|r| r.end - r.start).sum();
        let fits = ranges.len() <= AHEAD_RANGES && bytes <= Held::MAX_BYTES as u64;
        Ok((fits && !ranges.is_empty()).then_some((reference, digest, ranges)))
    })
    .await;
    let (reference, digest, ranges) = match planned {
        Ok(Some(planned)) => planned,
        Ok(None) => return Held::default(),
        Err(e) => {
            tracing::debug!(layer = %key, error = %e.chain(), "not fetching the structure check's bytes ahead");
            return Held::default();
        }
    };
    let blob = &Blob::layer(client, &reference, digest);
    let fetches = ranges.into_iter().map(|range| async move {
        let bytes = blob.fetch(range.clone(), Ask::AnyEndpoint).await.ok()?;
        Some((range.start, bytes))
    });
    let fetched = tokio::time::timeout(AHEAD_WAIT, futures_util::future::join_all(fetches))
        .await
        .unwrap_or_default();
    let mut held = Held::default();
    for (at, bytes) in fetched.into_iter().flatten() {
        held.add(at, bytes);
    }
    held
}

/// The TOC `loc` places in `blob`, fetched by one request from byte `from` (at most its
/// offset), verified against its pinned checksum; with the bytes before it.
async fn fetch_toc_from(
    blob: &Blob<'_>,
    loc: &TocLocation,
    from: u64,
) -> Result<(Vec<u8>, bytes::Bytes)> {
    let range = &(from..loc.range().end);
    let before = (loc.offset - from) as usize;
    // Bytes that fail the pinned checksum are fetched again from the registry itself.
    let what = format!("the zstd:chunked TOC of {}", blob.what());
    fetch_checked(&what, Ask::AnyEndpoint, |ask| async move {
        let bytes = blob.fetch(range.clone(), ask).await?;
        let toc = &bytes[before..];
        loc.checksum.verify(toc, "zstd:chunked TOC")?;
        Ok((toc.to_vec(), bytes.slice(..before)))
    })
    .await
    .map_err(|e| e.context(what))
}
