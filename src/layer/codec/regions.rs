//! The regions of a layer's stream between its chunks, planned and fetched in one way for
//! every codec ([`Regions`], [`blob_pieces`]), and the decode of codecs whose chunks decode
//! alone ([`decode_each`]).

use crate::error::{Error, Result};
use crate::layer::{fetch_checked, MAX_REGION_BYTES, MAX_REGION_DECODED};
use crate::layer::{Ask, Decoded, Fetch, Layer, Piece, Store};

/// Most regions fetched at once.
pub(super) const REGION_FETCHES: usize = 8;

/// Decodes each chunk of `run` from its own bytes within `bytes` (which start where the run
/// does) with `decode` (`None`: checked to be the zeros the TOC says it is), and hands the
/// content, or why it failed, to `store`: the
/// [`Codec::decode_run`] of codecs whose chunks decode alone.
pub(super) fn decode_each(
    layer: &Layer,
    run: &[usize],
    bytes: &[u8],
    store: &mut Store<'_>,
    decode: impl Fn(usize, &[u8]) -> Result<Option<Vec<u8>>>,
) -> Result<()> {
    let base = layer.chunks[run[0]].compressed.start;
    for &idx in run {
        let c = &layer.chunks[idx].compressed;
        let frame = &bytes[(c.start - base) as usize..(c.end - base) as usize];
        match decode(idx, frame) {
            Ok(Some(data)) => store(idx, Ok(Decoded::Bytes(&data)))?,
            Ok(None) => store(idx, Ok(Decoded::Zeros))?,
            Err(e) => store(idx, Err(e))?,
        }
    }
    Ok(())
}

/// What follows a chunk in the blob, for [`Regions`]: the region after chunk `idx` starts at
/// the returned offset, its first `skip` decoded bytes being the chunk's own.
pub(super) type After = fn(&Layer, usize) -> (u64, u64);

/// Decodes a region of the blob between chunks, dropping its first `skip` bytes.
pub(super) type DecodeRegion = fn(&[u8], u64) -> Result<Vec<u8>>;

/// Where the regions between the chunks of a layer with a TOC lie in its blob, up to byte
/// `until`: the one plan [`blob_pieces`] fetches by and [`Codec::structure_ranges`] names.
pub(super) struct Regions {
    pub(super) until: u64,
    pub(super) after: After,
}

/// A region of the blob to fetch: its slot in the pieces, its blob range and the decoded bytes
/// to drop (the chunk's own, when the region is read from the chunk's start).
pub(super) struct RegionToFetch {
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
    pub(super) fn ranges(&self, layer: &Layer) -> Result<Vec<std::ops::Range<u64>>> {
        Ok(self.plan(layer)?.1.into_iter().map(|w| w.range).collect())
    }
}

/// The pieces of a layer with a TOC as `regions` places them: every chunk, and the regions
/// between them fetched and decoded by `decode`. A region carries no digest, but it must
/// decode (zstd frames, gzip members with their CRC): one that does not came cut or flipped,
/// or lies, and is fetched once more from the registry itself before it fails.
pub(super) async fn blob_pieces(
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
