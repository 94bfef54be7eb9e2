//! The containerd matrix: Debian 12's containerd 1.6, Debian 13's 1.7, Debian unstable's 2.1, and
//! 2.3 (long-term support) and 2.4 built from the Go module proxy, each on a node configured as
//! that release configures itself (`containerd config default`, kubeadm's `SystemdCgroup =
//! true`) and set up with the package's install step (`vmdisk containerd-config --write`,
//! which merges the snippet vmdisk ships, `config/containerd-*.toml`, in the file's own
//! configuration version). For each: containerd loads vmdisk's proxy plugin with no warning of
//! what vmdisk wrote; a CRI pull of a containerDisk, as a pod of the documented setup makes
//! it, is a remote snapshot (under 1% of the disk from the registry); a KubeVirt-style container
//! reads `/disk` identical; the image filesystem containerd reports to kubelet exists on
//! vmdisk's filesystem and counts what vmdisk stores; a containerd restart keeps the disk
//! serving. On 2.x, `ctr images pull` through the transfer service is lazy too, and so is an
//! image volume (KEP-4639) of a containerDisk.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use k8s_cri::v1 as cri;

use crate::fixtures::cri::{
    container_output, rt, CriContainerd, Daemon, InstallStep, NodeFile, Release,
};
use crate::fixtures::harness::*;
use crate::fixtures::node::{cri_config, node_config, reads_the_disk, same_digest};

/// Whether `mountpoint` (of an image filesystem CRI reports) is vmdisk's: the link under
/// containerd's root vmdisk makes (1.6, 2.x), or the root `daemon` exports (1.7's CRI reports
/// a proxy snapshotter's exported root).
fn vmdisks_image_filesystem(mountpoint: &str, daemon: &Daemon) -> bool {
    mountpoint.ends_with("io.containerd.snapshotter.v1.vmdisk")
        || Path::new(mountpoint) == daemon.root
}

/// CRI `ImageFsInfo`: the image filesystems containerd reports to kubelet.
fn image_filesystems(ctd: &CriContainerd) -> Vec<cri::FilesystemUsage> {
    rt().block_on(async {
        ctd.images()
            .await
            .unwrap()
            .image_fs_info(cri::ImageFsInfoRequest {})
            .await
            .unwrap()
            .into_inner()
            .image_filesystems
    })
}

/// An application image (busybox, its config runs a shell) in the registry as zstd:chunked
/// (skopeo) and as eStargz: each layer with a TOC of its own, neither published by vmdisk. The
/// references, with their formats.
fn ordinary_images_with_tocs(
    scratch: &Scratch,
    reg: &crate::fixtures::harness::Registry,
) -> [(String, &'static str); 2] {
    // zstd:chunked as containers/storage writes it (skopeo 1.9's conversion leaves the
    // config's diff_id that of the gzip layer, which containerd then refuses).
    let busybox = std::fs::read("/bin/busybox").unwrap();
    let layer =
        crate::fixtures::hostile::CraftedLayer::honest(&[("bin/busybox", &busybox)], 256 << 10);
    let (blob, annotations) = layer.blob();
    let layout = scratch.path("busybox-chunked");
    crate::fixtures::harness::write_layout(
        &layout,
        &[(
            blob,
            "application/vnd.oci.image.layer.v1.tar+zstd",
            layer.diff_id().to_string(),
            annotations,
        )],
        "amd64",
        serde_json::json!({"Cmd": ["/bin/busybox", "sh"]}),
    );
    let chunked = format!("{}/busybox-chunked:1", reg.host());
    crate::fixtures::images::push_layout_as_is(&layout, &chunked);
    let estargz = format!("{}/busybox-estargz:1", reg.host());
    let layout = scratch.path("busybox-estargz");
    let busybox = std::fs::read("/bin/busybox").unwrap();
    let layer = vmdisk_testing::estargz::layer(&[("bin/busybox", busybox)], 1 << 20);
    crate::fixtures::harness::write_layout(
        &layout,
        &[(
            layer.blob,
            vmdisk::oci::OCI_LAYER_GZIP,
            layer.diff_id.to_string(),
            serde_json::json!({ vmdisk::format::estargz::ANN_TOC_DIGEST: layer.toc_digest.to_string() }),
        )],
        "amd64",
        serde_json::json!({"Cmd": ["/bin/busybox", "sh"]}),
    );
    crate::fixtures::images::push_layout_as_is(&layout, &estargz);
    [(chunked, "zstd:chunked"), (estargz, "eStargz")]
}

/// Deprecations this machine itself causes, whatever containerd's configuration: its cgroup v1
/// hierarchies (containerd 2.2 and later warn of them).
const HOST_DEPRECATIONS: [&str; 1] = ["\"io.containerd.deprecation/cgroup-v1\""];

/// Fails when `ctd` warns of a deprecation that is not the machine's own: nothing vmdisk wrote
/// into its configuration is deprecated in that release.
fn no_deprecation_from_vmdisk(ctd: &CriContainerd, when: &str) {
    let warned: Vec<String> = ctd
        .deprecations()
        .into_iter()
        .filter(|w| !HOST_DEPRECATIONS.iter().any(|host| w.starts_with(host)))
        .collect();
    assert!(
        warned.is_empty(),
        "{:?} {when}: containerd warns of deprecations: {warned:#?}",
        ctd.release
    );
}

/// What vmdisk's install step did to a node's file, and containerd's answer: every line the
/// node had is kept (the file's `version` and kubeadm's `SystemdCgroup = true` with them),
/// containerd loaded vmdisk's proxy plugin (`ok`), and warns of nothing vmdisk wrote (nor of a
/// migration of a version vmdisk chose: where the node had no file).
pub(crate) fn installed_as_written(
    ctd: &CriContainerd,
    install: &crate::fixtures::cri::NodeInstall,
    file: NodeFile,
    step: InstallStep,
) {
    let release = ctd.release;
    let what = format!("{release:?} {file:?} {step:?}");
    let diff = similar::TextDiff::from_lines(&install.original, &install.written);
    // The package's step sets the CRI snapshotter, and both turn the snapshot annotations on
    // for 1.x: those lines change; no other line does.
    let its_own = |line: &str| {
        let line = line.trim_start();
        line.starts_with("disable_snapshot_annotations = ")
            || (step == InstallStep::Package && line.starts_with("snapshotter = "))
    };
    let removed: Vec<&str> = diff
        .iter_all_changes()
        .filter(|c| c.tag() == similar::ChangeTag::Delete && !its_own(c.value()))
        .map(|c| c.value())
        .collect();
    assert!(
        removed.is_empty(),
        "{what}: vmdisk changed {removed:?}:\n{}",
        install.written
    );
    let version = |text: &str| {
        text.parse::<toml_edit::DocumentMut>()
            .unwrap()
            .get("version")
            .and_then(|v| v.as_integer())
    };
    let want = match file {
        NodeFile::Missing => Some(if release.v3() {
            // What the release writes itself: 4 from 2.3 on.
            if matches!(release, Release::V2_1) {
                3
            } else {
                4
            }
        } else {
            2
        }),
        _ => version(&install.original),
    };
    assert_eq!(
        version(&install.written),
        want,
        "{what}:\n{}",
        install.written
    );
    if file != NodeFile::Missing {
        assert!(
            install.written.contains("SystemdCgroup = true"),
            "{what}:\n{}",
            install.written
        );
    }
    eprintln!(
        "{what}: {} (configuration version {want:?})",
        install.said.trim()
    );
    assert!(
        ctd.proxy_plugin_ok(),
        "{what}: vmdisk's proxy plugin is not ok: {}",
        String::from_utf8_lossy(&ctd.ctr(&["plugins", "ls"]).stdout)
    );
    let warned = ctd.warnings_of_vmdisks_part(file == NodeFile::Missing);
    assert!(
        warned.is_empty(),
        "{what}: containerd warns of vmdisk's part: {warned:#?}"
    );
}

fn matrix(release: Release) {
    release.require();
    let scratch = Scratch::new();
    let (reg, disk) = crate::fixtures::images::registry_with_images(&scratch, 96);
    let proxy = FaultProxy::counting(reg.port);
    let mut daemon = Daemon::start(&scratch, "");
    let pause = format!("{}/pause:1", reg.host());
    // The node as its installer leaves it, then the package's install step; pods of runc's
    // default handler here use the cgroupfs driver (this machine runs no systemd), set after
    // vmdisk's step.
    let (mut ctd, install) = CriContainerd::start_node(
        &scratch,
        release,
        NodeFile::OwnDefault,
        InstallStep::Package,
        &daemon,
        &pause,
        &[reg.port, proxy.port],
        true,
    );
    installed_as_written(&ctd, &install, NodeFile::OwnDefault, InstallStep::Package);
    no_deprecation_from_vmdisk(&ctd, "with the shipped snippet");
    let image = format!("127.0.0.1:{}/disk:1", proxy.port);
    let disk_len = std::fs::metadata(&disk).unwrap().len();
    let want = sha256_file(&disk);

    // An ordinary container image costs vmdisk no request: the registry sees containerd's
    // alone, and the decision says what the image is.
    let registry_log = reg.root.join("registry.log");
    let vmdisk_asked = |since: usize| -> Vec<String> {
        let log = std::fs::read_to_string(&registry_log).unwrap();
        log[since..]
            .lines()
            .filter(|l| l.contains("\"vmdisk/"))
            .map(str::to_string)
            .collect()
    };
    let logged = std::fs::read_to_string(&registry_log).unwrap().len();
    ctd.pull(&format!("{}/busybox:1", reg.host()))
        .unwrap_or_else(|e| panic!("{release:?} PullImage busybox: {e}\n{}", daemon.log_text()));
    let asked = vmdisk_asked(logged);
    assert!(
        asked.is_empty(),
        "{release:?}: vmdisk asked the registry for an ordinary image: {asked:?}"
    );
    assert_eq!(
        daemon.decisions().get("ordinary:not_disk_image"),
        Some(&1),
        "{release:?}: {:?}",
        daemon.decisions()
    );
    // So does one whose layer carries a TOC of its own (podman's zstd:chunked, eStargz): its
    // config runs a program, so no TOC is fetched and no mount server starts.
    for (image, format) in ordinary_images_with_tocs(&scratch, &reg) {
        let logged = std::fs::read_to_string(&registry_log).unwrap().len();
        ctd.pull(&image).unwrap_or_else(|e| {
            panic!("{release:?} PullImage {format}: {e}\n{}", daemon.log_text())
        });
        let asked = vmdisk_asked(logged);
        assert!(
            asked.is_empty(),
            "{release:?}: vmdisk asked the registry for an ordinary {format} image: {asked:?}"
        );
        assert!(
            daemon.server_pids().is_empty(),
            "{release:?}: a mount server started for an ordinary {format} image"
        );
    }
    assert_eq!(
        daemon.decisions().get("ordinary:not_disk_image"),
        Some(&3),
        "{release:?}: {:?}",
        daemon.decisions()
    );

    // A CRI pull as kubelet makes it for any pod: lazy.
    let logged = std::fs::read_to_string(&registry_log).unwrap().len();
    let before = proxy.bytes_to_client();
    ctd.pull(&image).unwrap_or_else(|e| {
        panic!(
            "{release:?} PullImage: {e}\n{}\n{}",
            ctd.log_text(),
            daemon.log_text()
        )
    });
    let pulled = proxy.bytes_to_client() - before;
    eprintln!("{release:?}: CRI pull moved {pulled} registry bytes for a {disk_len}-byte disk");
    assert!(
        pulled < disk_len / 100,
        "{release:?}: the pull moved {pulled} bytes"
    );
    assert_eq!(
        daemon.decisions().get("remote"),
        Some(&1),
        "{:?}",
        daemon.decisions()
    );
    // The manifest came from containerd's content store (it holds it before it unpacks):
    // the daemon did not ask the registry for it again, and the layer's mount server asked the
    // registry for no manifest of the image (it serves the layer the daemon decided, from the
    // cache). Once serving, the server looks for a boot trace published for the image (its
    // referrers' fallback tag `sha256-<hex>`, crate::trace): counted apart.
    let log = std::fs::read_to_string(&registry_log).unwrap();
    let manifests_asked_by = |server: bool, trace: bool| -> Vec<&str> {
        log[logged..]
            .lines()
            .filter(|l| {
                (l.contains("\"GET /v2/") || l.contains("\"HEAD /v2/"))
                    && l.contains("/manifests/")
                    && l.contains("/manifests/sha256-") == trace
                    && l.contains("\"vmdisk/")
                    && l.contains("(mount-server)") == server
            })
            .collect()
    };
    let (daemon_asked, server_asked) = (
        manifests_asked_by(false, false),
        manifests_asked_by(true, false),
    );
    eprintln!(
        "{release:?}: the Prepare's manifest requests: {} by the daemon, {} by the mount server (and {} for a published boot trace)",
        daemon_asked.len(),
        server_asked.len(),
        manifests_asked_by(true, true).len()
    );
    assert!(
        daemon_asked.is_empty(),
        "{release:?}: vmdisk fetched the manifest containerd holds: {daemon_asked:?}"
    );
    assert!(
        server_asked.is_empty(),
        "{release:?}: the mount server asked the registry for a manifest: {server_asked:?}"
    );

    // KubeVirt's pattern: the containerDisk as the container's image, read whole.
    let logs = scratch.path("pod-logs");
    let sandbox = ctd.run_sandbox("vm", &logs);
    reads_the_disk(&ctd, &sandbox, &logs, "compute", &image, &want);

    // kubelet's image filesystem: the path containerd reports exists, on vmdisk's filesystem,
    // and its usage counts the disk vmdisk keeps (containerd asks a committed snapshot once;
    // vmdisk answers with what its layer takes once read whole; stats every second here).
    let layer_dir = {
        let key: vmdisk::oci::digest::Digest = daemon.disks()[0].layer_key.parse().unwrap();
        vmdisk::cache::CacheRoot::open(&daemon.root.join("cache"))
            .unwrap()
            .layer_dir(&key)
    };
    let kept: u64 = walk_size(&layer_dir);
    assert!(
        kept > disk_len / 2,
        "{release:?}: the cache holds {kept} bytes of the disk"
    );
    std::thread::sleep(Duration::from_secs(3));
    let filesystems = image_filesystems(&ctd);
    let vmdisk_fs = filesystems
        .iter()
        .find(|f| {
            f.fs_id
                .as_ref()
                .is_some_and(|id| vmdisks_image_filesystem(&id.mountpoint, &daemon))
        })
        .unwrap_or_else(|| panic!("{release:?}: no image filesystem for vmdisk: {filesystems:?}"));
    let mountpoint = Path::new(&vmdisk_fs.fs_id.as_ref().unwrap().mountpoint);
    let device = std::fs::metadata(mountpoint)
        .unwrap_or_else(|e| panic!("{release:?}: {} does not exist ({e})", mountpoint.display()))
        .dev();
    assert_eq!(device, std::fs::metadata(&daemon.root).unwrap().dev());
    let used = vmdisk_fs.used_bytes.as_ref().map_or(0, |u| u.value);
    eprintln!(
        "{release:?}: image filesystem {} counts {used} bytes; vmdisk keeps {kept} of the disk",
        mountpoint.display()
    );
    assert!(
        used >= kept,
        "{release:?}: ImageFsInfo counts {used} bytes, vmdisk keeps {kept}"
    );

    // A containerd restart (an upgrade) keeps the disk serving: a new container reads it from
    // what the node holds.
    ctd.restart();
    let before = proxy.bytes_to_client();
    reads_the_disk(&ctd, &sandbox, &logs, "after-restart", &image, &want);
    assert!(
        proxy.bytes_to_client() - before < 64 << 10,
        "{release:?}: the restart refetched the disk"
    );

    if release.v3() {
        let volume = transfer_service_and_image_volumes(
            &scratch, &ctd, &daemon, &proxy, &sandbox, &logs, &pause,
        );
        unservable_volume_is_never_empty(&ctd, &mut daemon, &reg.root, &logs, &pause, &volume);
    }
}

/// Bytes allocated under `dir`.
fn walk_size(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                total += m.blocks() * 512;
            }
        }
    }
    total
}

/// containerd 2.x: `ctr images pull` through the transfer service unpacks into vmdisk lazily,
/// and that image mounted as an image volume is read lazily, identical. The image's id.
fn transfer_service_and_image_volumes(
    scratch: &Scratch,
    ctd: &CriContainerd,
    daemon: &Daemon,
    proxy: &FaultProxy,
    sandbox: &(String, cri::PodSandboxConfig),
    logs: &Path,
    pause: &str,
) -> String {
    let volume = VolumeImage::push(scratch, proxy);
    volume.pulled_by_ctr_and_read_as_a_volume(ctd, daemon, proxy, sandbox, logs, pause, 2)
}

/// A containerDisk pushed for `ctr pull` and an image volume (a disk of its own: its pull asks
/// vmdisk again).
pub(crate) struct VolumeImage {
    upstream: String,
    disk: std::path::PathBuf,
}

impl VolumeImage {
    /// Pushes it through `proxy`.
    pub(crate) fn push(scratch: &Scratch, proxy: &FaultProxy) -> Self {
        let disk = scratch.path("second.qcow2");
        make_qcow2(&disk, "256M", &[]);
        write_random(&disk, 8 << 20, 64 << 20, 41);
        let upstream = format!("127.0.0.1:{}/volume:1", proxy.port);
        vmdisk_ok(&["push", disk.to_str().unwrap(), &upstream]);
        VolumeImage { upstream, disk }
    }

    /// containerd 2.x: `ctr images pull` through the transfer service unpacks it into vmdisk
    /// lazily (the daemon's `remote` decisions then `remote`), and that image mounted as an
    /// image volume in `sandbox` is read lazily, identical. The image's id.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pulled_by_ctr_and_read_as_a_volume(
        &self,
        ctd: &CriContainerd,
        daemon: &Daemon,
        proxy: &FaultProxy,
        sandbox: &(String, cri::PodSandboxConfig),
        logs: &Path,
        pause: &str,
        remote: u64,
    ) -> String {
        let (upstream, second) = (&self.upstream, &self.disk);
        let len = std::fs::metadata(second).unwrap().len();
        let before = proxy.bytes_to_client();
        let out = ctd.ctr(&[
            "-n",
            "k8s.io",
            "images",
            "pull",
            "--plain-http",
            "--snapshotter",
            "vmdisk",
            upstream,
        ]);
        assert!(
            out.status.success(),
            "ctr pull: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            ctd.log_text()
        );
        let pulled = proxy.bytes_to_client() - before;
        eprintln!(
            "{:?}: ctr pull through the transfer service moved {pulled} bytes for {len}",
            ctd.release
        );
        assert!(
            pulled < len / 100,
            "the transfer service's pull moved {pulled} bytes"
        );
        assert_eq!(
            daemon.decisions().get("remote"),
            Some(&remote),
            "{:?}",
            daemon.decisions()
        );

        // An image volume of that image, as kubelet asks for one: by the image's id. CRI learns of
        // an image pulled outside it from containerd's image events, after the pull returned.
        let id = rt().block_on(async {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let status = ctd
                .images()
                .await
                .unwrap()
                .image_status(cri::ImageStatusRequest {
                    image: Some(cri::ImageSpec {
                        image: upstream.to_string(),
                        ..Default::default()
                    }),
                    verbose: false,
                })
                .await
                .unwrap()
                .into_inner();
            match status.image {
                Some(image) => break image.id,
                None if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                None => panic!("the image pulled through the transfer service is not known to CRI 10 s after the pull"),
            }
        }
    });
        let before = proxy.bytes_to_client();
        let container = create_with_image_volume(ctd, sandbox, pause, &id, "volume")
            .unwrap_or_else(|e| {
                panic!(
                    "CreateContainer with an image volume: {e}\n{}",
                    ctd.log_text()
                )
            });
        let at_create = proxy.bytes_to_client() - before;
        eprintln!(
            "{:?}: image volume created with {at_create} registry bytes",
            ctd.release
        );
        assert!(
            at_create < len / 100,
            "the image volume fetched {at_create} bytes to start"
        );
        rt().block_on(async {
            ctd.runtime()
                .await
                .unwrap()
                .start_container(cri::StartContainerRequest {
                    container_id: container.clone(),
                })
                .await
                .unwrap();
        });
        assert_eq!(
            ctd.wait_exit(&container, Duration::from_secs(300)),
            0,
            "{}",
            ctd.log_text()
        );
        let out = container_output(&logs.join("volume.log"));
        assert!(
            same_digest(out.first(), &sha256_file(second)),
            "the image volume read {out:?}"
        );
        id
    }
}

/// A layer vmdisk cannot serve is never handed to containerd as the empty directory its
/// mountpoint is then: the node rebooted (the volume's server and mount gone) while the layer's
/// bytes are neither in the cache (a replaced cache disk) nor in the registry (its garbage
/// collection); a new image volume of it fails naming the layer and the cause, where an empty
/// `/vol` would start the container (and a VM reading it would find no disk).
fn unservable_volume_is_never_empty(
    ctd: &CriContainerd,
    daemon: &mut Daemon,
    registry_root: &Path,
    logs: &Path,
    pause: &str,
    id: &str,
) {
    let disk = daemon
        .disks()
        .into_iter()
        .find(|d| d.reference.contains("/volume"))
        .unwrap_or_else(|| panic!("no image volume disk in {:?}", daemon.disks()));
    daemon.stop();
    run("kill", &["-KILL", &disk.server_pid.to_string()]);
    let dead = std::time::Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{}", disk.server_pid)).exists()
        && std::time::Instant::now() < dead
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    run("umount", &["-l", &disk.mountpoint]);
    let key: vmdisk::oci::digest::Digest = disk.layer_key.parse().unwrap();
    let cache = vmdisk::cache::CacheRoot::open(&daemon.root.join("cache"))
        .unwrap()
        .layer_dir(&key);
    std::fs::remove_dir_all(&cache).unwrap();
    let hex = disk.layer_digest.trim_start_matches("sha256:");
    let blob = registry_root.join(format!(
        "data/docker/registry/v2/blobs/sha256/{}/{hex}",
        &hex[..2]
    ));
    std::fs::remove_dir_all(&blob).unwrap_or_else(|e| panic!("{}: {e}", blob.display()));
    daemon.restart();
    // A pod of after the reboot (containerd keeps an image volume mounted per pod: the old
    // pod's would still show the dead mount).
    let sandbox = &ctd.run_sandbox("after-reboot", logs);
    // containerd redials the restarted daemon after a back-off; kubelet retries a pod's
    // containers until it has.
    let redialled = std::time::Instant::now() + Duration::from_secs(20);
    let created = loop {
        match create_with_image_volume(ctd, sandbox, pause, id, "unservable") {
            Err(e)
                if e.message().contains("connection error")
                    && std::time::Instant::now() < redialled =>
            {
                std::thread::sleep(Duration::from_millis(200))
            }
            created => break created,
        }
    };
    match created {
        Ok(container) => {
            let started = rt().block_on(async {
                ctd.runtime()
                    .await
                    .unwrap()
                    .start_container(cri::StartContainerRequest {
                        container_id: container.clone(),
                    })
                    .await
            });
            let code = started
                .is_ok()
                .then(|| ctd.wait_exit(&container, Duration::from_secs(60)));
            panic!(
                "{:?}: an image volume of a layer vmdisk cannot serve was created (started: \
                 {started:?}, exit {code:?}); it read {:?}",
                ctd.release,
                container_output(&logs.join("unservable.log"))
            );
        }
        Err(e) => {
            eprintln!(
                "{:?}: the unservable image volume failed: {}",
                ctd.release,
                e.message()
            );
            assert!(
                e.message().contains(&disk.layer_key) && e.message().contains("not served"),
                "{:?}: {}\n{}",
                ctd.release,
                e.message(),
                daemon.log_text()
            );
        }
    }
}

/// Creates a container (of `pause`, with the host's busybox) that reads
/// `/vol/disk/second.qcow2` from an image volume of image `id` at `/vol`, as kubelet asks for
/// one: the image by its id.
fn create_with_image_volume(
    ctd: &CriContainerd,
    sandbox: &(String, cri::PodSandboxConfig),
    pause: &str,
    id: &str,
    name: &str,
) -> Result<String, tonic::Status> {
    rt().block_on(async {
        let mut r = ctd.runtime().await.unwrap();
        let config = cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: name.into(),
                attempt: 0,
            }),
            image: Some(cri::ImageSpec {
                image: pause.to_string(),
                ..Default::default()
            }),
            command: vec![
                "/busybox".into(),
                "sha256sum".into(),
                "/vol/disk/second.qcow2".into(),
            ],
            log_path: format!("{name}.log"),
            mounts: vec![
                cri::Mount {
                    container_path: "/busybox".into(),
                    host_path: "/bin/busybox".into(),
                    readonly: true,
                    ..Default::default()
                },
                cri::Mount {
                    container_path: "/vol".into(),
                    image: Some(cri::ImageSpec {
                        image: id.to_string(),
                        ..Default::default()
                    }),
                    readonly: true,
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        r.create_container(cri::CreateContainerRequest {
            pod_sandbox_id: sandbox.0.clone(),
            config: Some(config),
            sandbox_config: Some(sandbox.1.clone()),
        })
        .await
        .map(|r| r.into_inner().container_id)
    })
}

#[test]
fn containerd_1_6_with_the_shipped_snippet() {
    matrix(Release::V1_6);
}

#[test]
fn containerd_1_7_with_the_shipped_snippet() {
    matrix(Release::V1_7);
}

#[test]
fn containerd_2_1_with_the_shipped_snippet() {
    matrix(Release::V2_1);
}

#[test]
fn containerd_2_3_with_the_shipped_snippet() {
    matrix(Release::V2_3);
}

#[test]
fn containerd_2_4_with_the_shipped_snippet() {
    matrix(Release::V2_4);
}

/// The unified diff `vmdisk containerd-config --dry-run` prints for `config`.
fn diff_of(path: &Path, original: &str, merged: &str) -> String {
    let path = path.display().to_string();
    similar::TextDiff::from_lines(original, merged)
        .unified_diff()
        .header(&path, &path)
        .to_string()
}

/// The DaemonSet's install step on a node's containerd of `release`: `vmdisk containerd-config
/// --only-handlers --write`, as packaging/kubernetes/vmdisk.yaml runs it. On 1.6 it refuses
/// and changes nothing; on 1.7 and 2.x the node's CRI settings survive (before and after,
/// from containerd's own CRI status), the VM handlers get vmdisk, and a pod of such a handler
/// that carries the handler annotation pulls a containerDisk lazily.
fn daemonset_setup(release: Release) {
    release.require();
    let manifest = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes/vmdisk.yaml"),
    )
    .unwrap();
    assert!(
        manifest.contains("vmdisk containerd-config") && manifest.contains("--only-handlers"),
        "the DaemonSet's install step is `vmdisk containerd-config --only-handlers`"
    );
    let scratch = Scratch::new();
    let (reg, disk) = crate::fixtures::images::registry_with_images(&scratch, 8);
    let daemon = Daemon::start(&scratch, "");
    let pause = format!("{}/pause:1", reg.host());
    let dir = scratch.path("ctd");
    let certs = dir.join("certs.d");
    crate::fixtures::cri::plain_http_host(&certs, &reg.host());
    let config = dir.join("config.toml");
    std::fs::write(&config, node_config(release, &dir, &pause, &certs)).unwrap();
    let mut ctd = CriContainerd::start_config(&scratch, release);
    let before = cri_config(&ctd);
    let install = |ctd: &CriContainerd| {
        vmdisk(&[
            "containerd-config",
            "--config",
            config.to_str().unwrap(),
            "--containerd",
            ctd.socket.to_str().unwrap(),
            "--only-handlers",
            "--address",
            daemon.socket.to_str().unwrap(),
            "--root",
            daemon.root.to_str().unwrap(),
            "--write",
        ])
    };
    if release == Release::V1_6 {
        let text = std::fs::read(&config).unwrap();
        let out = install(&ctd);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("containerd 1.6"),
            "{err}"
        );
        assert_eq!(
            std::fs::read(&config).unwrap(),
            text,
            "the config was changed"
        );
        return;
    }
    let original = std::fs::read_to_string(&config).unwrap();
    // What would change, learnt with no containerd to ask: from the binary on PATH, and (2.x)
    // from the file's `version`; the same as asking the running containerd.
    let dry_run = |path: &str| {
        let out = crate::fixtures::harness::vmdisk_env(
            &[
                "containerd-config",
                "--config",
                config.to_str().unwrap(),
                "--containerd",
                "/nonexistent.sock",
                "--only-handlers",
                "--address",
                daemon.socket.to_str().unwrap(),
                "--root",
                daemon.root.to_str().unwrap(),
                "--dry-run",
            ],
            &[("PATH", path)],
        );
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let path = format!(
        "{}:/usr/sbin:/usr/bin:/sbin:/bin",
        release.bin_dir().display()
    );
    let (ok, from_binary, err) = dry_run(&path);
    assert!(ok && from_binary.starts_with("--- "), "{release:?}: {err}");
    let (ok, from_config, err) = dry_run("/nonexistent");
    match release {
        r if r.v3() => assert!(ok && from_config == from_binary, "{err}"),
        _ => assert!(!ok && err.contains("--release"), "{release:?}: {err}"),
    }

    let out = install(&ctd);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "{release:?} install step: {}",
        String::from_utf8_lossy(&out.stdout).trim()
    );
    // Written as a person would: every line of the file kept as it was (quoting included), in
    // order; the added tables and keys indented like their neighbours; the proxy plugin after
    // the plugins.
    let merged = std::fs::read_to_string(&config).unwrap();
    let diff = similar::TextDiff::from_lines(&original, &merged);
    // (1.x: the snapshot annotations turned on, which CRI's labels need.)
    let removed: Vec<&str> = diff
        .iter_all_changes()
        .filter(|c| {
            c.tag() == similar::ChangeTag::Delete
                && !c
                    .value()
                    .trim_start()
                    .starts_with("disable_snapshot_annotations = ")
        })
        .map(|c| c.value())
        .collect();
    assert!(
        removed.is_empty(),
        "{release:?} changed {removed:?}:\n{merged}"
    );
    let layout = |table: &str| -> (usize, usize) {
        let lines: Vec<&str> = merged.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.trim_end().ends_with(&format!(".runtimes.{table}]")))
            .unwrap_or_else(|| panic!("{release:?}: no {table} table:\n{merged}"));
        let indent = |l: &str| l.len() - l.trim_start().len();
        (indent(lines[at]), indent(lines[at + 1]))
    };
    assert_eq!(layout("kubevirt"), layout("runc"), "{release:?}:\n{merged}");
    let last_plugin = merged.rfind("[plugins.").unwrap();
    assert!(
        merged.find("[proxy_plugins.").unwrap() > last_plugin,
        "{release:?}:\n{merged}"
    );
    assert_eq!(
        diff_of(&config, &original, &merged),
        from_binary,
        "{release:?}: the dry run and the write differ"
    );
    ctd.restart();
    no_deprecation_from_vmdisk(&ctd, "after the install step");
    // containerd loaded it; writing again changes nothing.
    let out = install(&ctd);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("already"),
        "{release:?}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(std::fs::read_to_string(&config).unwrap(), merged);
    let after = cri_config(&ctd);
    eprintln!("{release:?} CRI config before: {before}\n{release:?} CRI config after: {after}");
    // What the node set survives.
    for pointer in [
        "/containerd/runtimes/runc/options/SystemdCgroup",
        "/sandboxImage",
        "/registry/configPath",
    ] {
        if before.pointer(pointer).is_some() {
            assert_eq!(
                before.pointer(pointer),
                after.pointer(pointer),
                "{release:?}: {pointer}"
            );
        }
    }
    let runtimes = after
        .pointer("/containerd/runtimes")
        .unwrap_or_else(|| panic!("{release:?}: no runtimes in {after}"));
    assert_eq!(
        runtimes["runc"]["options"]["SystemdCgroup"], true,
        "{runtimes}"
    );
    assert_eq!(runtimes["kubevirt"]["snapshotter"], "vmdisk", "{runtimes}");
    assert_eq!(
        after
            .pointer("/containerd/snapshotter")
            .and_then(|s| s.as_str())
            .unwrap_or("overlayfs"),
        "overlayfs"
    );

    // A virt-launcher pod as kubelet runs one whose runtimeClassName is the DaemonSet's
    // `kubevirt` RuntimeClass (KubeVirt's defaultRuntimeClass), with the annotation: its sandbox
    // on the kubevirt handler, then its image pulled with the pod's config (a lazy pull); its
    // containers' snapshotter is the one the pull used, and the containerDisk reads whole and
    // right.
    let image = format!("{}/disk:1", reg.host());
    let logs = scratch.path("pod-logs");
    let sandbox = ctd
        .try_run_sandbox(
            "virt-launcher",
            &logs,
            "kubevirt",
            &[("io.containerd.cri.runtime-handler", "kubevirt")],
        )
        .unwrap_or_else(|e| panic!("{release:?} RunPodSandbox: {e}\n{}", ctd.log_text()));
    ctd.pull_for(&image, &sandbox.1);
    assert_eq!(
        daemon.decisions().get("remote"),
        Some(&1),
        "{release:?}: {:?}\n{}",
        daemon.decisions(),
        ctd.log_text()
    );
    let want = crate::fixtures::harness::sha256_file(&disk);
    reads_the_disk(&ctd, &sandbox, &logs, "compute", &image, &want);
}

#[test]
fn the_daemonset_install_step_keeps_the_nodes_cri_config_on_1_6() {
    daemonset_setup(Release::V1_6);
}

#[test]
fn the_daemonset_install_step_keeps_the_nodes_cri_config_on_1_7() {
    daemonset_setup(Release::V1_7);
}

#[test]
fn the_daemonset_install_step_keeps_the_nodes_cri_config_on_2_1() {
    daemonset_setup(Release::V2_1);
}

#[test]
fn the_daemonset_install_step_keeps_the_nodes_cri_config_on_2_3() {
    daemonset_setup(Release::V2_3);
}

#[test]
fn the_daemonset_install_step_keeps_the_nodes_cri_config_on_2_4() {
    daemonset_setup(Release::V2_4);
}

/// A node where vmdisk starts before containerd has ever run (a fresh install's unit order, a
/// DaemonSet before containerd's first start): containerd's root does not exist yet when the
/// daemon starts, and the image filesystem link appears once containerd has made it, so
/// kubelet's image filesystem stats find vmdisk's root (containerd first: the matrix tests;
/// 1.7 reports the root vmdisk's proxy plugin exports).
#[test]
fn the_image_filesystem_link_appears_when_containerd_starts_after_vmdisk() {
    for release in [Release::V1_7, Release::V2_1, Release::V2_3, Release::V2_4] {
        release.require();
        let scratch = Scratch::new();
        let mut daemon = Daemon::start(&scratch, "");
        daemon.stop();
        let root = scratch.path("ctd/root");
        std::fs::remove_dir_all(&root).unwrap();
        daemon.restart();
        assert!(!root.exists());
        let ctd = CriContainerd::start_release(&scratch, release, &daemon, "pause:1", &[]);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mountpoint = loop {
            let vmdisk = image_filesystems(&ctd).into_iter().find_map(|f| {
                let id = f.fs_id?;
                vmdisks_image_filesystem(&id.mountpoint, &daemon).then_some(id.mountpoint)
            });
            let vmdisk =
                vmdisk.unwrap_or_else(|| panic!("{release:?}: no image filesystem for vmdisk"));
            if Path::new(&vmdisk).exists() {
                break vmdisk;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{release:?}: {vmdisk} did not appear: {}",
                daemon.log_text()
            );
            std::thread::sleep(Duration::from_millis(200));
        };
        assert_eq!(
            std::fs::metadata(&mountpoint).unwrap().dev(),
            std::fs::metadata(&daemon.root).unwrap().dev(),
            "{release:?}"
        );
    }
}

/// The install steps on the nodes users have, beyond a node its installer set up (the matrix
/// tests): for every release, a node with no configuration file and a node whose file was
/// written for the release before it (an upgrade keeps it: 1.6's version 2 for 1.7, 1.7's
/// version 2 for 2.1, 2.1's version 3 for 2.3, 2.3's version 4 for 2.4). Each is set up by the
/// package's step, then pulls a containerDisk lazily through CRI, and on 2.x also by `ctr
/// pull` and as an image volume; and by the DaemonSet's step, then a pod of the kubevirt
/// handler (with the handler annotation) pulls it lazily. containerd loads each file with
/// vmdisk's proxy plugin `ok` and warns of nothing vmdisk wrote. One registry for all; a
/// daemon and a containerd of their own for each node.
#[test]
fn every_install_step_on_nodes_with_no_file_or_the_previous_releases_file() {
    let shared = Scratch::new();
    let (reg, _disk) = crate::fixtures::images::registry_with_images(&shared, 16);
    let proxy = FaultProxy::counting(reg.port);
    let volume = VolumeImage::push(&shared, &proxy);
    let pause = format!("{}/pause:1", reg.host());
    let image = format!("127.0.0.1:{}/disk:1", proxy.port);
    for release in Release::ALL {
        release.require();
        for file in [NodeFile::Missing, NodeFile::Upgraded] {
            if file == NodeFile::Upgraded && release.previous().is_none() {
                continue;
            }
            for step in [InstallStep::Package, InstallStep::DaemonSet] {
                if step == InstallStep::DaemonSet && release == Release::V1_6 {
                    continue; // refused on 1.6: the_daemonset_install_step_…_on_1_6
                }
                let what = format!("{release:?} {file:?} {step:?}");
                let scratch = Scratch::new();
                let daemon = Daemon::start(&scratch, "");
                let (ctd, install) = CriContainerd::start_node(
                    &scratch,
                    release,
                    file,
                    step,
                    &daemon,
                    &pause,
                    &[reg.port, proxy.port],
                    true,
                );
                installed_as_written(&ctd, &install, file, step);
                let before = proxy.bytes_to_client();
                match step {
                    InstallStep::Package => {
                        ctd.pull(&image).unwrap_or_else(|e| {
                            panic!("{what}: PullImage: {e}\n{}", ctd.log_text())
                        });
                    }
                    InstallStep::DaemonSet => {
                        let logs = scratch.path("pod-logs");
                        let config = CriContainerd::sandbox_config(
                            "default",
                            "virt-launcher",
                            &logs,
                            &[("io.containerd.cri.runtime-handler", "kubevirt")],
                        );
                        ctd.pull_for(&image, &config);
                    }
                }
                let pulled = proxy.bytes_to_client() - before;
                assert_eq!(
                    daemon.decisions().get("remote"),
                    Some(&1),
                    "{what}: {:?}\n{}",
                    daemon.decisions(),
                    ctd.log_text()
                );
                assert!(pulled < 1 << 20, "{what}: the pull moved {pulled} bytes");
                if step == InstallStep::Package && release.v3() {
                    let logs = scratch.path("pod-logs");
                    let sandbox = ctd.run_sandbox("vm", &logs);
                    volume.pulled_by_ctr_and_read_as_a_volume(
                        &ctd, &daemon, &proxy, &sandbox, &logs, &pause, 2,
                    );
                }
                eprintln!("{what}: lazy, {pulled} registry bytes for the pull");
            }
        }
    }
}
