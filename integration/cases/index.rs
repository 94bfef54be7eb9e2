//! Ordinary containerDisks made lazy by `vmdisk index`: a gzip image pushed by skopeo, an
//! uncompressed one, an index in another repository, and indexes that lie. The real registry,
//! containerd 1.6's CRI through vmdisk-snapshotter, FUSE and qemu.

use std::path::Path;
use std::time::Duration;

use crate::fixtures::cri::{container_output, rt, CriContainerd, Daemon};
use crate::fixtures::guest::boot;
use crate::fixtures::harness::{
    oci_layout, run, sha256_file, skopeo_push, vmdisk, vmdisk_ok, FaultProxy, Layer, Registry,
    Scratch,
};
use crate::fixtures::images::{
    bootable_raw, client, manifest_digest, pause_image, push_layout_as_is, wait_verified,
};
use vmdisk::format::seekable;
use vmdisk::oci::reference::Reference;

/// Container `compute` of a new pod reads `/disk/<file>` in full; its sha256.
fn kubevirt_reads(
    ctd: &CriContainerd,
    scratch: &Scratch,
    pod: &str,
    image: &str,
    file: &str,
) -> String {
    let logs = scratch.path(&format!("{pod}-logs"));
    let sandbox = ctd.run_sandbox(pod, &logs);
    let path = format!("/disk/{file}");
    let id = ctd.start_container(
        &sandbox,
        "compute",
        image,
        &["/busybox", "sha256sum", &path],
    );
    let code = ctd.wait_exit(&id, Duration::from_secs(900));
    let out = container_output(&logs.join("compute.log"));
    assert_eq!(code, 0, "{out:?}");
    let out = container_output(&logs.join("compute.log"));
    ctd.remove_sandbox(&sandbox.0);
    let sum = out
        .first()
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or("-");
    format!("sha256:{sum}")
}

/// The main case: a 1 GiB gzip containerDisk pushed by skopeo, indexed, pulled through
/// CRI as a remote snapshot for a small fraction of its bytes; KubeVirt's read of the whole
/// disk has the original's sha256, the complete layer matches its diff_id, the disk boots,
/// and the image's manifest digest is what it was.
#[test]
fn an_indexed_gzip_containerdisk_is_a_lazy_cri_pull_and_boots() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = bootable_raw(scratch.dir.path(), "1G");
    let disk_len = std::fs::metadata(&disk).unwrap().len();
    let want = sha256_file(&disk);
    let layout = scratch.path("layout");
    oci_layout(&layout, &disk, "disk/disk.img", Layer::Tar, "amd64");
    let source = format!("{}/vm/plain:1", reg.host());
    skopeo_push(&layout, &source, &["--dest-compress-format", "gzip"]);
    std::fs::remove_dir_all(&layout).unwrap();
    let before = manifest_digest(&source);

    let out = vmdisk_ok(&["index", "--json", &source]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    eprintln!("vmdisk index: {report}");
    assert_eq!(report["compression"], "gzip");
    assert_eq!(report["disk"], "disk/disk.img");
    assert_eq!(report["manifest"].as_str(), Some(before.as_str()));
    let index_size = report["index_size"].as_u64().unwrap();
    assert!(index_size < disk_len / 50, "index of {index_size} bytes");
    assert_eq!(manifest_digest(&source), before, "the image is not touched");
    let inspect = vmdisk_ok(&["inspect", &source]);
    assert!(inspect.contains("seekable index"), "{inspect}");

    let proxy = FaultProxy::start(reg.port, None);
    let daemon = Daemon::start(&scratch, "");
    let pause = pause_image(&reg, &scratch);
    let ctd = CriContainerd::start(&scratch, &daemon.socket, &pause, &[reg.port, proxy.port]);
    let image = format!("127.0.0.1:{}/vm/plain:1", proxy.port);
    let bytes = || proxy.to_client.load(std::sync::atomic::Ordering::SeqCst);
    let start = bytes();
    let (_, took) = ctd
        .pull(&image)
        .unwrap_or_else(|e| panic!("PullImage: {e}\n{}", daemon.log_text()));
    let pulled = bytes() - start;
    eprintln!(
        "PullImage (indexed gzip): {took:?}, {pulled} registry bytes for a {disk_len}-byte disk ({:.2}%)",
        pulled as f64 * 100.0 / disk_len as f64
    );
    assert_eq!(
        daemon.decisions().get("remote"),
        Some(&1),
        "{:?}",
        daemon.decisions()
    );
    assert!(pulled < disk_len / 20, "the lazy pull moved {pulled} bytes");
    let disks = daemon.disks();
    assert!(
        disks[0].serving && disks[0].disk_path == "disk/disk.img",
        "{:?}",
        disks[0]
    );

    // Boot from the disk as it is served (raw), before anything read it all.
    let start = bytes();
    let out = vmdisk_ok(&[
        "path",
        "--raw",
        "--manage",
        daemon.manage.to_str().unwrap(),
        &image,
    ]);
    let console = boot(Path::new(out.trim()));
    assert!(
        console.contains("BOOT-MARKER"),
        "the VM did not boot:\n{console}"
    );
    eprintln!("cold boot: {} registry bytes", bytes() - start);

    assert_eq!(
        kubevirt_reads(&ctd, &scratch, "vm", &image, "disk.img"),
        want
    );
    assert_eq!(wait_verified(&daemon), "verified", "{}", daemon.log_text());
    assert_eq!(manifest_digest(&source), before);
}

/// The index in another repository (`--to`, found through `[registry] index_repositories`),
/// and an uncompressed layer (spans are byte ranges of the blob).
#[test]
fn an_index_in_another_repository_and_an_uncompressed_layer_load_lazily() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("disk.img");
    crate::fixtures::harness::random_file(&disk, 48 << 20, 11);
    run("truncate", &["-s", "256M", disk.to_str().unwrap()]);
    let want = sha256_file(&disk);
    let layout = scratch.path("layout");
    oci_layout(&layout, &disk, "disk/disk.img", Layer::Tar, "amd64");
    let gz = format!("{}/vendor/gz:1", reg.host());
    skopeo_push(&layout, &gz, &["--dest-compress-format", "gzip"]);
    // Another disk for the uncompressed image: with the same tar, containerd would find the
    // gzip image's snapshot (same diff_id) and unpack nothing.
    let plain = scratch.path("plain.img");
    crate::fixtures::harness::random_file(&plain, 40 << 20, 12);
    run("truncate", &["-s", "128M", plain.to_str().unwrap()]);
    let layout = scratch.path("layout-tar");
    oci_layout(&layout, &plain, "disk/disk.img", Layer::Tar, "amd64");
    let tar = format!("{}/vendor/tar:1", reg.host());
    push_layout_as_is(&layout, &tar);
    let indexes = format!("{}/team/indexes", reg.host());
    let out = vmdisk_ok(&["index", "--json", "--to", &indexes, "--span", "4M", &gz]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["repository"].as_str(), Some(indexes.as_str()));
    let out = vmdisk_ok(&["index", "--json", &tar]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["compression"], "none");
    // The index in another repository is found where the lookup is told to search.
    let lazy = |args: &[&str]| {
        let out = vmdisk_ok(&[&["inspect", "--json"][..], args, &[&gz]].concat());
        let report: serde_json::Value = serde_json::from_str(&out).unwrap();
        report["platforms"][0]["layers"][0]["lazy"].as_bool()
    };
    assert_eq!(lazy(&[]), Some(false));
    assert_eq!(lazy(&["--index-repository", &indexes]), Some(true));

    let daemon = Daemon::start(&scratch, &format!("index_repositories = [\"{indexes}\"]\n"));
    let pause = pause_image(&reg, &scratch);
    let ctd = CriContainerd::start(&scratch, &daemon.socket, &pause, &[reg.port]);
    for (n, (image, want)) in [(&gz, &want), (&tar, &sha256_file(&plain))]
        .into_iter()
        .enumerate()
    {
        ctd.pull(image)
            .unwrap_or_else(|e| panic!("PullImage {image}: {e}\n{}", daemon.log_text()));
        assert_eq!(
            daemon.decisions().get("remote"),
            Some(&(n as u64 + 1)),
            "{image}: {:?}\n{}",
            daemon.decisions(),
            daemon
                .log_text()
                .lines()
                .filter(|l| l.contains("ordinary"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        assert_eq!(
            kubevirt_reads(&ctd, &scratch, &format!("vm{n}"), image, "disk.img"),
            *want
        );
    }
    let disks = daemon.disks();
    assert_eq!(disks.len(), 2, "{disks:?}");
    // The uncompressed layer's disk came as the blob's own bytes, each once.
    let tar_disk = disks
        .iter()
        .find(|d| d.reference.contains("vendor/tar"))
        .unwrap();
    let size = std::fs::metadata(&plain).unwrap().len();
    assert!(
        tar_disk.registry_bytes >= size && tar_disk.registry_bytes <= size + (4 << 20),
        "{tar_disk:?}"
    );
}

/// Indexes that do not describe the image, or lie about a span, never serve wrong bytes: a
/// wrong subject or layer means an ordinary pull (or a clear refusal), a wrong span digest or
/// checkpoint an error on the reads of that span only.
#[test]
fn corrupted_or_mismatched_indexes_never_serve_wrong_bytes() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("a/disk.img");
    std::fs::create_dir_all(scratch.path("a")).unwrap();
    crate::fixtures::harness::random_file(&disk, 24 << 20, 3);
    let layout = scratch.path("layout");
    oci_layout(&layout, &disk, "disk/disk.img", Layer::Tar, "amd64");
    let a = format!("{}/vm/a:1", reg.host());
    skopeo_push(&layout, &a, &["--dest-compress-format", "gzip"]);
    let other = scratch.path("b.img");
    crate::fixtures::harness::random_file(&other, 24 << 20, 4);
    let layout = scratch.path("layout-b");
    oci_layout(&layout, &other, "disk/disk.img", Layer::Tar, "amd64");
    let b = format!("{}/vm/b:1", reg.host());
    skopeo_push(&layout, &b, &["--dest-compress-format", "gzip"]);
    vmdisk_ok(&["index", "--span", "1M", &a]);

    let c = client();
    let s = rt();
    // The index of A, found and decoded as the daemon would.
    let (a_ref, b_ref): (Reference, Reference) = (a.parse().unwrap(), b.parse().unwrap());
    let (a_manifest, b_manifest) = s.block_on(async {
        (
            c.get_manifest(&a_ref).await.unwrap(),
            c.get_manifest(&b_ref).await.unwrap(),
        )
    });
    let found = s
        .block_on(c.referrers(&a_ref, &a_manifest.digest, &[seekable::ARTIFACT_TYPE]))
        .unwrap();
    assert_eq!(found.len(), 1);
    let artifact = s
        .block_on(c.get_manifest(&a_ref.with_digest(found[0].digest)))
        .unwrap();
    let vmdisk::oci::ManifestKind::Image(artifact) = artifact.manifest else {
        panic!("an artifact manifest")
    };
    let blob = s
        .block_on(c.get_blob(&a_ref, &artifact.layers[0], seekable::MAX_INDEX_BYTES))
        .unwrap();
    let json = zstd::decode_all(blob.as_slice()).unwrap();
    let index: seekable::SeekIndex = serde_json::from_slice(&json).unwrap();
    let windows_desc = artifact.layers[1].clone();
    let windows = s
        .block_on(c.get_blob(&a_ref, &windows_desc, 1 << 30))
        .unwrap();
    let publish = |target: &Reference,
                   subject: &vmdisk::registry::FetchedManifest,
                   index: &seekable::SeekIndex| {
        let bytes = index.encode().unwrap();
        let layer = vmdisk::oci::Descriptor::of(seekable::MEDIA_TYPE, &bytes);
        let subject = vmdisk::oci::Descriptor::of(&subject.media_type, &subject.bytes);
        s.block_on(async {
            c.push_blob(target, &layer.digest, bytes.into())
                .await
                .unwrap();
            c.push_blob(target, &windows_desc.digest, windows.clone().into())
                .await
                .unwrap();
            c.push_referrer(
                target,
                subject,
                seekable::ARTIFACT_TYPE,
                vec![layer, windows_desc.clone()],
                Default::default(),
            )
            .await
            .unwrap();
        });
    };

    // A's index published for B (its subject is B, it describes A's layer): refused.
    publish(&b_ref, &b_manifest, &index);
    let daemon = Daemon::start(&scratch, "");
    let manage = daemon.manage.to_str().unwrap().to_string();
    let out = vmdisk(&["path", "--manage", &manage, &b]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "B has no index of its own");
    assert!(
        err.contains("no usable seekable index") && err.contains("describes layer"),
        "{err}"
    );

    // A wrong span digest, then a wrong checkpoint (another span's window), replacing A's.
    for (what, lie) in [
        ("digest", {
            let mut i = index.clone();
            i.spans[3].digest = i.spans[4].digest;
            i
        }),
        ("checkpoint", {
            // Its compressed offset one byte on (the random disk's blocks never look back
            // into the window, so a wrong window alone would decode right here).
            let mut i = index.clone();
            i.spans[3].input += 1;
            i
        }),
    ] {
        publish(&a_ref, &a_manifest, &lie);
        let path = vmdisk_ok(&["path", "--manage", &manage, &a]);
        let file = std::fs::File::open(path.trim()).unwrap();
        let entry = lie.disk_entry().unwrap();
        let span = &lie.spans[3];
        let mut buf = vec![0u8; 4096];
        use std::os::unix::fs::FileExt;
        let at = span.offset - entry.offset + 100;
        let e = file.read_exact_at(&mut buf, at).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{what}: {e}");
        // The spans it does not lie about read, and equal the disk.
        file.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(buf, std::fs::read(&disk).unwrap()[..4096], "{what}");
        assert!(
            daemon.servers_log_text().contains("span 3"),
            "{what}: the log names the span"
        );
        vmdisk_ok(&["rm", "--manage", &manage, &a]);
        drop(file);
    }
}

/// An eStargz containerDisk (written as stargz-snapshotter's writer writes one) is pulled
/// through CRI as a remote snapshot read from its own TOC, KubeVirt's read of the whole disk
/// has the original's sha256, and the complete layer matches its diff_id.
#[test]
fn an_estargz_containerdisk_reads_lazily_and_identically() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("disk.qcow2");
    crate::fixtures::harness::make_qcow2(&disk, "1G", &[(0, 2 << 20, 0x21)]);
    crate::fixtures::harness::write_random(&disk, 100 << 20, 24 << 20, 21);
    let content = std::fs::read(&disk).unwrap();
    let vmdisk_testing::estargz::Layer {
        blob,
        toc_digest: toc,
        diff_id,
    } = vmdisk_testing::estargz::layer(&[("disk/disk.qcow2", content)], 1 << 20);
    let layout = scratch.path("layout");
    crate::fixtures::harness::write_layout(
        &layout,
        &[(
            blob,
            vmdisk::oci::OCI_LAYER_GZIP,
            diff_id.to_string(),
            serde_json::json!({ vmdisk::format::estargz::ANN_TOC_DIGEST: toc.to_string() }),
        )],
        "amd64",
        serde_json::json!({}),
    );
    let image = format!("{}/vm/estargz:1", reg.host());
    push_layout_as_is(&layout, &image);
    let inspect: serde_json::Value =
        serde_json::from_str(&vmdisk_ok(&["inspect", "--json", &image])).unwrap();
    let layer = &inspect["platforms"][0]["layers"][0];
    assert_eq!(
        (layer["layout"].as_str(), layer["lazy"].as_bool()),
        (Some("estargz"), Some(true)),
        "{layer}"
    );

    let proxy = FaultProxy::start(reg.port, None);
    let daemon = Daemon::start(&scratch, "");
    let pause = pause_image(&reg, &scratch);
    let ctd = CriContainerd::start(&scratch, &daemon.socket, &pause, &[reg.port, proxy.port]);
    let lazy = format!("127.0.0.1:{}/vm/estargz:1", proxy.port);
    let bytes = || proxy.to_client.load(std::sync::atomic::Ordering::SeqCst);
    let start = bytes();
    ctd.pull(&lazy)
        .unwrap_or_else(|e| panic!("PullImage: {e}\n{}", daemon.log_text()));
    let pulled = bytes() - start;
    let size = std::fs::metadata(&disk).unwrap().len();
    eprintln!("PullImage (eStargz): {pulled} registry bytes for a {size}-byte disk");
    assert_eq!(
        daemon.decisions().get("remote"),
        Some(&1),
        "{:?}",
        daemon.decisions()
    );
    // The qcow2 head and tables: a few 1 MiB chunks of a 27 MB file.
    assert!(pulled < size / 5, "the lazy pull moved {pulled} bytes");
    // The mount server's structure check read the bytes the daemon fetched while the server
    // started (the tar headers and the disk's last chunk): the server fetched none itself.
    let disks = daemon.disks();
    assert_eq!(disks[0].registry_bytes, 0, "{disks:?}");
    assert_eq!(
        kubevirt_reads(&ctd, &scratch, "vm", &lazy, "disk.qcow2"),
        sha256_file(&disk)
    );
    assert_eq!(
        wait_verified(&daemon),
        "verified",
        "{}",
        daemon.servers_log_text()
    );
}
