//! The engine's tests: reads, shared fetches, retries and checks against a blob in memory;
//! the cache's checks in `check.rs`, copies from other layers in `dedup.rs`, the layer's
//! integrity in `integrity.rs`.

mod check;
mod dedup;
mod integrity;

use super::*;
use crate::blob::{Blob, BlobSource};
use crate::format::toc::Toc;
use crate::format::zstd_chunked::{decode_chunk, decode_toc, TocLocation};
use crate::layer::{Held, IndexSource, LayerKind, LayerMeta, Resolved};

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

/// `source` as an engine's blob (its engine sets how it is read).
fn test_blob(source: impl BlobSource + 'static) -> Blob<'static> {
    Blob::new(
        source,
        "the test blob",
        crate::retry::RetryPolicy::default(),
    )
}

const CHUNK: usize = 4096;

/// The default options, but a reader's request asks for just what it reads: these layers'
/// chunks are a few KiB, and the tests count requests chunk by chunk.
fn exact() -> EngineOptions {
    EngineOptions {
        min_request_bytes: 0,
        ..EngineOptions::default()
    }
}

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
        blob: test_blob(Arc::clone(&source)),
        windows: windows.map(|_| test_blob(Arc::clone(&windows_source))),
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
            repository: "127.0.0.1:1/test/t".parse().unwrap(),
            compression: index.compression,
            layout: index.layout,
        }),
    };
    let windows = index.windows.map(|_| windows);
    engine_of_sources(blob, windows, meta, &bytes, exact())
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
    let (engine, source, _dir) = engine(&data, exact());
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
    assert_eq!(engine.sources.blob.reads_in_flight(), 0);
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
    let (engine, _, _dir) = engine_of_layer(blob, meta, &json, exact());
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
    let (engine, source, _dir) = engine(&data, exact());
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
        ..exact()
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

#[tokio::test(start_paused = true)]
async fn background_hydration_waits_while_readers_fetch_and_keeps_slots_of_its_own() {
    let data = content(64);
    let (engine, source, _dir) = engine(&data, exact());
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
            ..exact()
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
    let (engine, source, _dir) = engine(&data, exact());
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
    let (engine, source, _dir) = engine(&data, exact());
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
        ..exact()
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
            ..exact()
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
    let (engine, source, _dir) = engine_of_blob(blob.clone(), &summary, exact());
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
    let (engine, source, _dir) = engine_of_blob(blob.clone(), &summary, exact());
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

/// What `vmdisk inspect` reads an index's spans with (a codec fetching through `Sources`, no
/// engine): each read retried under the blob's policy, as an engine's are.
#[tokio::test]
async fn a_blob_read_without_an_engine_is_retried_and_counted() {
    let source = Arc::new(FakeBlob {
        blob: content(1),
        ..FakeBlob::default()
    });
    *source.failures.lock() = 1;
    let policy = crate::retry::RetryPolicy::demand_range(Duration::from_secs(5));
    let sources = Sources {
        blob: Blob::new(Arc::clone(&source), "the test blob", policy),
        windows: None,
    };
    let got = Fetch::blob(&sources, 0..100, Ask::AnyEndpoint)
        .await
        .unwrap();
    assert_eq!(&got[..], &source.blob[..100]);
    assert_eq!(
        source.calls.lock().len(),
        2,
        "the failed request was asked again"
    );
}

/// `len` bytes that do not compress.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut data = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut data);
    data
}

#[tokio::test]
async fn a_read_of_small_chunks_brings_the_small_chunks_after_it_in_the_same_request() {
    // 64 chunks of 4 KiB that compress to a few dozen bytes each (a file system's metadata).
    let data: Vec<u8> = (0..64 * CHUNK).map(|i| (i / 512) as u8).collect();
    let (engine, source, _dir) = engine(&data, EngineOptions::default());
    let disk = engine.layer.disk;
    assert_eq!(engine.read(disk, 0, 100).await.unwrap(), data[..100]);
    assert_eq!(calls(&source), 1);
    assert_eq!(
        engine.read(disk, 40 * CHUNK as u64, 100).await.unwrap(),
        data[40 * CHUNK..40 * CHUNK + 100],
    );
    assert_eq!(
        calls(&source),
        1,
        "the chunks after the first read came with it"
    );
    // Chunks that do not compress fill the floor alone: a random reader fetches what it reads.
    let data = noise(8 * (64 << 10), 5);
    let (summary, blob) = crate::format::zstd_chunked::testing::write_layer(&data, 64 << 10);
    let (engine, source, _dir) = engine_of_blob(blob, &summary, EngineOptions::default());
    let disk = engine.layer.disk;
    let at = 3 * (64 << 10) + 10;
    assert_eq!(
        engine.read(disk, at as u64, 100).await.unwrap(),
        data[at..at + 100]
    );
    let asked = source.calls.lock().clone();
    assert_eq!(asked.len(), 1);
    let chunk = &engine.layer.chunks[3].compressed;
    assert_eq!(asked[0], chunk.clone(), "one chunk's frame and no more");
}

#[tokio::test]
async fn chunks_whose_frames_came_with_the_toc_are_kept_once_verified() {
    let data: Vec<u8> = (0..16 * CHUNK).map(|i| (i / 512) as u8).collect();
    let (blob, summary) = honest(&data);
    let (engine, source, _dir) = engine_of_blob(blob.clone(), &summary, exact());
    let head = engine.layer.chunks[5].compressed.end as usize;
    let mut held = Held::default();
    held.add(0, blob[..head].to_vec().into());
    assert_eq!(
        engine.keep_held(&held),
        6,
        "chunks 0..=5 are whole in the head"
    );
    let disk = engine.layer.disk;
    assert_eq!(
        engine.read(disk, 0, 6 * CHUNK as u64).await.unwrap(),
        data[..6 * CHUNK]
    );
    assert_eq!(calls(&source), 0, "nothing asked of the registry");
    // Bytes that fail their check are not kept: the chunk is fetched when read.
    let (engine, source, _dir) = engine_of_blob(blob.clone(), &summary, exact());
    let mut garbled = blob[..head].to_vec();
    let c2 = engine.layer.chunks[2].compressed.clone();
    garbled[(c2.start + c2.end) as usize / 2] ^= 0x40;
    let mut held = Held::default();
    held.add(0, garbled.into());
    assert!(engine.keep_held(&held) < 6);
    assert_eq!(engine.counters().verify_failures, 1);
    assert_eq!(
        engine.read(disk, 0, 6 * CHUNK as u64).await.unwrap(),
        data[..6 * CHUNK]
    );
    assert!(calls(&source) >= 1);
}
