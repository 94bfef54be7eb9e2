//! Building a seekable index: the layer's blob read once, front to back, cut into spans at
//! deflate block boundaries (gzip, [`super::zran::BlockInflater`]) or at byte offsets
//! (uncompressed), each span's window written to the windows blob, the tar entries listed.

use std::io::Read;

use super::zran::BlockInflater;
use super::zran::WINDOW;
use super::{Compression, Entry, Expected, Layout, SeekIndex, Span, Windows};
use super::{MAX_ENTRIES, MAX_SPANS, VERSION};
use crate::error::{Error, Result};
use crate::format::artifact::Codec;
use crate::oci::digest::{Digest, Hasher};

/// How many bytes of the stream's start [`build`] hands back: enough to identify a disk.
pub const HEAD_BYTES: u64 = 66 << 10;

/// What [`build`] read: the index, and the stream's first [`HEAD_BYTES`] (for a disk file,
/// what identifies it).
#[derive(Debug)]
pub struct Built {
    pub index: SeekIndex,
    pub head: Vec<u8>,
}

/// Builds the index of a layer while reading its blob once, front to back: the blob's own
/// reader checks its digest at the end; this checks the stream against the digest `expected`
/// pins. The compression is `expected`'s or, for a disk artifact, what the blob's first bytes
/// say. A gzip layer's windows blob is written to `windows` (nothing for an uncompressed one).
pub fn build(
    blob: impl Read,
    expected: &Expected,
    span_size: u64,
    windows: impl std::io::Write,
) -> Result<Built> {
    use std::io::BufRead;
    crate::format::layout::check_chunk_size(span_size as usize).map_err(|_| {
        Error::invalid(format!(
            "--span {span_size} must be a power of two between 64K and 16M"
        ))
    })?;
    let mut blob = std::io::BufReader::with_capacity(64 << 10, blob);
    let compression = match expected.compression {
        Some(c) => c,
        None => {
            let head = blob
                .fill_buf()
                .map_err(|e| Error::io("reading the layer blob", e))?;
            match Codec::sniff(head) {
                Codec::Gzip => Compression::Gzip,
                Codec::Plain => Compression::None,
                other => {
                    return Err(Error::unsupported(format!(
                        "the layer is {}-compressed; a seekable index reads gzip and uncompressed layers (republish it with `vmdisk convert`)",
                        other.name()
                    )))
                }
            }
        }
    };
    let mut stream = IndexingReader::new(blob, compression, span_size, windows)?;
    let mut head = Vec::new();
    let entries = match expected.layout {
        Layout::Tar => read_entries(&mut stream)?,
        Layout::File => {
            (&mut stream)
                .take(HEAD_BYTES)
                .read_to_end(&mut head)
                .map_err(|e| Error::io("reading the layer", e))?;
            Vec::new()
        }
    };
    std::io::copy(&mut stream, &mut std::io::sink())
        .map_err(|e| Error::io("reading the rest of the layer", e))?;
    let (spans, diff_id, stream_size, windows) = stream.finish()?;
    if let Some(pinned) = expected.diff_id.filter(|&d| d != diff_id) {
        return Err(Error::corrupt(match expected.layout {
            Layout::Tar => format!(
                "the layer's tar stream hashes to {diff_id}, its image config says {pinned}"
            ),
            Layout::File => {
                format!("the disk hashes to {diff_id}, the artifact's annotation says {pinned}")
            }
        }));
    }
    let index = SeekIndex {
        version: VERSION,
        layer: expected.layer,
        layer_size: expected.layer_size,
        compression,
        layout: expected.layout,
        diff_id,
        stream_size,
        span_size,
        windows,
        entries,
        spans,
    };
    index.validate(expected)?;
    Ok(Built { index, head })
}

/// The tar entries of the stream, as a tar reader sees them.
fn read_entries(stream: &mut impl Read) -> Result<Vec<Entry>> {
    let corrupt = |e: std::io::Error| Error::corrupt(format!("the layer is not a valid tar: {e}"));
    let mut entries = Vec::new();
    for entry in tar::Archive::new(stream).entries().map_err(corrupt)? {
        let entry = entry.map_err(corrupt)?;
        let header = entry.header();
        let kind = match header.entry_type() {
            tar::EntryType::Regular | tar::EntryType::Continuous => "reg",
            tar::EntryType::Directory => "dir",
            tar::EntryType::Symlink => "symlink",
            tar::EntryType::Link => "hardlink",
            tar::EntryType::XGlobalHeader => continue,
            _ => "other",
        };
        let name = String::from_utf8(entry.path_bytes().into_owned())
            .map_err(|_| Error::corrupt("a tar entry name is not UTF-8"))?;
        if kind == "dir" && matches!(name.trim_end_matches('/'), "" | ".") {
            continue;
        }
        let link_name = entry
            .link_name_bytes()
            .map(|l| String::from_utf8(l.into_owned()))
            .transpose()
            .map_err(|_| Error::corrupt(format!("the link target of {name} is not UTF-8")))?
            .unwrap_or_default();
        let number = |v: std::io::Result<u64>| v.map_err(corrupt);
        if entries.len() == MAX_ENTRIES {
            return Err(Error::unsupported(format!(
                "the layer has more than {MAX_ENTRIES} entries"
            )));
        }
        entries.push(Entry {
            kind: kind.into(),
            link_name,
            mode: (number(header.mode().map(u64::from))? & 0o7777) as u32,
            mtime: number(header.mtime())?,
            uid: u32::try_from(number(header.uid())?)
                .map_err(|_| Error::corrupt("uid too large"))?,
            gid: u32::try_from(number(header.gid())?)
                .map_err(|_| Error::corrupt("gid too large"))?,
            size: if kind == "reg" { entry.size() } else { 0 },
            offset: if kind == "reg" {
                entry.raw_file_position()
            } else {
                0
            },
            name,
        });
    }
    Ok(entries)
}

/// The layer's uncompressed stream, read through once, noting spans as it goes and writing
/// each span's window into the windows blob.
struct IndexingReader<R, W> {
    blob: R,
    windows: W,
    windows_hasher: Hasher,
    windows_size: u64,
    compression: Compression,
    span_size: u64,
    inflater: Option<BlockInflater>,
    input: Vec<u8>,
    input_at: usize,
    /// Whether the blob has ended.
    blob_done: bool,
    /// Blob bytes consumed by the inflater (its total_in).
    consumed: u64,
    member_done: bool,
    /// A block boundary where the next span starts once output follows it: a stream may end
    /// in empty blocks (Go's gzip writers close with an empty final block, sync-flushing ones
    /// add empty blocks before it), which must not make an empty last span.
    cut: Option<Cut>,
    spans: Vec<Span>,
    span_hasher: Hasher,
    stream_hasher: Hasher,
    /// The last 32 KiB of output (a ring: `ring_at` is where the next byte goes).
    ring: Vec<u8>,
    ring_at: usize,
    produced: u64,
}

/// Where a span may start: blob byte `input` (bit `bits` of it), after `consumed` blob bytes
/// were inflated.
#[derive(Clone, Copy)]
struct Cut {
    input: u64,
    bits: u8,
    consumed: u64,
}

impl<R: Read, W: std::io::Write> IndexingReader<R, W> {
    fn new(blob: R, compression: Compression, span_size: u64, windows: W) -> Result<Self> {
        Ok(IndexingReader {
            blob,
            windows,
            windows_hasher: Hasher::new(),
            windows_size: 0,
            compression,
            span_size,
            inflater: match compression {
                Compression::Gzip => Some(BlockInflater::gzip()?),
                Compression::None => None,
            },
            input: Vec::with_capacity(128 << 10),
            input_at: 0,
            blob_done: false,
            consumed: 0,
            member_done: false,
            cut: None,
            spans: Vec::new(),
            span_hasher: Hasher::new(),
            stream_hasher: Hasher::new(),
            ring: Vec::with_capacity(WINDOW),
            ring_at: 0,
            produced: 0,
        })
    }

    /// Starts a span at the current output position, at `cut` of the blob.
    fn checkpoint(&mut self, cut: Cut) -> std::io::Result<()> {
        if let Some(last) = self.spans.last_mut() {
            last.digest = std::mem::take(&mut self.span_hasher).finish();
            last.input_end = cut.consumed;
        }
        if self.spans.len() == MAX_SPANS {
            return Err(std::io::Error::other(format!(
                "the layer needs more than {MAX_SPANS} spans; use a larger --span"
            )));
        }
        if self.compression == Compression::Gzip && self.produced > 0 {
            let mut w = Vec::with_capacity(self.ring.len());
            w.extend_from_slice(&self.ring[self.ring_at..]);
            w.extend_from_slice(&self.ring[..self.ring_at]);
            let frame = zstd::bulk::compress(&w, 3)?;
            self.windows.write_all(&frame)?;
            self.windows_hasher.update(&frame);
            self.windows_size += frame.len() as u64;
        }
        self.spans.push(Span {
            offset: self.produced,
            input: cut.input,
            input_end: cut.input,
            bits: cut.bits,
            window_end: self.windows_size,
            digest: Digest::of(b""),
        });
        Ok(())
    }

    /// Takes `data` as the next output bytes.
    fn emit(&mut self, data: &[u8]) {
        self.stream_hasher.update(data);
        self.span_hasher.update(data);
        self.produced += data.len() as u64;
        if self.compression == Compression::Gzip {
            let mut tail = &data[data.len().saturating_sub(WINDOW)..];
            while !tail.is_empty() {
                if self.ring.len() < WINDOW {
                    let n = tail.len().min(WINDOW - self.ring.len());
                    self.ring.extend_from_slice(&tail[..n]);
                    self.ring_at = self.ring.len() % WINDOW;
                    tail = &tail[n..];
                } else {
                    let n = tail.len().min(WINDOW - self.ring_at);
                    self.ring[self.ring_at..self.ring_at + n].copy_from_slice(&tail[..n]);
                    self.ring_at = (self.ring_at + n) % WINDOW;
                    tail = &tail[n..];
                }
            }
        }
    }

    fn fill(&mut self) -> std::io::Result<()> {
        if self.input_at < self.input.len() && self.input_at > 0 {
            self.input.copy_within(self.input_at.., 0);
        }
        let kept = self.input.len() - self.input_at.min(self.input.len());
        self.input.truncate(kept);
        self.input_at = 0;
        let mut buf = [0u8; 64 << 10];
        let n = self.blob.read(&mut buf)?;
        if n == 0 {
            self.blob_done = true;
        }
        self.input.extend_from_slice(&buf[..n]);
        Ok(())
    }

    /// Spans, the stream's digest and size and the windows blob, once the whole blob was read.
    fn finish(mut self) -> Result<(Vec<Span>, Digest, u64, Option<Windows>)> {
        // The blob reader checks the blob's digest at its end: read it there.
        let mut rest = Vec::new();
        self.blob
            .read_to_end(&mut rest)
            .map_err(|e| Error::io("reading the layer blob", e))?;
        let trailing = rest.len() + self.input.len() - self.input_at.min(self.input.len());
        if self.compression == Compression::Gzip && (!self.member_done || trailing > 0) {
            return Err(Error::unsupported(
                "the gzip layer has more than one member (or trailing bytes); vmdisk indexes single-member gzip layers",
            ));
        }
        if let Some(last) = self.spans.last_mut() {
            last.digest = std::mem::take(&mut self.span_hasher).finish();
            last.input_end = match self.compression {
                Compression::Gzip => self.consumed,
                Compression::None => self.produced,
            };
        }
        if self.spans.is_empty() {
            return Err(Error::corrupt("the layer is empty"));
        }
        self.windows
            .flush()
            .map_err(|e| Error::io("writing the windows", e))?;
        let windows = (self.compression == Compression::Gzip).then(|| Windows {
            digest: self.windows_hasher.finish(),
            size: self.windows_size,
        });
        let size = self.produced;
        Ok((self.spans, self.stream_hasher.finish(), size, windows))
    }

    fn read_plain(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let next = (self.produced / self.span_size + 1) * self.span_size;
        let room = ((next - self.produced) as usize).min(buf.len());
        let n = self.blob.read(&mut buf[..room])?;
        if n == 0 {
            return Ok(0);
        }
        if self.spans.is_empty() || self.produced.is_multiple_of(self.span_size) {
            self.checkpoint(Cut {
                input: self.produced,
                bits: 0,
                consumed: self.consumed,
            })?;
        }
        self.emit(&buf[..n]);
        // For an uncompressed layer a span's blob bytes are its own.
        self.consumed = self.produced;
        Ok(n)
    }
}

impl<R: Read, W: std::io::Write> Read for IndexingReader<R, W> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.compression == Compression::None {
            return self.read_plain(buf);
        }
        loop {
            if self.member_done {
                return Ok(0);
            }
            if self.input_at == self.input.len() {
                if self.blob_done {
                    return Err(std::io::Error::other("the gzip layer ends early"));
                }
                self.fill()?;
                continue;
            }
            let inflater = self
                .inflater
                .as_mut()
                .expect("gzip layers have an inflater");
            let step = inflater
                .inflate(&self.input[self.input_at..], buf)
                .map_err(|e| std::io::Error::other(e.chain()))?;
            self.input_at += step.consumed;
            if step.produced > 0 {
                if let Some(cut) = self.cut.take() {
                    self.checkpoint(cut)?;
                }
            }
            self.consumed += step.consumed as u64;
            let since = self.spans.last().map_or(u64::MAX, |s| {
                self.produced + step.produced as u64 - s.offset
            });
            self.emit(&buf[..step.produced]);
            if step.end {
                self.member_done = true;
            } else if step.at_boundary && (self.spans.is_empty() || since >= self.span_size) {
                self.cut = Some(Cut {
                    input: self.consumed - u64::from(step.pending_bits > 0),
                    bits: step.pending_bits,
                    consumed: self.consumed,
                });
            }
            if step.produced > 0 {
                return Ok(step.produced);
            }
            if step.consumed == 0 && !step.at_boundary {
                // Needs more input than is buffered.
                if self.blob_done {
                    return Err(std::io::Error::other("the gzip layer ends early"));
                }
                self.fill()?;
            }
        }
    }
}
