//! The codec of layers read through a seekable index: an ordinary gzip or uncompressed tar
//! layer, or a disk artifact's disk file. The unit of a fetch is a span: its compressed bytes
//! and, for gzip, its window (the 32 KiB of stream before it), which is the end of the span
//! before it when both come in one fetch, else a frame of the index's windows blob. A span
//! decodes to exactly its length and is checked against its digest before any of it is used.
//!
//! Every regular file is cut where the spans are: a chunk is the part of one span inside one
//! file, fetched as the whole span. A chunk that is a whole span carries the span's digest (so
//! identical spans of other layers dedup); a part of one carries none and is verified through
//! its span. The stream between files (tar headers, padding, the end of the archive) is read
//! from the spans that hold it.

use std::ops::Range;

use futures_util::future::BoxFuture;

use crate::error::{Error, Result};
use crate::format::seekable::{self, Expected, Layout, SeekIndex};
use crate::format::tree::{clean_path, Chunk, Node, NodeKind};
use crate::layer::{fetch_checked, MAX_REGION_DECODED};
use crate::layer::{Ask, Codec, Decoded, Extent, Fetch, Piece, Store, StreamKind};
use crate::layer::{FileChunks, LayerMeta, Table};
use crate::layer::{IndexSource, Layer};

/// The codec of a layer read through `index`.
#[derive(Debug)]
pub struct Indexed {
    index: SeekIndex,
    /// The span chunk `i` is part of.
    span_of: Vec<u32>,
    /// Where each file's content starts in the uncompressed stream.
    file_at: Vec<u64>,
}

/// What the index of the layer `meta` records must describe.
pub fn expected(meta: &LayerMeta, source: &IndexSource) -> Expected {
    Expected {
        layer: meta.layer_digest,
        layer_size: meta.layer_size,
        compression: Some(source.compression),
        diff_id: Some(meta.diff_id),
        layout: source.layout,
    }
}

/// The table and codec of the layer `meta` records from its index bytes (pinned by
/// `meta.toc_digest`, validated against what the record says the layer is). A disk file's
/// layer (a disk artifact's) is one file at the path its record names, each span one chunk.
pub(crate) fn open(meta: &LayerMeta, index_bytes: &[u8]) -> Result<(Table, Indexed)> {
    let source = meta
        .index_source()
        .ok_or_else(|| Error::corrupt("the layer's record names no seekable index"))?;
    meta.toc_digest.verify(index_bytes, "seekable index")?;
    let index = SeekIndex::decode(index_bytes, &expected(meta, source))?;
    let entries: std::borrow::Cow<'_, [seekable::Entry]> = match index.layout {
        Layout::Tar => (&index.entries[..]).into(),
        Layout::File => {
            let path = meta.disk_path.as_deref().ok_or_else(|| {
                Error::corrupt("the record of a disk file's layer names no path for it")
            })?;
            disk_file_entries(path, index.stream_size).into()
        }
    };
    let mut nodes = Vec::with_capacity(entries.len());
    let (mut files, mut chunks, mut span_of, mut file_at) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for entry in entries.iter() {
        let kind = match entry.kind.as_str() {
            "dir" => NodeKind::Dir,
            "reg" => NodeKind::Regular,
            "symlink" => NodeKind::Symlink,
            "hardlink" => NodeKind::Hardlink,
            _ => NodeKind::Other,
        };
        let link = match kind {
            NodeKind::Hardlink => clean_path(&entry.link_name)?,
            _ => entry.link_name.clone(),
        };
        if kind == NodeKind::Regular && entry.size > 0 {
            let first = chunks.len();
            let file = entry.offset..entry.offset + entry.size;
            for s in index.spans_for(file.clone()) {
                let span = &index.spans[s];
                let (start, end) = (span.offset.max(file.start), index.span_end(s).min(file.end));
                let whole = (start, end) == (span.offset, index.span_end(s));
                chunks.push(Chunk {
                    offset: start - file.start,
                    size: end - start,
                    compressed: span.input..span.input_end,
                    digest: whole.then_some(span.digest),
                    zeros: false,
                });
                span_of.push(s as u32);
            }
            files.push(FileChunks {
                node: nodes.len(),
                first,
                count: chunks.len() - first,
            });
            file_at.push(entry.offset);
        }
        nodes.push(Node {
            kind,
            path: clean_path(&entry.name)?,
            link,
            mode: entry.mode,
            uid: entry.uid,
            gid: entry.gid,
            size: if kind == NodeKind::Regular {
                entry.size
            } else {
                0
            },
            mod_time: time::OffsetDateTime::from_unix_timestamp(entry.mtime as i64)
                .ok()
                .and_then(|t| {
                    t.format(&time::format_description::well_known::Rfc3339)
                        .ok()
                }),
            digest: None,
            chunks: Vec::new(),
        });
    }
    let table = Table {
        nodes,
        files,
        chunks,
    };
    Ok((
        table,
        Indexed {
            index,
            span_of,
            file_at,
        },
    ))
}

/// The lazy view of a disk artifact's layer, as a containerDisk holds its disk
/// ([`crate::format::layout::disk_view`]): the directories above `path` and the disk file,
/// whose content is the whole stream.
fn disk_file_entries(path: &str, size: u64) -> Vec<seekable::Entry> {
    crate::format::layout::disk_view(path)
        .map(|v| seekable::Entry {
            kind: if v.dir { "dir" } else { "reg" }.into(),
            name: v.path,
            link_name: String::new(),
            mode: v.mode,
            uid: v.owner,
            gid: v.owner,
            mtime: 0,
            size: if v.dir { 0 } else { size },
            offset: 0,
        })
        .collect()
}

impl Indexed {
    /// The span chunk `idx` is part of.
    fn span_of(&self, idx: usize) -> usize {
        self.span_of[idx] as usize
    }

    /// Chunk `idx`'s part of the decoded bytes of its span.
    fn chunk_in_span<'a>(&self, layer: &Layer, idx: usize, span: &'a [u8]) -> &'a [u8] {
        let (file, chunk) = layer.chunk(idx);
        let s = self.span_of(idx);
        let start = (self.file_at[file] + chunk.offset - self.index.spans[s].offset) as usize;
        &span[start..start + chunk.size as usize]
    }
}

impl Codec for Indexed {
    fn stream(&self) -> StreamKind {
        match self.index.layout {
            Layout::Tar => StreamKind::Tar,
            Layout::File => StreamKind::DiskFile,
        }
    }

    fn windows_blob(&self) -> Option<crate::oci::digest::Digest> {
        self.index.windows.map(|w| w.digest)
    }

    fn window(&self, idx: usize) -> Option<Range<u64>> {
        self.index.window_range(self.span_of(idx))
    }

    fn decode_window(&self, idx: usize, frame: &[u8]) -> Result<Vec<u8>> {
        self.index.decode_window(self.span_of(idx), frame)
    }

    /// Decodes span by span, each later span's window the end of the span before it; a span
    /// that fails breaks the chain (the next one then has no window and fails too, to be
    /// fetched again on its own).
    fn decode_run(
        &self,
        layer: &Layer,
        run: &[usize],
        bytes: &[u8],
        window: Option<&[u8]>,
        store: &mut Store<'_>,
    ) -> Result<()> {
        let first_span = self.span_of(run[0]);
        let base = layer.chunks[run[0]].compressed.start;
        let mut previous: Option<(usize, Vec<u8>)> = None;
        for &idx in run {
            let c = &layer.chunks[idx].compressed;
            let input = &bytes[(c.start - base) as usize..(c.end - base) as usize];
            let s = self.span_of(idx);
            let chained = previous
                .as_ref()
                .filter(|(p, _)| p + 1 == s)
                .and_then(|(_, data)| self.index.window_after(s, data));
            let window = chained.or(window.filter(|_| s == first_span));
            let decoded = window
                .ok_or_else(|| Error::corrupt(format!("span {s} has no window to start from")))
                .and_then(|w| self.index.decode_span(s, input, w));
            match decoded {
                Ok(span) => {
                    store(
                        idx,
                        Ok(Decoded::Bytes(self.chunk_in_span(layer, idx, &span))),
                    )?;
                    previous = Some((s, span));
                }
                Err(e) => {
                    store(idx, Err(e))?;
                    previous = None;
                }
            }
        }
        Ok(())
    }

    /// Every chunk, and the stream between files decoded from the spans that hold it (the
    /// same for either extent: an indexed layer has no TOC the structure check could stop at).
    fn pieces<'a>(
        &'a self,
        layer: &'a Layer,
        _extent: Extent,
        fetch: &'a dyn Fetch,
        ask: Ask,
    ) -> BoxFuture<'a, Result<Vec<Piece>>> {
        Box::pin(async move {
            let mut order: Vec<usize> = (0..layer.files.len()).collect();
            order.sort_unstable_by_key(|&f| self.file_at[f]);
            let mut pieces = Vec::with_capacity(layer.chunks.len() + order.len() + 1);
            let mut wanted = Vec::new();
            let mut at = 0u64;
            for next in order.into_iter().map(Some).chain([None]) {
                let end = next.map_or(self.index.stream_size, |f| self.file_at[f]);
                if end > at {
                    wanted.push((pieces.len(), at..end));
                    pieces.push(Piece::Region(Vec::new()));
                }
                if let Some(f) = next {
                    pieces.extend(layer.chunks_of(f).map(Piece::Chunk));
                    at = end + layer.file_size(f);
                }
            }
            let between: u64 = wanted.iter().map(|(_, r)| r.end - r.start).sum();
            if between > MAX_REGION_DECODED {
                return Err(Error::corrupt(format!(
                    "{between} bytes of the layer's stream belong to no file, more than the {MAX_REGION_DECODED} tar headers can take"
                )));
            }
            let mut reader = SpanReader::new(&self.index, fetch, ask);
            for (slot, range) in wanted {
                pieces[slot] = Piece::Region(reader.read(range).await?);
            }
            Ok(pieces)
        })
    }
}

/// Reads ranges of an indexed layer's uncompressed stream from the spans that hold them, in
/// order: each span fetched through `fetch` and checked against its digest (fetched once more
/// from the registry itself if it fails), its window the end of the span read before it when
/// that is the span before it, else its frame in the windows blob.
pub struct SpanReader<'a> {
    index: &'a SeekIndex,
    fetch: &'a dyn Fetch,
    ask: Ask,
    /// The last span read and its bytes.
    previous: Option<(usize, Vec<u8>)>,
}

impl<'a> SpanReader<'a> {
    pub fn new(index: &'a SeekIndex, fetch: &'a dyn Fetch, ask: Ask) -> Self {
        SpanReader {
            index,
            fetch,
            ask,
            previous: None,
        }
    }

    /// Bytes `range` of the stream.
    pub async fn read(&mut self, range: Range<u64>) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity((range.end - range.start) as usize);
        for s in self.index.spans_for(range.clone()) {
            let data = self.span(s).await?;
            let start = self.index.spans[s].offset;
            let from = (range.start.max(start) - start) as usize;
            let to = (range.end.min(self.index.span_end(s)) - start) as usize;
            out.extend_from_slice(&data[from..to]);
            self.previous = Some((s, data));
        }
        Ok(out)
    }

    /// Span `s`, decoded and verified.
    async fn span(&self, s: usize) -> Result<Vec<u8>> {
        let span = &self.index.spans[s];
        let range = span.input..span.input_end;
        let chained = self
            .previous
            .as_ref()
            .filter(|(p, _)| p + 1 == s)
            .and_then(|(_, data)| self.index.window_after(s, data))
            .map(<[u8]>::to_vec);
        let what = format!(
            "span {s} of the layer (bytes {}..{})",
            range.start, range.end
        );
        fetch_checked(&what, self.ask, |ask| {
            let (range, chained) = (range.clone(), chained.clone());
            async move {
                let (bytes, window) = match chained {
                    Some(w) => (self.fetch.blob(range, ask).await?, w),
                    None => {
                        let (bytes, window) =
                            tokio::join!(self.fetch.blob(range, ask), self.window(s, ask));
                        (bytes?, window?)
                    }
                };
                crate::task::off_the_runtime(|| self.index.decode_span(s, &bytes, &window))
            }
        })
        .await
    }

    /// The window span `s` decodes from: its frame in the windows blob, decoded (empty when
    /// the span needs none).
    async fn window(&self, s: usize, ask: Ask) -> Result<Vec<u8>> {
        match self.index.window_range(s) {
            Some(frame) => {
                let bytes = self.fetch.windows(frame, ask).await?;
                self.index.decode_window(s, &bytes)
            }
            None => Ok(Vec::new()),
        }
    }
}
