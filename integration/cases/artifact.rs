//! Disk artifacts: OCI artifacts whose layer is the disk file itself (KubeVirt's VM export,
//! `oras push` of a disk, build systems' disk images), made lazy by `vmdisk index` and served
//! by the real daemon through `vmdisk path` (what the runtime shim and libvirt pools use), from
//! the real registry.

use std::path::Path;

use crate::fixtures::cri::{rt, CriContainerd, Daemon};
use crate::fixtures::guest::boot;
use crate::fixtures::harness::{
    run, sha256_file, vmdisk, vmdisk_ok, FaultProxy, Registry, Scratch,
};
use crate::fixtures::images::{bootable_raw, manifest_digest};
use vmdisk::oci::reference::Reference;
use vmdisk::oci::{Descriptor, OCI_INDEX, OCI_MANIFEST};
use vmdisk::registry::{RegistryClient, RegistryConfig};

/// A layer of a test artifact: its bytes, media type and annotations.
pub struct ArtifactLayer {
    pub bytes: Vec<u8>,
    pub media_type: String,
    pub annotations: serde_json::Value,
}

/// Pushes an artifact as `oras push` or KubeVirt's export writes one: the config
/// (`config_type`, `config`), the layers, the manifest with `artifact_type` and, with
/// `platform`, an index naming it for that platform (`os/arch`), tagged `dest`'s tag. Returns
/// the manifest's digest (the index's, with a platform).
pub fn push_artifact(
    dest: &str,
    artifact_type: &str,
    config_type: &str,
    config: &[u8],
    layers: Vec<ArtifactLayer>,
    platform: Option<&str>,
) -> String {
    let r: Reference = dest.parse().unwrap();
    let c = RegistryClient::new(RegistryConfig::default()).unwrap();
    rt().block_on(async {
        let config_desc = Descriptor::of(config_type, config);
        c.push_blob(&r, &config_desc.digest, config.to_vec().into())
            .await
            .unwrap();
        let mut descs = Vec::new();
        for layer in layers {
            let desc = Descriptor::of(&layer.media_type, &layer.bytes);
            c.push_blob(&r, &desc.digest, layer.bytes.into())
                .await
                .unwrap();
            let mut desc = serde_json::to_value(desc).unwrap();
            desc["annotations"] = layer.annotations;
            descs.push(desc);
        }
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "artifactType": artifact_type,
            "config": config_desc,
            "layers": descs,
            "annotations": {"org.opencontainers.image.created": "2026-11-01T00:00:00Z"},
        }))
        .unwrap();
        let tag = r.tag.clone();
        let Some(platform) = platform else {
            return c
                .put_manifest(&r, tag.as_deref(), OCI_MANIFEST, manifest)
                .await
                .unwrap()
                .to_string();
        };
        let digest = c
            .put_manifest(&r, None, OCI_MANIFEST, manifest.clone())
            .await
            .unwrap();
        let (os, arch) = platform.split_once('/').unwrap();
        let index = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "artifactType": artifact_type,
            "manifests": [{
                "mediaType": OCI_MANIFEST,
                "digest": digest.to_string(),
                "size": manifest.len(),
                "platform": {"os": os, "architecture": arch},
            }],
        }))
        .unwrap();
        c.put_manifest(&r, tag.as_deref(), OCI_INDEX, index)
            .await
            .unwrap()
            .to_string()
    })
}

/// `gzip -c FILE` (one member, as `gzip` and Go's writer make).
fn gzip(file: &Path) -> Vec<u8> {
    run("gzip", &["-1", "-c", file.to_str().unwrap()])
}

/// The JSON report of `vmdisk inspect` for the first platform's layer `n`.
fn inspected_layer(image: &str, n: usize) -> serde_json::Value {
    let report: serde_json::Value =
        serde_json::from_str(&vmdisk_ok(&["inspect", "--json", image])).unwrap();
    report["platforms"][0]["layers"][n].clone()
}

/// The sha256 of a whole file read through the daemon's path.
fn read_whole(path: &str) -> String {
    sha256_file(Path::new(path.trim()))
}

/// A bootable raw disk exported the way KubeVirt exports a VM (an index over one manifest, the
/// disk gzip-compressed as `application/vnd.kubevirt.disk.raw+gzip` beside a checksum file,
/// its digest pinned by vmdisk's annotation), indexed by `vmdisk index` and served lazily by
/// the daemon: ready and booted for a small part of the disk, read whole with the original's
/// sha256, checked whole against the pinned digest; the artifact itself is not touched.
/// (containerd's CRI refuses to pull it as an image.)
#[test]
fn a_gzip_disk_artifact_is_indexed_and_boots_lazily() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = bootable_raw(scratch.dir.path(), "1G");
    let disk_len = std::fs::metadata(&disk).unwrap().len();
    let want = sha256_file(&disk);
    let gz = gzip(&disk);
    let gz_len = gz.len();
    let source = format!("{}/vms/fedora:1", reg.host());
    push_artifact(
        &source,
        "application/vnd.kubevirt.virtualmachine.v1",
        "application/vnd.kubevirt.virtualmachine.config.v1+json",
        br#"{"kind":"VirtualMachine","metadata":{"name":"fedora"}}"#,
        vec![
            ArtifactLayer {
                bytes: format!("{want}  rootdisk.raw\n").into_bytes(),
                media_type: "text/plain".into(),
                annotations: serde_json::json!({"org.opencontainers.image.title": "SHA256SUMS"}),
            },
            ArtifactLayer {
                bytes: gz,
                media_type: "application/vnd.kubevirt.disk.raw+gzip".into(),
                annotations: serde_json::json!({
                    "org.opencontainers.image.title": "rootdisk.raw.gz",
                    "io.kubevirt.disk.name": "rootdisk",
                    "io.kubevirt.disk.size": "1Gi",
                    vmdisk::format::layout::ANN_DISK_DIGEST: want,
                }),
            },
        ],
        Some("linux/amd64"),
    );
    let before = manifest_digest(&source);
    let layer = inspected_layer(&source, 1);
    assert_eq!(layer["lazy"], false, "{layer}");
    assert!(
        layer["reason"].as_str().unwrap().contains("vmdisk index"),
        "{layer}"
    );

    let report: serde_json::Value =
        serde_json::from_str(&vmdisk_ok(&["index", "--json", &source])).unwrap();
    eprintln!("vmdisk index: {report}");
    assert_eq!(
        (&report["layout"], &report["compression"], &report["disk"]),
        (
            &serde_json::json!("file"),
            &serde_json::json!("gzip"),
            &serde_json::json!("disk/rootdisk.raw")
        )
    );
    assert_eq!(report["stream_size"].as_u64(), Some(disk_len));
    assert_eq!(
        manifest_digest(&source),
        before,
        "the artifact is not touched"
    );
    let layer = inspected_layer(&source, 1);
    assert_eq!(
        (
            &layer["lazy"],
            &layer["disk"]["format"],
            &layer["disk"]["path"]
        ),
        (
            &serde_json::json!(true),
            &serde_json::json!("raw"),
            &serde_json::json!("disk/rootdisk.raw")
        ),
        "{layer}"
    );
    assert_eq!(inspected_layer(&source, 0)["lazy"], false);

    // Through the daemon, as the shim (Kata) or a libvirt pool asks for it, behind a proxy
    // that counts what the registry sends.
    let proxy = FaultProxy::counting(reg.port);
    let daemon = Daemon::start(&scratch, "");
    let image = format!("127.0.0.1:{}/vms/fedora:1", proxy.port);
    let path = daemon.vmdisk_ok(&["path", "--raw", &image]);
    let ready = proxy.bytes_to_client();
    let console = boot(Path::new(path.trim()));
    assert!(
        console.contains("BOOT-MARKER"),
        "the VM did not boot:\n{console}\n{}",
        daemon.servers_log_text()
    );
    let booted = proxy.bytes_to_client();
    eprintln!(
        "disk artifact: ready after {ready} registry bytes, booted after {booted}, of a {disk_len}-byte disk ({gz_len} compressed)"
    );
    assert!(booted < disk_len / 20, "the lazy boot moved {booted} bytes");
    let disks = daemon.disks();
    assert_eq!(disks[0].disk_path, "disk/rootdisk.raw", "{:?}", disks[0]);
    // containerd cannot pull an artifact as an image: it refuses before the snapshotter is
    // asked anything.
    let pause = crate::fixtures::images::pause_image(&reg, &scratch);
    let ctd = CriContainerd::start(&scratch, &daemon.socket, &pause, &[reg.port, proxy.port]);
    let refused = ctd.pull(&image).unwrap_err();
    assert!(
        refused
            .message()
            .contains("mismatched image rootfs and manifest layers"),
        "{refused:?}"
    );
    assert!(daemon.decisions().is_empty(), "{:?}", daemon.decisions());

    // The disk as published, read whole, is the original; once complete it is checked against
    // the digest the artifact pins.
    let published = daemon.vmdisk_ok(&["path", &image]);
    assert_eq!(read_whole(&published), want);
    assert_eq!(
        crate::fixtures::images::wait_verified(&daemon),
        "verified",
        "{}",
        daemon.servers_log_text()
    );
    assert_eq!(manifest_digest(&source), before);
}

/// An uncompressed qcow2 pushed as `oras push` pushes a file (empty config, `artifactType`,
/// no platform) with no digest pinned, its index in another repository: served lazily, the
/// disk and its raw view equal to the original, the disk checked whole against the blob (an
/// uncompressed disk is its blob). An artifact whose pinned digest is wrong is not indexed,
/// and an index made for another artifact is refused by name.
#[test]
fn a_plain_qcow2_artifact_loads_lazily_and_lying_ones_are_refused() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("disk.qcow2");
    crate::fixtures::harness::make_qcow2(&disk, "2G", &[(0, 1 << 20, 0x5a)]);
    crate::fixtures::harness::write_random(&disk, 64 << 20, 24 << 20, 5);
    let bytes = std::fs::read(&disk).unwrap();
    let oras = |dest: &str, bytes: Vec<u8>, annotations: serde_json::Value| {
        push_artifact(
            dest,
            "application/vnd.unknown.artifact.v1",
            vmdisk::oci::OCI_EMPTY,
            b"{}",
            vec![ArtifactLayer {
                bytes,
                media_type: vmdisk::oci::OCI_LAYER_TAR.into(),
                annotations,
            }],
            None,
        )
    };
    let a = format!("{}/disks/a:1", reg.host());
    oras(
        &a,
        bytes.clone(),
        serde_json::json!({"org.opencontainers.image.title": "guest.qcow2"}),
    );
    let indexes = format!("{}/team/indexes", reg.host());
    let report: serde_json::Value = serde_json::from_str(&vmdisk_ok(&[
        "index", "--json", "--to", &indexes, "--span", "256K", &a,
    ]))
    .unwrap();
    assert_eq!(
        (&report["compression"], &report["disk"]),
        (
            &serde_json::json!("none"),
            &serde_json::json!("disk/guest.qcow2")
        )
    );

    // A pinned digest that is not the disk's: nothing is published.
    let b = format!("{}/disks/b:1", reg.host());
    oras(
        &b,
        bytes.clone(),
        serde_json::json!({
            "org.opencontainers.image.title": "guest.qcow2",
            vmdisk::format::layout::ANN_DISK_DIGEST: vmdisk::oci::digest::Digest::of(b"other").to_string(),
        }),
    );
    let out = vmdisk(&["index", &b]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("the artifact's annotation says"), "{err}");

    let daemon = Daemon::start(&scratch, &format!("index_repositories = [\"{indexes}\"]\n"));
    let published = daemon.vmdisk_ok(&["path", &a]);
    let raw = daemon.vmdisk_ok(&["path", "--raw", &a]);
    assert!(published.trim().ends_with("guest.qcow2"), "{published}");
    run(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "qcow2",
            raw.trim(),
            disk.to_str().unwrap(),
        ],
    );
    assert_eq!(read_whole(&published), sha256_file(&disk));
    assert_eq!(
        crate::fixtures::images::wait_verified(&daemon),
        "verified",
        "{}",
        daemon.servers_log_text()
    );

    // A's index published for C (another disk): C's own lookup refuses it, naming why.
    let c = format!("{}/disks/c:1", reg.host());
    let mut other = bytes.clone();
    let at = other.len() - 100;
    other[at] ^= 1;
    oras(
        &c,
        other,
        serde_json::json!({"org.opencontainers.image.title": "guest.qcow2"}),
    );
    let client = RegistryClient::new(RegistryConfig::default()).unwrap();
    let (a_ref, c_ref, idx_ref): (Reference, Reference, Reference) = (
        a.parse().unwrap(),
        c.parse().unwrap(),
        indexes.parse().unwrap(),
    );
    rt().block_on(async {
        let a_manifest = client.get_manifest(&a_ref).await.unwrap();
        let c_manifest = client.get_manifest(&c_ref).await.unwrap();
        let found = client
            .referrers(
                &idx_ref,
                &a_manifest.digest,
                &[vmdisk::format::seekable::ARTIFACT_TYPE],
            )
            .await
            .unwrap();
        let artifact = client
            .get_manifest(&idx_ref.with_digest(found[0].digest))
            .await
            .unwrap();
        let vmdisk::oci::ManifestKind::Image(artifact) = artifact.manifest else {
            panic!("an artifact manifest")
        };
        // Its blobs are in the index repository already.
        client
            .push_referrer(
                &idx_ref,
                Descriptor::of(&c_manifest.media_type, &c_manifest.bytes),
                vmdisk::format::seekable::ARTIFACT_TYPE,
                artifact.layers.clone(),
                Default::default(),
            )
            .await
            .unwrap();
    });
    let out = daemon.vmdisk(&["path", &c]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "C has no index of its own");
    assert!(
        err.contains("no usable seekable index") && err.contains("describes layer"),
        "{err}"
    );
}

/// The upstream peer-pod image as cloud-api-adaptor publishes it — `oras push IMAGE
/// podvm.tar.xz`, a tar.xz holding `podvm-*.qcow2` — is not lazily loadable and says so;
/// `vmdisk convert --path /image/podvm.qcow2` republishes it in the lazy peer-pod layout, whose
/// disk (and libvirt volume) the daemon serves equal to the original. A gzip raw disk artifact
/// converts too, to `/disk/<its name>`.
#[test]
fn the_peer_pod_oras_artifact_converts_to_the_lazy_layout() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let dir = scratch.path("podvm");
    std::fs::create_dir_all(&dir).unwrap();
    let qcow2 = dir.join("podvm-fedora-amd64.qcow2");
    crate::fixtures::harness::make_qcow2(&qcow2, "4G", &[(0, 2 << 20, 0x33)]);
    crate::fixtures::harness::write_random(&qcow2, 256 << 20, 20 << 20, 8);
    let archive = scratch.path("podvm.tar.xz");
    run(
        "tar",
        &[
            "-C",
            dir.to_str().unwrap(),
            "-cJf",
            archive.to_str().unwrap(),
            "podvm-fedora-amd64.qcow2",
        ],
    );
    let source = format!(
        "{}/confidential-containers/podvm-generic-fedora-amd64:v0.13.0",
        reg.host()
    );
    push_artifact(
        &source,
        "application/vnd.unknown.artifact.v1",
        vmdisk::oci::OCI_EMPTY,
        b"{}",
        vec![ArtifactLayer {
            bytes: std::fs::read(&archive).unwrap(),
            media_type: vmdisk::oci::OCI_LAYER_TAR.into(),
            annotations: serde_json::json!({"org.opencontainers.image.title": "podvm.tar.xz"}),
        }],
        None,
    );
    let layer = inspected_layer(&source, 0);
    assert_eq!(
        (&layer["layout"], &layer["lazy"]),
        (&serde_json::json!("archive"), &serde_json::json!(false)),
        "{layer}"
    );
    assert!(
        layer["reason"].as_str().unwrap().contains("vmdisk convert"),
        "{layer}"
    );
    let out = vmdisk(&["index", &source]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("vmdisk convert"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let target = format!("{}/peerpods/podvm:v0.13.0", reg.host());
    let out = vmdisk_ok(&["convert", "--path", "/image/podvm.qcow2", &source, &target]);
    eprintln!("vmdisk convert: {out}");
    let report: serde_json::Value =
        serde_json::from_str(&vmdisk_ok(&["inspect", "--json", &target])).unwrap();
    let platform = &report["platforms"][0];
    let layer = &platform["layers"][0];
    assert_eq!(
        (
            &layer["layout"],
            &layer["lazy"],
            &layer["disk"]["path"],
            &layer["disk"]["format"]
        ),
        (
            &serde_json::json!("zstd:chunked"),
            &serde_json::json!(true),
            &serde_json::json!("image/podvm.qcow2"),
            &serde_json::json!("qcow2")
        ),
        "{layer}"
    );
    assert_eq!(
        platform["platform"].as_str(),
        Some(vmdisk::oci::Platform::host().to_string().as_str())
    );

    let daemon = Daemon::start(&scratch, "");
    let volume = daemon.vmdisk_ok(&["path", "--volume", &target]);
    assert!(
        volume.trim().ends_with("peerpods_podvm+v0.13.0.qcow2"),
        "{volume}"
    );
    assert_eq!(read_whole(&volume), sha256_file(&qcow2));

    // A gzip raw disk as an artifact's own layer: decompressed, then published at /disk/.
    let raw = scratch.path("data.raw");
    crate::fixtures::harness::random_file(&raw, 8 << 20, 9);
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&raw).unwrap();
        f.seek(SeekFrom::Start(510)).unwrap();
        f.write_all(&[0x55, 0xaa]).unwrap();
    }
    run("truncate", &["-s", "64M", raw.to_str().unwrap()]);
    let kubevirt = format!("{}/vms/data:1", reg.host());
    push_artifact(
        &kubevirt,
        "application/vnd.kubevirt.virtualmachine.v1",
        "application/vnd.kubevirt.virtualmachine.config.v1+json",
        b"{}",
        vec![ArtifactLayer {
            bytes: gzip(&raw),
            media_type: "application/vnd.kubevirt.disk.raw+gzip".into(),
            annotations: serde_json::json!({"org.opencontainers.image.title": "datadisk.raw.gz"}),
        }],
        Some("linux/amd64"),
    );
    let converted = format!("{}/vms/data:1-lazy", reg.host());
    vmdisk_ok(&["convert", &kubevirt, &converted]);
    let layer = inspected_layer(&converted, 0);
    assert_eq!(
        (&layer["disk"]["path"], &layer["disk"]["format"]),
        (
            &serde_json::json!("disk/datadisk.raw"),
            &serde_json::json!("raw")
        ),
        "{layer}"
    );
    let path = daemon.vmdisk_ok(&["path", &converted]);
    assert_eq!(read_whole(&path), sha256_file(&raw));
}
