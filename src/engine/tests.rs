//! The engine's tests: reads, shared fetches, retries and checks against a blob in memory.

use super::*;
use crate::format::toc::Toc;
use crate::format::zstd_chunked::{decode_chunk, decode_toc, TocLocation};
use crate::layer::{Held, IndexSource, LayerKind, LayerMeta};

/// A blob in memory that records requests and can fail or corrupt the next answers.
#[derive(Default)]
struct FakeBlob {
    blob: Vec<u8>,
    calls: Mutex<Vec<Range<u64>>>,
    failures: Mutex<u32>,
    corruptions: Mutex<u32>,
    /// How long each answer takes.
    delay: Mutex<Duration>,
}

impl BlobSource for Arc<FakeBlob> {
    fn fetch(
        &self,
        range: Range<u64>,
        _ask: Ask,
    ) -> futures_util::future::BoxFuture<'_, Result<bytes::Bytes>> {
        self.calls.lock().push(range.clone());
        let fail = std::mem::replace(&mut *self.failures.lock(), 0);
        if fail > 0 {
            *self.failures.lock() = fail - 1;
            return Box::pin(async {
                Err(Error::new(ErrorKind::Network, "injected network failure"))
            });
        }
        let mut bytes = self.blob[range.start as usize..range.end as usize].to_vec();
        let mut corrupt = self.corruptions.lock();
        if *corrupt > 0 {
            *corrupt -= 1;
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0x40;
        }
        let delay = *self.delay.lock();
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            Ok(bytes::Bytes::from(bytes))
        })
    }
}

const CHUNK: usize = 4096;

/// Content of `chunks` chunks; chunk 3 (if there is one) is all zeros.
fn content(chunks: usize) -> Vec<u8> {
    let mut v: Vec<u8> = (0..chunks * CHUNK)
        .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
        .collect();
    if chunks > 3 {
        v[3 * CHUNK..4 * CHUNK].fill(0);
    }
    v
}

fn engine(data: &[u8], opts: EngineOptions) -> (Arc<Engine>, Arc<FakeBlob>, tempfile::TempDir) {
    let (blob, summary) = honest(data);
    engine_of_blob(blob, &summary, opts)
}

/// An engine over `blob`, a layer `summary` describes.
fn engine_of_blob(
    blob: Vec<u8>,
    summary: &crate::format::zstd_chunked::LayerSummary,
    opts: EngineOptions,
) -> (Arc<Engine>, Arc<FakeBlob>, tempfile::TempDir) {
    let (meta, toc) = crate::layer::testing::zstd_chunked_meta(summary, &blob);
    engine_of_layer(blob, meta, &toc, opts)
}

/// An engine over `blob`, the layer `meta` and `toc` (its TOC or index) describe.
fn engine_of_layer(
    blob: Vec<u8>,
    meta: LayerMeta,
    toc: &[u8],
    opts: EngineOptions,
) -> (Arc<Engine>, Arc<FakeBlob>, tempfile::TempDir) {
    let (engine, source, _, dir) = engine_of_sources(blob, None, meta, toc, opts);
    (engine, source, dir)
}

/// [`engine_of_layer`] with a windows blob; its source too.
fn engine_of_sources(
    blob: Vec<u8>,
    windows: Option<Vec<u8>>,
    meta: LayerMeta,
    toc: &[u8],
    opts: EngineOptions,
) -> (Arc<Engine>, Arc<FakeBlob>, Arc<FakeBlob>, tempfile::TempDir) {
    let layer =
        crate::layer::codec::open(meta.reference.clone(), meta, toc, Resolved::Offline).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sizes: Vec<u64> = (0..layer.files.len()).map(|f| layer.file_size(f)).collect();
    let cache = LayerCache::open(dir.path(), &sizes, layer.chunks.len()).unwrap();
    let source = Arc::new(FakeBlob {
        blob,
        ..FakeBlob::default()
    });
    let windows_source = Arc::new(FakeBlob {
        blob: windows.clone().unwrap_or_default(),
        ..FakeBlob::default()
    });
    let sources = Sources {
        blob: Box::new(Arc::clone(&source)),
        windows: windows.map(|_| Box::new(Arc::clone(&windows_source)) as Box<dyn BlobSource>),
    };
    let engine = Engine::with_source(layer, cache, sources, opts);
    (engine, source, windows_source, dir)
}

/// An engine over an ordinary layer `blob` (of tar stream `tar`) read through `index` and
/// its `windows`; the sources of both.
fn engine_of_indexed(
    blob: Vec<u8>,
    windows: Vec<u8>,
    tar: &[u8],
    index: &crate::format::seekable::SeekIndex,
) -> (Arc<Engine>, Arc<FakeBlob>, Arc<FakeBlob>, tempfile::TempDir) {
    engine_of_indexed_at(blob, windows, tar, index, None)
}

/// The same, with the disk at `disk_path` (a disk artifact's layer).
fn engine_of_indexed_at(
    blob: Vec<u8>,
    windows: Vec<u8>,
    tar: &[u8],
    index: &crate::format::seekable::SeekIndex,
    disk_path: Option<&str>,
) -> (Arc<Engine>, Arc<FakeBlob>, Arc<FakeBlob>, tempfile::TempDir) {
    let bytes = index.encode().unwrap();
    let meta = LayerMeta {
        reference: "127.0.0.1:1/test/t:1".parse().unwrap(),
        layer_digest: Digest::of(&blob),
        layer_size: blob.len() as u64,
        toc_offset: 0,
        toc_length: bytes.len() as u64,
        toc_uncompressed_length: 0,
        toc_digest: Digest::of(&bytes),
        disk_path: disk_path.map(str::to_string),
        diff_id: Digest::of(tar),
        kind: LayerKind::Indexed(IndexSource {
            repository: "127.0.0.1:1/test/t".into(),
            compression: index.compression,
            layout: index.layout,
        }),
    };
    let windows = index.windows.map(|_| windows);
    engine_of_sources(blob, windows, meta, &bytes, EngineOptions::default())
}

/// Where the disk's content starts in the tar stream `index` describes.
fn disk_at(index: &crate::format::seekable::SeekIndex) -> u64 {
    index.disk_entry().unwrap().offset
}

/// A gzip containerDisk layer (a small file before the disk, one after) and its index.
struct GzipLayer {
    data: Vec<u8>,
    tar: Vec<u8>,
    blob: Vec<u8>,
    index: crate::format::seekable::SeekIndex,
    windows: Vec<u8>,
}

fn gzip_layer(span: u64) -> GzipLayer {
    use crate::format::seekable::{testing, Compression, Expected, Layout};
    let data = testing::disk(3 << 20);
    let tar = testing::tar_of(&[
        ("etc/README", b"hello".to_vec()),
        ("disk/d.raw", data.clone()),
        ("image/zz", vec![7; 3000]),
    ]);
    let blob = testing::gzip(&tar, 6);
    let exp = Expected {
        layer: Digest::of(&blob),
        layer_size: blob.len() as u64,
        compression: Some(Compression::Gzip),
        diff_id: Some(Digest::of(&tar)),
        layout: Layout::Tar,
    };
    let (index, windows) = testing::index_of(&blob, &exp, span);
    GzipLayer {
        data,
        tar,
        blob,
        index,
        windows,
    }
}

/// A disk artifact's layer, the gzip-compressed disk file itself, read through its index
/// as `disk/d.raw`; checked whole against the disk's digest once complete, and a lie
/// caught there.
#[tokio::test]
async fn concurrent_asks_for_the_same_bytes_share_one_request() {
    let data = content(8);
    let (engine, source, _dir) = engine(&data, EngineOptions::default());
    *source.delay.lock() = Duration::from_millis(50);
    let range = engine.layer.chunks[1].compressed.clone();
    let asked = || source.calls.lock().iter().filter(|r| **r == range).count();
    let (a, b) = tokio::join!(
        engine.fetch_range(range.clone(), Ask::AnyEndpoint),
        engine.fetch_range(range.clone(), Ask::AnyEndpoint)
    );
    assert_eq!(a.unwrap(), b.unwrap());
    assert_eq!(asked(), 1, "two concurrent asks, one request");
    // Nothing is kept once answered, and the registry itself is always asked on its own.
    engine
        .fetch_range(range.clone(), Ask::AnyEndpoint)
        .await
        .unwrap();
    let (a, b) = tokio::join!(
        engine.fetch_range(range.clone(), Ask::Registry),
        engine.fetch_range(range.clone(), Ask::AnyEndpoint)
    );
    assert_eq!(a.unwrap(), b.unwrap());
    assert_eq!(asked(), 4);
    // A sharer dropped before its answer came leaves its waiter to ask on its own.
    *source.delay.lock() = Duration::from_millis(300);
    let sharer = tokio::time::timeout(
        Duration::from_millis(50),
        engine.fetch_range(range.clone(), Ask::AnyEndpoint),
    );
    let waiter = async {
        tokio::time::sleep(Duration::from_millis(10)).await;
        engine.fetch_range(range.clone(), Ask::AnyEndpoint).await
    };
    let (gone, answer) = tokio::join!(sharer, waiter);
    assert!(gone.is_err(), "the sharer was dropped");
    assert_eq!(answer.unwrap().len() as u64, range.end - range.start);
    assert_eq!(asked(), 6);
    assert!(engine.shared_fetches.lock().is_empty());
}

#[tokio::test]
async fn a_disk_file_layer_reads_by_span_and_is_verified_once_complete() {
    use crate::format::seekable::testing;
    let data = testing::disk(3 << 20);
    let blob = testing::gzip(&data, 6);
    let (index, windows) = testing::index_of(&blob, &testing::file_expected(&blob), 64 << 10);
    let (engine, source, _, _dir) = engine_of_indexed_at(
        blob.clone(),
        windows.clone(),
        &data,
        &index,
        Some("disk/d.raw"),
    );
    let layer = &engine.layer;
    let paths: Vec<_> = layer.nodes.iter().map(|n| n.path.as_str()).collect();
    assert_eq!(paths, ["disk", "disk/d.raw"]);
    assert_eq!(layer.files.len(), 1);
    assert_eq!(layer.chunks.len(), index.spans.len());
    engine
        .check_structure(None, &Held::default())
        .await
        .unwrap();
    assert!(source.calls.lock().is_empty(), "nothing to check");
    assert_eq!(
        engine.read(0, 2 << 20, 4096).await.unwrap(),
        data[2 << 20..(2 << 20) + 4096]
    );
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = CacheRoot::open(cache_dir.path()).unwrap();
    assert_eq!(read_all(&engine).await.unwrap(), data);
    assert_eq!(engine.check_integrity(&cache).await, Integrity::Verified);

    // An index that lies consistently about span 5 (a forged window, the digest of what
    // it decodes to): every read passes its span check, the complete disk does not.
    let forged = vec![b'x'; 32 << 10];
    let (mut lying, lying_windows) = testing::with_window(&index, &windows, 5, &forged);
    let s = &lying.spans[5];
    let lie = lying
        .decode_unverified(5, &blob[s.input as usize..s.input_end as usize], &forged)
        .unwrap();
    assert_ne!(lie, data[s.offset as usize..index.span_end(5) as usize]);
    lying.spans[5].digest = Digest::of(&lie);
    let (engine, _, _, _dir) =
        engine_of_indexed_at(blob, lying_windows, &data, &lying, Some("disk/d.raw"));
    engine.read(0, 0, engine.layer.file_size(0)).await.unwrap();
    let outcome = engine.check_integrity(&cache).await;
    assert!(
        matches!(&outcome, Integrity::Failed(why) if why.contains("the disk hashes to")),
        "{outcome:?}"
    );
}

/// Bytes fetched from `source` so far.
fn fetched_bytes(source: &FakeBlob) -> u64 {
    source.calls.lock().iter().map(|r| r.end - r.start).sum()
}

#[tokio::test]
async fn an_indexed_gzip_layer_reads_by_span_and_is_verified_once_complete() {
    let GzipLayer {
        data,
        tar,
        blob,
        index,
        windows,
    } = gzip_layer(64 << 10);
    let (engine, source, windows_source, _dir) =
        engine_of_indexed(blob.clone(), windows.clone(), &tar, &index);
    let disk = engine.layer.disk;
    assert_eq!(
        engine.layer.nodes[engine.layer.files[disk].node].path,
        "disk/d.raw"
    );
    engine
        .check_structure(None, &Held::default())
        .await
        .unwrap();
    let before = fetched_bytes(&source);
    assert_eq!(
        engine.read(disk, 1 << 20, 4096).await.unwrap(),
        data[1 << 20..(1 << 20) + 4096]
    );
    let fetched = fetched_bytes(&source) - before;
    assert!(
        fetched < blob.len() as u64 / 4,
        "a few spans, not the blob: {fetched} of {}",
        blob.len()
    );
    // Spans 4 to 6 read in one go: one request, one window (the others follow from the
    // spans before them).
    let (requests, window_requests) =
        (source.calls.lock().len(), windows_source.calls.lock().len());
    let file_at = disk_at(&index);
    let (from, to) = (index.spans[4].offset - file_at, index.span_end(6) - file_at);
    assert_eq!(
        engine.read(disk, from, to - from).await.unwrap(),
        data[from as usize..to as usize]
    );
    assert_eq!(source.calls.lock().len(), requests + 1);
    assert_eq!(window_requests + 1, windows_source.calls.lock().len());
    // Never more windows than requests of the layer, and not all of them.
    assert!(windows_source.calls.lock().len() <= source.calls.lock().len());
    assert!(fetched_bytes(&windows_source) < windows.len() as u64);
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = CacheRoot::open(cache_dir.path()).unwrap();
    assert_eq!(engine.check_integrity(&cache).await, Integrity::Pending);
    for f in 0..engine.layer.files.len() {
        engine.read(f, 0, engine.layer.file_size(f)).await.unwrap();
    }
    assert_eq!(read_all(&engine).await.unwrap(), data);
    assert_eq!(engine.read(0, 0, 100).await.unwrap(), b"hello");
    assert_eq!(engine.check_integrity(&cache).await, Integrity::Verified);
}

#[tokio::test]
async fn an_indexed_layer_never_serves_bytes_its_span_digest_does_not_match() {
    use crate::format::seekable::testing;
    let GzipLayer {
        data,
        tar,
        blob,
        index,
        windows,
    } = gzip_layer(64 << 10);
    // A wrong checkpoint: span 5's window is span 6's.
    let (index, windows) =
        testing::with_window(&index, &windows, 5, &testing::window(&index, &windows, 6));
    let (engine, source, windows_source, _dir) = engine_of_indexed(blob, windows, &tar, &index);
    let disk = engine.layer.disk;
    let at = index.spans[5].offset - disk_at(&index);
    let err = engine.read(disk, at, 10).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{}", err.chain());
    assert!(err.chain().contains("span 5"), "{}", err.chain());
    assert_eq!(
        engine.stats.snapshot().verify_failures,
        u64::from(crate::layer::VERIFY_TRIES),
        "checked, then refetched and checked until the tries ran out"
    );
    assert!(source.calls.lock().len() >= 3);
    assert!(
        windows_source.calls.lock().len() >= 3,
        "its window refetched too"
    );
    // The rest of the disk still reads.
    assert_eq!(engine.read(disk, 0, 4096).await.unwrap(), data[..4096]);
    // A window frame corrupted on the way once is fetched again and the span reads.
    *windows_source.corruptions.lock() = 1;
    let at = index.spans[9].offset - disk_at(&index);
    engine.read(disk, at, 10).await.unwrap();
}

#[tokio::test]
async fn an_index_that_lies_consistently_is_caught_by_the_diff_id_once_complete() {
    use crate::format::seekable::testing;
    let GzipLayer {
        tar,
        blob,
        index,
        windows,
        ..
    } = gzip_layer(64 << 10);
    // Span 5 from a forged window, with the digest of what that decodes to: every span
    // check passes, the bytes differ.
    let forged = vec![b'x'; 32 << 10];
    let (mut index, windows) = testing::with_window(&index, &windows, 5, &forged);
    let s = &index.spans[5];
    let input = &blob[s.input as usize..s.input_end as usize];
    let lie = index.decode_unverified(5, input, &forged).unwrap();
    assert_ne!(lie, tar[s.offset as usize..index.span_end(5) as usize]);
    index.spans[5].digest = Digest::of(&lie);
    let (engine, _, _, _dir) = engine_of_indexed(blob, windows, &tar, &index);
    for f in 0..engine.layer.files.len() {
        engine.read(f, 0, engine.layer.file_size(f)).await.unwrap();
    }
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = CacheRoot::open(cache_dir.path()).unwrap();
    let outcome = engine.check_integrity(&cache).await;
    assert!(
        matches!(&outcome, Integrity::Failed(why) if why.contains("hashes to")),
        "{outcome:?}"
    );
    assert_eq!(
        read_all(&engine).await.unwrap_err().kind(),
        ErrorKind::Corrupt
    );
}

#[tokio::test]
async fn an_estargz_layer_reads_through_its_toc_and_is_verified_once_complete() {
    use crate::format::estargz;
    let data = content(5);
    let files = [
        ("disk/d.qcow2", data.clone()),
        ("etc/hostname", b"vm\n".to_vec()),
    ];
    let written = vmdisk_testing::estargz::layer(&files, CHUNK);
    let (blob, toc, diff_id): (_, Digest, Digest) = (
        written.blob,
        written.toc_digest.parse().unwrap(),
        written.diff_id.parse().unwrap(),
    );
    let size = blob.len() as u64;
    let offset = estargz::toc_offset(&blob[blob.len() - 51..], size).unwrap();
    let json = estargz::toc_json(&blob[offset as usize..blob.len() - 51], &toc).unwrap();
    let meta = LayerMeta {
        reference: "127.0.0.1:1/test/t:1".parse().unwrap(),
        layer_digest: Digest::of(&blob),
        layer_size: size,
        toc_offset: offset,
        toc_length: json.len() as u64,
        toc_uncompressed_length: 0,
        toc_digest: toc,
        disk_path: None,
        diff_id,
        kind: LayerKind::Estargz,
    };
    let (engine, _, _dir) = engine_of_layer(blob, meta, &json, EngineOptions::default());
    engine
        .check_structure(None, &Held::default())
        .await
        .unwrap();
    assert_eq!(
        engine.read(engine.layer.disk, 100, 10).await.unwrap(),
        data[100..110]
    );
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = CacheRoot::open(cache_dir.path()).unwrap();
    for f in 0..engine.layer.files.len() {
        engine.read(f, 0, engine.layer.file_size(f)).await.unwrap();
    }
    assert_eq!(read_all(&engine).await.unwrap(), data);
    assert_eq!(engine.check_integrity(&cache).await, Integrity::Verified);
}

fn calls(source: &FakeBlob) -> usize {
    source.calls.lock().len()
}

#[tokio::test]
async fn adjacent_missing_chunks_are_one_request_and_fetched_once() {
    let data = content(8);
    let (engine, source, _dir) = engine(&data, EngineOptions::default());
    let disk = engine.layer.disk;
    assert_eq!(
        engine.read(disk, 0, 3 * CHUNK as u64).await.unwrap(),
        data[..3 * CHUNK]
    );
    assert_eq!(
        calls(&source),
        1,
        "chunks 0..3 coalesced into one Range request"
    );
    assert_eq!(engine.read(disk, 100, 5000).await.unwrap(), data[100..5100]);
    assert_eq!(calls(&source), 1, "cached chunks are not fetched again");
    // Chunk 3 is marked zeros: verified like any chunk (a few bytes), kept as a hole.
    assert_eq!(
        engine
            .read(disk, 3 * CHUNK as u64, CHUNK as u64)
            .await
            .unwrap(),
        vec![0u8; CHUNK]
    );
    assert_eq!(calls(&source), 2);
    let zero_frame = source.calls.lock()[1].clone();
    assert!(zero_frame.end - zero_frame.start < 64, "{zero_frame:?}");
    // Reading past the end is short, not an error.
    assert_eq!(
        engine
            .read(disk, data.len() as u64 - 10, 100)
            .await
            .unwrap(),
        data[data.len() - 10..]
    );
}

#[tokio::test]
async fn requests_are_bounded_in_size() {
    let data = content(8);
    let opts = EngineOptions {
        max_request_bytes: 1,
        ..EngineOptions::default()
    };
    let (engine, source, _dir) = engine(&data, opts);
    engine
        .read(engine.layer.disk, 0, data.len() as u64)
        .await
        .unwrap();
    assert_eq!(
        calls(&source),
        8,
        "one request per chunk when requests may not grow"
    );
}

/// A second engine over `engine`'s cache directory `dir` and blob: the layer opened again
/// by a new process.
fn reopened(engine: &Engine, dir: &std::path::Path, blob: &Arc<FakeBlob>) -> Arc<Engine> {
    engine.cache.flush().unwrap();
    let layer = &engine.layer;
    let sizes: Vec<u64> = (0..layer.files.len()).map(|f| layer.file_size(f)).collect();
    let cache = LayerCache::open(dir, &sizes, layer.chunks.len()).unwrap();
    let again = Layer::new(
        layer.reference.clone(),
        layer.meta.clone(),
        crate::layer::Table {
            nodes: layer.nodes.clone(),
            files: layer.files.clone(),
            chunks: layer.chunks.clone(),
        },
        Box::new(crate::layer::codec::zstd_chunked::ZstdChunked),
        Resolved::Offline,
    )
    .unwrap();
    let sources = Sources {
        blob: Box::new(Arc::clone(blob)),
        windows: None,
    };
    Engine::with_source(again, cache, sources, engine.opts.clone())
}

/// Flips a byte of the cache's data file of file 0 at `at`.
fn damage(dir: &std::path::Path, at: u64) {
    damage_file(dir, 0, at)
}

/// Flips a byte of the cache's data file of file `file` at `at`.
fn damage_file(dir: &std::path::Path, file: usize, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(crate::cache::data_file(dir, file))
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 1], at).unwrap();
}

#[tokio::test]
async fn a_damaged_cached_chunk_is_fetched_again_never_served() {
    let data = content(4);
    let (engine, source, dir) = engine(&data, EngineOptions::default());
    let disk = engine.layer.disk;
    let len = data.len() as u64;
    engine.read(disk, 0, len).await.unwrap();
    // Written by this process from verified bytes: checked without reading them back.
    assert!((0..4).all(|i| engine.cache.is_checked(i)));
    damage(dir.path(), CHUNK as u64 + 10);
    // A new process life: cached chunks are checked before they are served, by either
    // read path, and a damaged one is fetched again.
    let engine = reopened(&engine, dir.path(), &source);
    let before = calls(&source);
    assert!(
        engine.read_cached(disk, 0, len).is_none(),
        "a cached read that found a damaged chunk is a miss"
    );
    assert_eq!(engine.stats.snapshot().cache_damaged, 1);
    assert!(!engine.cache.is_present(1) && engine.cache.is_present(0));
    assert_eq!(engine.read(disk, 0, len).await.unwrap(), data);
    assert_eq!(calls(&source) - before, 1, "the damaged chunk alone");
    assert_eq!(
        engine.read_cached(disk, 0, len).unwrap().unwrap(),
        data,
        "now all checked"
    );

    // The async read path finds it too.
    damage(dir.path(), 2 * CHUNK as u64);
    let engine = reopened(&engine, dir.path(), &source);
    assert_eq!(engine.read(disk, 0, len).await.unwrap(), data);
    assert_eq!(engine.stats.snapshot().cache_damaged, 1);
}

/// A chunk that is only part of a span carries no digest of its own: the one of its bytes
/// is kept when the span is verified, and the chunk is checked against it.
#[tokio::test]
async fn a_chunk_without_a_digest_of_its_own_is_checked_against_the_one_kept() {
    let GzipLayer {
        data,
        tar,
        blob,
        index,
        windows,
    } = gzip_layer(64 << 10);
    let (engine, _source, _windows, dir) =
        engine_of_indexed(blob.clone(), windows.clone(), &tar, &index);
    let disk = engine.layer.disk;
    engine.read(disk, 0, data.len() as u64).await.unwrap();
    let partial: Vec<usize> = engine
        .layer
        .chunks_of(disk)
        .filter(|&i| engine.layer.chunks[i].digest.is_none())
        .collect();
    assert!(
        !partial.is_empty(),
        "the disk's first and last chunks are parts of spans"
    );
    for &idx in &partial {
        let chunk = &engine.layer.chunks[idx];
        let bytes = &data[chunk.offset as usize..(chunk.offset + chunk.size) as usize];
        assert_eq!(engine.cache.sum(idx), Some(Digest::of(bytes)));
        assert!(engine.check_cached(idx));
    }
    let idx = partial[0];
    damage_file(dir.path(), disk, engine.layer.chunks[idx].offset);
    assert!(!engine.check_cached(idx) && !engine.cache.is_present(idx));
}

#[tokio::test]
async fn a_damaged_cache_with_the_registry_gone_answers_an_error_naming_it() {
    let data = content(2);
    let (engine, source, dir) = engine(
        &data,
        EngineOptions {
            fetch_deadline: Duration::from_millis(300),
            ..EngineOptions::default()
        },
    );
    let disk = engine.layer.disk;
    engine.read(disk, 0, data.len() as u64).await.unwrap();
    damage(dir.path(), 5);
    let engine = reopened(&engine, dir.path(), &source);
    *source.failures.lock() = u32::MAX;
    let e = engine.read(disk, 0, 100).await.unwrap_err();
    assert!(e.chain().contains("injected network failure"), "{e}");
    assert_eq!(engine.stats.snapshot().cache_damaged, 1);
    // The chunk that was sound is still served.
    assert_eq!(
        engine.read_cached(disk, CHUNK as u64, 10).unwrap().unwrap(),
        data[CHUNK..CHUNK + 10]
    );
}

/// A registry whose every answer fails its check, each answer slow: the read ends within
/// the fetch deadline and one more try, however many fetches its retries would make (they
/// nested: three fetches of nearly a deadline each).
#[tokio::test(start_paused = true)]
async fn a_read_from_a_registry_that_fails_every_check_ends_within_its_deadline() {
    let data = content(4);
    let opts = EngineOptions {
        fetch_deadline: Duration::from_secs(10),
        ..EngineOptions::default()
    };
    let (engine, source, _dir) = engine(&data, opts);
    *source.corruptions.lock() = u32::MAX;
    *source.delay.lock() = Duration::from_secs(9);
    let started = tokio::time::Instant::now();
    let e = engine.read(engine.layer.disk, 0, 100).await.unwrap_err();
    let took = started.elapsed();
    assert!(
        took <= Duration::from_secs(10) + READ_GRACE,
        "{took:?}: {}",
        e.chain()
    );
    assert!(
        source.calls.lock().len() >= 2,
        "fetched again after the failed check"
    );
    // The kernel's read of the same page right after fails at once.
    let again = tokio::time::Instant::now();
    engine.read(engine.layer.disk, 0, 100).await.unwrap_err();
    assert_eq!(again.elapsed(), Duration::ZERO);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_complete_file_is_fit_for_passthrough_only_once_checked_and_unchanged() {
    let data = content(4);
    let (engine, source, dir) = engine(&data, EngineOptions::default());
    let disk = engine.layer.disk;
    engine.read(disk, 0, data.len() as u64).await.unwrap();
    let _ = engine.integrity.set(Integrity::Verified);
    assert!(engine.passthrough_file(disk).is_some());
    // Changed by someone else: not handed over until checked again.
    damage(dir.path(), 3);
    assert!(engine.passthrough_file(disk).is_none());
    assert_eq!(
        counts(engine.check_cache(Some(0))),
        (4, 1),
        "the changed file is checked again"
    );
    assert!(
        engine.passthrough_file(disk).is_none(),
        "a chunk is missing now"
    );
    engine.read(disk, 0, data.len() as u64).await.unwrap();
    assert!(engine.passthrough_file(disk).is_some());
    // Another process life: nothing is handed over before the check.
    let engine = reopened(&engine, dir.path(), &source);
    let _ = engine.integrity.set(Integrity::Verified);
    assert!(engine.passthrough_file(disk).is_none());
    assert_eq!(counts(engine.check_cache(Some(0))), (4, 0));
    assert!(engine.passthrough_file(disk).is_some());
    assert_eq!(
        counts(engine.check_cache(Some(0))),
        (0, 0),
        "nothing left to check"
    );
}

/// After a restart, the chunks cached before are read back at the verify rate (in the
/// node's turn); without the turn a pass checks only data files someone changed.
#[tokio::test(flavor = "multi_thread")]
async fn chunks_cached_before_a_restart_are_checked_at_the_verify_rate_in_the_nodes_turn() {
    let data = content(8);
    let (engine, source, dir) = engine(&data, EngineOptions::default());
    let disk = engine.layer.disk;
    engine.read(disk, 0, data.len() as u64).await.unwrap();
    let engine = reopened(&engine, dir.path(), &source);
    // No turn: nothing changed, nothing checked.
    let found = engine.check_cache(None);
    assert_eq!((found.checked, found.complete), (0, false));
    // A file changed by someone else is checked at once, turn or not.
    damage(dir.path(), 1);
    let found = engine.check_cache(None);
    assert_eq!(counts_of(&found), (8, 1), "the changed file, at once");
    engine.repair(&found.damaged).await;

    let engine = reopened(&engine, dir.path(), &source);
    let rate = 8 * CHUNK as u64; // 8 chunks a second
    let started = std::time::Instant::now();
    let found = engine.check_cache(Some(rate));
    let took = started.elapsed();
    assert_eq!(counts_of(&found), (8, 0));
    assert!(found.complete);
    assert!(
        took >= Duration::from_millis(800),
        "8 chunks at 8 a second start over 0.875 s: {took:?}"
    );
}

fn counts_of(found: &CacheCheck) -> (usize, usize) {
    (found.checked, found.damaged.len())
}

fn counts(found: CacheCheck) -> (usize, usize) {
    counts_of(&found)
}

/// Bytes changed in a checked data file while it is served are noticed by the next read
/// through the daemon (not only by the background pass): that read is answered with the
/// verified bytes, and the repair writes them back where passthrough readers read.
#[tokio::test(flavor = "multi_thread")]
async fn a_change_to_a_checked_data_file_is_noticed_by_the_next_read_and_repaired() {
    let data = content(4);
    let (engine, source, dir) = engine(&data, EngineOptions::default());
    let disk = engine.layer.disk;
    engine.read(disk, 0, data.len() as u64).await.unwrap();
    let fetched = source.calls.lock().len();
    damage(dir.path(), CHUNK as u64 + 9);
    assert!(
        engine.read_cached(disk, CHUNK as u64, 16).is_none(),
        "the changed chunk is not answered from the cache"
    );
    assert_eq!(
        engine.read(disk, CHUNK as u64, 16).await.unwrap(),
        data[CHUNK..CHUNK + 16]
    );
    assert_eq!(engine.stats.snapshot().cache_damaged, 1);
    assert!(source.calls.lock().len() > fetched, "fetched again");
    // Written back: the data file holds the verified bytes again.
    let mut back = vec![0u8; 16];
    engine.cache.read_at(disk, &mut back, CHUNK as u64).unwrap();
    assert_eq!(back, data[CHUNK..CHUNK + 16]);

    // Found by the background pass instead: repaired without a reader.
    damage(dir.path(), 2 * CHUNK as u64 + 1);
    let found = engine.check_cache(Some(0));
    assert_eq!(found.damaged, [2]);
    engine.repair(&found.damaged).await;
    engine
        .cache
        .read_at(disk, &mut back, 2 * CHUNK as u64)
        .unwrap();
    assert_eq!(back, data[2 * CHUNK..2 * CHUNK + 16]);
    assert!(engine.all_present(0..4));
}

#[tokio::test(start_paused = true)]
async fn background_hydration_waits_while_readers_fetch_and_keeps_slots_of_its_own() {
    let data = content(64);
    let (engine, source, _dir) = engine(&data, EngineOptions::default());
    let disk = engine.layer.disk;
    let hydrating = Arc::clone(&engine);
    let hydration = tokio::spawn(async move { hydrating.hydrate(2, Some(1 << 40)).await });
    tokio::time::sleep(READERS_REST / 2).await;
    assert_eq!(calls(&source), 0, "nothing before the readers rested");
    engine.read(disk, 40 * CHUNK as u64, 10).await.unwrap();
    assert_eq!(calls(&source), 1);
    tokio::time::sleep(READERS_REST - Duration::from_millis(100)).await;
    assert_eq!(calls(&source), 1, "a reader fetched: hydration waits again");
    // Every hydration slot taken: a reader still fetches at once.
    let held: Vec<_> = (0..engine.opts.max_concurrent_fetches)
        .map(|_| engine.hydrate_slots.try_acquire().unwrap())
        .collect();
    engine.read(disk, 20 * CHUNK as u64, 10).await.unwrap();
    assert_eq!(calls(&source), 2);
    drop(held);
    hydration.await.unwrap().unwrap();
    assert!(engine.cache.complete());
    assert_eq!(engine.read(disk, 0, data.len() as u64).await.unwrap(), data);
}

#[tokio::test]
async fn a_read_of_a_chunk_that_just_failed_fails_at_once() {
    let data = content(2);
    let deadline = Duration::from_millis(400);
    let (engine, source, _dir) = engine(
        &data,
        EngineOptions {
            fetch_deadline: deadline,
            ..EngineOptions::default()
        },
    );
    *source.failures.lock() = u32::MAX;
    let started = Instant::now();
    assert!(engine.read(engine.layer.disk, 0, 10).await.is_err());
    assert!(started.elapsed() >= deadline);
    let again = Instant::now();
    let e = engine.read(engine.layer.disk, 0, 10).await.unwrap_err();
    assert!(again.elapsed() < deadline / 4, "{:?}", again.elapsed());
    assert!(e.chain().contains("not asked again so soon"), "{e}");
    // Later it is asked again.
    tokio::time::sleep(FAILED_RECENTLY).await;
    *source.failures.lock() = 0;
    assert_eq!(
        engine.read(engine.layer.disk, 0, 10).await.unwrap(),
        data[..10]
    );
}

#[tokio::test]
async fn a_corrupt_chunk_is_fetched_once_more() {
    let data = content(4);
    let (engine, source, _dir) = engine(&data, EngineOptions::default());
    *source.corruptions.lock() = 1;
    assert_eq!(
        engine
            .read(engine.layer.disk, 0, CHUNK as u64)
            .await
            .unwrap(),
        data[..CHUNK]
    );
    assert_eq!(engine.stats.snapshot().verify_failures, 1);
    assert_eq!(calls(&source), 2);
}

#[tokio::test]
async fn persistent_corruption_fails_and_caches_nothing() {
    let data = content(4);
    let (engine, source, _dir) = engine(&data, EngineOptions::default());
    *source.corruptions.lock() = 100;
    let err = engine
        .read(engine.layer.disk, 0, CHUNK as u64)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{}", err.chain());
    assert!(err
        .chain()
        .contains("failed verification on each of 3 fetches"));
    assert!(
        !engine.cache.is_present(0),
        "unverified bytes are never cached"
    );
    assert_eq!(calls(&source), 3);
}

#[tokio::test]
async fn network_errors_are_retried_until_the_deadline() {
    let data = content(4);
    let opts = EngineOptions {
        fetch_deadline: Duration::from_secs(1),
        ..EngineOptions::default()
    };
    let (engine, source, _dir) = engine(&data, opts);
    *source.failures.lock() = 2;
    assert_eq!(
        engine.read(engine.layer.disk, 0, 10).await.unwrap(),
        data[..10]
    );
    assert_eq!(calls(&source), 3);
    *source.failures.lock() = 1000;
    let err = engine
        .read(engine.layer.disk, CHUNK as u64, 10)
        .await
        .unwrap_err();
    // The deadline ends the tries and names the last failure.
    assert_eq!(err.kind(), ErrorKind::Timeout, "{}", err.chain());
    assert!(err.chain().contains("fetching bytes"), "{}", err.chain());
    assert!(!engine.cache.is_present(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reads_of_the_same_chunks_fetch_each_once() {
    let data = content(16);
    let (engine, source, _dir) = engine(
        &data,
        EngineOptions {
            max_request_bytes: 1,
            ..EngineOptions::default()
        },
    );
    let disk = engine.layer.disk;
    let reads = (0..8).map(|i| {
        let engine = Arc::clone(&engine);
        tokio::spawn(async move { engine.read(disk, (i * 100) as u64, 12 * CHUNK as u64).await })
    });
    for r in futures_util::future::join_all(reads).await {
        r.unwrap().unwrap();
    }
    // 13 chunks touched (0..13): 13 fetches, however many readers.
    assert_eq!(engine.stats.snapshot().chunks_fetched, 13);
    assert_eq!(calls(&source), 13);
}

/// A layer of one file `disk/d.raw` holding `data` in `CHUNK`-byte chunks.
/// Bytes held from the TOC's fetch answer the structure check's first try; when they fail
/// it (garbled on the way), the check asks the registry itself, never the held bytes again.
#[tokio::test]
async fn held_bytes_that_fail_the_structure_check_are_asked_of_the_registry() {
    let (blob, summary) = honest(&content(2));
    // `head` held as the blob's first bytes.
    let holding = |head: Vec<u8>| {
        let mut held = Held::default();
        held.add(0, head.into());
        held
    };
    let (engine, source, _dir) = engine_of_blob(blob.clone(), &summary, EngineOptions::default());
    let head_end = engine.layer.chunks.iter().map(|c| c.compressed.start).min();
    let head = blob[..head_end.unwrap() as usize].to_vec();
    // Held as fetched: the head is not asked for.
    engine
        .check_structure(None, &holding(head.clone()))
        .await
        .unwrap();
    let calls = source.calls.lock().clone();
    assert!(calls.iter().all(|r| r.start > 0), "{calls:?}");
    // Garbled: the check fails on them once, then reads the registry's.
    let mut garbled = head;
    let mid = garbled.len() / 2;
    garbled[mid] ^= 0x40;
    let (engine, source, _dir) = engine_of_blob(blob.clone(), &summary, EngineOptions::default());
    engine
        .check_structure(None, &holding(garbled))
        .await
        .unwrap();
    let calls = source.calls.lock().clone();
    assert!(calls.iter().any(|r| r.start == 0), "{calls:?}");
}

fn honest(data: &[u8]) -> (Vec<u8>, crate::format::zstd_chunked::LayerSummary) {
    let (summary, blob) = crate::format::zstd_chunked::testing::write_layer(data, CHUNK);
    (blob, summary)
}

fn toc_of(blob: &[u8], s: &crate::format::zstd_chunked::LayerSummary) -> Toc {
    let loc = s.toc_location;
    decode_toc(
        &blob[loc.range().start as usize..loc.range().end as usize],
        &loc,
    )
    .unwrap()
}

/// `prefix` (the tar data as crafted) followed by `toc` in a skippable frame, and a summary
/// that pins that TOC and claims `diff_id`.
fn with_toc(
    mut prefix: Vec<u8>,
    toc: &Toc,
    diff_id: Digest,
) -> (Vec<u8>, crate::format::zstd_chunked::LayerSummary) {
    let json = serde_json::to_vec(toc).unwrap();
    let compressed = zstd::bulk::compress(&json, 1).unwrap();
    prefix.extend_from_slice(&[0x50, 0x2a, 0x4d, 0x18]);
    prefix.extend_from_slice(&(compressed.len() as u32).to_le_bytes());
    let toc_location = TocLocation {
        offset: prefix.len() as u64,
        length: compressed.len() as u64,
        uncompressed_length: json.len() as u64,
        checksum: Digest::of(&compressed),
    };
    prefix.extend_from_slice(&compressed);
    let summary = crate::format::zstd_chunked::LayerSummary {
        digest: Digest::of(&prefix),
        size: prefix.len() as u64,
        diff_id,
        annotations: Default::default(),
        toc_location,
        chunks: 0,
        zero_chunks: 0,
    };
    (prefix, summary)
}

async fn read_all(engine: &Engine) -> Result<Vec<u8>> {
    engine
        .read(
            engine.layer.disk,
            0,
            engine.layer.file_size(engine.layer.disk),
        )
        .await
}

#[tokio::test]
async fn an_honest_layer_passes_both_checks_and_is_verified_once_complete() {
    let data = content(6);
    let (blob, summary) = honest(&data);
    let (engine, _, _dir) = engine_of_blob(blob, &summary, EngineOptions::default());
    engine
        .check_structure(None, &Held::default())
        .await
        .unwrap();
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = CacheRoot::open(cache_dir.path()).unwrap();
    assert_eq!(
        engine.check_integrity(&cache).await,
        Integrity::Pending,
        "not complete yet"
    );
    assert_eq!(read_all(&engine).await.unwrap(), data);
    assert_eq!(engine.check_integrity(&cache).await, Integrity::Verified);
    assert_eq!(read_all(&engine).await.unwrap(), data);
}

#[tokio::test]
async fn a_layer_whose_diff_id_is_a_lie_fails_every_read_once_complete() {
    let data = content(4);
    let (blob, mut summary) = honest(&data);
    summary.diff_id = Digest::of(b"another layer");
    let (engine, _, _dir) = engine_of_blob(blob, &summary, EngineOptions::default());
    engine
        .check_structure(None, &Held::default())
        .await
        .unwrap();
    assert_eq!(read_all(&engine).await.unwrap(), data);
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = CacheRoot::open(cache_dir.path()).unwrap();
    let outcome = engine.check_integrity(&cache).await;
    let Integrity::Failed(why) = &outcome else {
        panic!("{outcome:?}")
    };
    assert!(
        why.contains("hashes to") && why.contains(&summary.diff_id.to_string()),
        "{why}"
    );
    assert_eq!(engine.stats.snapshot().integrity_failures, 1);
    let err = read_all(&engine).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt);
    assert!(
        err.chain()
            .contains("differs from what its image config says"),
        "{}",
        err.chain()
    );
    assert!(engine
        .read_cached(engine.layer.disk, 0, 10)
        .unwrap()
        .is_err());
}

#[tokio::test]
async fn a_toc_that_renames_a_file_is_refused_before_anything_is_served() {
    let data = content(3);
    let (blob, summary) = honest(&data);
    let mut toc = toc_of(&blob, &summary);
    for e in &mut toc.entries {
        e.name = e.name.replace("d.raw", "other.raw");
    }
    let data_end = (summary.toc_location.offset - 8) as usize;
    let (blob, summary) = with_toc(blob[..data_end].to_vec(), &toc, summary.diff_id);
    let (engine, source, _dir) = engine_of_blob(blob, &summary, EngineOptions::default());
    let err = engine
        .check_structure(None, &Held::default())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt);
    assert!(
        err.chain()
            .contains("path disk/d.raw, the TOC says disk/other.raw"),
        "{}",
        err.chain()
    );
    // Only the regions between chunks were fetched: no chunk.
    for range in source.calls.lock().iter() {
        assert!(engine
            .layer
            .chunks
            .iter()
            .all(|c| c.compressed.start >= range.end || c.compressed.end <= range.start));
    }
}

/// A one-chunk layer whose chunk is replaced, in the TOC, by a frame of fake content put
/// just before the real one: hidden in a skippable frame (which every ordinary decoder
/// ignores), or in plain sight (then the real content sits where the TOC says padding is).
fn fake_first_chunk(hidden: bool) -> (Arc<Engine>, tempfile::TempDir) {
    let data = content(1);
    let (blob, summary) = honest(&data);
    let mut toc = toc_of(&blob, &summary);
    let first = toc.entries.iter().position(|e| e.kind == "reg").unwrap();
    let start = toc.entries[first].offset as usize;
    let fake = vec![0x41u8; CHUNK];
    let frame = zstd::bulk::compress(&fake, 1).unwrap();
    let mut crafted = blob[..start].to_vec();
    if hidden {
        crafted.extend_from_slice(&[0x50, 0x2a, 0x4d, 0x18]);
        crafted.extend_from_slice(&(frame.len() as u32).to_le_bytes());
    }
    let fake_at = crafted.len() as i64;
    crafted.extend_from_slice(&frame);
    let fake_end = crafted.len() as i64;
    crafted.extend_from_slice(&blob[start..(summary.toc_location.offset - 8) as usize]);
    let reg = &mut toc.entries[first];
    reg.offset = fake_at;
    reg.end_offset = fake_end;
    reg.chunk_digest = Digest::of(&fake).to_string();
    reg.digest = reg.chunk_digest.clone();
    let (crafted, summary) = with_toc(crafted, &toc, summary.diff_id);
    let (engine, _, dir) = engine_of_blob(crafted, &summary, EngineOptions::default());
    (engine, dir)
}

#[tokio::test]
async fn a_chunk_inside_a_skippable_frame_is_refused() {
    let (engine, _dir) = fake_first_chunk(true);
    let err = engine
        .check_structure(None, &Held::default())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt);
    assert!(
        err.chain().contains("no whole zstd frame"),
        "{}",
        err.chain()
    );
}

#[tokio::test]
async fn a_fake_chunk_followed_by_the_real_content_is_refused() {
    let (engine, _dir) = fake_first_chunk(false);
    let err = engine
        .check_structure(None, &Held::default())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{}", err.chain());
    assert!(err.chain().contains("not a valid tar"), "{}", err.chain());
}

#[tokio::test]
async fn a_chunk_range_with_a_skippable_frame_is_never_served() {
    let data = content(1);
    let (blob, summary) = honest(&data);
    let (engine, _, _dir) = engine_of_blob(blob, &summary, EngineOptions::default());
    let (_, chunk) = engine.layer.chunk(0);
    let mut frame = vec![0x50, 0x2a, 0x4d, 0x18, 4, 0, 0, 0, 1, 2, 3, 4];
    frame.extend(zstd::bulk::compress(&data, 1).unwrap());
    let err = decode_chunk(&frame, chunk).unwrap_err();
    assert!(err.chain().contains("skippable frame"), "{}", err.chain());
    let mut trailing = zstd::bulk::compress(&data, 1).unwrap();
    trailing.extend_from_slice(b"junk");
    assert!(decode_chunk(&trailing, chunk).is_err());
}

#[tokio::test(start_paused = true)]
async fn a_registry_that_never_finishes_an_answer_fails_the_read_at_the_deadline() {
    struct Stalled;
    impl BlobSource for Stalled {
        fn fetch(
            &self,
            _range: Range<u64>,
            _ask: Ask,
        ) -> futures_util::future::BoxFuture<'_, Result<bytes::Bytes>> {
            Box::pin(std::future::pending())
        }
    }
    let data = content(2);
    let (blob, summary) = honest(&data);
    let (engine, _, _dir) = engine_of_blob(blob, &summary, EngineOptions::default());
    let engine = Arc::try_unwrap(engine).ok().unwrap();
    let engine = Engine::with_source(
        engine.layer,
        engine.cache,
        Sources {
            blob: Box::new(Stalled),
            windows: None,
        },
        EngineOptions {
            fetch_deadline: Duration::from_secs(5),
            ..EngineOptions::default()
        },
    );
    let started = tokio::time::Instant::now();
    let err = read_all(&engine).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout);
    assert!(
        err.chain().contains("did not succeed within 5 s"),
        "{}",
        err.chain()
    );
    assert!(
        started.elapsed() <= Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}
