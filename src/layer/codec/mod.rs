//! How a layer's blob becomes verified content: one codec per [`LayerKind`], each owning its
//! decode (the one way registry bytes become chunk content), what one fetch of a chunk is (a
//! zstd frame, a gzip member, a span of a seekable index with its window) and the regions of
//! the layer's stream that lie between chunks, which the integrity checks rebuild.
//!
//! - [`zstd_chunked`]: each chunk its own zstd frames, checked against its digest.
//! - [`estargz`]: each chunk a gzip member; a file's tar padding rides in its last one.
//! - [`indexed`]: an ordinary gzip or uncompressed tar layer, or a disk artifact's disk file,
//!   read span by span through a seekable index; a span's window is the end of the span before
//!   it or a frame of the index's windows blob.
//!
//! The engine asks the codec of a layer ([`super::Layer::codec`], the [`Codec`] trait) and
//! never what kind the layer is. A codec fetches nothing itself: what it needs comes through
//! [`Fetch`].

pub mod estargz;
pub mod indexed;
mod regions;
pub mod zstd_chunked;

use super::{Codec, Layer, LayerKind, LayerMeta, Resolved, Table};
use crate::error::{Error, Result};
use crate::oci::reference::Reference;

/// The layer `meta` records, its chunk table and codec from its verified TOC or index bytes
/// `toc` (checked against the digest the record pins and validated here): the one place a
/// layer's kind becomes its codec.
pub fn open(
    reference: Reference,
    meta: LayerMeta,
    toc: &[u8],
    resolved: Resolved,
) -> Result<Layer> {
    let (table, codec): (Table, Box<dyn Codec>) = match &meta.kind {
        LayerKind::ZstdChunked => (
            zstd_chunked::table(&meta, toc)?,
            Box::new(zstd_chunked::ZstdChunked),
        ),
        LayerKind::Estargz => (estargz::table(&meta, toc)?, Box::new(estargz::Estargz)),
        LayerKind::Indexed(_) => {
            let (table, codec) = indexed::open(&meta, toc)?;
            (table, Box::new(codec))
        }
    };
    Layer::new(reference, meta, table, codec, resolved)
}

/// The content of one chunk of a file `file_size` bytes long in a layer of `kind`, decoded
/// alone from its compressed bytes `frame` and checked against its digest: what `vmdisk
/// inspect` reads of a disk's first chunk before any layer is opened. A layer read through a
/// seekable index has no chunk that decodes alone.
pub fn decode_chunk_alone(
    kind: &LayerKind,
    chunk: &crate::format::tree::Chunk,
    file_size: u64,
    frame: &[u8],
) -> Result<Vec<u8>> {
    match kind {
        LayerKind::ZstdChunked => crate::format::zstd_chunked::decode_chunk(frame, chunk),
        LayerKind::Estargz => estargz::decode_alone(frame, chunk, file_size),
        LayerKind::Indexed(_) => Err(Error::unsupported(
            "a span of a layer read through a seekable index decodes only with its window",
        )),
    }
}

/// The blob ranges the structure check of the layer `meta` records reads
/// ([`Codec::structure_ranges`]), from its verified TOC or index bytes `toc`; a layer read
/// through a seekable index has none, which is known without parsing its index.
pub fn structure_ranges(
    reference: Reference,
    meta: LayerMeta,
    toc: &[u8],
) -> Result<Vec<std::ops::Range<u64>>> {
    if let LayerKind::Indexed(_) = meta.kind {
        return Ok(Vec::new());
    }
    let layer = open(reference, meta, toc, Resolved::Offline)?;
    layer.codec().structure_ranges(&layer)
}
