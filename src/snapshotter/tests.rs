//! The Prepare decision without root, network or processes: an in-memory registry behind the
//! [`Registry`] seam and a recording [`Supervisor`]. What each outcome does to the store and
//! the counters is checked here; the real thing (containerd, FUSE, mount servers) is checked
//! in `integration/cases/snapshotter.rs`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures_util::future::BoxFuture;
use parking_lot::Mutex;

use super::prepare::classify::{
    Classifier, CriLabels, LABEL_IMAGE_REF, LABEL_LAYER, LABEL_MANIFEST, LABEL_TARGET,
};
use super::servers::control::LayerStatus;
use super::servers::supervisor::Supervisor;
use super::{CacheSettings, Snapshotter};
use crate::error::{Error, ErrorKind, Result};
use crate::format::zstd_chunked::{ANN_TOC_CHECKSUM, ANN_TOC_POSITION};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::registry::auth::Credential;
use crate::registry::testing::MemoryRegistry;
use crate::registry::Registry;

impl MemoryRegistry {
    /// Stores an image whose layers have `layers` (media type, annotations) and returns the
    /// manifest digest and the layer digests.
    fn image(&self, layers: &[(&str, BTreeMap<String, String>)]) -> (Digest, Vec<Digest>) {
        self.image_with(layers, serde_json::json!({}))
    }

    /// [`Self::image`] with `runtime` as the config's `config` (e.g. a `Cmd`).
    fn image_with(
        &self,
        layers: &[(&str, BTreeMap<String, String>)],
        runtime: serde_json::Value,
    ) -> (Digest, Vec<Digest>) {
        let digests: Vec<Digest> = (0..layers.len())
            .map(|i| Digest::of(format!("layer {i} of {layers:?}").as_bytes()))
            .collect();
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64", "os": "linux", "config": runtime,
            "rootfs": {"type": "layers", "diff_ids": digests.iter().map(|d| d.to_string()).collect::<Vec<_>>()},
        }))
        .unwrap();
        let config_digest = Digest::of(&config);
        self.blobs.lock().insert(config_digest, config.clone());
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": config_digest.to_string(), "size": config.len()},
            "layers": layers.iter().zip(&digests).map(|((media_type, annotations), d)| serde_json::json!({
                "mediaType": media_type, "digest": d.to_string(), "size": 1 << 20,
                "annotations": annotations,
            })).collect::<Vec<_>>(),
        }))
        .unwrap();
        let digest = Digest::of(&manifest);
        self.manifests.lock().insert(digest, manifest);
        (digest, digests)
    }
}

/// Records what it was asked; mounts are plain directories; `fail` makes `ensure` fail.
struct FakeSupervisor {
    root: PathBuf,
    /// Layer, reference and the user names of the grants handed over.
    ensured: Mutex<Vec<(Digest, String, Vec<String>)>>,
    stopped: Mutex<Vec<Digest>>,
    fail: AtomicBool,
}

impl Supervisor for FakeSupervisor {
    fn mountpoint(&self, layer: &Digest) -> PathBuf {
        self.root.join(layer.hex())
    }

    /// Mounted once `ensure` made its directory (a test removes it to unmount).
    fn mounted(&self, layer: &Digest) -> bool {
        self.mountpoint(layer).is_dir()
    }

    fn ready_dir(&self, _reference: &Reference) -> Option<PathBuf> {
        None
    }

    fn status<'a>(&'a self, _layer: &'a Digest) -> BoxFuture<'a, Option<LayerStatus>> {
        Box::pin(async { None })
    }

    fn hydrate<'a>(&'a self, _layer: &'a Digest) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async { Ok(true) })
    }

    fn ensure<'a>(
        &'a self,
        plan: &'a super::servers::control::LayerPlan,
        _ahead: Option<super::servers::supervisor::Ahead>,
    ) -> BoxFuture<'a, Result<PathBuf>> {
        Box::pin(async move {
            if self.fail.load(Ordering::SeqCst) {
                return Err(Error::new(ErrorKind::Timeout, "the mount did not come up"));
            }
            let dir = self.mountpoint(&plan.key);
            std::fs::create_dir_all(&dir).unwrap();
            self.ensured.lock().push((
                plan.key,
                plan.reference.to_string(),
                plan.grants
                    .iter()
                    .map(|g| g.credential.username.clone())
                    .collect(),
            ));
            Ok(dir)
        })
    }

    fn stop<'a>(&'a self, layer: &'a Digest) -> BoxFuture<'a, Result<Option<LayerStatus>>> {
        Box::pin(async move {
            self.stopped.lock().push(*layer);
            Ok(Some(LayerStatus::default()))
        })
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    registry: Arc<MemoryRegistry>,
    supervisor: Arc<FakeSupervisor>,
    snapshotter: Arc<Snapshotter>,
}

fn fixture() -> Fixture {
    fixture_with(super::prepare::tenants::Verification::IfPrivate)
}

fn fixture_with(policy: super::prepare::tenants::Verification) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let registry = Arc::new(MemoryRegistry::default());
    let supervisor = Arc::new(FakeSupervisor {
        root: dir.path().join("fake-mounts"),
        ensured: Mutex::default(),
        stopped: Mutex::default(),
        fail: AtomicBool::new(false),
    });
    let snapshotter = Snapshotter::open(
        &dir.path().join("root"),
        Box::new(Arc::clone(&supervisor)),
        super::prepare::Pulls::new(
            Classifier::new(
                Arc::clone(&registry) as Arc<dyn Registry>,
                None,
                Default::default(),
            ),
            super::prepare::tenants::Tenants::new(policy, std::time::Duration::from_secs(3600)),
        ),
        CacheSettings {
            dir: dir.path().join("cache"),
            limit: None,
            memory_budget: 256 << 20,
        },
    )
    .unwrap();
    Fixture {
        _dir: dir,
        registry,
        supervisor,
        snapshotter: Arc::new(snapshotter),
    }
}

const ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
const GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// The annotations of a zstd:chunked layer whose TOC sits near its end.
fn chunked() -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            ANN_TOC_POSITION.to_string(),
            "1000000:4000:20000:1".to_string(),
        ),
        (ANN_TOC_CHECKSUM.to_string(), Digest::of(b"toc").to_string()),
    ])
}

/// The labels containerd's CRI plugin sets on the Prepare of `layer` of `manifest`.
fn cri_labels(target: &str, manifest: &Digest, layer: &Digest) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_TARGET.to_string(), target.to_string()),
        (
            LABEL_IMAGE_REF.to_string(),
            "r.example/vm/disk:1".to_string(),
        ),
        (LABEL_MANIFEST.to_string(), manifest.to_string()),
        (LABEL_LAYER.to_string(), layer.to_string()),
    ])
}

impl Fixture {
    fn decisions(&self) -> BTreeMap<String, u64> {
        self.snapshotter
            .counters
            .counted(super::prepare::classify::Outcome::all())
            .into_iter()
            .map(|(outcome, n)| (outcome.name(), n))
            .collect()
    }
}

#[tokio::test]
async fn a_disk_layer_is_served_remotely_then_reused() {
    let f = fixture();
    let (manifest, layers) = f
        .registry
        .image(&[(GZIP, BTreeMap::new()), (ZSTD, chunked())]);
    // The base layer is ordinary: containerd unpacks it into an active snapshot.
    let base = f
        .snapshotter
        .prepare("extract-0", "", cri_labels("base", &manifest, &layers[0]))
        .await
        .unwrap();
    assert!(
        base.is_some(),
        "an ordinary layer gets mounts to unpack into"
    );
    f.snapshotter
        .commit("base", "extract-0", BTreeMap::new())
        .unwrap();
    // The disk layer becomes a committed remote snapshot: no mounts, the target exists.
    let disk = f
        .snapshotter
        .prepare(
            "extract-1",
            "base",
            cri_labels("disk", &manifest, &layers[1]),
        )
        .await
        .unwrap();
    assert!(disk.is_none(), "the remote handshake answers AlreadyExists");
    let record = f.snapshotter.stat("disk").unwrap();
    let remote = record.remote.expect("recorded as remote");
    assert_eq!(record.parent, "base");
    assert_eq!(
        record
            .labels
            .get(super::prepare::classify::LABEL_REMOTE)
            .map(String::as_str),
        Some("vmdisk")
    );
    let ensured = f.supervisor.ensured.lock().clone();
    assert_eq!(ensured.len(), 1);
    assert_eq!(
        ensured[0].0, remote.layer,
        "the layer key, not the blob digest, is mounted"
    );
    assert_ne!(remote.layer, layers[1]);
    assert!(ensured[0].1.ends_with(&format!("@{manifest}")));
    // A second pull of the same image finds the snapshot.
    let again = f
        .snapshotter
        .prepare(
            "extract-2",
            "base",
            cri_labels("disk", &manifest, &layers[1]),
        )
        .await
        .unwrap();
    assert!(again.is_none());
    let d = f.decisions();
    assert_eq!(d.get("remote"), Some(&1), "{d:?}");
    assert_eq!(d.get("reused"), Some(&1), "{d:?}");
    assert_eq!(d.get("ordinary:not_disk_layer"), Some(&1), "{d:?}");
    // Removing the last user stops the layer's server.
    let layer = f
        .snapshotter
        .remove("disk")
        .unwrap()
        .expect("a remote layer");
    assert_eq!(f.snapshotter.stop_unused(vec![layer]).await.unwrap(), 1);
    assert_eq!(*f.supervisor.stopped.lock(), [layer]);
}

/// A remote layer found unmounted when a container or view is made on it (a reboot, a dead
/// server) is served again first; one that cannot be fails the call naming the layer, never an
/// empty mountpoint handed to containerd.
#[tokio::test]
async fn a_layer_not_served_is_served_again_before_its_mounts_are_handed_out() {
    let f = fixture();
    let (manifest, layers) = f.registry.image(&[(ZSTD, chunked())]);
    let disk = f
        .snapshotter
        .prepare("extract-0", "", cri_labels("disk", &manifest, &layers[0]))
        .await
        .unwrap();
    assert!(disk.is_none());
    let layer = f.snapshotter.stat("disk").unwrap().remote.unwrap().layer;
    let ensured = || f.supervisor.ensured.lock().len();
    assert_eq!(ensured(), 1);
    // Served: a container's Prepare asks nothing of the supervisor.
    f.snapshotter
        .prepare("rootfs-0", "disk", BTreeMap::new())
        .await
        .unwrap()
        .expect("an active snapshot");
    assert_eq!(ensured(), 1);
    // Unmounted: served again, then the mounts.
    std::fs::remove_dir(f.supervisor.mountpoint(&layer)).unwrap();
    f.snapshotter
        .prepare("rootfs-1", "disk", BTreeMap::new())
        .await
        .unwrap()
        .expect("an active snapshot");
    assert_eq!(ensured(), 2);
    // Unmounted and unservable: the Prepare fails naming the layer and creates nothing.
    std::fs::remove_dir(f.supervisor.mountpoint(&layer)).unwrap();
    f.supervisor.fail.store(true, Ordering::SeqCst);
    let err = f
        .snapshotter
        .prepare("rootfs-2", "disk", BTreeMap::new())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{}", err.chain());
    assert!(
        err.chain().contains(&layer.to_string()) && err.chain().contains("not served"),
        "{}",
        err.chain()
    );
    assert!(f.snapshotter.stat("rootfs-2").is_err());
    // So does the mounts of a snapshot made while it was served.
    let err = f.snapshotter.serve_chain("rootfs-0").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition);
}

#[tokio::test]
async fn every_other_outcome_is_an_ordinary_snapshot_with_its_reason() {
    let f = fixture();
    let (plain, plain_layers) = f.registry.image(&[(GZIP, BTreeMap::new())]);
    let (disk, disk_layers) = f.registry.image(&[(ZSTD, chunked())]);
    let mut bad_toc = chunked();
    bad_toc.insert(ANN_TOC_POSITION.into(), "1000000:4000:20000:7".into());
    let (odd, odd_layers) = f.registry.image(&[(ZSTD, bad_toc)]);
    let mut n = 0;
    let mut prepare = |labels: BTreeMap<String, String>| {
        n += 1;
        let s = Arc::clone(&f.snapshotter);
        async move {
            let mounts = s
                .prepare(&format!("extract-{n}"), "", labels)
                .await
                .unwrap();
            assert!(mounts.is_some(), "an ordinary snapshot to unpack into");
        }
    };
    // An ordinary gzip layer with no seekable index published.
    prepare(cri_labels("a", &plain, &plain_layers[0])).await;
    // No CRI labels (a `ctr` pull).
    prepare(BTreeMap::from([(
        LABEL_TARGET.to_string(),
        "b".to_string(),
    )]))
    .await;
    // Labels that do not parse.
    let mut malformed = cri_labels("c", &disk, &disk_layers[0]);
    malformed.insert(LABEL_MANIFEST.into(), "sha256:nothex".into());
    prepare(malformed).await;
    // A layer the manifest does not list.
    prepare(cri_labels("d", &disk, &Digest::of(b"elsewhere"))).await;
    // A TOC type nobody reads.
    prepare(cri_labels("e", &odd, &odd_layers[0])).await;
    // The registry is down.
    f.registry.down.store(true, Ordering::SeqCst);
    prepare(cri_labels("f", &disk, &disk_layers[0])).await;
    f.registry.down.store(false, Ordering::SeqCst);
    // The mount does not come up: containerd pulls the layer after all.
    f.supervisor.fail.store(true, Ordering::SeqCst);
    prepare(cri_labels("g", &disk, &disk_layers[0])).await;
    let d = f.decisions();
    for reason in [
        "ordinary:no_index",
        "ordinary:no_cri_labels",
        "ordinary:malformed_labels",
        "ordinary:layer_not_in_manifest",
        "ordinary:not_lazy",
        "ordinary:registry_error",
        "fallback:mount_failed",
    ] {
        assert!(d.contains_key(reason), "{reason} missing from {d:?}");
    }
    assert_eq!(d.get("ordinary:not_lazy"), Some(&1), "{d:?}");
    assert_eq!(d.get("ordinary:no_index"), Some(&1), "{d:?}");
    assert!(f
        .snapshotter
        .list()
        .unwrap()
        .iter()
        .all(|(_, r)| r.remote.is_none()));
}

/// An ordinary container image (its config runs a program) costs no index search, whatever
/// its layers; a data image is searched once, and its other layers and a second pull believe
/// the answer.
#[tokio::test]
async fn an_ordinary_image_is_decided_without_asking_the_registry() {
    let f = fixture();
    let program = serde_json::json!({"Cmd": ["/bin/sh"]});
    let (busybox, busybox_layers) = f.registry.image_with(&[(GZIP, BTreeMap::new())], program);
    let entry = serde_json::json!({"Entrypoint": ["/app"], "Cmd": []});
    let three = [
        (GZIP, BTreeMap::new()),
        (GZIP, BTreeMap::new()),
        (GZIP, BTreeMap::new()),
    ];
    let (app, app_layers) = f.registry.image_with(&three, entry);
    let (data, data_layers) = f.registry.image(&three);
    let mut n = 0;
    let mut prepare = |labels: BTreeMap<String, String>| {
        n += 1;
        let s = Arc::clone(&f.snapshotter);
        async move {
            let mounts = s.prepare(&format!("extract-{n}"), "", labels).await;
            assert!(
                mounts.unwrap().is_some(),
                "an ordinary snapshot to unpack into"
            );
        }
    };
    prepare(cri_labels("a", &busybox, &busybox_layers[0])).await;
    for l in &app_layers {
        prepare(cri_labels(&format!("b{l}"), &app, l)).await;
    }
    let lookups = || f.registry.lookups.load(Ordering::SeqCst);
    assert_eq!(lookups(), 0, "an ordinary image searched for an index");
    let d = f.decisions();
    assert_eq!(d.get("ordinary:not_disk_image"), Some(&4), "{d:?}");
    assert_eq!(d.len(), 1, "{d:?}");

    // A data image with no index: its topmost layer is searched once.
    for round in 0..2 {
        for l in &data_layers {
            prepare(cri_labels(&format!("c{round}{l}"), &data, l)).await;
        }
    }
    assert_eq!(
        lookups(),
        1,
        "searched again within the time an answer is kept"
    );
    let d = f.decisions();
    assert_eq!(d.get("ordinary:no_index"), Some(&2), "{d:?}");
    assert_eq!(d.get("ordinary:not_lazy"), Some(&4), "{d:?}");
}

#[tokio::test]
async fn the_manifest_and_config_containerd_holds_are_taken_from_its_content_store_verified() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Arc::new(MemoryRegistry::default());
    let (manifest, layers) = registry.image(&[(ZSTD, chunked())]);
    // containerd holds them while it pulls; the registry serves them no more (any fetch of
    // them fails the classification).
    let root = dir.path().join("containerd");
    let blobs = root.join("io.containerd.content.v1.content/blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let manifest_bytes = registry.manifests.lock().remove(&manifest).unwrap();
    let crate::oci::ManifestKind::Image(m) =
        crate::oci::parse_manifest(&manifest_bytes, None).unwrap()
    else {
        panic!("an image manifest");
    };
    let config = registry.blobs.lock().remove(&m.config.digest).unwrap();
    std::fs::write(blobs.join(manifest.hex()), &manifest_bytes).unwrap();
    std::fs::write(blobs.join(m.config.digest.hex()), &config).unwrap();
    let classify = |cache: &str| {
        let cache = crate::cache::CacheRoot::open(&dir.path().join(cache)).unwrap();
        let classifier = Classifier::new(
            Arc::clone(&registry) as Arc<dyn Registry>,
            Some(cache.clone()),
            Default::default(),
        )
        .with_content_store(super::prepare::classify::ContentStore::of_root(&root));
        let labels = cri_labels("disk", &manifest, &layers[0]);
        let registry = Arc::clone(&registry);
        async move {
            let cri = CriLabels::read(&labels);
            let (image, manifest, wanted) = cri.wanted_layer().unwrap();
            let pinned = image.with_digest(manifest);
            let decision = classifier
                .classify(registry.as_ref(), &pinned, wanted)
                .await;
            (decision, cache)
        }
    };
    let (decision, cache) = classify("cache").await;
    assert!(
        matches!(decision, super::prepare::classify::Decision::Remote { .. }),
        "{decision:?}"
    );
    // Kept for the mount server, as if fetched.
    assert!(cache.load_blob(&manifest, 1 << 20).is_some());
    assert!(cache.load_blob(&m.config.digest, 1 << 20).is_some());

    // A blob there that does not hash to its name is not taken (nor kept).
    let mut changed = manifest_bytes.clone();
    changed[0] = b' ';
    std::fs::write(blobs.join(manifest.hex()), &changed).unwrap();
    let (decision, cache) = classify("cache2").await;
    assert!(
        matches!(
            decision,
            super::prepare::classify::Decision::Ordinary {
                reason: super::prepare::classify::Reason::RegistryError,
                ..
            }
        ),
        "{decision:?}"
    );
    assert!(cache.load_blob(&manifest, 1 << 20).is_none());
}

#[tokio::test]
async fn what_classification_verified_is_kept_for_the_mount_server() {
    let dir = tempfile::tempdir().unwrap();
    let cache = crate::cache::CacheRoot::open(dir.path()).unwrap();
    let registry = Arc::new(MemoryRegistry::default());
    let (manifest, layers) = registry.image(&[(ZSTD, chunked())]);
    let classifier = Classifier::new(
        Arc::clone(&registry) as Arc<dyn Registry>,
        Some(cache.clone()),
        Default::default(),
    );
    let cri = CriLabels::read(&cri_labels("disk", &manifest, &layers[0]));
    let (image, manifest_digest, wanted) = cri.wanted_layer().unwrap();
    let pinned = image.with_digest(manifest_digest);
    let decision = classifier
        .classify(registry.as_ref(), &pinned, wanted)
        .await;
    let super::prepare::classify::Decision::Remote { reference, layer } = decision else {
        panic!("the disk layer is remote: {decision:?}");
    };
    // The server resolves the same image with the registry gone: manifest and config come
    // from the cache, re-verified, and give the same key.
    registry.down.store(true, Ordering::SeqCst);
    let client = registry.as_ref() as &dyn Registry;
    let (m, digest, _) = crate::resolve::platform_manifest(client, Some(&cache), &reference)
        .await
        .unwrap();
    assert_eq!(digest, manifest);
    let (_, meta) = crate::resolve::disk_layer_id(
        client,
        Some(&cache),
        &crate::policy::Verifier::none(),
        &reference,
        &m,
        digest,
        None,
    )
    .await
    .unwrap();
    assert_eq!(meta.id().key(), layer);
    // A kept blob that no longer hashes to its name is not used.
    let kept = dir.path().join("blobs").join(manifest.hex());
    let mut bytes = std::fs::read(&kept).unwrap();
    bytes[0] = b' ';
    std::fs::write(&kept, bytes).unwrap();
    assert!(cache.load_blob(&manifest, 1 << 20).is_none());
    let err = crate::resolve::platform_manifest(client, Some(&cache), &reference)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Network, "{err}");
    // Nor one larger than what may be read for it.
    assert!(cache.load_blob(&m.config.digest, 10).is_none());
    assert!(cache.load_blob(&m.config.digest, 1 << 20).is_some());
}

fn user(name: &str) -> Credential {
    Credential {
        username: name.into(),
        secret: format!("{name}'s password"),
    }
}

const IMAGE: &str = "r.example/vm/disk:1";

impl Fixture {
    /// A private disk image tagged `1` that only `accepted` read; its manifest digest.
    fn private_image(&self, accepted: &[&str]) -> Digest {
        let (manifest, _) = self.registry.image(&[(ZSTD, chunked())]);
        self.registry.tags.lock().insert("1".into(), manifest);
        *self.registry.private.lock() = Some(accepted.iter().map(|u| user(u)).collect());
        manifest
    }

    async fn ensure(&self, reference: &str, namespace: &str) -> Result<Digest> {
        self.snapshotter
            .ensure_disk(reference, &super::Requester::of(namespace))
            .await
    }

    /// The user names of the grants the last server start was handed.
    fn handed(&self) -> Vec<String> {
        self.supervisor.ensured.lock().last().unwrap().2.clone()
    }
}

/// The management API's disk and a Prepare's layer are one decision ([`super::prepare::Pulls::decide`]):
/// the same key for the same image, and the same refusal, with its kind, where the image's disk
/// cannot be read lazily.
#[tokio::test]
async fn the_management_api_decides_a_disk_as_a_prepare_does() {
    let f = fixture();
    let (manifest, layers) = f.registry.image(&[(ZSTD, chunked())]);
    f.registry.tags.lock().insert("1".into(), manifest);
    let served = f
        .snapshotter
        .prepare("extract-0", "", cri_labels("disk", &manifest, &layers[0]))
        .await
        .unwrap();
    assert!(served.is_none(), "the disk layer is served remotely");
    let prepared = f.supervisor.ensured.lock()[0].0;
    assert_eq!(f.ensure(IMAGE, "").await.unwrap(), prepared);

    let mut bad_toc = chunked();
    bad_toc.insert(ANN_TOC_POSITION.into(), "1000000:4000:20000:7".into());
    let (odd, odd_layers) = f.registry.image(&[(ZSTD, bad_toc)]);
    f.registry.tags.lock().insert("1".into(), odd);
    let why = match f
        .snapshotter
        .pulls
        .judge(&cri_labels("odd", &odd, &odd_layers[0]))
        .await
    {
        Ok(super::prepare::Judged {
            decision: super::prepare::classify::Decision::Ordinary { why, .. },
            ..
        }) => why,
        other => panic!(
            "an unreadable TOC is no lazy disk: {:?}",
            other.map(|j| j.decision)
        ),
    };
    let refused = f.ensure(IMAGE, "").await.unwrap_err();
    assert_eq!((refused.kind(), refused.chain()), (why.kind(), why.chain()));

    // An image with no disk a pull would serve lazily: the API names what is missing.
    let (plain, _) = f.registry.image(&[(GZIP, BTreeMap::new())]);
    f.registry.tags.lock().insert("1".into(), plain);
    let missing = f.ensure(IMAGE, "").await.unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::NotFound, "{missing}");
}

#[tokio::test]
async fn a_namespace_gets_a_private_disk_only_through_its_own_pull() {
    let f = fixture();
    let manifest = f.private_image(&["alice", "bob"]);
    let image: Reference = IMAGE.parse().unwrap();
    let by_digest = format!("r.example/vm/disk@{manifest}");
    // Nobody pulled it: refused to a namespace and to the node's operator alike.
    let e = f.ensure(IMAGE, "tenant-a").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{}", e.chain());
    assert!(
        e.chain()
            .contains("no PullImage of it by a pod of namespace tenant-a"),
        "{}",
        e.chain()
    );
    assert_eq!(
        f.ensure(IMAGE, "").await.unwrap_err().kind(),
        ErrorKind::Auth
    );
    // tenant-a's pull with alice's credentials succeeded: tenant-a gets the disk, and its
    // server fetches with alice's credentials.
    f.snapshotter
        .pulls
        .tenants
        .grant("tenant-a", &image, user("alice"), [manifest].into());
    f.ensure(IMAGE, "tenant-a").await.unwrap();
    assert_eq!(f.handed(), ["alice"]);
    // tenant-b pulled nothing: refused, by tag and by digest, though the node holds the disk.
    for reference in [IMAGE, by_digest.as_str()] {
        let e = f.ensure(reference, "tenant-b").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Auth, "{}", e.chain());
    }
    // The operator's `vmdisk path` uses the node's credentials only, never a tenant's.
    assert_eq!(
        f.ensure(IMAGE, "").await.unwrap_err().kind(),
        ErrorKind::Auth
    );
    // tenant-b's own pull of another digest of the repository does not cover this one.
    let older = Digest::of(b"an older manifest");
    f.snapshotter
        .pulls
        .tenants
        .grant("tenant-b", &image, user("bob"), [older].into());
    let e = f.ensure(IMAGE, "tenant-b").await.unwrap_err();
    assert!(e.chain().contains("pulled other digests"), "{}", e.chain());
    // Once tenant-b's own pull of it succeeded, tenant-b gets it with its own credentials.
    f.snapshotter
        .pulls
        .tenants
        .grant("tenant-b", &image, user("bob"), [manifest].into());
    f.ensure(IMAGE, "tenant-b").await.unwrap();
    assert!(f.handed().contains(&"bob".to_string()), "{:?}", f.handed());
}

#[tokio::test]
async fn what_the_node_holds_is_served_to_a_namespace_as_the_policy_says() {
    use super::prepare::tenants::Verification::{Always, IfPrivate, Never};
    for policy in [Never, IfPrivate, Always] {
        let f = fixture_with(policy);
        let manifest = f.private_image(&["alice"]);
        let image: Reference = IMAGE.parse().unwrap();
        f.snapshotter
            .pulls
            .tenants
            .grant("tenant-a", &image, user("alice"), [manifest].into());
        f.ensure(IMAGE, "tenant-a").await.unwrap();
        // Another namespace, with the disk on the node and the registry saying no.
        let b = f.ensure(IMAGE, "tenant-b").await;
        assert_eq!(b.is_ok(), policy == Never, "{policy:?}: {b:?}");
        // With the registry unreachable, tenant-a's own pull still counts; tenant-b's nothing.
        f.registry.down.store(true, Ordering::SeqCst);
        assert!(f.ensure(IMAGE, "tenant-a").await.is_ok(), "{policy:?}");
        let b = f.ensure(IMAGE, "tenant-b").await;
        assert_eq!(b.is_ok(), policy == Never, "{policy:?}: {b:?}");
        // An image the node's own credentials read is anyone's, unless every use is checked
        // (then not while the registry cannot be asked).
        f.registry.down.store(false, Ordering::SeqCst);
        *f.registry.private.lock() = None;
        f.ensure(IMAGE, "tenant-c").await.unwrap();
        f.registry.down.store(true, Ordering::SeqCst);
        let c = f.ensure(IMAGE, "tenant-d").await;
        assert_eq!(c.is_ok(), policy != Always, "{policy:?}: {c:?}");
    }
}

#[tokio::test]
async fn a_pull_in_flight_hands_its_server_only_credentials_that_read_the_image() {
    let f = fixture();
    let manifest = f.private_image(&["alice"]);
    let (_, layers) = {
        let m = f.registry.manifests.lock()[&manifest].clone();
        let parsed: serde_json::Value = serde_json::from_slice(&m).unwrap();
        let layer: Digest = parsed["layers"][0]["digest"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        (manifest, vec![layer])
    };
    // Without credentials, the private image is not classified: containerd pulls it (and
    // fails as it would without vmdisk).
    let mounts = f
        .snapshotter
        .prepare("extract-1", "", cri_labels("disk", &manifest, &layers[0]))
        .await
        .unwrap();
    assert!(mounts.is_some());
    // Two pulls in flight: mallory's password is wrong, alice's right.
    let mallory = f
        .snapshotter
        .pulls
        .tenants
        .begin_pull(IMAGE, user("mallory"))
        .unwrap();
    let alice = f
        .snapshotter
        .pulls
        .tenants
        .begin_pull(IMAGE, user("alice"))
        .unwrap();
    let mounts = f
        .snapshotter
        .prepare("extract-2", "", cri_labels("disk", &manifest, &layers[0]))
        .await
        .unwrap();
    assert!(mounts.is_none(), "remote with the pulls' credentials");
    assert_eq!(
        f.handed(),
        ["alice"],
        "mallory's credentials are never handed over"
    );
    assert_eq!(alice.digests(), [manifest].into());
    drop((mallory, alice));
    assert!(f
        .snapshotter
        .pulls
        .tenants
        .pending_for(&IMAGE.parse().unwrap())
        .is_empty());
}

#[test]
fn every_outcome_has_a_counter_name_of_its_own_and_keeps_the_names_users_see() {
    use super::counters::Counted;
    use super::prepare::classify::{Outcome, Reason};
    let names: std::collections::BTreeSet<String> = Outcome::all().map(|o| o.key()).collect();
    assert_eq!(names.len(), Outcome::all().count());
    for (outcome, name) in [
        (Outcome::Remote, "decision/remote"),
        (Outcome::Reused, "decision/reused"),
        (Outcome::MountFailed, "decision/fallback:mount_failed"),
        (Outcome::RefusedByPolicy, "decision/refused:policy"),
        (
            Outcome::Ordinary(Reason::NoCriLabels),
            "decision/ordinary:no_cri_labels",
        ),
        (
            Outcome::Fallback(Reason::RegistryError),
            "decision/fallback:registry_error",
        ),
    ] {
        assert_eq!(outcome.key(), name);
    }
}
