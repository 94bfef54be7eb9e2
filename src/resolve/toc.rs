//! Fetching a layer's TOC (or seekable index) and checking it against the digest that pins
//! it: a zstd:chunked TOC by its annotation's range, an eStargz TOC through its footer, an index
//! by its blob digest. Cut or flipped bytes are fetched again under the client's retry policy;
//! only the pinned bytes pass.

use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::format::estargz;
use crate::format::seekable;
use crate::format::zstd_chunked::TocLocation;
use crate::layer::{LayerKind, LayerMeta};
use crate::oci::Descriptor;
use crate::reference::Reference;
use crate::registry::Registry;
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
    let footer_at = size - estargz::FOOTER_SIZE;
    let tail_at = size.saturating_sub(ESTARGZ_TAIL);
    // Footer and TOC member are fetched and checked again if what came does not hold up (cut,
    // flipped): the TOC's digest is pinned, so only the published TOC passes.
    client
        .retry_policy()
        .run(&format!("the eStargz TOC of layer {layer}"), || async {
            let tail = client
                .get_blob_range(reference, &layer, tail_at..size)
                .await?;
            if tail.len() as u64 != size - tail_at {
                return Err(Error::corrupt(format!(
                    "the registry sent {} bytes of the layer's last {}",
                    tail.len(),
                    size - tail_at
                )));
            }
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
                    let mut head = client
                        .get_blob_range(reference, &layer, offset..tail_at)
                        .await?
                        .to_vec();
                    head.extend_from_slice(before_footer);
                    head
                }
            };
            let json = blocking(move || estargz::toc_json(&member, &digest)).await?;
            Ok((offset, json))
        })
        .await
}

/// The TOC (or seekable index) `meta` pins, verified against its digest.
pub(super) async fn fetch_toc_of(client: &dyn Registry, meta: &LayerMeta) -> Result<Vec<u8>> {
    match &meta.kind {
        LayerKind::Indexed(source) => {
            let repo: Reference = source.repository.parse()?;
            let desc = Descriptor {
                media_type: seekable::MEDIA_TYPE.into(),
                digest: meta.toc_digest,
                size: meta.toc_length,
                ..Descriptor::of(seekable::MEDIA_TYPE, b"")
            };
            client
                .get_blob(&repo, &desc, seekable::MAX_INDEX_BYTES)
                .await
        }
        LayerKind::Estargz => {
            let reference: Reference = meta.reference.parse()?;
            let (offset, json) = fetch_estargz_toc(
                client,
                &reference,
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
            Ok(json)
        }
        LayerKind::ZstdChunked => {
            let reference: Reference = meta.reference.parse()?;
            fetch_toc(client, &reference, &meta.layer_digest, &meta.toc_location()).await
        }
    }
}

/// The TOC that `loc` places in blob `layer`, verified against its pinned checksum.
pub(super) async fn fetch_toc(
    client: &dyn Registry,
    reference: &Reference,
    layer: &Digest,
    loc: &TocLocation,
) -> Result<Vec<u8>> {
    client
        .retry_policy()
        .run(
            &format!("the zstd:chunked TOC of layer {layer}"),
            || async {
                let toc = client
                    .get_blob_range(reference, layer, loc.range())
                    .await?
                    .to_vec();
                loc.checksum.verify(&toc, "zstd:chunked TOC")?;
                Ok(toc)
            },
        )
        .await
}
