//! Resolution against an in-memory registry ([`MemoryRegistry`]): which layer holds the disk,
//! how a record is found, kept and used offline, and which seekable index is trusted. The real
//! registry, containerd and FUSE are exercised in `integration/`.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::*;
use crate::format::seekable::{self, testing, Compression, Expected, Layout};
use crate::layer::{LayerKind, Resolved};
use crate::policy::Verifier;
use crate::registry::testing::MemoryRegistry;

const REGISTRY: &str = "127.0.0.1:1";

fn reference(name: &str) -> Reference {
    format!("{REGISTRY}/{name}").parse().unwrap()
}

/// The disk layer of image manifest `digest` (`manifest`) of `r` and its record, with no
/// signature policy and no key expected ([`disk_layer_id`] as classification calls it).
async fn layer_id(
    registry: &MemoryRegistry,
    cache: Option<&CacheRoot>,
    r: &Reference,
    manifest: &oci::Manifest,
    digest: Digest,
) -> Result<(Descriptor, LayerMeta)> {
    disk_layer_id(
        registry,
        cache,
        &Verifier::none(),
        r,
        manifest,
        digest,
        None,
    )
    .await
}

/// A layer of a test image: blob, media type, annotations, diff_id.
type TestLayer = (Vec<u8>, &'static str, BTreeMap<String, String>, Digest);

/// Stores an image of `layers` tagged `tag`; its manifest digest.
fn image(registry: &MemoryRegistry, tag: &str, layers: &[TestLayer]) -> Digest {
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| l.3.to_string()).collect::<Vec<_>>()},
    }))
    .unwrap();
    let config_len = config.len();
    let config_digest = registry.put_blob(config);
    let descriptors: Vec<_> = layers
        .iter()
        .map(|(blob, media_type, annotations, _)| {
            let digest = registry.put_blob(blob.clone());
            serde_json::json!({"mediaType": media_type, "digest": digest.to_string(),
                "size": blob.len(), "annotations": annotations})
        })
        .collect();
    registry.put_manifest(
        &serde_json::json!({
            "schemaVersion": 2,
            "mediaType": oci::OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": config_digest.to_string(), "size": config_len},
            "layers": descriptors,
        }),
        Some(tag),
    )
}

/// A zstd:chunked layer holding `disk/d.raw` = `data`: (blob, media type, annotations, diff_id).
fn chunked_layer(data: &[u8]) -> TestLayer {
    let (summary, blob) = crate::format::zstd_chunked::testing::write_layer(data, 64 << 10);
    (
        blob,
        oci::OCI_LAYER_ZSTD,
        summary.annotations,
        summary.diff_id,
    )
}

/// A gzip containerDisk layer holding `disk/d.raw` = `data`, its tar stream, and its index.
struct GzipLayer {
    blob: Vec<u8>,
    tar: Vec<u8>,
    index: seekable::SeekIndex,
    windows: Vec<u8>,
}

fn gzip_layer(data: &[u8]) -> GzipLayer {
    let tar = testing::tar_of(&[("disk/d.raw", data.to_vec())]);
    let blob = testing::gzip(&tar, 6);
    let expected = Expected {
        layer: Digest::of(&blob),
        layer_size: blob.len() as u64,
        compression: Some(Compression::Gzip),
        diff_id: Some(Digest::of(&tar)),
        layout: Layout::Tar,
    };
    let (index, windows) = testing::index_of(&blob, &expected, 64 << 10);
    GzipLayer {
        blob,
        tar,
        index,
        windows,
    }
}

/// Publishes `index` (with its `windows`) as a referrer of `subject`, naming `layer`.
fn publish_index(
    registry: &MemoryRegistry,
    subject: Digest,
    layer: Digest,
    index: &seekable::SeekIndex,
    windows: &[u8],
) {
    let bytes = index.encode().unwrap();
    let size = bytes.len();
    let digest = registry.put_blob(bytes);
    let windows_digest = registry.put_blob(windows.to_vec());
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": oci::OCI_MANIFEST,
        "artifactType": seekable::ARTIFACT_TYPE,
        "config": {"mediaType": "application/vnd.oci.empty.v1+json",
                   "digest": Digest::of(b"{}").to_string(), "size": 2},
        "layers": [
            {"mediaType": seekable::MEDIA_TYPE, "digest": digest.to_string(), "size": size},
            {"mediaType": seekable::WINDOWS_MEDIA_TYPE, "digest": windows_digest.to_string(),
             "size": windows.len()},
        ],
        "subject": {"mediaType": oci::OCI_MANIFEST, "digest": subject.to_string(), "size": 1},
        "annotations": {seekable::ANN_LAYER: layer.to_string()},
    });
    registry.put_referrer(subject, seekable::ARTIFACT_TYPE, &manifest);
}

fn disk(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(2654435761) >> 9) as u8)
        .collect()
}

#[tokio::test]
async fn a_layer_resolved_online_is_recorded_and_resolves_offline_from_the_cache() {
    let registry = MemoryRegistry::default();
    let data = disk(300 << 10);
    image(&registry, "1", &[chunked_layer(&data)]);
    let dir = tempfile::tempdir().unwrap();
    let cache = CacheRoot::open(dir.path()).unwrap();
    let r = reference("vm:1");

    let (online, _) = resolve(&registry, &cache, &Verifier::none(), Wanted::image(&r))
        .await
        .unwrap();
    assert_eq!(online.resolved, Resolved::Online);
    assert_eq!(online.disk_path(), "disk/d.raw");
    assert_eq!(online.file_size(online.disk), data.len() as u64);
    assert_eq!(online.meta.kind, LayerKind::ZstdChunked);
    let record = cache
        .load_ref(&r.to_string())
        .expect("the resolution is recorded");
    assert_eq!(record.layer_key, online.key());
    assert!(
        cache.load_layer_meta(&online.key()).is_some(),
        "and the TOC kept"
    );

    // The registry goes away: the same reference resolves from the cache, to the same layer;
    // one never resolved fails naming the registry as the cause.
    registry.down.store(true, Ordering::SeqCst);
    let (offline, _) = resolve(&registry, &cache, &Verifier::none(), Wanted::image(&r))
        .await
        .unwrap();
    assert_eq!(offline.resolved, Resolved::Offline);
    assert_eq!(offline.key(), online.key());
    assert_eq!(offline.chunks, online.chunks);
    let err = resolve(
        &registry,
        &cache,
        &Verifier::none(),
        Wanted::image(&reference("other:1")),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Network, "{}", err.chain());

    // A record whose kept TOC no longer matches what it pins is not used.
    let toc = cache
        .layer_dir(&online.key())
        .join(crate::cache::names::TOC);
    std::fs::write(&toc, b"not the TOC").unwrap();
    let err = resolve(&registry, &cache, &Verifier::none(), Wanted::image(&r))
        .await
        .unwrap_err();
    assert!(err.chain().contains("no TOC"), "{}", err.chain());
}

#[tokio::test]
async fn the_topmost_layer_with_a_toc_holds_the_disk_and_refused_annotations_say_why() {
    let registry = MemoryRegistry::default();
    let (lower, upper) = (
        chunked_layer(&disk(70 << 10)),
        chunked_layer(&disk(90 << 10)),
    );
    let plain = (
        b"plain".to_vec(),
        oci::OCI_LAYER_GZIP,
        BTreeMap::new(),
        Digest::of(b"p"),
    );
    let upper_digest = Digest::of(&upper.0);
    let digest = image(&registry, "1", &[lower, upper, plain]);
    let r = reference("vm:1");
    let (manifest, found, _) = platform_manifest(&registry, None, &r).await.unwrap();
    assert_eq!(found, digest);
    assert_eq!(disk_layer(&manifest).unwrap().digest, upper_digest);
    // Without a TOC, the topmost gzip or uncompressed tar layer is the one to index.
    let (position, layer, compression) = indexable_layer(&manifest).unwrap();
    assert_eq!((position, compression), (2, Compression::Gzip));
    assert_eq!(layer.digest, Digest::of(b"plain"));
    let (_, meta) = layer_id(&registry, None, &r, &manifest, digest)
        .await
        .unwrap();
    assert_eq!(meta.layer_digest, upper_digest);
    assert_eq!(meta.kind, LayerKind::ZstdChunked);

    // A TOC annotation that is there but malformed is the reason given, not "no lazy layer".
    let mut bad = chunked_layer(&disk(10 << 10));
    for value in bad.2.values_mut() {
        if value.contains(':') && !value.starts_with("sha256:") {
            *value = "1:2".into();
        }
    }
    let digest = image(&registry, "bad", &[bad]);
    let r = reference("vm:bad");
    let (manifest, _, _) = platform_manifest(&registry, None, &r).await.unwrap();
    let err = layer_id(&registry, None, &r, &manifest, digest)
        .await
        .unwrap_err();
    assert!(
        err.chain().contains("position") || err.chain().contains("annotation"),
        "{}",
        err.chain()
    );
    assert!(!err.chain().contains("seekable index"), "{}", err.chain());
}

/// An eStargz layer holding `disk/d.raw` = `data` in chunks of `chunk` bytes.
fn estargz_layer(data: &[u8], chunk: usize) -> TestLayer {
    let written = vmdisk_testing::estargz::layer(&[("disk/d.raw", data.to_vec())], chunk);
    let annotations = BTreeMap::from([(
        crate::format::estargz::ANN_TOC_DIGEST.to_string(),
        written.toc_digest,
    )]);
    (
        written.blob,
        oci::OCI_LAYER_GZIP,
        annotations,
        written.diff_id.parse().unwrap(),
    )
}

/// Stores an eStargz layer of `chunk`-byte chunks and fetches its TOC, which must pass its
/// digest: the blob's length and the TOC's offset.
async fn estargz_toc_fetched(registry: &MemoryRegistry, chunk: usize) -> (u64, u64) {
    let (blob, _, annotations, _) = estargz_layer(&disk(1 << 20), chunk);
    let toc: Digest = annotations.values().next().unwrap().parse().unwrap();
    let digest = registry.put_blob(blob.clone());
    let (offset, json) =
        fetch_estargz_toc(registry, &reference("vm:t"), digest, blob.len() as u64, toc)
            .await
            .unwrap();
    toc.verify(&json, "TOC").unwrap();
    (blob.len() as u64, offset)
}

#[tokio::test]
async fn an_estargz_toc_that_fits_the_tail_costs_one_request_and_a_larger_one_two() {
    let registry = MemoryRegistry::default();
    for (chunk, requests) in [(64 << 10, 1), (256, 2)] {
        let before = registry.ranges.load(Ordering::SeqCst);
        let (blob_len, offset) = estargz_toc_fetched(&registry, chunk).await;
        let footer_at = blob_len - crate::format::estargz::FOOTER_SIZE;
        assert_eq!(
            footer_at - offset > toc::ESTARGZ_TAIL,
            requests == 2,
            "the TOC member's size decides, {chunk}-byte chunks"
        );
        assert_eq!(
            registry.ranges.load(Ordering::SeqCst) - before,
            requests,
            "{chunk}-byte chunks"
        );
    }
}

#[tokio::test]
async fn a_mount_server_takes_the_estargz_record_the_daemon_kept_and_only_that() {
    let registry = MemoryRegistry::default();
    image(&registry, "1", &[estargz_layer(&disk(300 << 10), 64 << 10)]);
    let dir = tempfile::tempdir().unwrap();
    let cache = CacheRoot::open(dir.path()).unwrap();
    let r = reference("vm:1");
    // The daemon classifies the layer: footer and TOC fetched, the record kept.
    let (manifest, digest, _) = platform_manifest(&registry, Some(&cache), &r)
        .await
        .unwrap();
    let pinned = r.with_digest(digest);
    let (_, meta) = layer_id(&registry, Some(&cache), &pinned, &manifest, digest)
        .await
        .unwrap();
    let key = meta.id().key();
    assert!(cache.has_layer_meta(&key));

    // Its mount server, told the key: not one Range request of the blob.
    let before = registry.ranges.load(Ordering::SeqCst);
    let wanted = Wanted {
        expected: Some(key),
        ..Wanted::image(&pinned)
    };
    let (layer, _) = resolve(&registry, &cache, &Verifier::none(), wanted)
        .await
        .unwrap();
    assert_eq!(layer.key(), key);
    assert_eq!(layer.resolved, Resolved::Online);
    assert_eq!(registry.ranges.load(Ordering::SeqCst), before);

    // A key the manifest and config do not give (a kept record of the same blob whose
    // diff_id is another, or a key with no record) is not taken: the footer and TOC are
    // fetched and decide.
    let mut other = meta.clone();
    other.diff_id = Digest::of(b"another tar stream");
    let toc = std::fs::read(cache.layer_dir(&key).join(crate::cache::names::TOC)).unwrap();
    cache.save_layer_meta(&other, &toc).unwrap();
    for expected in [other.id().key(), Digest::of(b"another layer")] {
        let before = registry.ranges.load(Ordering::SeqCst);
        let wanted = Wanted {
            expected: Some(expected),
            ..Wanted::image(&pinned)
        };
        let (layer, _) = resolve(&registry, &cache, &Verifier::none(), wanted)
            .await
            .unwrap();
        assert_eq!(layer.key(), key, "the layer the footer says");
        assert_eq!(registry.ranges.load(Ordering::SeqCst), before + 1);
    }
}

#[tokio::test]
async fn a_config_that_does_not_list_a_diff_id_per_layer_is_refused() {
    let registry = MemoryRegistry::default();
    let layer = chunked_layer(&disk(20 << 10));
    let digest = image(&registry, "1", &[layer]);
    let r = reference("vm:1");
    let (manifest, _, _) = platform_manifest(&registry, None, &r).await.unwrap();
    let config =
        br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
    let err = diff_id_of(config, &manifest, 0, &r).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt);
    assert!(
        err.chain().contains("0 diff_ids for 1 layers"),
        "{}",
        err.chain()
    );
    assert!(layer_id(&registry, None, &r, &manifest, digest)
        .await
        .is_ok());
}

#[tokio::test]
async fn an_index_is_trusted_only_for_its_image_and_layer_and_the_newest_valid_one_wins() {
    let registry = MemoryRegistry::default();
    let data = disk(400 << 10);
    let layer = gzip_layer(&data);
    let layer_digest = Digest::of(&layer.blob);
    let tar_digest = Digest::of(&layer.tar);
    let subject = image(
        &registry,
        "1",
        &[(
            layer.blob.clone(),
            oci::OCI_LAYER_GZIP,
            BTreeMap::new(),
            tar_digest,
        )],
    );
    let dir = tempfile::tempdir().unwrap();
    let cache = CacheRoot::open(dir.path()).unwrap();
    let r = reference("vm:1");

    // No index yet: the error says what was searched and what to do.
    let err = resolve(&registry, &cache, &Verifier::none(), Wanted::image(&r))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{}", err.chain());
    assert!(err.chain().contains("vmdisk index"), "{}", err.chain());
    assert!(
        err.chain().contains(&format!("{REGISTRY}/vm")),
        "{}",
        err.chain()
    );

    // The valid index, then a newer one that names another layer: the newer is refused, the
    // valid one used.
    publish_index(
        &registry,
        subject,
        layer_digest,
        &layer.index,
        &layer.windows,
    );
    let other = gzip_layer(&disk(100 << 10));
    publish_index(
        &registry,
        subject,
        Digest::of(&other.blob),
        &other.index,
        &other.windows,
    );
    let (resolved, _) = resolve(&registry, &cache, &Verifier::none(), Wanted::image(&r))
        .await
        .unwrap();
    let Some(source) = resolved.meta.index_source() else {
        panic!("read through an index: {:?}", resolved.meta.kind);
    };
    assert_eq!(source.repository.to_string(), format!("{REGISTRY}/vm"));
    assert_eq!(
        resolved.meta.toc_digest,
        Digest::of(&layer.index.encode().unwrap())
    );
    assert_eq!(resolved.disk_path(), "disk/d.raw");
    assert_eq!(resolved.file_size(resolved.disk), data.len() as u64);
    assert!(resolved.codec().windows_blob().is_some());
}

#[tokio::test]
async fn indexes_of_another_layer_or_image_are_refused_each_by_name() {
    let layer = gzip_layer(&disk(400 << 10));
    let other = gzip_layer(&disk(100 << 10));
    let (layer_digest, tar_digest) = (Digest::of(&layer.blob), Digest::of(&layer.tar));
    let r = reference("vm:1");
    // Only lies: an index of another layer for this image, and one of this layer for
    // another image. Every refusal is named.
    let lying = MemoryRegistry::default();
    let subject = image(
        &lying,
        "1",
        &[(
            layer.blob.clone(),
            oci::OCI_LAYER_GZIP,
            BTreeMap::new(),
            tar_digest,
        )],
    );
    publish_index(
        &lying,
        subject,
        Digest::of(&other.blob),
        &other.index,
        &other.windows,
    );
    publish_index(
        &lying,
        Digest::of(b"another image"),
        layer_digest,
        &layer.index,
        &layer.windows,
    );
    let dir = tempfile::tempdir().unwrap();
    let cache = CacheRoot::open(dir.path()).unwrap();
    let err = resolve(&lying, &cache, &Verifier::none(), Wanted::image(&r))
        .await
        .unwrap_err();
    assert!(
        err.chain().contains("no usable seekable index"),
        "{}",
        err.chain()
    );
    assert!(err.chain().contains("indexes layer"), "{}", err.chain());
}

#[tokio::test]
async fn a_kept_manifest_by_digest_saves_its_round_trip_and_a_changed_one_is_not_used() {
    let registry = MemoryRegistry::default();
    let digest = image(&registry, "1", &[chunked_layer(&disk(10 << 10))]);
    let dir = tempfile::tempdir().unwrap();
    let cache = CacheRoot::open(dir.path()).unwrap();
    let pinned = reference("vm:1").with_digest(digest);
    manifest_of(&registry, Some(&cache), &pinned).await.unwrap();
    registry.down.store(true, Ordering::SeqCst);
    let (_, kept) = manifest_of(&registry, Some(&cache), &pinned).await.unwrap();
    assert_eq!(kept, digest, "answered from the cache, not the registry");
    // A kept blob that no longer hashes to its digest is fetched again (and here fails).
    std::fs::write(dir.path().join("blobs").join(digest.hex()), b"{}").unwrap();
    let err = manifest_of(&registry, Some(&cache), &pinned)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Network);
}

/// A registry holding `vm:1`, one zstd:chunked layer of one 300 KiB file, and a cache at `dir`
/// that keeps the image's manifest: the registry, the cache, the reference, its platform
/// manifest and that manifest's digest.
async fn one_file_image(
    dir: &std::path::Path,
) -> (
    Arc<MemoryRegistry>,
    CacheRoot,
    Reference,
    oci::Manifest,
    Digest,
) {
    let registry = Arc::new(MemoryRegistry::default());
    image(&registry, "1", &[chunked_layer(&disk(300 << 10))]);
    let cache = CacheRoot::open(dir).unwrap();
    let r = reference("vm:1");
    let (manifest, digest, _) = platform_manifest(registry.as_ref(), Some(&cache), &r)
        .await
        .unwrap();
    (registry, cache, r, manifest, digest)
}

/// A mount server whose daemon kept the image's config but not its TOC (the config came from
/// containerd's content store) fetches the TOC with the blob's head and the bytes before it,
/// in one round trip: the structure check then asks the registry for nothing more.
#[tokio::test]
async fn a_one_file_layers_structure_check_reads_the_bytes_fetched_with_its_toc() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, cache, r, manifest, digest) = one_file_image(dir.path()).await;
    let config = registry
        .get_blob(&r, &manifest.config, oci::MAX_CONFIG_SIZE)
        .await
        .unwrap();
    cache.save_blob(&manifest.config.digest, &config).unwrap();
    let pinned = r.with_digest(digest);

    let before = registry.ranges.load(Ordering::SeqCst);
    let client: Arc<dyn Registry> = registry.clone();
    let engine = crate::serve::open_engine(
        client,
        &cache,
        &Verifier::none(),
        crate::serve::Opening::Resolve(Wanted::image(&pinned)),
        crate::engine::EngineOptions::default(),
        crate::serve::Warm::Nothing,
        std::future::ready(crate::layer::Held::default()),
    )
    .await
    .unwrap();
    // The TOC with the bytes before it, and the blob's head: two requests at once, and the
    // check (done by open_engine) none of its own.
    assert_eq!(registry.ranges.load(Ordering::SeqCst) - before, 2);
    assert!(cache.structure_checked(&engine.layer().key()));
}

/// While an eStargz layer's mount server starts, the snapshotter fetches what the server's
/// structure check reads (the tar headers before the file, the members of its last chunk) from
/// the record and TOC it kept when it classified the layer: the server's check then asks the
/// registry for nothing, and the disk's first chunks come with those bytes. Once the check
/// passed, nothing is fetched ahead.
#[tokio::test]
async fn an_estargz_layers_structure_check_reads_the_bytes_the_daemon_fetched_ahead() {
    let registry = Arc::new(MemoryRegistry::default());
    image(&registry, "1", &[estargz_layer(&disk(300 << 10), 64 << 10)]);
    let r = reference("vm:1");
    let ranges = || registry.ranges.load(Ordering::SeqCst);
    for ahead in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let cache = CacheRoot::open(dir.path()).unwrap();
        // The daemon classifies the layer: footer and TOC fetched, the record kept.
        let (manifest, digest, _) = platform_manifest(registry.as_ref(), Some(&cache), &r)
            .await
            .unwrap();
        let pinned = r.with_digest(digest);
        let (_, meta) = layer_id(registry.as_ref(), Some(&cache), &pinned, &manifest, digest)
            .await
            .unwrap();
        let key = meta.id().key();
        let before = ranges();
        let held = match ahead {
            true => fetch_structure_ahead(registry.as_ref(), &cache, key).await,
            false => crate::layer::Held::default(),
        };
        assert_eq!(ranges() - before, if ahead { 2 } else { 0 });
        let before = ranges();
        let client: Arc<dyn Registry> = registry.clone();
        let engine = crate::serve::open_engine(
            client,
            &cache,
            &Verifier::none(),
            crate::serve::Opening::Resolve(Wanted {
                expected: Some(key),
                ..Wanted::image(&pinned)
            }),
            crate::engine::EngineOptions::default(),
            crate::serve::Warm::Nothing,
            std::future::ready(held),
        )
        .await
        .unwrap();
        assert_eq!(
            ranges() - before,
            if ahead { 0 } else { 2 },
            "the check's own requests, bytes fetched ahead: {ahead}"
        );
        assert!(cache.structure_checked(&engine.layer().key()));
        // The blob's head came with those bytes: the disk's first chunks are kept, unasked.
        assert_eq!(engine.present_count() > 0, ahead, "{ahead}");
        let before = ranges();
        assert!(fetch_structure_ahead(registry.as_ref(), &cache, key)
            .await
            .is_empty());
        assert_eq!(ranges(), before, "checked already: nothing fetched ahead");
    }
}

/// A mirror that damages the TOCs it serves answered, so it counts as healthy and is asked
/// first: the bytes that failed their pinned digest are fetched from the registry itself next,
/// and the layer resolves (a zstd:chunked TOC and an eStargz footer and TOC alike).
#[tokio::test]
async fn a_toc_a_mirror_damaged_is_fetched_from_the_registry_itself() {
    let registry = MemoryRegistry::default();
    registry.lying_mirror.store(true, Ordering::SeqCst);
    let data = disk(300 << 10);
    image(&registry, "1", &[chunked_layer(&data)]);
    let dir = tempfile::tempdir().unwrap();
    let cache = CacheRoot::open(dir.path()).unwrap();
    let (layer, _) = resolve(
        &registry,
        &cache,
        &Verifier::none(),
        Wanted::image(&reference("vm:1")),
    )
    .await
    .unwrap();
    assert_eq!(layer.file_size(layer.disk), data.len() as u64);
    assert!(registry.registry_ranges.load(Ordering::SeqCst) >= 1);

    let before = registry.registry_ranges.load(Ordering::SeqCst);
    estargz_toc_fetched(&registry, 64 << 10).await;
    assert_eq!(
        registry.registry_ranges.load(Ordering::SeqCst) - before,
        1,
        "one try of the registry itself after the mirror's"
    );
}

/// A layer the daemon decided just now opens from the cache by its key: nothing is asked of
/// the registry (here it is down), and the image's reference record is kept as a resolution
/// keeps it (for a later resolution without the registry). A key the cache has no record of
/// opens nothing (the server then resolves the image), and an image not pinned by digest is
/// refused.
#[tokio::test]
async fn a_decided_layer_opens_from_the_cache_by_its_key_without_the_registry() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, cache, r, manifest, digest) = one_file_image(dir.path()).await;
    let pinned = r.with_digest(digest);
    // The daemon's decision: the layer identified, its record and TOC kept.
    let (_, meta) = disk_layer_id(
        registry.as_ref(),
        Some(&cache),
        &Verifier::none(),
        &pinned,
        &manifest,
        digest,
        None,
    )
    .await
    .unwrap();
    let key = meta.id().key();
    registry.down.store(true, Ordering::SeqCst);
    let asked = (
        registry.lookups.load(Ordering::SeqCst),
        registry.ranges.load(Ordering::SeqCst),
    );
    let layer = kept(&cache, &pinned, key).await.unwrap().expect("kept");
    assert_eq!(layer.key(), key);
    assert_eq!(
        (
            registry.lookups.load(Ordering::SeqCst),
            registry.ranges.load(Ordering::SeqCst)
        ),
        asked
    );
    let record = cache
        .load_ref(&pinned.to_string())
        .expect("the reference record");
    assert_eq!((record.layer_key, record.manifest_digest), (key, digest));
    assert!(kept(&cache, &pinned, Digest::of(b"another layer"))
        .await
        .unwrap()
        .is_none());
    assert!(
        kept(&cache, &r, key).await.is_err(),
        "a tag is not a decision"
    );
}
