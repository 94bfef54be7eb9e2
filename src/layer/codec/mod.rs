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
pub mod zstd_chunked;

use super::{fetch_checked, MAX_REGION_BYTES, MAX_REGION_DECODED};
use super::{Ask, Codec, Fetch, Layer, LayerKind, LayerMeta, Piece, Resolved, Store, Table};
use crate::error::{Error, Result};
use crate::oci::reference::Reference;

/// Most regions fetched at once.
const REGION_FETCHES: usize = 8;

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

/// Decodes each chunk of `run` from its own bytes within `bytes` (which start where the run
/// does) with `decode`, and hands the content, or why it failed, to `store`: the
/// [`Codec::decode_run`] of codecs whose chunks decode alone.
fn decode_each(
    layer: &Layer,
    run: &[usize],
    bytes: &[u8],
    store: &mut Store<'_>,
    decode: impl Fn(usize, &[u8]) -> Result<Vec<u8>>,
) -> Result<()> {
    let base = layer.chunks[run[0]].compressed.start;
    for &idx in run {
        let c = &layer.chunks[idx].compressed;
        let frame = &bytes[(c.start - base) as usize..(c.end - base) as usize];
        match decode(idx, frame) {
            Ok(data) => store(idx, Ok(&data))?,
            Err(e) => store(idx, Err(e))?,
        }
    }
    Ok(())
}

/// What follows a chunk in the blob, for [`Regions`]: the region after chunk `idx` starts at
/// the returned offset, its first `skip` decoded bytes being the chunk's own.
type After = fn(&Layer, usize) -> (u64, u64);
/// Decodes a region of the blob between chunks, dropping its first `skip` bytes.
type DecodeRegion = fn(&[u8], u64) -> Result<Vec<u8>>;

/// Where the regions between the chunks of a layer with a TOC lie in its blob, up to byte
/// `until`: the one plan [`blob_pieces`] fetches by and [`Codec::structure_ranges`] names.
struct Regions {
    until: u64,
    after: After,
}

/// A region of the blob to fetch: its slot in the pieces, its blob range and the decoded bytes
/// to drop (the chunk's own, when the region is read from the chunk's start).
struct RegionToFetch {
    slot: usize,
    range: std::ops::Range<u64>,
    skip: u64,
}

impl Regions {
    /// The layer's pieces in stream order (the regions still empty) and the regions to fetch.
    /// A region larger than a tar header region or TOC can be is refused.
    fn plan(&self, layer: &Layer) -> Result<(Vec<Piece>, Vec<RegionToFetch>)> {
        let mut order: Vec<usize> = (0..layer.chunks.len()).collect();
        order.sort_unstable_by_key(|&i| layer.chunks[i].compressed.start);
        let mut wanted = Vec::new();
        let mut pieces = Vec::with_capacity(order.len() * 2 + 1);
        let (mut at, mut skip) = (0u64, 0u64);
        for next in order.iter().map(|&i| Some(i)).chain([None]) {
            let end = next.map_or(self.until, |i| layer.chunks[i].compressed.start);
            if end > at {
                if end - at > MAX_REGION_BYTES {
                    return Err(Error::corrupt(format!(
                        "bytes {at}..{end} of the layer belong to no chunk and are more than the {MAX_REGION_BYTES} a tar header region or the TOC can take"
                    )));
                }
                wanted.push(RegionToFetch {
                    slot: pieces.len(),
                    range: at..end,
                    skip,
                });
                pieces.push(Piece::Region(Vec::new()));
            }
            if let Some(i) = next {
                pieces.push(Piece::Chunk(i));
                (at, skip) = (self.after)(layer, i);
            }
        }
        Ok((pieces, wanted))
    }

    /// The blob ranges of the regions ([`Codec::structure_ranges`]).
    fn ranges(&self, layer: &Layer) -> Result<Vec<std::ops::Range<u64>>> {
        Ok(self.plan(layer)?.1.into_iter().map(|w| w.range).collect())
    }
}

/// The pieces of a layer with a TOC as `regions` places them: every chunk, and the regions
/// between them fetched and decoded by `decode`. A region carries no digest, but it must
/// decode (zstd frames, gzip members with their CRC): one that does not came cut or flipped,
/// or lies, and is fetched once more from the registry itself before it fails.
async fn blob_pieces(
    layer: &Layer,
    regions: Regions,
    fetch: &dyn Fetch,
    ask: Ask,
    decode: DecodeRegion,
) -> Result<Vec<Piece>> {
    use futures_util::StreamExt;
    let (mut pieces, wanted) = regions.plan(layer)?;
    let mut fetched = futures_util::stream::iter(wanted.into_iter().map(
        |RegionToFetch { slot, range, skip }| async move {
            let what = format!(
                "bytes {}..{} of layer {}",
                range.start, range.end, layer.meta.layer_digest
            );
            let region = fetch_checked(&what, ask, |ask| {
                let range = range.clone();
                async move {
                    let bytes = fetch.blob(range, ask).await?;
                    crate::task::off_the_runtime(|| decode(&bytes, skip))
                }
            })
            .await
            .map_err(|e| e.context(what.as_str()))?;
            Ok::<_, Error>((slot, region))
        },
    ))
    .buffer_unordered(REGION_FETCHES);
    let mut decoded = 0u64;
    while let Some(result) = fetched.next().await {
        let (slot, region) = result?;
        decoded += region.len() as u64;
        if decoded > MAX_REGION_DECODED {
            return Err(Error::corrupt(format!(
                "the regions between chunks decode to more than the {MAX_REGION_DECODED} bytes tar headers can take"
            )));
        }
        pieces[slot] = Piece::Region(region);
    }
    Ok(pieces)
}
