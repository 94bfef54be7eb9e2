//! The cache's chunks checked against what was verified (`engine/check.rs`).

use super::*;
use crate::engine::check::CacheCheck;

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
        blob: test_blob(Arc::clone(blob)),
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
    let (engine, source, dir) = engine(&data, exact());
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
            ..exact()
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
        ..exact()
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
    let (engine, source, dir) = engine(&data, exact());
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
    let (engine, source, dir) = engine(&data, exact());
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
    let (engine, source, dir) = engine(&data, exact());
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
