//! Publishing: `vmdisk push`, `convert` and `inspect` against a real registry, checked with
//! tools that know nothing of vmdisk (containerd, curl, skopeo, qemu-img).

use crate::fixtures::cri::CriContainerd;
use crate::fixtures::harness::*;

/// Pushes a two-platform peer-pod image (`/image/podvm.qcow2`); returns the disks.
fn push_podvm_pair(
    scratch: &Scratch,
    reference: &str,
    arm_size: &str,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let amd = scratch.path("amd.qcow2");
    let arm = scratch.path("arm.qcow2");
    make_qcow2(&amd, "64M", &[(0, 1 << 20, 0x01)]);
    make_qcow2(&arm, arm_size, &[(0, 1 << 20, 0x02)]);
    vmdisk_ok(&[
        "push",
        "--path",
        "/image/podvm.qcow2",
        "--platform",
        "linux/amd64",
        amd.to_str().unwrap(),
        "--platform",
        "linux/arm64",
        arm.to_str().unwrap(),
        reference,
    ]);
    (amd, arm)
}

#[test]
fn pushed_qcow2_unpacks_identically_with_plain_containerd() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("fedora.qcow2");
    scattered_qcow2(&disk);
    let reference = format!("{}/vm/fedora:1", reg.host());
    let out = vmdisk_ok(&["push", disk.to_str().unwrap(), &reference]);
    assert!(
        last_line(&out).starts_with("sha256:"),
        "last line is the digest: {out}"
    );

    let ctd = CriContainerd::start_plain(&scratch);
    let mnt = ctd.pull_and_mount(&reference, None, &scratch.path("rootfs"));
    let pulled = mnt.at.join("disk/fedora.qcow2");
    let meta = std::fs::metadata(&pulled).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        (meta.uid(), meta.gid(), meta.mode() & 0o777),
        (107, 107, 0o644)
    );
    let cmp = run(
        "qemu-img",
        &["compare", pulled.to_str().unwrap(), disk.to_str().unwrap()],
    );
    assert!(String::from_utf8_lossy(&cmp).contains("identical"));
    assert_eq!(sha256_file(&pulled), sha256_file(&disk));
}

#[test]
fn every_chunk_and_the_toc_verify_through_range_requests() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("d.qcow2");
    scattered_qcow2(&disk);
    let reference = format!("{}/vm/ranges:1", reg.host());
    vmdisk_ok(&[
        "push",
        "--chunk-size",
        "1M",
        disk.to_str().unwrap(),
        &reference,
    ]);

    let accept = "Accept: application/vnd.oci.image.manifest.v1+json";
    let manifest: serde_json::Value = serde_json::from_slice(&curl(&[
        "-sf",
        "-H",
        accept,
        &reg.url("/v2/vm/ranges/manifests/1"),
    ]))
    .unwrap();
    let layer = &manifest["layers"][0];
    assert_eq!(
        layer["mediaType"],
        "application/vnd.oci.image.layer.v1.tar+zstd"
    );
    let ann = &layer["annotations"];
    for key in [
        "io.github.containers.zstd-chunked.manifest-checksum",
        "io.containers.zstd-chunked.manifest-position",
        "containerd.io/snapshot/vmdisk.format",
        "containerd.io/snapshot/vmdisk.virtual-size",
        "containerd.io/snapshot/vmdisk.disk-digest",
        "containerd.io/snapshot/vmdisk.path",
    ] {
        assert!(ann[key].is_string(), "annotation {key} missing: {ann}");
    }
    assert_eq!(ann["containerd.io/snapshot/vmdisk.format"], "qcow2");
    assert_eq!(
        ann["containerd.io/snapshot/vmdisk.virtual-size"],
        (2u64 << 30).to_string()
    );
    assert_eq!(
        ann["containerd.io/snapshot/vmdisk.disk-digest"],
        sha256_file(&disk)
    );
    assert_eq!(ann["containerd.io/snapshot/vmdisk.path"], "disk/d.qcow2");

    let blob_url = reg.url(&format!(
        "/v2/vm/ranges/blobs/{}",
        layer["digest"].as_str().unwrap()
    ));
    let pos: Vec<u64> = ann["io.github.containers.zstd-chunked.manifest-position"]
        .as_str()
        .unwrap()
        .split(':')
        .map(|f| f.parse().unwrap())
        .collect();
    let toc_z = curl(&[
        "-sf",
        "-r",
        &format!("{}-{}", pos[0], pos[0] + pos[1] - 1),
        &blob_url,
    ]);
    assert_eq!(
        sha256(&toc_z),
        ann["io.github.containers.zstd-chunked.manifest-checksum"]
            .as_str()
            .unwrap()
    );
    let toc: serde_json::Value =
        serde_json::from_slice(&zstd::stream::decode_all(&toc_z[..]).unwrap()).unwrap();
    let entries = toc["entries"].as_array().unwrap();
    let reg_index = entries.iter().position(|e| e["type"] == "reg").unwrap();
    let file_end = entries[reg_index]["endOffset"].as_u64().unwrap();
    let chunks: Vec<&serde_json::Value> = entries[reg_index..]
        .iter()
        .take_while(|e| e["type"] == "reg" || e["type"] == "chunk")
        .collect();
    let file_size = std::fs::metadata(&disk).unwrap().len();
    let original = std::fs::read(&disk).unwrap();
    // Chunks of at most 1 MiB, back to back over the file, ending at multiples of 1 MiB except
    // around the qcow2's tables, each a chunk of its own: the L2 tables qemu-img wrote among
    // the data are found through the image's own L1 table.
    let spans: Vec<(u64, u64)> = chunks
        .iter()
        .map(|c| {
            let at = c["chunkOffset"].as_u64().unwrap_or(0);
            (at, at + c["chunkSize"].as_u64().unwrap())
        })
        .collect();
    assert!(spans.windows(2).all(|w| w[0].1 == w[1].0), "{spans:?}");
    assert_eq!((spans[0].0, spans[spans.len() - 1].1), (0, file_size));
    assert!(spans.iter().all(|(a, b)| b - a <= 1 << 20), "{spans:?}");
    let be = |at: usize, n: usize| {
        original[at..at + n]
            .iter()
            .fold(0u64, |v, &b| v << 8 | u64::from(b))
    };
    let cluster = 1u64 << be(20, 4);
    let (l1_size, l1) = (be(36, 4) as usize, be(40, 8) as usize);
    let tables: Vec<u64> = (0..l1_size)
        .map(|i| be(l1 + 8 * i, 8) & 0x00ff_ffff_ffff_fe00)
        .filter(|&o| o != 0)
        .collect();
    assert!(
        tables.len() >= 2,
        "the disk's data lies under several L2 tables"
    );
    // The header's cluster, the refcount table (one cluster here), the L1 and L2 tables.
    let own: Vec<u64> = [0, be(48, 8), l1 as u64]
        .into_iter()
        .chain(tables.iter().copied())
        .collect();
    for table in &own {
        assert!(
            spans.contains(&(*table, table + cluster)),
            "the table at {table} is a chunk of its own: {spans:?}"
        );
    }
    let edge = |at: u64| {
        at.is_multiple_of(1 << 20)
            || at == file_size
            || own.iter().any(|t| at == *t || at == t + cluster)
    };
    assert!(
        spans.iter().all(|(a, b)| edge(*a) && edge(*b)),
        "data chunks end at multiples of the chunk size or at a table: {spans:?}"
    );
    for (i, c) in chunks.iter().enumerate() {
        let start = c["offset"].as_u64().unwrap();
        let end = chunks
            .get(i + 1)
            .map_or(file_end, |n| n["offset"].as_u64().unwrap());
        let frame = curl(&["-sf", "-r", &format!("{start}-{}", end - 1), &blob_url]);
        let data = zstd::stream::decode_all(&frame[..]).unwrap();
        assert_eq!(
            sha256(&data),
            c["chunkDigest"].as_str().unwrap(),
            "chunk {i}"
        );
        let off = c["chunkOffset"].as_u64().unwrap_or(0) as usize;
        assert_eq!(data.len() as u64, c["chunkSize"].as_u64().unwrap());
        assert!(data == original[off..off + data.len()], "chunk {i} content");
    }
}

#[test]
fn skopeo_zstd_chunked_image_is_recognised_as_lazy() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("cirros.qcow2");
    make_qcow2(&disk, "1G", &[(0, 2 << 20, 0x5a)]);
    write_random(&disk, 300 << 20, 6 << 20, 3);
    let layout = scratch.path("layout");
    oci_layout(&layout, &disk, "disk/cirros.qcow2", Layer::Tar, "amd64");
    let reference = format!("{}/vm/skopeo:zc", reg.host());
    skopeo_push(
        &layout,
        &reference,
        &["--dest-compress", "--dest-compress-format", "zstd:chunked"],
    );

    let report = inspect_json(&reference);
    let layer = &report["platforms"][0]["layers"][0];
    assert_eq!(layer["layout"], "zstd:chunked", "{report}");
    assert_eq!(layer["lazy"], true, "{report}");
    assert_eq!(layer["vmdisk_annotations"], false);
    assert_eq!(layer["disk"]["path"], "disk/cirros.qcow2");
    assert_eq!(layer["disk"]["format"], "qcow2");
    assert_eq!(layer["disk"]["virtual_size"], 1u64 << 30);
    assert_eq!(
        layer["disk"]["size"],
        std::fs::metadata(&disk).unwrap().len()
    );
    assert!(
        layer["chunks"].as_u64().unwrap() > 1,
        "content-defined chunks: {layer}"
    );
    assert!(layer["toc_size"].as_u64().unwrap() > 0);
}

#[test]
fn plain_containerdisks_are_reported_not_lazy_and_convert_to_lazy_identical_disks() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("alpine.qcow2");
    scattered_qcow2(&disk);
    let layout = scratch.path("layout");
    oci_layout(&layout, &disk, "disk/alpine.qcow2", Layer::Gzip, "amd64");
    let source = format!("{}/vm/gzip:1", reg.host());
    skopeo_push(&layout, &source, &[]);

    let report = inspect_json(&source);
    let layer = &report["platforms"][0]["layers"][0];
    assert_eq!(
        (layer["layout"].as_str(), layer["lazy"].as_bool()),
        (Some("gzip"), Some(false)),
        "{report}"
    );
    assert!(layer["reason"].as_str().unwrap().contains("vmdisk convert"));
    assert_eq!(layer["disk"]["path"], "disk/alpine.qcow2");
    assert_eq!(layer["disk"]["virtual_size"], 2u64 << 30);

    let target = format!("{}/vm/converted:1", reg.host());
    let out = vmdisk_ok(&["convert", &source, &target]);
    assert!(last_line(&out).starts_with("sha256:"));
    let report = inspect_json(&target);
    let layer = &report["platforms"][0]["layers"][0];
    assert_eq!(
        (layer["layout"].as_str(), layer["lazy"].as_bool()),
        (Some("zstd:chunked"), Some(true)),
        "{report}"
    );
    assert_eq!(layer["disk"]["digest"], sha256_file(&disk));
    assert_eq!(report["platforms"][0]["platform"], "linux/amd64");

    let ctd = CriContainerd::start_plain(&scratch);
    let mnt = ctd.pull_and_mount(&target, None, &scratch.path("rootfs"));
    assert_eq!(
        sha256_file(&mnt.at.join("disk/alpine.qcow2")),
        sha256_file(&disk)
    );
}

#[test]
fn multi_arch_push_builds_an_index_and_peer_pod_paths_work() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let reference = format!("{}/vm/podvm:multi", reg.host());
    let (_amd, arm) = push_podvm_pair(&scratch, &reference, "128M");
    let report = inspect_json(&reference);
    assert_eq!(
        report["media_type"],
        "application/vnd.oci.image.index.v1+json"
    );
    let platforms: Vec<&str> = report["platforms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["platform"].as_str().unwrap())
        .collect();
    assert_eq!(platforms, ["linux/amd64", "linux/arm64"]);
    let arm_layer = &report["platforms"][1]["layers"][0];
    assert_eq!(arm_layer["disk"]["path"], "image/podvm.qcow2");
    assert_eq!(arm_layer["disk"]["virtual_size"], 128u64 << 20);

    let ctd = CriContainerd::start_plain(&scratch);
    let mnt = ctd.pull_and_mount(&reference, Some("linux/arm64"), &scratch.path("rootfs"));
    assert_eq!(
        sha256_file(&mnt.at.join("image/podvm.qcow2")),
        sha256_file(&arm)
    );
}

#[test]
fn raw_vmdk_and_ova_inputs_are_published() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    // A raw disk with a partition table.
    let raw = scratch.path("disk.img");
    let qcow = scratch.path("src.qcow2");
    make_qcow2(&qcow, "32M", &[(0, 1 << 20, 0x33)]);
    run(
        "qemu-img",
        &[
            "convert",
            "-O",
            "raw",
            qcow.to_str().unwrap(),
            raw.to_str().unwrap(),
        ],
    );
    let mut bytes = std::fs::read(&raw).unwrap();
    bytes[510] = 0x55;
    bytes[511] = 0xaa;
    std::fs::write(&raw, &bytes).unwrap();
    let r_raw = format!("{}/vm/raw:1", reg.host());
    vmdisk_ok(&["push", raw.to_str().unwrap(), &r_raw]);
    let layer = &inspect_json(&r_raw)["platforms"][0]["layers"][0];
    assert_eq!(
        (
            layer["disk"]["format"].as_str(),
            layer["disk"]["virtual_size"].as_u64()
        ),
        (Some("raw"), Some(32 << 20))
    );

    // vmdk is converted to qcow2 with the same guest content.
    let vmdk = scratch.path("appliance.vmdk");
    run(
        "qemu-img",
        &[
            "convert",
            "-O",
            "vmdk",
            qcow.to_str().unwrap(),
            vmdk.to_str().unwrap(),
        ],
    );
    let r_vmdk = format!("{}/vm/vmdk:1", reg.host());
    vmdisk_ok(&["push", vmdk.to_str().unwrap(), &r_vmdk]);
    let layer = &inspect_json(&r_vmdk)["platforms"][0]["layers"][0];
    assert_eq!(
        (
            layer["disk"]["path"].as_str(),
            layer["disk"]["format"].as_str()
        ),
        (Some("disk/appliance.qcow2"), Some("qcow2"))
    );

    // An OVA: tar of an OVF naming a stream-optimized vmdk.
    let ova_dir = scratch.path("ova");
    std::fs::create_dir_all(&ova_dir).unwrap();
    run(
        "qemu-img",
        &[
            "convert",
            "-O",
            "vmdk",
            "-o",
            "subformat=streamOptimized",
            qcow.to_str().unwrap(),
            ova_dir.join("vm-disk1.vmdk").to_str().unwrap(),
        ],
    );
    std::fs::write(
        ova_dir.join("vm.ovf"),
        r#"<?xml version="1.0"?><Envelope xmlns="http://schemas.dmtf.org/ovf/envelope/1" xmlns:ovf="http://schemas.dmtf.org/ovf/envelope/1"><References><File ovf:id="file1" ovf:href="vm-disk1.vmdk"/></References><DiskSection><Disk ovf:diskId="vmdisk1" ovf:fileRef="file1" ovf:capacity="33554432"/></DiskSection></Envelope>"#,
    )
    .unwrap();
    let ova = scratch.path("vm.ova");
    run(
        "tar",
        &[
            "-C",
            ova_dir.to_str().unwrap(),
            "-cf",
            ova.to_str().unwrap(),
            "vm.ovf",
            "vm-disk1.vmdk",
        ],
    );
    let r_ova = format!("{}/vm/ova:1", reg.host());
    vmdisk_ok(&["push", ova.to_str().unwrap(), &r_ova]);
    let layer = &inspect_json(&r_ova)["platforms"][0]["layers"][0];
    assert_eq!(
        (
            layer["disk"]["path"].as_str(),
            layer["disk"]["virtual_size"].as_u64()
        ),
        (Some("disk/vm-disk1.qcow2"), Some(32 << 20))
    );
    assert_eq!(layer["lazy"], true);
}

#[test]
fn htpasswd_registry_works_with_docker_config_credentials() {
    let scratch = Scratch::new();
    let reg = Registry::start_htpasswd(&scratch, "alice", "wonderland");
    let disk = scratch.path("d.qcow2");
    make_qcow2(&disk, "64M", &[(0, 1 << 20, 0x42)]);
    let reference = format!("{}/vm/private:1", reg.host());

    let good = docker_config(scratch.dir.path(), &reg.host(), "alice", "wonderland");
    let env = [("DOCKER_CONFIG", scratch.dir.path().to_str().unwrap())];
    std::fs::copy(&good, scratch.path("config.json")).unwrap();
    let out = vmdisk_env(&["push", disk.to_str().unwrap(), &reference], &env);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = vmdisk_env(&["inspect", "--json", &reference], &env);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let bad = docker_config(scratch.dir.path(), &reg.host(), "alice", "wrong");
    let out = vmdisk(&["inspect", "--auth-file", bad.to_str().unwrap(), &reference]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&reg.host()) && err.contains("alice") && err.contains("refused"),
        "{err}"
    );

    let out = vmdisk(&[
        "push",
        disk.to_str().unwrap(),
        &format!("{}/vm/private:2", reg.host()),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&reg.host()) && err.contains("requires credentials and none were found"),
        "{err}"
    );
}

#[test]
fn bad_input_fails_clearly_and_tags_nothing() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let target = format!("{}/vm/bad:1", reg.host());
    let expect_failure = |args: &[&str], needle: &str| {
        let out = vmdisk(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Retries may log warnings first; the error itself is the one last line.
        let err = stderr.lines().last().unwrap_or_default();
        assert!(
            err.starts_with("vmdisk: error: ") && err.contains(needle),
            "{args:?}: expected {needle:?} in: {stderr}"
        );
    };

    let text = scratch.path("notes.txt");
    std::fs::write(&text, "not a disk\n".repeat(1000)).unwrap();
    expect_failure(
        &["push", text.to_str().unwrap(), &target],
        "does not look like a VM disk",
    );

    let disk = scratch.path("full.qcow2");
    make_qcow2(
        &disk,
        "256M",
        &[(0, 8 << 20, 0x77), (200 << 20, 8 << 20, 0x78)],
    );
    let bytes = std::fs::read(&disk).unwrap();
    let truncated = scratch.path("truncated.qcow2");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    expect_failure(&["push", truncated.to_str().unwrap(), &target], "truncated");

    expect_failure(
        &[
            "push",
            scratch.path("missing.qcow2").to_str().unwrap(),
            &target,
        ],
        "cannot open disk",
    );
    expect_failure(
        &[
            "push",
            disk.to_str().unwrap(),
            &format!("127.0.0.1:{}/vm/x:1", free_port()),
        ],
        "unreachable",
    );
    expect_failure(
        &["push", disk.to_str().unwrap(), "127.0.0.1:5000/Bad/Name:1"],
        "malformed",
    );
    expect_failure(&["inspect", "not a reference"], "malformed");
    expect_failure(
        &["inspect", &format!("{}/vm/nothing:here", reg.host())],
        "not found",
    );

    assert!(
        reg.tags("vm/bad").is_empty(),
        "nothing may be tagged after failed pushes"
    );
}

#[test]
fn mirrors_from_hosts_toml_serve_pulls() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("d.qcow2");
    make_qcow2(&disk, "64M", &[(0, 1 << 20, 0x42)]);
    vmdisk_ok(&[
        "push",
        disk.to_str().unwrap(),
        &format!("{}/vm/mirrored:1", reg.host()),
    ]);
    // The upstream name does not resolve; only the mirror can answer.
    let hosts = scratch.path("certs.d/registry.invalid:5000");
    std::fs::create_dir_all(&hosts).unwrap();
    std::fs::write(hosts.join("hosts.toml"), format!("server = \"https://registry.invalid:5000\"\n\n[host.\"http://{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n", reg.host())).unwrap();
    let out = vmdisk_ok(&[
        "inspect",
        "--hosts-dir",
        scratch.path("certs.d").to_str().unwrap(),
        "--json",
        "registry.invalid:5000/vm/mirrored:1",
    ]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["platforms"][0]["layers"][0]["lazy"], true);
}

#[test]
fn bearer_token_registry_works_with_docker_config_credentials() {
    let scratch = Scratch::new();
    let tokens = crate::fixtures::token::TokenServer::start(&scratch, "bob", "builder");
    let reg = tokens.registry(&scratch);
    let disk = scratch.path("d.qcow2");
    make_qcow2(&disk, "64M", &[(0, 1 << 20, 0x42)]);
    let reference = format!("{}/vm/token:1", reg.host());
    let unauthenticated = curl(&[
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        &reg.url("/v2/vm/token/tags/list"),
    ]);
    assert_eq!(unauthenticated, b"401", "the registry must demand a token");

    let good = docker_config(scratch.dir.path(), &reg.host(), "bob", "builder");
    let out = vmdisk(&[
        "push",
        "--auth-file",
        good.to_str().unwrap(),
        disk.to_str().unwrap(),
        &reference,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let issued_for_push = tokens.issued.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (1..=3).contains(&issued_for_push),
        "tokens are cached per scope, got {issued_for_push} for one push"
    );
    let out = vmdisk(&[
        "inspect",
        "--auth-file",
        good.to_str().unwrap(),
        "--json",
        &reference,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["platforms"][0]["layers"][0]["lazy"], true);

    let bad = docker_config(scratch.dir.path(), &reg.host(), "bob", "wrong");
    let out = vmdisk(&["inspect", "--auth-file", bad.to_str().unwrap(), &reference]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&reg.host()) && err.contains("refused user bob"),
        "{err}"
    );
}

#[test]
fn an_upload_cut_mid_body_is_resumed_or_restarted_and_lands_intact() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let proxy = FaultProxy::start(reg.port, Some(20 << 20));
    let disk = scratch.path("d.qcow2");
    make_qcow2(&disk, "256M", &[]);
    write_random(&disk, 0, 48 << 20, 11); // incompressible: the layer spans two upload segments
    let reference = format!("127.0.0.1:{}/vm/resume:1", proxy.port);
    let out = vmdisk_env(
        &["push", disk.to_str().unwrap(), &reference],
        &[("VMDISK_LOG", "warn")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        proxy.cuts.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the proxy cut the upload once"
    );
    assert!(
        stderr.contains("asking the registry where to resume"),
        "{stderr}"
    );
    // Whether the registry let the upload resume, or cancelled it (distribution 2.8 usually
    // does) and vmdisk uploaded the layer anew, depends on timing; both must land intact.
    // The registry checked the blob digest when the upload completed; pull it to be sure.
    let ctd = CriContainerd::start_plain(&scratch);
    let mnt = ctd.pull_and_mount(
        &format!("{}/vm/resume:1", reg.host()),
        None,
        &scratch.path("rootfs"),
    );
    assert_eq!(
        sha256_file(&mnt.at.join("disk/d.qcow2")),
        sha256_file(&disk)
    );
}

#[test]
fn blobs_mount_across_repositories() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("d.qcow2");
    make_qcow2(&disk, "64M", &[(0, 1 << 20, 0x42)]);
    let source = format!("{}/vm/source:1", reg.host());
    vmdisk_ok(&["push", disk.to_str().unwrap(), &source]);
    let layer: vmdisk::oci::digest::Digest = inspect_json(&source)["platforms"][0]["layers"][0]
        ["digest"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();

    let client = vmdisk::registry::RegistryClient::new(vmdisk::registry::RegistryConfig {
        auth_files: Some(vec![]),
        ..Default::default()
    })
    .unwrap();
    let target: vmdisk::oci::reference::Reference =
        format!("{}/vm/target:1", reg.host()).parse().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        assert!(!client.blob_exists(&target, &layer).await.unwrap());
        assert!(
            client
                .mount_blob(&target, &layer, "vm/source")
                .await
                .unwrap(),
            "registry mounts the blob"
        );
        assert!(client.blob_exists(&target, &layer).await.unwrap());
        let absent = vmdisk::oci::digest::Digest::of(b"never pushed");
        assert!(
            !client
                .mount_blob(&target, &absent, "vm/source")
                .await
                .unwrap(),
            "an unknown blob is not mounted"
        );
    });
}

#[test]
fn zstd_sources_convert_and_estargz_is_recognised() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("d.qcow2");
    make_qcow2(&disk, "512M", &[(0, 2 << 20, 0x21)]);
    write_random(&disk, 100 << 20, 4 << 20, 5);

    // A plain zstd containerDisk (no TOC): not lazy, converts to a lazy identical disk.
    let layout = scratch.path("plain");
    oci_layout(&layout, &disk, "disk/d.qcow2", Layer::Tar, "amd64");
    let source = format!("{}/vm/zstd:1", reg.host());
    skopeo_push(
        &layout,
        &source,
        &["--dest-compress", "--dest-compress-format", "zstd"],
    );
    let layer = &inspect_json(&source)["platforms"][0]["layers"][0];
    assert_eq!(
        (layer["layout"].as_str(), layer["lazy"].as_bool()),
        (Some("zstd"), Some(false)),
        "{layer}"
    );
    let target = format!("{}/vm/zstd:lazy", reg.host());
    vmdisk_ok(&["convert", &source, &target]);
    let layer = &inspect_json(&target)["platforms"][0]["layers"][0];
    assert_eq!(layer["lazy"], true, "{layer}");
    assert_eq!(layer["disk"]["digest"], sha256_file(&disk));

    // An eStargz-annotated layer is recognised and reported, not misread.
    let layout = scratch.path("estargz");
    let toc = format!("sha256:{}", "ab".repeat(32));
    oci_layout_annotated(
        &layout,
        &disk,
        "disk/d.qcow2",
        Layer::Gzip,
        "amd64",
        serde_json::json!({"containerd.io/snapshot/stargz/toc.digest": toc}),
    );
    let esgz = format!("{}/vm/estargz:1", reg.host());
    skopeo_push(&layout, &esgz, &[]);
    let layer = &inspect_json(&esgz)["platforms"][0]["layers"][0];
    assert_eq!(
        (layer["layout"].as_str(), layer["lazy"].as_bool()),
        (Some("estargz"), Some(false)),
        "{layer}"
    );
    assert!(layer["reason"].as_str().unwrap().contains("eStargz"));
}

#[test]
fn convert_republishes_every_platform_of_an_index() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let source = format!("{}/vm/podvm:src", reg.host());
    let (amd, arm) = push_podvm_pair(&scratch, &source, "96M");
    let converted = format!("{}/vm/podvm:converted", reg.host());
    vmdisk_ok(&["convert", "--chunk-size", "64K", &source, &converted]);
    let report = inspect_json(&converted);
    assert_eq!(
        report["media_type"],
        "application/vnd.oci.image.index.v1+json"
    );
    for (i, (platform, file)) in [("linux/amd64", &amd), ("linux/arm64", &arm)]
        .into_iter()
        .enumerate()
    {
        let layer = &report["platforms"][i]["layers"][0];
        assert_eq!(report["platforms"][i]["platform"], platform);
        assert_eq!(layer["disk"]["path"], "image/podvm.qcow2");
        assert_eq!(layer["disk"]["digest"], sha256_file(file));
        assert_eq!(layer["chunk_size"]["max"], 64 << 10);
    }
}
