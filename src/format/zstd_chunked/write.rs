//! Writing a zstd:chunked layer: tar entries, one zstd frame per chunk, then the TOC, the
//! tar-split and the footer as skippable frames ([`LayerWriter`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;

use super::layout::{
    TocLocation, ANN_TARSPLIT_POSITION, ANN_TOC_CHECKSUM, ANN_TOC_CHECKSUM_OLD, ANN_TOC_POSITION,
    ANN_TOC_POSITION_OLD, FOOTER_MAGIC, MANIFEST_TYPE_CRFS,
};
use crate::error::{Error, Result};
use crate::format::tarsplit::{crc64_after_zeros, Crc64, TarSplitWriter, CRC64_ISO};
use crate::format::toc::{Toc, TocEntry};
use crate::format::zstd_frames::{all_zero, SKIPPABLE_HEADER, SKIPPABLE_MAGIC};
use crate::oci::digest::{Digest, Hasher};

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

/// A chunk's content: bytes, or a run of zeros that is never held.
#[derive(Clone, Debug)]
pub enum ChunkBytes {
    Data(Arc<Vec<u8>>),
    Zeros(u64),
}

/// Zeros handed to hashers a piece at a time.
static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

impl ChunkBytes {
    pub fn len(&self) -> u64 {
        match self {
            ChunkBytes::Data(data) => data.len() as u64,
            ChunkBytes::Zeros(len) => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Calls `f` with the content, in order, a piece at a time.
    pub fn each_piece(&self, mut f: impl FnMut(&[u8])) {
        match self {
            ChunkBytes::Data(data) => f(data),
            ChunkBytes::Zeros(len) => {
                let mut left = *len;
                while left > 0 {
                    let n = left.min(ZEROS.len() as u64);
                    f(&ZEROS[..n as usize]);
                    left -= n;
                }
            }
        }
    }
}

/// The sha256 of `len` zeros, hashed once per length for the first lengths asked (a disk's
/// runs of zeros nearly all have one length; a TOC with many cannot grow the memo).
pub fn zeros_digest(len: u64) -> Digest {
    use std::collections::HashMap;
    use std::sync::OnceLock;
    static MEMO: OnceLock<parking_lot::Mutex<HashMap<u64, Digest>>> = OnceLock::new();
    let memo = MEMO.get_or_init(Default::default);
    if let Some(d) = memo.lock().get(&len) {
        return *d;
    }
    let mut hasher = Hasher::new();
    ChunkBytes::Zeros(len).each_piece(|piece| hasher.update(piece));
    let digest = hasher.finish();
    let mut memo = memo.lock();
    if memo.len() < 16 {
        memo.insert(len, digest);
    }
    digest
}

/// A chunk ready to be written: its content, its own zstd frame and its digest.
pub struct EncodedChunk {
    pub data: ChunkBytes,
    pub frame: Arc<Vec<u8>>,
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
        let zeros = all_zero(&data);
        Ok(EncodedChunk {
            data: ChunkBytes::Data(data),
            frame: Arc::new(frame),
            digest,
            zeros,
        })
    }
}

/// The frame and digest of a run of zeros, made once for each length a layer has (a disk's
/// runs are nearly all the same length) and shared by the builder's workers.
pub struct ZeroFrames {
    level: i32,
    made: parking_lot::Mutex<std::collections::HashMap<u64, ZeroFrame>>,
}

/// A run of zeros' frame and digest.
type ZeroFrame = (Arc<Vec<u8>>, Digest);

impl ZeroFrames {
    pub fn new(level: i32) -> Self {
        ZeroFrames {
            level,
            made: Default::default(),
        }
    }

    /// One frame of `len` zeros (its content size recorded, as every chunk's), compressed a
    /// piece at a time: a run is up to 256 MiB, and never held.
    fn frame(&self, len: u64) -> Result<Vec<u8>> {
        use std::io::Write as _;
        let failed = |e| Error::io("zstd compression", e);
        let mut encoder = zstd::stream::Encoder::new(Vec::new(), self.level).map_err(failed)?;
        encoder.include_contentsize(true).map_err(failed)?;
        encoder.set_pledged_src_size(Some(len)).map_err(failed)?;
        let mut written = Ok(());
        ChunkBytes::Zeros(len).each_piece(|piece| {
            if written.is_ok() {
                written = encoder.write_all(piece);
            }
        });
        written.map_err(failed)?;
        encoder.finish().map_err(failed)
    }

    /// The chunk of `len` zeros.
    pub fn chunk(&self, len: u64) -> Result<EncodedChunk> {
        let known = self.made.lock().get(&len).cloned();
        let (frame, digest) = match known {
            Some(made) => made,
            None => {
                let made = (Arc::new(self.frame(len)?), zeros_digest(len));
                self.made.lock().insert(len, made.clone());
                made
            }
        };
        Ok(EncodedChunk {
            data: ChunkBytes::Zeros(len),
            frame,
            digest,
            zeros: true,
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
    crc: Crc64,
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
        let len = chunk.data.len();
        if file.written + len > file.size {
            return Err(Error::invalid(format!(
                "{}: more data than the announced {} bytes",
                file.path, file.size
            )));
        }
        let diff = &mut self.diff;
        match &chunk.data {
            // A run of zeros is all hashing (of a disk's holes, most of its size): the file's
            // digest and the tar's on two threads, the CRC extended without reading zeros.
            ChunkBytes::Zeros(zeros) => {
                std::thread::scope(|s| {
                    s.spawn(|| chunk.data.each_piece(|piece| diff.update(piece)));
                    chunk.data.each_piece(|piece| file.hasher.update(piece));
                });
                let crc = std::mem::replace(&mut file.crc, CRC64_ISO.digest());
                file.crc = crc64_after_zeros(crc, *zeros);
            }
            ChunkBytes::Data(data) => {
                file.hasher.update(data);
                file.crc.update(data);
                diff.update(data);
            }
        }
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
