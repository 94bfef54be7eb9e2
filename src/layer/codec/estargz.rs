//! The codec of eStargz layers: each chunk is a gzip member, inflated to its size and checked
//! against its digest. A file's tar padding rides in its last chunk's member, whose end the
//! TOC does not give, so that chunk may be followed by the next entry's members and the region
//! after it is decoded from the chunk's start. The stream ends with the TOC as a tar entry.

use std::ops::Range;

use futures_util::future::BoxFuture;

use super::regions::{blob_pieces, decode_each, Regions};
use crate::error::{Error, Result};
use crate::format::estargz::{self, decode_chunk, inflate_members};
use crate::format::tree::Chunk;
use crate::layer::{Ask, Codec, Extent, Fetch, Piece, Store, MAX_REGION_DECODED};
use crate::layer::{Layer, LayerMeta, Table};

/// The eStargz codec.
#[derive(Debug)]
pub struct Estargz;

/// The table of an eStargz layer from its TOC JSON (checked against the digest the record
/// pins).
pub(crate) fn table(meta: &LayerMeta, json: &[u8]) -> Result<Table> {
    meta.toc_digest.verify(json, "eStargz TOC")?;
    Table::of_nodes(estargz::nodes(json, meta.toc_offset)?)
}

/// When chunk `idx` is the last of its file, the file's tar padding (kept in its member).
fn last_of_file(layer: &Layer, idx: usize) -> Option<u64> {
    let (file, chunk) = layer.chunk(idx);
    padding_after(chunk, layer.file_size(file))
}

/// When `chunk` is the last of its file of `file_size` bytes, the file's tar padding.
fn padding_after(chunk: &Chunk, file_size: u64) -> Option<u64> {
    (chunk.offset + chunk.size == file_size).then(|| estargz::padding(file_size))
}

/// The content of `chunk` of a file of `file_size` bytes from its gzip `members`, checked.
pub(super) fn decode_alone(members: &[u8], chunk: &Chunk, file_size: u64) -> Result<Vec<u8>> {
    decode_chunk(members, chunk, padding_after(chunk, file_size))
}

/// Where the regions between an eStargz layer's chunks lie: up to the TOC's member, or the
/// whole blob.
fn regions(layer: &Layer, extent: Extent) -> Regions {
    Regions {
        until: match extent {
            Extent::Structure => layer.meta.toc_offset,
            Extent::Whole => layer.meta.layer_size,
        },
        after: |layer, idx| {
            let chunk = &layer.chunks[idx];
            match last_of_file(layer, idx) {
                // Where a file's last member ends is not known: the region after it is read
                // from the chunk's start, its content skipped.
                Some(_) => (chunk.compressed.start, chunk.size),
                None => (chunk.compressed.end, 0),
            }
        },
    }
}

impl Codec for Estargz {
    fn decode_run(
        &self,
        layer: &Layer,
        run: &[usize],
        bytes: &[u8],
        _window: Option<&[u8]>,
        store: &mut Store<'_>,
    ) -> Result<()> {
        decode_each(layer, run, bytes, store, |idx, members| {
            decode_chunk(members, &layer.chunks[idx], last_of_file(layer, idx)).map(Some)
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
            |bytes, skip| {
                let mut out = inflate_members(bytes, MAX_REGION_DECODED + skip)?;
                if (out.len() as u64) < skip {
                    return Err(Error::corrupt("a file's last chunk member is short"));
                }
                Ok(out.split_off(skip as usize))
            },
        ))
    }

    fn structure_ranges(&self, layer: &Layer) -> Result<Vec<Range<u64>>> {
        regions(layer, Extent::Structure).ranges(layer)
    }

    fn trailing_entry(&self) -> Option<&'static str> {
        Some(estargz::TOC_NAME)
    }
}
