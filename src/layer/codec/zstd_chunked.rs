//! The codec of zstd:chunked layers: each chunk is its own regular zstd frames, decoded within
//! its size and checked against its digest (a chunk marked zeros: checked to decode to zeros,
//! never held); the regions between chunks (tar headers, padding,
//! the end of the archive) are zstd frames too, and the stream the checks rebuild ends where
//! the TOC's skippable frame begins.

use std::ops::Range;

use futures_util::future::BoxFuture;

use super::regions::{blob_pieces, decode_each, Regions};
use crate::error::Result;
use crate::format::zstd_chunked::{check_zeros, decode_chunk, read_toc};
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
            let chunk = &layer.chunks[idx];
            if chunk.zeros {
                check_zeros(frame, chunk).map(|()| None)
            } else {
                decode_chunk(frame, chunk).map(Some)
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::format::zstd_chunked::testing::write_layer;
    use crate::layer::{Decoded, Resolved};

    const CHUNK: usize = 64 << 10;

    /// A layer of `data` in 64 KiB chunks, opened from its TOC, and its blob.
    fn layer(data: &[u8]) -> (Layer, Vec<u8>) {
        let (summary, blob) = write_layer(data, CHUNK);
        let (meta, toc) = crate::layer::testing::zstd_chunked_meta(&summary, &blob);
        let layer =
            crate::layer::codec::open(meta.reference.clone(), meta, &toc, Resolved::Offline)
                .unwrap();
        (layer, blob)
    }

    #[test]
    fn a_run_hands_each_chunk_its_own_verdict() {
        let data: Vec<u8> = (0..3 * CHUNK).map(|i| (i * 31 % 253) as u8).collect();
        let (layer, blob) = layer(&data);
        let run = [0, 1, 2];
        let range = layer.chunks[0].compressed.start..layer.chunks[2].compressed.end;
        let mut bytes = blob[range.start as usize..range.end as usize].to_vec();
        // One byte of chunk 1's frame flipped: it fails, its neighbours do not.
        let flip = (layer.chunks[1].compressed.start - range.start) as usize + 20;
        bytes[flip] ^= 0x40;
        let mut verdicts = Vec::new();
        ZstdChunked
            .decode_run(&layer, &run, &bytes, None, &mut |idx, decoded| {
                let decoded = decoded.map(|d| match d {
                    Decoded::Bytes(bytes) => bytes.to_vec(),
                    Decoded::Zeros => panic!("no chunk here is zeros"),
                });
                verdicts.push((idx, decoded.map_err(|e| e.kind())));
                Ok(())
            })
            .unwrap();
        assert_eq!(verdicts.len(), 3);
        assert_eq!(verdicts[0], (0, Ok(data[..CHUNK].to_vec())));
        assert_eq!(verdicts[1], (1, Err(ErrorKind::Corrupt)));
        assert_eq!(verdicts[2], (2, Ok(data[2 * CHUNK..].to_vec())));
    }

    #[test]
    fn the_structure_check_reads_between_chunks_and_stops_before_the_toc() {
        let data = vec![7u8; 2 * CHUNK];
        let (layer, _) = layer(&data);
        let ranges = ZstdChunked.structure_ranges(&layer).unwrap();
        assert!(!ranges.is_empty());
        let toc_frame = layer.meta.toc_offset - 8;
        for r in &ranges {
            assert!(r.end <= toc_frame, "{r:?} reaches into the TOC's frame");
            for c in &layer.chunks {
                assert!(
                    r.end <= c.compressed.start || r.start >= c.compressed.end,
                    "{r:?} overlaps a chunk ({:?})",
                    c.compressed
                );
            }
        }
        assert_eq!(ranges.last().unwrap().end, toc_frame);
    }
}
