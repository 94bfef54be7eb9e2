//! Chunks copied from other cached layers (`engine/dedup.rs`).

use super::*;

/// An engine over a zstd:chunked layer of `data` whose cache is in `root`, as a mount's is.
fn engine_in(root: &CacheRoot, data: &[u8]) -> (Arc<Engine>, Arc<FakeBlob>) {
    let (blob, summary) = honest(data);
    let (meta, toc) = crate::layer::testing::zstd_chunked_meta(&summary, &blob);
    root.save_layer_meta(&meta, &toc).unwrap();
    let layer =
        crate::layer::codec::open(meta.reference.clone(), meta, &toc, Resolved::Offline).unwrap();
    let sizes: Vec<u64> = (0..layer.files.len()).map(|f| layer.file_size(f)).collect();
    let dir = root.layer_dir(&layer.key());
    let cache = LayerCache::open(&dir, &sizes, layer.chunks.len()).unwrap();
    let source = Arc::new(FakeBlob {
        blob,
        ..FakeBlob::default()
    });
    let sources = Sources {
        blob: test_blob(Arc::clone(&source)),
        windows: None,
    };
    let engine = Engine::with_source(layer, cache, sources, exact());
    (engine, source)
}

/// How many chunks `engine` copied from other layers.
fn deduplicated(engine: &Engine) -> u64 {
    engine.stats.snapshot().chunks_deduplicated
}

#[tokio::test]
async fn chunks_another_layer_keeps_are_copied_and_a_damaged_copy_is_fetched() {
    let root_dir = tempfile::tempdir().unwrap();
    let root = CacheRoot::open(root_dir.path()).unwrap();
    // Layer A holds chunks 0..8; layer B the same 8 and 4 more (another blob, another key).
    let (a, _) = engine_in(&root, &content(8));
    read_all(&a).await.unwrap();
    a.cache.flush().unwrap();
    let mut b_data = content(8);
    b_data.extend((0..4 * CHUNK).map(|i| ((i / 7) ^ 0x5a) as u8));
    let (b, b_blob) = engine_in(&root, &b_data);
    assert_ne!(a.layer.key(), b.layer.key());
    b.index_other_layers(&root);
    assert!(read_all(&b).await.unwrap() == b_data);
    // All but chunk 3, which is zeros: its frame of a few bytes is fetched instead.
    assert_eq!(deduplicated(&b), 7, "A's chunks copied");
    let asked: u64 = b_blob.calls.lock().iter().map(|r| r.end - r.start).sum();
    assert!(asked < b_blob.blob.len() as u64 / 2, "asked {asked} bytes");

    // A's data file damaged under it: the copy of chunk 0 fails its digest and is fetched.
    let (disk, chunk) = a.layer.chunk(0);
    let file = crate::cache::data_file(&root.layer_dir(&a.layer.key()), disk);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[chunk.offset as usize + 10] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    std::fs::remove_dir_all(root.layer_dir(&b.layer.key())).unwrap();
    let (b, b_blob) = engine_in(&root, &b_data);
    b.index_other_layers(&root);
    assert!(
        read_all(&b).await.unwrap() == b_data,
        "never the damaged bytes"
    );
    assert_eq!(deduplicated(&b), 6, "the damaged chunk is not copied");
    let first = b.layer.chunk(0).1.compressed.clone();
    assert!(
        b_blob
            .calls
            .lock()
            .iter()
            .any(|r| r.start <= first.start && first.end <= r.end),
        "chunk 0 fetched from the registry"
    );
}
