//! Layer records for other modules' tests (the codecs', the engine's).

use super::{LayerKind, LayerMeta};
use crate::format::zstd_chunked::LayerSummary;

/// The record and compressed TOC of the zstd:chunked layer `summary` describes, written as
/// `blob` (as if resolved from `127.0.0.1:1/test/t:1`).
pub(crate) fn zstd_chunked_meta(summary: &LayerSummary, blob: &[u8]) -> (LayerMeta, Vec<u8>) {
    let loc = summary.toc_location;
    let meta = LayerMeta {
        reference: "127.0.0.1:1/test/t:1".parse().unwrap(),
        layer_digest: summary.digest,
        layer_size: blob.len() as u64,
        toc_offset: loc.offset,
        toc_length: loc.length,
        toc_uncompressed_length: loc.uncompressed_length,
        toc_digest: loc.checksum,
        disk_path: None,
        diff_id: summary.diff_id,
        kind: LayerKind::ZstdChunked,
    };
    let toc = blob[loc.range().start as usize..loc.range().end as usize].to_vec();
    (meta, toc)
}
