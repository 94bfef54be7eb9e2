//! The codec of zstd:chunked layers: each chunk is its own regular zstd frames, decoded within
//! its size and checked against its digest; the regions between chunks (tar headers, padding,
//! the end of the archive) are zstd frames too, and the stream the checks rebuild ends where
//! the TOC's skippable frame begins.

use std::ops::Range;

use futures_util::future::BoxFuture;

use super::{blob_pieces, decode_each, Regions};
use crate::error::Result;
use crate::format::zstd_chunked::{decode_chunk, read_toc};
use crate::format::zstd_frames::decode_region;
use crate::layer::{Ask, Codec, Extent, Fetch, Piece, Store, MAX_REGION_DECODED};
use crate::layer::{Layer, LayerMeta, Table};

/// The zstd:chunked codec.
#[derive(Debug)]
pub struct ZstdChunked;

/// The table of a zstd:chunked layer from its compressed TOC (verified against the digest the
/// record pins, validated while parsed).
pub(crate) fn table(meta: &LayerMeta, toc: &[u8]) -> Result<Table> {
    Table::of_nodes(read_toc(toc, &meta.toc_location())?)
}

/// Where the regions between a zstd:chunked layer's chunks lie: up to the TOC's skippable
/// frame header, or the whole blob.
fn regions(layer: &Layer, extent: Extent) -> Regions {
    Regions {
        until: match extent {
            Extent::Structure => layer.meta.toc_offset.saturating_sub(8),
            Extent::Whole => layer.meta.layer_size,
        },
        after: |layer, idx| (layer.chunks[idx].compressed.end, 0),
    }
}

impl Codec for ZstdChunked {
    fn decode_run(
        &self,
        layer: &Layer,
        run: &[usize],
        bytes: &[u8],
        _window: Option<&[u8]>,
        store: &mut Store<'_>,
    ) -> Result<()> {
        decode_each(layer, run, bytes, store, |idx, frame| {
            decode_chunk(frame, &layer.chunks[idx])
        })
    }

    fn pieces<'a>(
        &'a self,
        layer: &'a Layer,
        extent: Extent,
        fetch: &'a dyn Fetch,
        ask: Ask,
    ) -> BoxFuture<'a, Result<Vec<Piece>>> {
        Box::pin(blob_pieces(
            layer,
            regions(layer, extent),
            fetch,
            ask,
            |bytes, _| decode_region(bytes, MAX_REGION_DECODED),
        ))
    }

    fn structure_ranges(&self, layer: &Layer) -> Result<Vec<Range<u64>>> {
        regions(layer, Extent::Structure).ranges(layer)
    }
}
