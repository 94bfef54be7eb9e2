//! A layer checked whole once complete: its diff_id and its TOC (`engine/integrity.rs`).

use super::*;

#[tokio::test]
async fn an_honest_layer_passes_both_checks_and_is_verified_once_complete() {
    let data = content(6);
    let (blob, summary) = honest(&data);
    let (engine, _, _dir) = engine_of_blob(blob, &summary, exact());
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
    let (engine, _, _dir) = engine_of_blob(blob, &summary, exact());
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
    let (engine, source, _dir) = engine_of_blob(blob, &summary, exact());
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
    let (engine, _, dir) = engine_of_blob(crafted, &summary, exact());
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
    let (engine, _, _dir) = engine_of_blob(blob, &summary, exact());
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
    let (engine, _, _dir) = engine_of_blob(blob, &summary, exact());
    let engine = Arc::try_unwrap(engine).ok().unwrap();
    let engine = Engine::with_source(
        engine.layer,
        engine.cache,
        Sources {
            blob: test_blob(Stalled),
            windows: None,
        },
        EngineOptions {
            fetch_deadline: Duration::from_secs(5),
            ..exact()
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
