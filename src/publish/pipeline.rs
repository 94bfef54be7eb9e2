//! The streaming layer builder: reads a disk once, cuts it into fixed-size chunks, compresses
//! them on every core, and writes the zstd:chunked layer in order into a sink.
//!
//! Memory is bounded by the chunks in flight (a few per core), never by the disk size. Runs
//! of zeros (a sparse disk's holes, its unwritten space) become one chunk of up to
//! [`ZERO_RUN_BYTES`], so what grows with the disk's size is the TOC by one entry per 256 MiB
//! of zeros and about one per chunk of data; a file's holes are not even read.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::{mpsc, Arc};

use parking_lot::Mutex;

use super::cuts::Cuts;
use crate::error::{Error, Result};
use crate::format::zstd_chunked::{
    ChunkBytes, EncodedChunk, EntryMeta, LayerSummary, LayerWriter, ZeroFrames,
};
use crate::format::zstd_frames::all_zero;
use crate::oci::digest::Digest;
use crate::progress::Counted;

/// Most zeros one chunk holds (256 MiB, the largest zeros chunk a TOC may list): a run of zero
/// chunks (each `chunk_size`) becomes one chunk of up to this many bytes. A reader of any byte
/// in it fetches a frame of a few KiB, which the node checks decodes to zeros without holding
/// them (`check_zeros`: tens of milliseconds); a 256 GiB sparse disk's TOC lists 1 024 of them
/// instead of a million 256 KiB chunks.
pub const ZERO_RUN_BYTES: u64 = crate::format::toc::MAX_ZEROS_CHUNK_SIZE;

/// What a disk is read from: its bytes in order, and where the source knows it, whether the
/// next bytes are a hole (a sparse file's), which are then skipped instead of read.
pub trait DiskSource: Read {
    /// Whether the next `len` bytes are all in a hole; if they are, they are skipped.
    fn skip_hole(&mut self, _len: u64) -> std::io::Result<bool> {
        Ok(false)
    }
}

impl DiskSource for std::fs::File {
    fn skip_hole(&mut self, len: u64) -> std::io::Result<bool> {
        use std::io::{Seek, SeekFrom};
        use std::os::fd::AsFd;
        let at = self.stream_position()?;
        // SEEK_DATA: where the next data starts at or after `at` (ENXIO: none before the end).
        let data = match nix::unistd::lseek(self.as_fd(), at as i64, nix::unistd::Whence::SeekData)
        {
            Ok(data) => data as u64,
            Err(nix::errno::Errno::ENXIO) => u64::MAX,
            // A file system without SEEK_DATA: read everything.
            Err(nix::errno::Errno::EINVAL) => at,
            Err(e) => return Err(e.into()),
        };
        let hole = data >= at.saturating_add(len);
        self.seek(SeekFrom::Start(if hole { at + len } else { at }))?;
        Ok(hole)
    }
}

impl<R: DiskSource> DiskSource for Counted<R> {
    fn skip_hole(&mut self, len: u64) -> std::io::Result<bool> {
        let hole = self.get_mut().skip_hole(len)?;
        if hole {
            self.count(len);
        }
        Ok(hole)
    }
}

impl DiskSource for &[u8] {}

impl<R: Read> DiskSource for &mut tar::Entry<'_, R> {}

/// How to cut and compress.
#[derive(Clone, Copy, Debug)]
pub struct ChunkingOptions {
    pub chunk_size: usize,
    pub level: i32,
    pub threads: usize,
}

/// The disk file to put into the layer, and the directories above it.
pub struct LayerContent<R> {
    pub dirs: Vec<EntryMeta>,
    pub file: EntryMeta,
    pub size: u64,
    pub reader: R,
}

/// What was learned while streaming the disk.
pub struct BuiltLayer {
    pub summary: LayerSummary,
    /// sha256 of the disk file.
    pub disk_digest: Digest,
    /// The first bytes of the disk (up to 66 KiB), for format detection.
    pub head: Vec<u8>,
}

const HEAD_BYTES: usize = 66 * 1024;

fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match reader.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Streams `content` into a zstd:chunked layer written to `out`. The disk is read on the
/// calling thread (so the reader need not be `Send`); compression runs on `threads` workers and
/// a writer thread puts chunks back in order.
pub fn build_layer<R: DiskSource, W: Write + Send>(
    content: LayerContent<R>,
    opts: ChunkingOptions,
    out: W,
) -> Result<(BuiltLayer, W)> {
    let LayerContent {
        dirs,
        file,
        size,
        mut reader,
    } = content;
    let chunk_size = opts.chunk_size.max(4096);
    let threads = opts.threads.max(1);
    let mut writer = LayerWriter::new(out, opts.level)?;
    for dir in &dirs {
        writer.add_dir(dir)?;
    }
    writer.begin_file(&file, size)?;

    let (raw_tx, raw_rx) = mpsc::sync_channel::<RawChunk>(threads * 2);
    // The scope owns the receiver and hands it to the workers only: when they stop (because
    // the writer failed), the channel disconnects and the reading loop stops instead of
    // blocking forever on a full channel.
    let raw_rx = Arc::new(Mutex::new(raw_rx));
    let (enc_tx, enc_rx) = mpsc::sync_channel::<Result<(u64, EncodedChunk)>>(threads * 2);
    let zero_frames = &ZeroFrames::new(opts.level);

    let (writer, disk_digest, head) =
        std::thread::scope(move |scope| -> Result<(LayerWriter<W>, Digest, Vec<u8>)> {
            for _ in 0..threads {
                let (rx, tx, zeros) = (Arc::clone(&raw_rx), enc_tx.clone(), zero_frames);
                scope.spawn(move || compress_chunks(&rx, &tx, zeros, opts.level));
            }
            drop(enc_tx);
            drop(raw_rx);
            let writer_thread = scope.spawn(move || write_in_order(writer, &enc_rx));
            let read = read_chunks(&mut reader, &file.path, size, chunk_size, raw_tx);
            let written = writer_thread.join().expect("layer writer thread panicked");
            read.and(written)
        })?;

    let (summary, out) = writer.finish()?;
    Ok((
        BuiltLayer {
            summary,
            disk_digest,
            head,
        },
        out,
    ))
}

/// A chunk of the disk read, with its index.
type RawChunk = (u64, ChunkBytes);

/// A compression worker: chunks from `rx` compressed at `level` (runs of zeros: the frame
/// made once for their length) and sent on `tx` with their index, until either channel closes.
fn compress_chunks(
    rx: &Mutex<mpsc::Receiver<RawChunk>>,
    tx: &mpsc::SyncSender<Result<(u64, EncodedChunk)>>,
    zero_frames: &ZeroFrames,
    level: i32,
) {
    let mut compressor = match zstd::bulk::Compressor::new(level) {
        Ok(c) => c,
        Err(e) => {
            let _ = tx.send(Err(Error::io("zstd compressor", e)));
            return;
        }
    };
    loop {
        let next = rx.lock().recv();
        let Ok((index, data)) = next else { return };
        let encoded = match data {
            ChunkBytes::Data(data) => EncodedChunk::encode(data, &mut compressor),
            ChunkBytes::Zeros(len) => zero_frames.chunk(len),
        };
        let encoded = encoded.map(|c| (index, c));
        if tx.send(encoded).is_err() {
            return;
        }
    }
}

/// The writer: compressed chunks from `rx` added to the layer in their order (they arrive in
/// any), the disk's first [`HEAD_BYTES`] kept; the file ended with its digest.
fn write_in_order<W: Write>(
    mut writer: LayerWriter<W>,
    rx: &mpsc::Receiver<Result<(u64, EncodedChunk)>>,
) -> Result<(LayerWriter<W>, Digest, Vec<u8>)> {
    let mut head = Vec::new();
    let mut pending = BTreeMap::new();
    let mut next = 0u64;
    for item in rx.iter() {
        let (index, chunk) = item?;
        pending.insert(index, chunk);
        while let Some(chunk) = pending.remove(&next) {
            if head.len() < HEAD_BYTES {
                let take = (HEAD_BYTES as u64 - head.len() as u64).min(chunk.data.len()) as usize;
                match &chunk.data {
                    ChunkBytes::Data(data) => head.extend_from_slice(&data[..take]),
                    ChunkBytes::Zeros(_) => head.resize(head.len() + take, 0),
                }
            }
            writer.add_chunk(&chunk)?;
            next += 1;
        }
    }
    let digest = writer.end_file()?;
    Ok((writer, digest, head))
}

/// Reads the `size` bytes of file `path` from `reader` in chunks of `chunk_size` (shorter
/// where [`Cuts`] ends one: around a qcow2's tables), each sent on
/// `tx` with its index; consecutive chunks of zeros (holes the reader skips, or read and found
/// zero) are sent as one run of up to [`ZERO_RUN_BYTES`]. Stops early when the writer stopped
/// (its error is the one reported). The channel closes when this returns, which ends the
/// workers.
fn read_chunks<R: DiskSource>(
    reader: &mut R,
    path: &str,
    size: u64,
    chunk_size: usize,
    tx: mpsc::SyncSender<RawChunk>,
) -> Result<()> {
    let io = |e| Error::io(format!("reading {path}"), e);
    let mut chunks = Chunks {
        tx,
        index: 0,
        zeros: 0,
        run_limit: (ZERO_RUN_BYTES / chunk_size as u64).max(1) * chunk_size as u64,
    };
    let mut cuts = Cuts::new(size);
    let mut remaining = size;
    while remaining > 0 {
        let at = size - remaining;
        // Up to the next multiple of the chunk size (after a table's chunk, the rest of its
        // chunk), or the next cut.
        let want = remaining
            .min(chunk_size as u64 - at % chunk_size as u64)
            .min(cuts.next_after(at) - at) as usize;
        remaining -= want as u64;
        if reader.skip_hole(want as u64).map_err(io)? {
            if !chunks.zeros(want as u64) {
                break;
            }
            continue;
        }
        let mut buf = vec![0u8; want];
        let got = read_full(reader, &mut buf).map_err(io)?;
        if got != want {
            return Err(Error::invalid(format!(
                "{path}: ended after {} of {size} bytes (truncated, or changed while read)",
                size - remaining - (want - got) as u64
            )));
        }
        if all_zero(&buf) {
            if !chunks.zeros(want as u64) {
                break;
            }
            continue;
        }
        cuts.learn(at, &buf);
        // What it taught cuts inside it (the first chunk holds a qcow2's header): one chunk
        // per piece.
        let mut pieces = Vec::new();
        let mut start = at;
        while start < at + want as u64 {
            let end = cuts.next_after(start).min(at + want as u64);
            pieces.push((start - at) as usize..(end - at) as usize);
            start = end;
        }
        let sent = match pieces.len() {
            1 => chunks.data(buf),
            _ => pieces.into_iter().all(|piece| {
                let piece = &buf[piece];
                match all_zero(piece) {
                    true => chunks.zeros(piece.len() as u64),
                    false => chunks.data(piece.to_vec()),
                }
            }),
        };
        if !sent {
            break; // the writer stopped; its error is reported by the caller
        }
    }
    chunks.flush();
    Ok(())
}

/// The chunks [`read_chunks`] sends, with the run of zeros not sent yet.
struct Chunks {
    tx: mpsc::SyncSender<RawChunk>,
    index: u64,
    zeros: u64,
    run_limit: u64,
}

impl Chunks {
    /// `len` more zeros; false once the writer stopped.
    fn zeros(&mut self, len: u64) -> bool {
        if self.zeros + len > self.run_limit && !self.flush() {
            return false;
        }
        self.zeros += len;
        true
    }

    /// A chunk of data, after the zeros before it; false once the writer stopped.
    fn data(&mut self, buf: Vec<u8>) -> bool {
        self.flush() && self.send(ChunkBytes::Data(Arc::new(buf)))
    }

    /// Sends the run of zeros, if any; false once the writer stopped.
    fn flush(&mut self) -> bool {
        let run = std::mem::take(&mut self.zeros);
        run == 0 || self.send(ChunkBytes::Zeros(run))
    }

    fn send(&mut self, bytes: ChunkBytes) -> bool {
        let sent = self.tx.send((self.index, bytes)).is_ok();
        self.index += 1;
        sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::zstd_chunked::{decode_toc, TocLocation};

    fn meta(path: &str) -> EntryMeta {
        EntryMeta {
            path: path.into(),
            mode: 0o644,
            uid: 107,
            gid: 107,
            mtime: 0,
        }
    }

    #[test]
    fn parallel_build_keeps_order_and_content() {
        let data: Vec<u8> = (0..300_000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let content = LayerContent {
            dirs: vec![meta("disk")],
            file: meta("disk/x.raw"),
            size: data.len() as u64,
            reader: &data[..],
        };
        let (built, blob) = build_layer(
            content,
            ChunkingOptions {
                chunk_size: 8192,
                level: 1,
                threads: 3,
            },
            Vec::new(),
        )
        .unwrap();
        assert_eq!(built.disk_digest, Digest::of(&data));
        assert_eq!(built.head, data[..HEAD_BYTES]);
        assert_eq!(built.summary.chunks, 300_000u64.div_ceil(8192));
        let tar = zstd::stream::decode_all(&blob[..]).unwrap();
        assert_eq!(Digest::of(&tar), built.summary.diff_id);
        let loc: TocLocation = built.summary.toc_location;
        let toc = decode_toc(
            &blob[loc.offset as usize..(loc.offset + loc.length) as usize],
            &loc,
        )
        .unwrap();
        assert_eq!(toc.entries[1].digest, Digest::of(&data).to_string());
    }

    #[test]
    fn short_input_is_an_error() {
        let data = vec![1u8; 1000];
        let content = LayerContent {
            dirs: vec![],
            file: meta("d"),
            size: 5000,
            reader: &data[..],
        };
        let err = build_layer(
            content,
            ChunkingOptions {
                chunk_size: 4096,
                level: 1,
                threads: 2,
            },
            Vec::new(),
        )
        .err()
        .unwrap();
        assert!(
            err.to_string().contains("ended after 1000 of 5000"),
            "{err}"
        );
    }

    /// A sink that fails after `limit` bytes, as an aborted upload does.
    struct FailingSink {
        limit: usize,
        written: usize,
    }

    impl Write for FailingSink {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            if self.written + data.len() > self.limit {
                return Err(std::io::Error::other("upload aborted"));
            }
            self.written += data.len();
            Ok(data.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_failing_sink_stops_the_build_instead_of_hanging_it() {
        let (done_tx, done_rx) = mpsc::channel();
        std::thread::spawn(move || {
            // Much more data than the pipeline's queues hold, so the reader would block.
            let data = vec![7u8; 8 << 20];
            let content = LayerContent {
                dirs: vec![],
                file: meta("d"),
                size: data.len() as u64,
                reader: &data[..],
            };
            let result = build_layer(
                content,
                ChunkingOptions {
                    chunk_size: 4096,
                    level: 1,
                    threads: 2,
                },
                FailingSink {
                    limit: 10_000,
                    written: 0,
                },
            );
            let _ = done_tx.send(result.err().map(|e| e.chain()));
        });
        let outcome = done_rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("build_layer hung after its sink failed");
        assert!(outcome
            .expect("the build must fail")
            .contains("upload aborted"));
    }
}
