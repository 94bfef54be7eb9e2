//! The seekable index of an ordinary (gzip or uncompressed) tar layer, published beside the
//! image as an OCI artifact by `vmdisk index`: what makes a disk nobody republished load
//! lazily. See docs/format.md ("The seekable index").
//!
//! The layer's tar stream is cut into **spans** of about `spanSize` uncompressed bytes. For a
//! gzip layer each span starts at a deflate block boundary, where decoding can begin given
//! the bit position and the 32 KiB of output before it (the *window*, zran-style); for an
//! uncompressed layer a span is a plain byte range. Every span carries the sha256 of its
//! uncompressed bytes, and the index lists the tar's entries with their data offsets, and
//! the layer digest and diff_id it describes.
//!
//! The windows are most of an index's bytes (32 KiB a span) and a cold read needs one per
//! run of spans it fetches, not all of them: they live in a second blob, one zstd frame per
//! span, fetched by Range with the span, so a node is ready after fetching the small JSON
//! index alone.
//!
//! The index is someone's claim, like a TOC: a span is served only after it decoded to exactly
//! its length and digest ([`SeekIndex::decode_span`]), the tar headers are checked against the
//! entries before anything is served, and the whole stream against the diff_id once complete
//! (`engine::integrity`).
//!
//! The index's model, validation and span decoding are here; [`build`] makes an index from a
//! layer's blob, [`zran`] is the deflate code at block boundaries both sides need.

pub mod build;
pub mod zran;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::tree::clean_path;
use crate::oci::digest::Digest;
use zran::WINDOW;

/// The artifact type of the index's manifest (and of its referrer descriptor).
pub const ARTIFACT_TYPE: &str = "application/vnd.vmdisk.seekable-index.v2";
/// The media type of the index blob: zstd-compressed JSON.
pub const MEDIA_TYPE: &str = "application/vnd.vmdisk.seekable-index.v2+json+zstd";
/// The media type of a gzip layer's windows blob: one zstd frame per span but the first.
pub const WINDOWS_MEDIA_TYPE: &str = "application/vnd.vmdisk.seekable-index.v2.windows+zstd";
/// The index version this vmdisk writes and reads.
const VERSION: u32 = 2;
/// Annotation on the index manifest: the layer digest it indexes.
pub const ANN_LAYER: &str = "io.vmdisk.index.layer";

/// Most bytes of a compressed index blob.
pub const MAX_INDEX_BYTES: u64 = 64 << 20;
/// Most bytes of the index JSON once decompressed.
const MAX_INDEX_JSON: u64 = 512 << 20;
/// Most spans (64 Ki spans of 16 MiB is a 1 TiB layer).
const MAX_SPANS: usize = 1 << 20;
/// Most tar entries the index may list.
const MAX_ENTRIES: usize = 100_000;
/// Most uncompressed bytes of one span: a deflate block of long matches can outgrow the span
/// size by a few MiB before the next boundary.
pub const MAX_SPAN_BYTES: u64 = 32 << 20;
/// Most bytes of one window's frame in the windows blob (zstd's bound for 32 KiB, rounded up).
const MAX_WINDOW_FRAME: u64 = 33 << 10;

/// How the indexed layer is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    Gzip,
    None,
}

impl Compression {
    pub fn name(&self) -> &'static str {
        match self {
            Compression::Gzip => "gzip",
            Compression::None => "none",
        }
    }
}

/// What the layer's uncompressed stream is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// A tar archive (a container image's layer): the index lists its entries.
    #[default]
    Tar,
    /// The disk file itself (a disk artifact's layer): no entries; the manifest names the
    /// file.
    File,
}

impl Layout {
    fn is_tar(&self) -> bool {
        *self == Layout::Tar
    }
}

/// A tar entry as the index lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Entry {
    /// `dir`, `reg`, `symlink`, `hardlink` or `other`.
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub link_name: String,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Modification time, seconds since the epoch.
    #[serde(default)]
    pub mtime: u64,
    #[serde(default)]
    pub size: u64,
    /// Where a regular file's content starts in the uncompressed tar stream.
    #[serde(default)]
    pub offset: u64,
}

/// A span: where its uncompressed bytes start, where decoding them starts in the blob, the
/// window before it and its digest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Span {
    /// Offset of its first byte in the uncompressed stream.
    pub offset: u64,
    /// The first blob byte holding its compressed bits.
    pub input: u64,
    /// End (exclusive) of the blob bytes needed to decode it.
    pub input_end: u64,
    /// When not 0, the span's first bit is the (8 − bits)th bit of byte `input`: the high
    /// `bits` bits of that byte are the span's (gzip only).
    #[serde(default)]
    pub bits: u8,
    /// Where the frame of its window (the 32 KiB of output before it) ends in the windows
    /// blob; it starts where the span before's ends (gzip only; 0 for the first span, which
    /// has none).
    #[serde(default)]
    pub window_end: u64,
    /// sha256 of the span's uncompressed bytes.
    pub digest: Digest,
}

/// The index document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SeekIndex {
    pub version: u32,
    /// The layer blob it indexes, its size and compression.
    pub layer: Digest,
    pub layer_size: u64,
    pub compression: Compression,
    /// Whether the stream is a tar or the disk file itself (absent: a tar).
    #[serde(default, skip_serializing_if = "Layout::is_tar")]
    pub layout: Layout,
    /// sha256 of the uncompressed stream, and its size.
    pub diff_id: Digest,
    pub stream_size: u64,
    /// The span size asked for (spans are at least this long, but for the last).
    pub span_size: u64,
    /// The windows blob (gzip only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub windows: Option<Windows>,
    pub entries: Vec<Entry>,
    pub spans: Vec<Span>,
}

/// The blob holding a gzip layer's windows, published beside the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Windows {
    pub digest: Digest,
    pub size: u64,
}

/// What a layer the index must describe is, from the verified manifest and config.
#[derive(Clone, Copy, Debug)]
pub struct Expected {
    pub layer: Digest,
    pub layer_size: u64,
    /// The compression the layer's media type names (an image layer's); `None` when the
    /// blob's own first bytes decide (a disk artifact's, whose media types may lie).
    pub compression: Option<Compression>,
    /// The uncompressed digest the manifest pins: an image config's diff_id, an artifact's
    /// disk digest annotation; `None` when nothing pins it (then the index's own claim is
    /// checked once complete, and an uncompressed blob's digest is its stream's).
    pub diff_id: Option<Digest>,
    pub layout: Layout,
}

impl SeekIndex {
    /// The index as published: zstd-compressed JSON.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let json = serde_json::to_vec(self).expect("the index serialises");
        let index =
            zstd::bulk::compress(&json, 3).map_err(|e| Error::io("compressing the index", e))?;
        if index.len() as u64 > MAX_INDEX_BYTES {
            return Err(Error::invalid(format!(
                "the index would be {} bytes, more than the {MAX_INDEX_BYTES} readers accept; use a larger --span",
                index.len()
            )));
        }
        Ok(index)
    }

    /// Parses and checks an index blob (already verified against its descriptor's digest)
    /// for the layer `expected`: bounded decompression, then every offset, length and count
    /// (see [`SeekIndex::validate`]).
    pub fn decode(blob: &[u8], expected: &Expected) -> Result<Self> {
        if blob.len() as u64 > MAX_INDEX_BYTES {
            return Err(Error::corrupt(format!(
                "the seekable index is {} bytes, more than the {MAX_INDEX_BYTES} accepted",
                blob.len()
            )));
        }
        let json = crate::format::zstd_frames::decompress_bounded(blob, MAX_INDEX_JSON)
            .map_err(|e| e.context("decompressing the seekable index"))?;
        let index: SeekIndex = serde_json::from_slice(&json)
            .map_err(|e| Error::corrupt(format!("the seekable index is not valid JSON: {e}")))?;
        index.validate(expected)?;
        Ok(index)
    }

    /// Checks that the index describes `expected` and is internally consistent: spans cover
    /// the stream in order, each at most [`MAX_SPAN_BYTES`], inside the blob, with a window of
    /// the right length; entries are safe paths with content inside the stream, in order.
    pub fn validate(&self, expected: &Expected) -> Result<()> {
        self.validate_header(expected)?;
        self.validate_spans()?;
        self.validate_entries()
    }

    /// What the index says of itself and of the layer: version, identity, layout, sizes and
    /// counts, the windows blob.
    fn validate_header(&self, expected: &Expected) -> Result<()> {
        let bad = |why: String| Err(Error::corrupt(format!("the seekable index {why}")));
        if self.version != VERSION {
            return bad(format!(
                "has version {}, this vmdisk reads {VERSION}; run `vmdisk index` again",
                self.version
            ));
        }
        if (self.layer, self.layer_size) != (expected.layer, expected.layer_size)
            || expected.compression.is_some_and(|c| c != self.compression)
            || expected.diff_id.is_some_and(|d| d != self.diff_id)
        {
            let claim = |v: Option<String>| v.unwrap_or_else(|| "any".into());
            return bad(format!(
                "describes layer {} ({} bytes, {:?}, diff_id {}), not the image's {} ({} bytes, {}, diff_id {})",
                self.layer, self.layer_size, self.compression, self.diff_id,
                expected.layer, expected.layer_size,
                claim(expected.compression.map(|c| format!("{c:?}"))),
                claim(expected.diff_id.map(|d| d.to_string()))
            ));
        }
        if self.layout != expected.layout {
            return bad(format!(
                "reads the layer as {:?}, but it is {:?}",
                self.layout, expected.layout
            ));
        }
        if self.layout == Layout::File && !self.entries.is_empty() {
            return bad("of a disk file lists tar entries".into());
        }
        if !self.span_size.is_power_of_two() || !((64 << 10)..=(16 << 20)).contains(&self.span_size)
        {
            return bad(format!("has span size {}", self.span_size));
        }
        if self.spans.is_empty() || self.spans.len() > MAX_SPANS {
            return bad(format!("has {} spans", self.spans.len()));
        }
        if self.entries.len() > MAX_ENTRIES {
            return bad(format!("lists {} entries", self.entries.len()));
        }
        if self.compression == Compression::None
            && (self.stream_size != self.layer_size || self.diff_id != self.layer)
        {
            return bad("of an uncompressed layer gives a stream unlike the blob".into());
        }
        match (self.compression, self.windows) {
            (Compression::Gzip, Some(w))
                if w.size <= self.spans.len() as u64 * MAX_WINDOW_FRAME => {}
            (Compression::None, None) => {}
            _ => {
                return bad(
                    "names no windows blob for a gzip layer, or one that does not fit".into(),
                )
            }
        }
        Ok(())
    }

    /// Each span follows the one before it, within its bounds, and (gzip) with a window frame
    /// of its own; the last window ends the windows blob.
    fn validate_spans(&self) -> Result<()> {
        let bad = |why: String| Err(Error::corrupt(format!("the seekable index {why}")));
        for (i, span) in self.spans.iter().enumerate() {
            let end = self.span_end(i);
            let first = i == 0;
            let at = |what: &str| Error::corrupt(format!("the seekable index's span {i} {what}"));
            if (first && span.offset != 0) || (!first && span.offset <= self.spans[i - 1].offset) {
                return Err(at("does not follow the one before it"));
            }
            if end <= span.offset || end - span.offset > MAX_SPAN_BYTES {
                return Err(at(&format!(
                    "is {} bytes long",
                    end.saturating_sub(span.offset)
                )));
            }
            if span.input > span.input_end
                || span.input_end > self.layer_size
                || (!first && span.input < self.spans[i - 1].input)
            {
                return Err(at("lies outside the blob or before the span before it"));
            }
            match self.compression {
                Compression::None => {
                    if span.input != span.offset || span.input_end != end || span.bits != 0 {
                        return Err(at("is not the blob's own bytes"));
                    }
                    if span.window_end != 0 {
                        return Err(at("has a window in an uncompressed layer"));
                    }
                }
                Compression::Gzip => {
                    if span.bits > 7 || (span.bits > 0 && span.input == span.input_end) {
                        return Err(at(&format!("starts at bit {} of its byte", span.bits)));
                    }
                    if span.input_end - span.input > end - span.offset + (1 << 20) {
                        return Err(at("needs more compressed bytes than deflate can take"));
                    }
                    let fits = match i {
                        0 => span.window_end == 0,
                        _ => span
                            .window_end
                            .checked_sub(self.spans[i - 1].window_end)
                            .is_some_and(|n| n > 0 && n <= MAX_WINDOW_FRAME),
                    };
                    if !fits {
                        return Err(at("has no window frame of its own, or too large a one"));
                    }
                }
            }
        }
        if let (Some(w), Some(last)) = (self.windows, self.spans.last()) {
            if last.window_end != w.size {
                return bad(format!(
                    "puts its last window at {}, but the windows blob is {} bytes",
                    last.window_end, w.size
                ));
            }
        }
        Ok(())
    }

    /// The entries' names are clean paths, their types known, their data in the stream in order.
    fn validate_entries(&self) -> Result<()> {
        let bad = |why: String| Err(Error::corrupt(format!("the seekable index {why}")));
        let mut data_end = 0;
        for entry in &self.entries {
            if i64::try_from(entry.mtime).is_err() {
                return bad(format!("gives {} the time {}", entry.name, entry.mtime));
            }
            let path = clean_path(&entry.name)?;
            if entry.kind == "reg" {
                if entry.offset < data_end
                    || !entry.offset.is_multiple_of(512)
                    || entry
                        .offset
                        .checked_add(entry.size)
                        .is_none_or(|e| e > self.stream_size)
                {
                    return bad(format!("places {path} outside the stream or out of order"));
                }
                data_end = entry.offset + entry.size;
            } else if !matches!(
                entry.kind.as_str(),
                "dir" | "symlink" | "hardlink" | "other"
            ) {
                return bad(format!("gives {path} the type {:?}", entry.kind));
            }
        }
        Ok(())
    }

    /// The disk the layer holds: its first regular file under `disk/` or `image/`.
    pub fn disk_entry(&self) -> Option<&Entry> {
        self.entries.iter().find(|e| {
            e.kind == "reg"
                && clean_path(&e.name).is_ok_and(|p| crate::format::layout::is_disk_path(&p, None))
        })
    }

    /// The uncompressed end (exclusive) of span `i`.
    pub fn span_end(&self, i: usize) -> u64 {
        self.spans
            .get(i + 1)
            .map_or(self.stream_size, |next| next.offset)
    }

    /// The spans that hold uncompressed bytes `range`.
    pub fn spans_for(&self, range: std::ops::Range<u64>) -> std::ops::Range<usize> {
        if range.is_empty() {
            return 0..0;
        }
        let first = self.spans.partition_point(|s| s.offset <= range.start) - 1;
        let last = self.spans.partition_point(|s| s.offset < range.end);
        first..last
    }

    /// Where span `i`'s window frame is in the windows blob; `None` when decoding it needs no
    /// window (an uncompressed layer, the first span).
    pub fn window_range(&self, i: usize) -> Option<std::ops::Range<u64>> {
        (self.compression == Compression::Gzip && i > 0)
            .then(|| self.spans[i - 1].window_end..self.spans[i].window_end)
    }

    /// The length of span `i`'s window: the 32 KiB before it, less at the stream's start.
    fn window_len(&self, i: usize) -> usize {
        match self.window_range(i) {
            Some(_) => (self.spans[i].offset as usize).min(WINDOW),
            None => 0,
        }
    }

    /// Span `i`'s window from its frame in the windows blob: exactly its length.
    pub fn decode_window(&self, i: usize, frame: &[u8]) -> Result<Vec<u8>> {
        let want = self.window_len(i);
        let window = crate::format::zstd_frames::decompress_bounded(frame, want as u64)
            .map_err(|e| e.context(format!("the window of span {i}")))?;
        if window.len() != want {
            return Err(Error::corrupt(format!(
                "the window of span {i} is {} bytes, not {want}",
                window.len()
            )));
        }
        Ok(window)
    }

    /// Span `i`'s window from the decoded bytes of span `i − 1` (its end), when they hold it
    /// all: a run of spans fetched together needs only its first span's window fetched.
    pub fn window_after<'a>(&self, i: usize, previous: &'a [u8]) -> Option<&'a [u8]> {
        let want = self.window_len(i);
        (previous.len() >= want).then(|| &previous[previous.len() - want..])
    }

    /// The uncompressed bytes of span `i` from `input` (blob bytes `input..input_end` of the
    /// span) and its `window` ([`SeekIndex::decode_window`], [`SeekIndex::window_after`]):
    /// decoded, exactly the span's length, matching its digest. The one decode of indexed
    /// layer bytes; nothing else turns them into content.
    pub fn decode_span(&self, i: usize, input: &[u8], window: &[u8]) -> Result<Vec<u8>> {
        let data = self.decode_unverified(i, input, window)?;
        let span = &self.spans[i];
        span.digest
            .verify(&data, &format!("span {i} at stream offset {}", span.offset))?;
        Ok(data)
    }

    /// What span `i` decodes to, of its length but not checked against its digest.
    pub(crate) fn decode_unverified(
        &self,
        i: usize,
        input: &[u8],
        window: &[u8],
    ) -> Result<Vec<u8>> {
        if window.len() != self.window_len(i) {
            return Err(Error::corrupt(format!(
                "span {i} was given a {}-byte window, not {}",
                window.len(),
                self.window_len(i)
            )));
        }
        let span = &self.spans[i];
        let size = (self.span_end(i) - span.offset) as usize;
        if input.len() as u64 != span.input_end - span.input {
            return Err(Error::corrupt(format!(
                "span {i}: got {} compressed bytes, expected {}",
                input.len(),
                span.input_end - span.input
            )));
        }
        let data = match self.compression {
            Compression::None => input.to_vec(),
            Compression::Gzip => {
                zran::inflate_span(window, span.bits, input, size).map_err(|e| {
                    e.context(format!("span {i} (bytes {} of the stream)", span.offset))
                })?
            }
        };
        if data.len() != size {
            return Err(Error::corrupt(format!(
                "span {i} decoded to {} bytes, expected {size}",
                data.len()
            )));
        }
        Ok(data)
    }
}

#[cfg(test)]
pub(crate) mod testing;

#[cfg(test)]
mod tests {
    use super::build::{build, HEAD_BYTES};
    use super::testing::{disk, file_expected, gzip, index_of, tar_of, window, with_window};
    use super::*;

    fn expected(blob: &[u8], tar: &[u8], compression: Compression) -> Expected {
        Expected {
            layer: Digest::of(blob),
            layer_size: blob.len() as u64,
            compression: Some(compression),
            diff_id: Some(Digest::of(tar)),
            layout: Layout::Tar,
        }
    }

    /// Every span decodes from its own bytes to exactly the stream's bytes.
    fn check_all_spans(index: &SeekIndex, windows: &[u8], blob: &[u8], tar: &[u8]) {
        for (i, s) in index.spans.iter().enumerate() {
            let data = index
                .decode_span(
                    i,
                    &blob[s.input as usize..s.input_end as usize],
                    &window(index, windows, i),
                )
                .unwrap();
            assert_eq!(
                data,
                tar[s.offset as usize..index.span_end(i) as usize],
                "span {i}"
            );
        }
    }

    #[test]
    fn gzip_spans_decode_from_their_checkpoints() {
        let tar = tar_of(&[("disk/d.raw", disk(5 << 20))]);
        for level in [1, 6, 9] {
            let blob = gzip(&tar, level);
            let exp = expected(&blob, &tar, Compression::Gzip);
            let (index, windows) = index_of(&blob, &exp, 64 << 10);
            assert!(
                index.spans.len() > 10,
                "level {level}: {} spans",
                index.spans.len()
            );
            assert!(
                index.spans.iter().any(|s| s.bits != 0),
                "bit-aligned checkpoints"
            );
            assert_eq!(index.entries.len(), 1);
            assert_eq!(index.entries[0].offset, 512);
            let again = SeekIndex::decode(&index.encode().unwrap(), &exp).unwrap();
            assert_eq!(again, index);
            check_all_spans(&index, &windows, &blob, &tar);
        }
    }

    /// Go's gzip writers (skopeo's, containerd's) end a stream in an empty final block, after
    /// empty sync-flush blocks where they flush: a span boundary right before them must not
    /// leave an empty last span (`vmdisk index` refused such a layer: "span N is 0 bytes
    /// long").
    #[test]
    fn a_stream_ending_in_empty_blocks_has_no_empty_span() {
        use std::io::Write;
        let span = 64 << 10;
        // A tar of exactly four spans (header, data, two end blocks), flushed at every span.
        let tar = tar_of(&[("disk/d.raw", disk(4 * span - 1536))]);
        assert_eq!(tar.len() % span, 0);
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
        for piece in tar.chunks(span) {
            e.write_all(piece).unwrap();
            e.flush().unwrap();
        }
        let blob = e.finish().unwrap();
        let exp = expected(&blob, &tar, Compression::Gzip);
        let (index, windows) = index_of(&blob, &exp, span as u64);
        assert_eq!(index.span_end(index.spans.len() - 1), tar.len() as u64);
        assert!(index
            .spans
            .iter()
            .enumerate()
            .all(|(i, s)| index.span_end(i) > s.offset));
        check_all_spans(&index, &windows, &blob, &tar);
    }

    /// GNU gzip (an essential Debian package, and what many image builders run), whose
    /// output mixes Huffman and stored blocks at any bit alignment.
    fn gnu_gzip(data: &[u8], level: u32) -> Vec<u8> {
        use std::io::Write;
        use std::process::{Command, Stdio};
        let mut child = Command::new("gzip")
            .arg(format!("-{level}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("gzip");
        let mut stdin = child.stdin.take().unwrap();
        let data = data.to_vec();
        let writer = std::thread::spawn(move || stdin.write_all(&data).unwrap());
        let out = child.wait_with_output().unwrap();
        writer.join().unwrap();
        assert!(out.status.success());
        out.stdout
    }

    /// Incompressible runs between compressible ones make GNU gzip switch between Huffman and
    /// stored blocks, so stored blocks start (and spans begin) at any bit of a byte; a stored
    /// block's padding depends on where its byte boundaries are.
    #[test]
    fn spans_with_stored_blocks_decode_at_any_bit() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut data = Vec::new();
        for i in 0..96 {
            let len = rng.gen_range(1..40_000);
            if i % 2 == 0 {
                data.extend((0..len).map(|_| rng.gen::<u8>()));
            } else {
                data.extend((0..len).map(|j| b"disk block "[j % 11]));
            }
        }
        let tar = tar_of(&[("disk/d.raw", data)]);
        let mut unaligned = 0;
        for level in [1, 6] {
            let blob = gnu_gzip(&tar, level);
            let exp = expected(&blob, &tar, Compression::Gzip);
            let (index, windows) = index_of(&blob, &exp, 64 << 10);
            unaligned += index.spans.iter().filter(|s| s.bits != 0).count();
            check_all_spans(&index, &windows, &blob, &tar);
        }
        assert!(unaligned > 0, "some spans start inside a byte");
    }

    #[test]
    fn uncompressed_spans_are_byte_ranges() {
        let tar = tar_of(&[("disk/d.raw", disk(1 << 20)), ("disk/x", vec![1; 100])]);
        let exp = expected(&tar, &tar, Compression::None);
        let (index, windows) = index_of(&tar, &exp, 64 << 10);
        assert_eq!(
            index.spans.len() as u64,
            (tar.len() as u64).div_ceil(64 << 10)
        );
        assert_eq!(index.entries.len(), 2);
        check_all_spans(&index, &windows, &tar, &tar);
    }

    #[test]
    fn a_wrong_diff_id_or_a_second_member_is_refused() {
        let tar = tar_of(&[("disk/d.raw", disk(256 << 10))]);
        let blob = gzip(&tar, 6);
        let mut exp = expected(&blob, &tar, Compression::Gzip);
        exp.diff_id = Some(Digest::of(b"other"));
        let e = build(blob.as_slice(), &exp, 64 << 10, Vec::new()).unwrap_err();
        assert!(e.chain().contains("hashes to"), "{}", e.chain());
        let mut two = blob.clone();
        two.extend(gzip(b"more", 6));
        let exp = expected(&two, &tar, Compression::Gzip);
        let e = build(two.as_slice(), &exp, 64 << 10, Vec::new()).unwrap_err();
        assert!(e.chain().contains("more than one member"), "{}", e.chain());
    }

    /// A disk artifact's layer: the disk file itself, gzip or not, its compression read from
    /// its bytes; a pinned digest is checked, an index of the other layout refused.
    #[test]
    fn disk_files_are_indexed_as_they_are() {
        let disk = disk(3 << 20);
        for (blob, compression) in [
            (gzip(&disk, 6), Compression::Gzip),
            (disk.clone(), Compression::None),
        ] {
            let exp = file_expected(&blob);
            let mut windows = Vec::new();
            let built = build(blob.as_slice(), &exp, 64 << 10, &mut windows).unwrap();
            let index = built.index;
            assert_eq!(
                (index.compression, index.diff_id, index.stream_size),
                (compression, Digest::of(&disk), disk.len() as u64)
            );
            assert!(index.entries.is_empty());
            assert_eq!(built.head, disk[..HEAD_BYTES as usize]);
            check_all_spans(&index, &windows, &blob, &disk);
            let again = SeekIndex::decode(&index.encode().unwrap(), &exp).unwrap();
            assert_eq!(again, index);
            // Pinned: the right digest passes, another fails the build.
            let pinned = Expected {
                diff_id: Some(Digest::of(&disk)),
                ..exp
            };
            assert!(index.validate(&pinned).is_ok());
            let wrong = Expected {
                diff_id: Some(Digest::of(b"x")),
                ..exp
            };
            let e = build(blob.as_slice(), &wrong, 64 << 10, Vec::new()).unwrap_err();
            assert!(
                e.chain().contains("the artifact's annotation"),
                "{}",
                e.chain()
            );
            // A file index for a tar layer, or a tar index for a file, is refused.
            assert!(index
                .validate(&Expected {
                    layout: Layout::Tar,
                    ..exp
                })
                .is_err());
        }
        // Other codecs are named, not indexed.
        let zst = zstd::bulk::compress(&disk, 3).unwrap();
        let exp = file_expected(&zst);
        let e = build(zst.as_slice(), &exp, 64 << 10, Vec::new()).unwrap_err();
        assert!(e.chain().contains("zstd-compressed"), "{}", e.chain());
        // An uncompressed index whose stream is not the blob's own bytes.
        let exp = file_expected(&disk);
        let mut index = build(disk.as_slice(), &exp, 64 << 10, Vec::new())
            .unwrap()
            .index;
        index.diff_id = Digest::of(b"other");
        assert!(index.validate(&exp).is_err());
    }

    #[test]
    fn crafted_indexes_are_refused_or_never_decode_to_wrong_bytes() {
        let tar = tar_of(&[("disk/d.raw", disk(2 << 20))]);
        let blob = gzip(&tar, 6);
        let exp = expected(&blob, &tar, Compression::Gzip);
        let (index, windows) = index_of(&blob, &exp, 64 << 10);
        let refused = |f: &dyn Fn(&mut SeekIndex)| {
            let mut i = index.clone();
            f(&mut i);
            i.validate(&exp).is_err()
        };
        assert!(refused(&|i| i.layer = Digest::of(b"x")));
        assert!(refused(&|i| i.diff_id = Digest::of(b"x")));
        assert!(refused(&|i| i.layout = Layout::File));
        assert!(refused(&|i| i.spans[3].offset = i.spans[2].offset));
        assert!(refused(&|i| i.spans[3].input_end = u64::MAX));
        assert!(refused(&|i| i.spans[3].bits = 9));
        assert!(refused(&|i| i.spans[3].window_end = i.spans[2].window_end));
        assert!(refused(&|i| i.spans[0].window_end = 1));
        assert!(refused(&|i| i.spans[3].window_end += MAX_WINDOW_FRAME));
        assert!(refused(&|i| i.windows = None));
        assert!(refused(&|i| i.windows.as_mut().unwrap().size += 1));
        assert!(refused(&|i| i.version = 1));
        assert!(refused(&|i| i.entries[0].name = "../etc/passwd".into()));
        assert!(refused(&|i| i.entries[0].offset = i.stream_size));
        assert!(refused(&|i| i.span_size = 3));
        // Consistent-looking lies fail at decode, never returning other bytes.
        let span = |i: &SeekIndex, n: usize| {
            let s = &i.spans[n];
            i.decode_span(
                n,
                &blob[s.input as usize..s.input_end as usize],
                &window(&index, &windows, n),
            )
        };
        let mut wrong_digest = index.clone();
        wrong_digest.spans[4].digest = Digest::of(b"x");
        assert!(span(&wrong_digest, 4).is_err());
        let mut wrong_bits = index.clone();
        wrong_bits.spans[4].bits = (wrong_bits.spans[4].bits + 3) % 8;
        assert!(span(&wrong_bits, 4).is_err());
        let (wrong_window, other) = with_window(&index, &windows, 4, &window(&index, &windows, 5));
        let s = &wrong_window.spans[4];
        assert!(wrong_window
            .decode_span(
                4,
                &blob[s.input as usize..s.input_end as usize],
                &window(&wrong_window, &other, 4)
            )
            .is_err());
        // A window of the wrong length, a frame that is no zstd.
        assert!(index
            .decode_span(4, &blob[s.input as usize..s.input_end as usize], b"short")
            .is_err());
        assert!(index.decode_window(4, b"not zstd").is_err());
        // A run of spans needs only the first one's window: the next ones' are in the output.
        let first = span(&index, 2).unwrap();
        assert_eq!(
            index.window_after(3, &first).unwrap(),
            window(&index, &windows, 3)
        );
        let mut moved = index.clone();
        moved.spans[4].input += 1;
        assert!(span(&moved, 4).is_err());
        assert!(SeekIndex::decode(b"not zstd", &exp).is_err());
        let mut v = serde_json::to_value(&index).unwrap();
        v["spans"][0]["extra"] = 1.into();
        let json = serde_json::to_vec(&v).unwrap();
        assert!(SeekIndex::decode(&zstd::bulk::compress(&json, 3).unwrap(), &exp).is_err());
    }
}
