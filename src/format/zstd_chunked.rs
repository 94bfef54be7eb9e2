//! The zstd:chunked layer layout (containers/storage), written by `vmdisk push` and read by
//! everything that fetches lazily.
//!
//! A layer is an ordinary `tar+zstd` stream made of many zstd frames: tar headers and padding
//! sit in "metadata" frames, every chunk of file content is a frame of its own, so a chunk can
//! be fetched with one HTTP Range request and decompressed alone. After the end-of-archive
//! blocks come three zstd *skippable* frames, which every zstd decoder ignores:
//!
//! ```text
//! [meta frame: tar header(s)] [chunk frame]... [meta frame: padding, next header]...
//! [meta frame: padding + 1024 zero bytes]
//! [skippable: zstd(TOC JSON)] [skippable: zstd(tar-split)] [skippable: 64-byte footer]
//! ```
//!
//! The TOC (`{"version":1,"entries":[...]}`) lists every tar entry; a regular file is a `reg`
//! entry followed by `chunk` entries, each with the compressed `offset` of its frame, its
//! uncompressed `chunkOffset`/`chunkSize` and the sha256 `chunkDigest` of its content. Layer
//! annotations locate the TOC and pin it by digest, so a reader trusts nothing it has not
//! checked: the TOC against the annotation, every chunk against its `chunkDigest`.
//! `docs/format.md` describes the bytes.

use std::collections::BTreeMap;
use std::io::Write;
use std::ops::Range;
use std::sync::Arc;

use super::tarsplit::{TarSplitWriter, CRC64_ISO};
use super::toc::{parse_toc, Toc, TocEntry};
use super::tree::{Chunk, Node};
use crate::digest::{Digest, Hasher};
use crate::error::{Error, Result};

/// TOC checksum annotation (current containers/storage).
pub const ANN_TOC_CHECKSUM: &str = "io.github.containers.zstd-chunked.manifest-checksum";
/// TOC position annotation, `offset:length:uncompressedLength:type`.
pub const ANN_TOC_POSITION: &str = "io.github.containers.zstd-chunked.manifest-position";
/// tar-split position annotation, `offset:length:uncompressedLength`.
pub const ANN_TARSPLIT_POSITION: &str = "io.github.containers.zstd-chunked.tarsplit-position";
/// TOC checksum annotation written by older containers/storage (Debian 12's skopeo 1.9).
pub const ANN_TOC_CHECKSUM_OLD: &str = "io.containers.zstd-chunked.manifest-checksum";
/// TOC position annotation written by older containers/storage.
pub const ANN_TOC_POSITION_OLD: &str = "io.containers.zstd-chunked.manifest-position";
/// eStargz's TOC digest annotation (recognised, not read yet).
pub const ANN_ESTARGZ_TOC: &str = "containerd.io/snapshot/stargz/toc.digest";

/// The only TOC type defined ("CRFS").
const MANIFEST_TYPE_CRFS: u64 = 1;
/// Footer magic, "GNUlInUx".
const FOOTER_MAGIC: &[u8; 8] = b"GNUlInUx";
const SKIPPABLE_MAGIC: [u8; 4] = [0x50, 0x2a, 0x4d, 0x18];
const SKIPPABLE_HEADER: u64 = 8;

/// Largest compressed TOC we fetch.
pub const MAX_TOC_COMPRESSED: u64 = 64 << 20;
/// Largest TOC we decompress (a 50 GiB disk at 256 KiB chunks is about 50 MB).
pub const MAX_TOC_UNCOMPRESSED: u64 = 128 << 20;
/// Largest TOC (uncompressed) parsed from memory; larger ones are parsed as they are
/// decompressed, so a TOC never takes more than this much memory (an 8 GiB disk's is 6 MB).
pub const TOC_IN_MEMORY: u64 = 8 << 20;
/// The magic number that starts a regular zstd frame (little-endian 0xFD2FB528).
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

/// Where the TOC is in the blob and what it must hash to, from the layer annotations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TocLocation {
    pub offset: u64,
    pub length: u64,
    pub uncompressed_length: u64,
    pub checksum: Digest,
}

impl TocLocation {
    /// Checks that the TOC lies inside a blob of `blob_size` bytes, after at least the 8 bytes
    /// of the skippable frame header that precedes it.
    pub fn check_within(&self, blob_size: u64) -> Result<()> {
        if self.range().end > blob_size || self.offset < 8 {
            return Err(Error::corrupt(format!(
                "TOC range {:?} lies outside the {blob_size}-byte layer",
                self.range()
            )));
        }
        Ok(())
    }

    /// Reads the current or the older annotation generation; `Ok(None)` if neither is present.
    pub fn from_annotations(ann: &BTreeMap<String, String>) -> Result<Option<Self>> {
        let pair = [
            (ANN_TOC_POSITION, ANN_TOC_CHECKSUM),
            (ANN_TOC_POSITION_OLD, ANN_TOC_CHECKSUM_OLD),
        ]
        .into_iter()
        .find_map(|(p, c)| ann.get(p).map(|pos| (p, pos, ann.get(c))));
        let Some((key, position, checksum)) = pair else {
            return Ok(None);
        };
        let bad = |why: &str| Error::corrupt(format!("layer annotation {key}={position:?}: {why}"));
        let fields: Vec<u64> = position
            .split(':')
            .map(|f| f.parse::<u64>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| {
                bad("expected offset:length:uncompressedLength:type as decimal numbers")
            })?;
        let [offset, length, uncompressed_length, kind] = fields[..] else {
            return Err(bad("expected four fields"));
        };
        if kind != MANIFEST_TYPE_CRFS {
            return Err(Error::unsupported(format!(
                "zstd:chunked TOC type {kind} is not supported (only 1)"
            )));
        }
        if length == 0 || length > MAX_TOC_COMPRESSED || uncompressed_length > MAX_TOC_UNCOMPRESSED
        {
            return Err(bad(&format!(
                "TOC size {length} (uncompressed {uncompressed_length}) outside the accepted bounds ({MAX_TOC_COMPRESSED}, {MAX_TOC_UNCOMPRESSED})"
            )));
        }
        offset
            .checked_add(length)
            .ok_or_else(|| bad("offset overflows"))?;
        let checksum = checksum
            .ok_or_else(|| {
                bad("the TOC checksum annotation is missing; the TOC cannot be verified")
            })?
            .parse::<Digest>()
            .map_err(|e| bad(&e.to_string()))?;
        Ok(Some(TocLocation {
            offset,
            length,
            uncompressed_length,
            checksum,
        }))
    }

    /// The byte range of the compressed TOC in the blob.
    pub fn range(&self) -> Range<u64> {
        self.offset..self.offset + self.length
    }
}

/// Verifies the compressed TOC against its pinned checksum, decompresses it within bounds and
/// parses it.
pub fn decode_toc(compressed: &[u8], loc: &TocLocation) -> Result<Toc> {
    loc.checksum.verify(compressed, "zstd:chunked TOC")?;
    let limit = if loc.uncompressed_length > 0 {
        loc.uncompressed_length
    } else {
        MAX_TOC_UNCOMPRESSED
    };
    let json =
        decompress_bounded(compressed, limit).map_err(|e| e.context("decompressing the TOC"))?;
    if loc.uncompressed_length > 0 && json.len() as u64 != loc.uncompressed_length {
        return Err(Error::corrupt(format!(
            "TOC decompressed to {} bytes, the annotation says {}",
            json.len(),
            loc.uncompressed_length
        )));
    }
    let toc: Toc = serde_json::from_slice(&json)
        .map_err(|e| Error::corrupt(format!("TOC is not valid JSON: {e}")))?;
    if toc.version != 1 {
        return Err(Error::unsupported(format!(
            "TOC version {} is not supported (only 1)",
            toc.version
        )));
    }
    Ok(toc)
}

/// Decompresses all zstd frames of `data`, failing if the output would exceed `limit` bytes.
pub fn decompress_bounded(data: &[u8], limit: u64) -> Result<Vec<u8>> {
    // One call into the bulk decoder (every frame, into a buffer of exactly `limit` bytes:
    // pages are only touched as they are written) instead of a stream that regrows its output.
    let capacity = usize::try_from(limit)
        .map_err(|_| Error::corrupt(format!("{limit} bytes cannot be held in memory")))?;
    zstd::bulk::decompress(data, capacity).map_err(|e| {
        Error::corrupt(format!(
            "zstd data is corrupt or decompresses to more than the expected {limit} bytes ({e})"
        ))
    })
}

/// The length of the zstd frame (regular or skippable) at the start of `data`, if a whole one
/// is there.
fn frame_len(data: &[u8]) -> Option<usize> {
    zstd::zstd_safe::find_frame_compressed_size(data)
        .ok()
        .filter(|&n| n > 0 && n <= data.len())
}

fn is_skippable(data: &[u8]) -> bool {
    data.len() >= 4 && data[1..4] == SKIPPABLE_MAGIC[1..] && data[0] & 0xf0 == 0x50
}

/// Checks that `data` is one or more whole regular zstd frames and nothing else. A chunk must
/// be: a skippable frame (which every ordinary decoder ignores) or trailing bytes would let the
/// lazy view serve bytes an extracted layer does not contain.
pub fn check_regular_frames(data: &[u8]) -> Result<()> {
    if data.is_empty() {
        return Err(Error::corrupt("empty chunk frame"));
    }
    let mut at = 0;
    while at < data.len() {
        let rest = &data[at..];
        if rest.len() < 4 || rest[..4] != ZSTD_MAGIC {
            return Err(Error::corrupt(format!(
                "byte {at} of the chunk's range does not start a regular zstd frame{}: an ordinary decoder would not read it as file content",
                if is_skippable(rest) { " (it is a skippable frame)" } else { "" }
            )));
        }
        at += frame_len(rest).ok_or_else(|| {
            Error::corrupt(format!(
                "the zstd frame at byte {at} of the chunk's range is incomplete or corrupt"
            ))
        })?;
    }
    Ok(())
}

/// The content of `chunk` from its `frame` (the compressed range): the range must be whole
/// regular zstd frames (what an ordinary decoder reads as file content), decompress within the
/// chunk's size to exactly that size, and match the chunk's digest. Only the zstd:chunked
/// codec (`layer::codec`) turns registry bytes into chunk content with it.
pub fn decode_chunk(frame: &[u8], chunk: &Chunk) -> Result<Vec<u8>> {
    check_regular_frames(frame)?;
    let data = decompress_bounded(frame, chunk.size)?;
    if data.len() as u64 != chunk.size {
        return Err(Error::corrupt(format!(
            "chunk at {} decompressed to {} bytes, expected {}",
            chunk.offset,
            data.len(),
            chunk.size
        )));
    }
    match chunk.digest {
        Some(d) => d.verify(&data, &format!("chunk at offset {}", chunk.offset))?,
        None => {
            return Err(Error::corrupt(format!(
                "chunk at {} has no digest",
                chunk.offset
            )))
        }
    }
    Ok(data)
}

/// Decodes a region of the layer that lies between chunks exactly as an ordinary decoder
/// would: regular frames are decompressed, skippable frames skipped; the region must be whole
/// frames. Fails if the output would exceed `limit` bytes.
pub fn decode_region(data: &[u8], limit: u64) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let rest = &data[at..];
        let len = frame_len(rest).ok_or_else(|| {
            Error::corrupt(format!(
                "the layer holds no whole zstd frame at byte {at} of a region between chunks"
            ))
        })?;
        if !is_skippable(rest) {
            let left = limit.saturating_sub(out.len() as u64);
            out.extend(decompress_bounded(&rest[..len], left)?);
        }
        at += len;
    }
    Ok(out)
}

/// Verifies a compressed TOC against its pinned checksum, then decompresses, parses and
/// validates it in one pass: entries are checked and folded into nodes as they are decoded, so
/// memory holds the chunk table and never the JSON or its parsed entries (a 50 GiB disk's TOC
/// is about 40 MB of JSON). `data_end` is where the layer's data region ends (the TOC offset).
pub fn read_toc(compressed: &[u8], loc: &TocLocation) -> Result<Vec<Node>> {
    loc.checksum.verify(compressed, "zstd:chunked TOC")?;
    let data_end = loc.offset.saturating_sub(SKIPPABLE_HEADER);
    if loc.uncompressed_length > 0 && loc.uncompressed_length <= TOC_IN_MEMORY {
        // Small enough to hold: parsing a slice is a third faster than parsing a stream.
        let json = decompress_bounded(compressed, loc.uncompressed_length).map_err(|e| {
            e.context(format!(
                "decompressing the TOC (the annotation says {} bytes)",
                loc.uncompressed_length
            ))
        })?;
        if json.len() as u64 != loc.uncompressed_length {
            return Err(Error::corrupt(format!(
                "TOC decompressed to {} bytes, the annotation says {}",
                json.len(),
                loc.uncompressed_length
            )));
        }
        return parse_toc(serde_json::Deserializer::from_slice(&json), data_end);
    }
    let decoder = zstd::stream::read::Decoder::with_buffer(compressed)
        .map_err(|e| Error::io("starting the TOC decompressor", e))?;
    let json = std::io::BufReader::with_capacity(
        64 << 10,
        Bounded {
            inner: decoder,
            read: 0,
            expected: loc.uncompressed_length,
        },
    );
    parse_toc(serde_json::Deserializer::from_reader(json), data_end)
        .map_err(|e| e.context("reading the TOC"))
}

/// Decompressed TOC bytes, failing past [`MAX_TOC_UNCOMPRESSED`] or, when the annotation
/// gives the uncompressed length (`expected` > 0), as soon as the length differs from it.
struct Bounded<R> {
    inner: R,
    read: u64,
    expected: u64,
}

impl<R: std::io::Read> std::io::Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        let limit = if self.expected > 0 {
            self.expected
        } else {
            MAX_TOC_UNCOMPRESSED
        };
        if self.read > limit || (n == 0 && self.expected > 0 && self.read != self.expected) {
            return Err(std::io::Error::other(format!(
                "the TOC decompresses to {} bytes, {}",
                if n == 0 {
                    self.read.to_string()
                } else {
                    format!("more than {limit}")
                },
                if self.expected > 0 {
                    format!("the annotation says {}", self.expected)
                } else {
                    format!("the most accepted is {MAX_TOC_UNCOMPRESSED}")
                }
            )));
        }
        Ok(n)
    }
}

/// Tar metadata of a file or directory written into a layer.
#[derive(Clone, Debug)]
pub struct EntryMeta {
    /// Path inside the layer, relative, e.g. `disk/disk.qcow2` (directories without slash).
    pub path: String,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Seconds since the epoch.
    pub mtime: u64,
}

/// A chunk ready to be written: its content, its own zstd frame and its digest.
pub struct EncodedChunk {
    pub data: Arc<Vec<u8>>,
    pub frame: Vec<u8>,
    pub digest: Digest,
    pub zeros: bool,
}

impl EncodedChunk {
    /// Compresses `data` into one frame with `compressor`.
    pub fn encode(data: Arc<Vec<u8>>, compressor: &mut zstd::bulk::Compressor<'_>) -> Result<Self> {
        let frame = compressor
            .compress(&data)
            .map_err(|e| Error::io("zstd compression", e))?;
        let digest = Digest::of(&data);
        let zeros = data.iter().all(|&b| b == 0);
        Ok(EncodedChunk {
            data,
            frame,
            digest,
            zeros,
        })
    }
}

/// What a finished layer is, for the manifest and config.
#[derive(Clone, Debug)]
pub struct LayerSummary {
    /// Digest and size of the compressed blob.
    pub digest: Digest,
    pub size: u64,
    /// Digest of the uncompressed tar (the config's diff_id).
    pub diff_id: Digest,
    /// Annotations that locate and pin the TOC (both generations) and the tar-split.
    pub annotations: BTreeMap<String, String>,
    pub toc_location: TocLocation,
    pub chunks: u64,
    pub zero_chunks: u64,
}

struct OpenFile {
    path: String,
    size: u64,
    written: u64,
    hasher: Hasher,
    crc: crc::Digest<'static, u64, crc::Table<16>>,
    reg_index: usize,
}

/// Streams a zstd:chunked tar layer into `out` (usually a blob upload).
pub struct LayerWriter<W: Write> {
    out: W,
    written: u64,
    blob: Hasher,
    diff: Hasher,
    pending: Vec<u8>,
    entries: Vec<TocEntry>,
    tarsplit: TarSplitWriter,
    open: Option<OpenFile>,
    meta_compressor: zstd::bulk::Compressor<'static>,
    level: i32,
    chunks: u64,
    zero_chunks: u64,
}

fn rfc3339(secs: u64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp(secs.min(253_402_300_799) as i64)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
}

fn tar_header(meta: &EntryMeta, kind: tar::EntryType, size: u64) -> Result<Vec<u8>> {
    let mut header = tar::Header::new_ustar();
    let name = if kind == tar::EntryType::Directory {
        format!("{}/", meta.path)
    } else {
        meta.path.clone()
    };
    header.set_path(&name).map_err(|e| {
        Error::invalid(format!(
            "path {name:?} cannot be stored in a tar header: {e}"
        ))
    })?;
    header.set_entry_type(kind);
    header.set_size(size);
    header.set_mode(meta.mode);
    header.set_uid(meta.uid.into());
    header.set_gid(meta.gid.into());
    header.set_mtime(meta.mtime);
    header.set_cksum();
    Ok(header.as_bytes().to_vec())
}

impl<W: Write> LayerWriter<W> {
    /// A writer compressing at zstd `level`.
    pub fn new(out: W, level: i32) -> Result<Self> {
        let meta_compressor =
            zstd::bulk::Compressor::new(level).map_err(|e| Error::io("zstd compressor", e))?;
        Ok(LayerWriter {
            out,
            written: 0,
            blob: Hasher::new(),
            diff: Hasher::new(),
            pending: Vec::new(),
            entries: Vec::new(),
            tarsplit: TarSplitWriter::default(),
            open: None,
            meta_compressor,
            level,
            chunks: 0,
            zero_chunks: 0,
        })
    }

    fn emit(&mut self, bytes: &[u8]) -> Result<()> {
        self.out
            .write_all(bytes)
            .map_err(|e| Error::io("writing the layer", e))?;
        self.blob.update(bytes);
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Queues tar bytes that are not file content (headers, padding) for the next metadata
    /// frame, recording them in the tar-split in stream order.
    fn push_meta(&mut self, bytes: &[u8]) {
        self.tarsplit.segment(bytes);
        self.pending.extend_from_slice(bytes);
    }

    /// Compresses the pending tar metadata into a frame of its own.
    fn flush_meta(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let pending = std::mem::take(&mut self.pending);
        self.diff.update(&pending);
        let frame = self
            .meta_compressor
            .compress(&pending)
            .map_err(|e| Error::io("zstd compression", e))?;
        self.emit(&frame)
    }

    fn entry(meta: &EntryMeta, kind: &str) -> TocEntry {
        TocEntry {
            kind: kind.to_string(),
            name: meta.path.clone(),
            mode: i64::from(meta.mode),
            uid: i64::from(meta.uid),
            gid: i64::from(meta.gid),
            mod_time: Some(rfc3339(meta.mtime)),
            ..TocEntry::default()
        }
    }

    /// Adds a directory entry.
    pub fn add_dir(&mut self, meta: &EntryMeta) -> Result<()> {
        assert!(self.open.is_none(), "add_dir while a file is open");
        let header = tar_header(meta, tar::EntryType::Directory, 0)?;
        self.push_meta(&header);
        let mut entry = Self::entry(meta, "dir");
        entry.name = format!("{}/", meta.path);
        self.tarsplit.file(&entry.name, 0, None);
        self.entries.push(entry);
        Ok(())
    }

    /// Starts a regular file of `size` bytes; its content follows as chunks.
    pub fn begin_file(&mut self, meta: &EntryMeta, size: u64) -> Result<()> {
        assert!(self.open.is_none(), "begin_file while a file is open");
        let header = tar_header(meta, tar::EntryType::Regular, size)?;
        self.push_meta(&header);
        self.flush_meta()?;
        let mut entry = Self::entry(meta, "reg");
        entry.size = size as i64;
        self.entries.push(entry);
        self.open = Some(OpenFile {
            path: meta.path.clone(),
            size,
            written: 0,
            hasher: Hasher::new(),
            crc: CRC64_ISO.digest(),
            reg_index: self.entries.len() - 1,
        });
        Ok(())
    }

    /// Appends the next chunk of the open file.
    pub fn add_chunk(&mut self, chunk: &EncodedChunk) -> Result<()> {
        let offset = self.written;
        let file = self.open.as_mut().expect("add_chunk without begin_file");
        let len = chunk.data.len() as u64;
        if file.written + len > file.size {
            return Err(Error::invalid(format!(
                "{}: more data than the announced {} bytes",
                file.path, file.size
            )));
        }
        file.hasher.update(&chunk.data);
        file.crc.update(&chunk.data);
        let chunk_offset = file.written;
        file.written += len;
        let entry = if chunk_offset == 0 {
            &mut self.entries[file.reg_index]
        } else {
            self.entries.push(TocEntry {
                kind: "chunk".into(),
                name: file.path.clone(),
                chunk_offset: chunk_offset as i64,
                ..TocEntry::default()
            });
            self.entries.last_mut().expect("just pushed")
        };
        entry.offset = offset as i64;
        entry.chunk_size = len as i64;
        entry.chunk_digest = chunk.digest.to_string();
        if chunk.zeros {
            entry.chunk_type = "zeros".into();
            self.zero_chunks += 1;
        }
        self.chunks += 1;
        self.diff.update(&chunk.data);
        self.emit(&chunk.frame)
    }

    /// Closes the open file and returns the sha256 of its content; its padding joins the next
    /// metadata frame.
    pub fn end_file(&mut self) -> Result<Digest> {
        let file = self.open.take().expect("end_file without begin_file");
        if file.written != file.size {
            return Err(Error::invalid(format!(
                "{}: got {} bytes of the announced {} (did the file change while it was read?)",
                file.path, file.written, file.size
            )));
        }
        let end = self.written as i64;
        let digest = file.hasher.finish();
        let reg = &mut self.entries[file.reg_index];
        reg.end_offset = if file.size > 0 { end } else { 0 };
        reg.digest = if file.size > 0 {
            digest.to_string()
        } else {
            String::new()
        };
        let crc = (file.size > 0).then(|| file.crc.finalize());
        self.tarsplit.file(&file.path, file.size, crc);
        let padding = (512 - (file.size % 512) as usize) % 512;
        self.push_meta(&[0u8; 512][..padding]);
        Ok(digest)
    }

    fn skippable(&mut self, data: &[u8]) -> Result<()> {
        let mut header = Vec::with_capacity(8);
        header.extend_from_slice(&SKIPPABLE_MAGIC);
        header.extend_from_slice(&(data.len() as u32).to_le_bytes());
        self.emit(&header)?;
        self.emit(data)
    }

    /// Writes the end of archive, the TOC, the tar-split and the footer; returns the layer's
    /// digests and annotations. The sink is flushed, not closed.
    pub fn finish(mut self) -> Result<(LayerSummary, W)> {
        assert!(self.open.is_none(), "finish while a file is open");
        self.push_meta(&[0u8; 1024]);
        self.flush_meta()?;

        let toc = Toc {
            version: 1,
            entries: std::mem::take(&mut self.entries),
            tar_split_digest: None,
        };
        let tarsplit_raw = std::mem::take(&mut self.tarsplit).into_bytes();
        let tarsplit = zstd::bulk::compress(&tarsplit_raw, self.level)
            .map_err(|e| Error::io("zstd compression", e))?;
        let toc = Toc {
            tar_split_digest: Some(Digest::of(&tarsplit).to_string()),
            ..toc
        };
        let toc_json = serde_json::to_vec(&toc).expect("TOC serialises");
        let toc_compressed = zstd::bulk::compress(&toc_json, self.level)
            .map_err(|e| Error::io("zstd compression", e))?;

        let toc_offset = self.written + SKIPPABLE_HEADER;
        self.skippable(&toc_compressed)?;
        let tarsplit_offset = self.written + SKIPPABLE_HEADER;
        self.skippable(&tarsplit)?;
        let mut footer = Vec::with_capacity(64);
        for v in [
            toc_offset,
            toc_compressed.len() as u64,
            toc_json.len() as u64,
            MANIFEST_TYPE_CRFS,
            tarsplit_offset,
            tarsplit.len() as u64,
            tarsplit_raw.len() as u64,
        ] {
            footer.extend_from_slice(&v.to_le_bytes());
        }
        footer.extend_from_slice(FOOTER_MAGIC);
        self.skippable(&footer)?;
        self.out
            .flush()
            .map_err(|e| Error::io("writing the layer", e))?;

        let location = TocLocation {
            offset: toc_offset,
            length: toc_compressed.len() as u64,
            uncompressed_length: toc_json.len() as u64,
            checksum: Digest::of(&toc_compressed),
        };
        let position = format!(
            "{}:{}:{}:{}",
            location.offset, location.length, location.uncompressed_length, MANIFEST_TYPE_CRFS
        );
        let mut annotations = BTreeMap::new();
        for (pos, sum) in [
            (ANN_TOC_POSITION, ANN_TOC_CHECKSUM),
            (ANN_TOC_POSITION_OLD, ANN_TOC_CHECKSUM_OLD),
        ] {
            annotations.insert(pos.to_string(), position.clone());
            annotations.insert(sum.to_string(), location.checksum.to_string());
        }
        annotations.insert(
            ANN_TARSPLIT_POSITION.to_string(),
            format!(
                "{}:{}:{}",
                tarsplit_offset,
                tarsplit.len(),
                tarsplit_raw.len()
            ),
        );
        let summary = LayerSummary {
            digest: self.blob.finish(),
            size: self.written,
            diff_id: self.diff.finish(),
            annotations,
            toc_location: location,
            chunks: self.chunks,
            zero_chunks: self.zero_chunks,
        };
        Ok((summary, self.out))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::format::toc::{MAX_PATH_DEPTH, MAX_TOC_ENTRIES, MAX_TOC_FILES};
    use crate::format::tree::clean_path;

    fn meta(path: &str, mode: u32) -> EntryMeta {
        EntryMeta {
            path: path.into(),
            mode,
            uid: 107,
            gid: 107,
            mtime: 1_700_000_000,
        }
    }

    /// Writes a layer (directory `disk`, file `disk/d.raw`) with `content` cut into `chunk` byte
    /// chunks.
    pub(crate) fn write_layer(content: &[u8], chunk: usize) -> (LayerSummary, Vec<u8>) {
        let mut w = LayerWriter::new(Vec::new(), 3).unwrap();
        let mut c = zstd::bulk::Compressor::new(3).unwrap();
        w.add_dir(&meta("disk", 0o755)).unwrap();
        w.begin_file(&meta("disk/d.raw", 0o644), content.len() as u64)
            .unwrap();
        for part in content.chunks(chunk) {
            w.add_chunk(&EncodedChunk::encode(Arc::new(part.to_vec()), &mut c).unwrap())
                .unwrap();
        }
        w.end_file().unwrap();
        w.finish().unwrap()
    }

    fn sample(len: usize) -> Vec<u8> {
        let mut v: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        v[len / 2..len / 2 + 4096.min(len / 2)].fill(0);
        v
    }

    #[test]
    fn layer_is_a_plain_tar_zstd_stream() {
        let content = sample(10_000 + 3);
        let (summary, blob) = write_layer(&content, 4096);
        assert_eq!(Digest::of(&blob), summary.digest);
        let tar_bytes = zstd::stream::decode_all(&blob[..]).unwrap();
        assert_eq!(Digest::of(&tar_bytes), summary.diff_id);
        let mut archive = tar::Archive::new(&tar_bytes[..]);
        let mut names = Vec::new();
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let name = entry.path().unwrap().to_string_lossy().into_owned();
            if name == "disk/d.raw" {
                let mut data = Vec::new();
                std::io::Read::read_to_end(&mut entry, &mut data).unwrap();
                assert_eq!(data, content);
                assert_eq!(entry.header().uid().unwrap(), 107);
                assert_eq!(entry.header().mode().unwrap(), 0o644);
            }
            names.push(name);
        }
        assert_eq!(names, ["disk/", "disk/d.raw"]);
    }

    #[test]
    fn toc_round_trips_and_chunks_verify() {
        let content = sample(3 * 4096 + 100);
        let (summary, blob) = write_layer(&content, 4096);
        let loc = TocLocation::from_annotations(&summary.annotations)
            .unwrap()
            .unwrap();
        assert_eq!(loc, summary.toc_location);
        let toc = decode_toc(
            &blob[loc.range().start as usize..loc.range().end as usize],
            &loc,
        )
        .unwrap();
        let nodes = toc.nodes(loc.offset - SKIPPABLE_HEADER).unwrap();
        assert_eq!(nodes.len(), 2);
        let file = &nodes[1];
        assert_eq!(
            (file.path.as_str(), file.size, file.uid),
            ("disk/d.raw", content.len() as u64, 107)
        );
        assert_eq!(file.chunks.len(), 4);
        assert_eq!(summary.chunks, 4);
        for c in &file.chunks {
            let frame = &blob[c.compressed.start as usize..c.compressed.end as usize];
            let data = decompress_bounded(frame, c.size).unwrap();
            assert_eq!(
                data,
                content[c.offset as usize..(c.offset + c.size) as usize]
            );
            c.digest.unwrap().verify(&data, "chunk").unwrap();
        }
        assert_eq!(file.digest, Some(Digest::of(&content)));
    }

    /// `read_toc` on `json` compressed, with the uncompressed length annotated (`annotated`:
    /// parsed from memory) or not (parsed as it is decompressed).
    fn read_json(json: &[u8], annotated: bool) -> Result<Vec<Node>> {
        let compressed = zstd::bulk::compress(json, 1).unwrap();
        let loc = TocLocation {
            offset: 1 << 20,
            length: compressed.len() as u64,
            uncompressed_length: if annotated { json.len() as u64 } else { 0 },
            checksum: Digest::of(&compressed),
        };
        read_toc(&compressed, &loc)
    }

    #[test]
    fn a_toc_read_from_memory_or_as_a_stream_gives_the_same_nodes() {
        let content = sample(20 * 4096 + 7);
        let (summary, blob) = write_layer(&content, 4096);
        let loc = summary.toc_location;
        let toc = decode_toc(
            &blob[loc.offset as usize..(loc.offset + loc.length) as usize],
            &loc,
        )
        .unwrap();
        let json = serde_json::to_vec(&toc).unwrap();
        let expected = toc.nodes(1 << 20).unwrap();
        for annotated in [true, false] {
            let nodes = read_json(&json, annotated).unwrap();
            assert_eq!(nodes.len(), expected.len());
            for (a, b) in nodes.iter().zip(&expected) {
                assert_eq!((&a.path, a.size, &a.chunks), (&b.path, b.size, &b.chunks));
            }
            assert_eq!(nodes[1].chunks.len(), 21);
        }
    }

    #[test]
    fn a_streamed_toc_is_bounded_and_checked_like_one_in_memory() {
        let (summary, blob) = write_layer(&sample(5000), 4096);
        let loc = summary.toc_location;
        let compressed = &blob[loc.offset as usize..(loc.offset + loc.length) as usize];
        // The annotated length is checked either way.
        for uncompressed in [loc.uncompressed_length - 1, loc.uncompressed_length + 1] {
            let wrong = TocLocation {
                uncompressed_length: uncompressed,
                ..loc
            };
            let err = read_toc(compressed, &wrong).unwrap_err();
            assert!(err.to_string().contains("the annotation says"), "{err}");
        }
        // Documents that are not a version-1 TOC, as a stream and from memory.
        let cases: [(&str, &str); 5] = [
            (
                r#"{"version":2,"entries":[]}"#,
                "version 2 is not supported",
            ),
            (r#"{"entries":[]}"#, "no version"),
            (r#"{"version":1}"#, "missing field `entries`"),
            (
                r#"{"version":1,"entries":[]} trailing"#,
                "trailing characters",
            ),
            (
                r#"{"version":1,"entries":[{"type":"chunk","name":"a"}]}"#,
                "without a preceding reg entry",
            ),
        ];
        for (json, why) in cases {
            for annotated in [true, false] {
                let err = read_json(json.as_bytes(), annotated).unwrap_err();
                assert!(
                    err.to_string().contains(why),
                    "{json}: expected {why:?}: {err}"
                );
            }
        }
        // Unknown fields are ignored, as containers/storage adds some.
        let nodes = read_json(
            br#"{"version":1,"x":[1],"entries":[{"type":"dir","name":"d","y":{}}]}"#,
            false,
        )
        .unwrap();
        assert_eq!(nodes[0].path, "d");
    }

    #[test]
    fn footer_and_skippable_frames_are_well_formed() {
        let (summary, blob) = write_layer(&sample(5000), 4096);
        let footer = &blob[blob.len() - 64..];
        assert_eq!(&footer[56..], FOOTER_MAGIC);
        let field = |i: usize| u64::from_le_bytes(footer[i * 8..i * 8 + 8].try_into().unwrap());
        assert_eq!(field(0), summary.toc_location.offset);
        assert_eq!(field(1), summary.toc_location.length);
        assert_eq!(field(3), 1);
        let toc_frame = (summary.toc_location.offset - 8) as usize;
        assert_eq!(blob[toc_frame..toc_frame + 4], SKIPPABLE_MAGIC);
    }

    #[test]
    fn zero_chunks_are_marked() {
        let mut content = vec![0u8; 8192];
        content[5000] = 1;
        let (summary, _) = write_layer(&content, 4096);
        assert_eq!((summary.chunks, summary.zero_chunks), (2, 1));
    }

    #[test]
    fn rejects_tampered_toc_and_bad_annotations() {
        let (summary, mut blob) = write_layer(&sample(5000), 4096);
        let loc = summary.toc_location;
        blob[loc.offset as usize + 3] ^= 1;
        let err = decode_toc(
            &blob[loc.offset as usize..(loc.offset + loc.length) as usize],
            &loc,
        )
        .unwrap_err();
        assert_eq!(err.kind(), crate::error::ErrorKind::Corrupt);
        let mut ann = summary.annotations.clone();
        ann.insert(ANN_TOC_POSITION.into(), "1:2:3".into());
        assert!(TocLocation::from_annotations(&ann).is_err());
        ann.insert(
            ANN_TOC_POSITION.into(),
            format!("1:{}:3:1", MAX_TOC_COMPRESSED + 1),
        );
        assert!(TocLocation::from_annotations(&ann).is_err());
        ann.remove(ANN_TOC_CHECKSUM);
        ann.insert(ANN_TOC_POSITION.into(), "1:2:3:1".into());
        assert!(TocLocation::from_annotations(&ann).is_err());
        assert!(TocLocation::from_annotations(&BTreeMap::new())
            .unwrap()
            .is_none());
    }

    #[test]
    fn rejects_unsafe_or_inconsistent_tocs() {
        assert!(clean_path("../etc/passwd").is_err());
        assert!(clean_path("/").is_err());
        assert_eq!(clean_path("./disk//d.qcow2").unwrap(), "disk/d.qcow2");
        let reg = |name: &str, size: i64, end: i64| TocEntry {
            kind: "reg".into(),
            name: name.into(),
            size,
            offset: 10,
            end_offset: end,
            ..Default::default()
        };
        let toc = |entries| Toc {
            version: 1,
            entries,
            tar_split_digest: None,
        };
        // Compressed range beyond the data region.
        assert!(toc(vec![reg("a", 100, 5000)]).nodes(1000).is_err());
        // Chunks that do not cover the file.
        let mut first = reg("a", 100, 200);
        first.chunk_size = 50;
        assert!(toc(vec![first.clone()]).nodes(1000).is_err());
        // Chunk entry for a different file.
        let other = TocEntry {
            kind: "chunk".into(),
            name: "b".into(),
            chunk_offset: 50,
            chunk_size: 50,
            offset: 100,
            ..Default::default()
        };
        assert!(toc(vec![first.clone(), other]).nodes(1000).is_err());
        // A consistent two-chunk file without digests is accepted but not verifiable.
        let second = TocEntry {
            kind: "chunk".into(),
            name: "a".into(),
            chunk_offset: 50,
            chunk_size: 50,
            offset: 100,
            ..Default::default()
        };
        let nodes = toc(vec![first, second]).nodes(1000).unwrap();
        assert_eq!(nodes[0].chunks[1].compressed, 100..200);
        assert!(!nodes[0].verifiable());
    }

    /// A TOC of `entries`, whose chunk-less reg entries get a one-chunk range each.
    fn toc_of(entries: Vec<TocEntry>) -> Toc {
        Toc {
            version: 1,
            entries,
            tar_split_digest: None,
        }
    }

    fn entry(kind: &str, name: &str) -> TocEntry {
        TocEntry {
            kind: kind.into(),
            name: name.into(),
            ..Default::default()
        }
    }

    fn file(name: &str, at: i64) -> TocEntry {
        TocEntry {
            size: 100,
            offset: at,
            end_offset: at + 50,
            chunk_size: 100,
            chunk_digest: Digest::of(name.as_bytes()).to_string(),
            ..entry("reg", name)
        }
    }

    fn refused(entries: Vec<TocEntry>, why: &str) {
        let err = toc_of(entries).nodes(1 << 20).unwrap_err();
        assert!(err.to_string().contains(why), "expected {why:?}: {err}");
    }

    #[test]
    fn toc_paths_must_be_unique_and_only_under_directories() {
        refused(
            vec![file("disk/a", 100), file("disk/a", 200)],
            "listed twice",
        );
        refused(
            vec![entry("dir", "disk"), entry("dir", "disk/")],
            "listed twice",
        );
        refused(
            vec![file("disk/a", 100), file("disk/a/b", 200)],
            "lies under disk/a",
        );
        refused(
            vec![file("disk/a/b", 100), file("disk/a", 200)],
            "other entries lie under it",
        );
        // A directory listed after what it holds is fine, once.
        let nodes = toc_of(vec![file("disk/a", 100), entry("dir", "disk")])
            .nodes(1 << 20)
            .unwrap();
        assert_eq!(nodes.len(), 2);
    }

    #[test]
    fn hardlinks_must_name_an_earlier_file() {
        let link = |target: &str| TocEntry {
            link_name: target.into(),
            ..entry("hardlink", "disk/l")
        };
        refused(vec![file("disk/a", 100), link("")], "unusable target");
        refused(
            vec![file("disk/a", 100), link("../etc/shadow")],
            "unusable target",
        );
        refused(
            vec![file("disk/a", 100), link("disk/b")],
            "not an earlier file",
        );
        refused(
            vec![entry("dir", "disk"), link("disk")],
            "not an earlier file",
        );
        refused(
            vec![link("disk/a"), file("disk/a", 100)],
            "not an earlier file",
        );
        let nodes = toc_of(vec![file("disk/a", 100), link("./disk//a")])
            .nodes(1 << 20)
            .unwrap();
        assert_eq!(nodes[1].link, "disk/a");
        refused(
            vec![TocEntry {
                link_name: String::new(),
                ..entry("symlink", "disk/s")
            }],
            "empty",
        );
        refused(vec![entry("char", "disk/tty")], "serves no devices");
    }

    #[test]
    fn chunk_frames_follow_each_other_without_gaps_or_overlaps() {
        // The file's last frame ends at 200 but the file's bytes end at 300: the 100 bytes
        // between would be file content in the tar stream.
        let mut first = file("disk/a", 100);
        first.chunk_size = 50;
        first.end_offset = 300;
        let second = TocEntry {
            chunk_offset: 50,
            chunk_size: 50,
            offset: 160,
            end_offset: 200,
            chunk_digest: Digest::of(b"2").to_string(),
            ..entry("chunk", "disk/a")
        };
        refused(vec![first, second], "must follow each other");
        // Two files whose frames overlap.
        refused(vec![file("disk/a", 100), file("disk/b", 120)], "overlap");
        // A chunk marked zeros still needs a digest.
        let mut zeros = file("disk/z", 100);
        zeros.chunk_type = "zeros".into();
        zeros.chunk_digest = String::new();
        let nodes = toc_of(vec![zeros]).nodes(1 << 20).unwrap();
        assert!(
            !nodes[0].verifiable(),
            "a zeros chunk without digest cannot be verified"
        );
    }

    #[test]
    fn toc_size_counts_and_depth_are_bounded() {
        let deep = (0..=MAX_PATH_DEPTH)
            .map(|_| "d")
            .collect::<Vec<_>>()
            .join("/");
        refused(vec![entry("dir", &deep)], "deeper than");
        let many: Vec<TocEntry> = (0..=MAX_TOC_FILES)
            .map(|i| entry("dir", &format!("d{i}")))
            .collect();
        refused(many, "more than 4096");
        // A TOC of more than MAX_TOC_ENTRIES tiny entries fails while it is parsed.
        let mut json = String::from("{\"version\":1,\"entries\":[");
        for i in 0..=MAX_TOC_ENTRIES {
            if i > 0 {
                json.push(',');
            }
            json.push_str("{\"type\":\"chunk\",\"name\":\"a\"}");
        }
        json.push_str("]}");
        let started = std::time::Instant::now();
        let err = serde_json::from_str::<Toc>(&json).unwrap_err();
        assert!(err.to_string().contains("more than"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(20));
        // Streamed, valid entries are counted as they come: one file of 1-byte chunks.
        let mut json = String::from(
            r#"{"version":1,"entries":[{"type":"reg","name":"a","size":9999999,"offset":100,"chunkSize":1}"#,
        );
        for i in 1..=MAX_TOC_ENTRIES {
            json.push_str(&format!(
                r#",{{"type":"chunk","name":"a","offset":{},"chunkOffset":{i},"chunkSize":1}}"#,
                100 + i
            ));
        }
        json.push_str("]}");
        let err = parse_toc(
            serde_json::Deserializer::from_reader(std::io::BufReader::new(json.as_bytes())),
            1 << 40,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("more than 1048576 entries"),
            "{err}"
        );
    }

    #[test]
    fn regions_between_chunks_decode_as_an_ordinary_decoder_reads_them() {
        let frame = zstd::bulk::compress(b"header bytes", 1).unwrap();
        let mut region = frame.clone();
        region.extend_from_slice(&[0x5f, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 9, 9, 9]);
        region.extend_from_slice(&frame);
        assert_eq!(
            decode_region(&region, 1 << 20).unwrap(),
            b"header bytesheader bytes"
        );
        // A skippable frame that runs past the region hides what follows it.
        let cut = [0x50, 0x2a, 0x4d, 0x18, 200, 0, 0, 0, 1, 2];
        assert!(decode_region(&cut, 1 << 20).is_err());
        assert!(decode_region(b"not zstd", 1 << 20).is_err());
        assert!(decode_region(&region, 10).is_err(), "bounded output");
        assert!(check_regular_frames(&frame).is_ok());
        assert!(check_regular_frames(&region).is_err());
    }
}
