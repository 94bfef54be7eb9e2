//! Tenants of one node: Kubernetes namespaces whose pods pull private VM disks through
//! kubelet's credentials. The daemon serves the CRI image service (kubelet's
//! `--image-service-endpoint`) in front of containerd 1.6's CRI; the node has no credentials
//! of its own; the registry takes Bearer tokens (short-lived here) from a token server that
//! knows alice (namespace A's secret) and bob (namespace B's). A namespace gets a disk only
//! through its own pull that succeeded; a failed pull changes nothing for anyone; what the
//! node keeps is root's (and the VMM group's, for ready disks), never another user's.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use k8s_cri::v1 as cri;
use k8s_cri::v1::image_service_client::ImageServiceClient;

use crate::fixtures::cri::{container_output, rt, CriContainerd, Daemon};
use crate::fixtures::harness::*;

/// Passwords no file or log may contain.
const ALICE: &str = "alice-7f3a9c-secret";
const BOB: &str = "bob-51e0d2-secret";
/// Seconds a registry token lives: the lazy fetches must authorize again after it.
const TOKEN_LIFETIME: u64 = 12;

/// kubelet's PullImage of `image` for a pod of `namespace` with `user`'s secret (none:
/// anonymous), sent to vmdisk's image service.
fn pull(
    socket: &Path,
    image: &str,
    namespace: &str,
    auth: Option<(&str, &str)>,
) -> Result<String, tonic::Status> {
    rt().block_on(async {
        let channel = vmdisk::api::unix::channel(socket).await.unwrap();
        ImageServiceClient::new(channel)
            .pull_image(cri::PullImageRequest {
                image: Some(cri::ImageSpec {
                    image: image.to_string(),
                    ..Default::default()
                }),
                auth: auth.map(|(user, password)| cri::AuthConfig {
                    username: user.into(),
                    password: password.into(),
                    ..Default::default()
                }),
                sandbox_config: Some(cri::PodSandboxConfig {
                    metadata: Some(cri::PodSandboxMetadata {
                        name: "vm".into(),
                        uid: format!("uid-{namespace}"),
                        namespace: namespace.into(),
                        attempt: 0,
                    }),
                    ..Default::default()
                }),
            })
            .await
            .map(|r| r.into_inner().image_ref)
    })
}

/// Every regular file under `dir` that contains `needle`, not descending into other
/// filesystems (the FUSE mounts serve the disk itself).
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let device = std::fs::metadata(dir).unwrap().dev();
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            if meta.dev() != device {
                continue;
            }
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file()
                && std::fs::read(&path).is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle))
            {
                found.push(path.display().to_string());
            }
        }
    }
    found
}

/// Runs `args` as `user` (`setpriv`, with that user's groups); whether it succeeded.
fn as_user(user: &str, args: &[&str]) -> bool {
    Command::new("setpriv")
        .args([
            &format!("--reuid={user}"),
            &format!("--regid={user}"),
            "--init-groups",
            "--",
        ])
        .args(args)
        .output()
        .unwrap()
        .status
        .success()
}

#[test]
fn a_namespace_reads_only_the_disks_it_was_allowed_to_pull() {
    require("setpriv");
    let scratch = Scratch::new();
    let tokens = crate::fixtures::token::TokenServer::start_for(
        &scratch,
        &[("alice", ALICE), ("bob", BOB)],
        TOKEN_LIFETIME,
    );
    let private = tokens.registry(&scratch);
    // Pods' own images (pause, busybox) come from a public registry.
    let public = Registry::start(&scratch);
    let pause = scratch.path("pause");
    crate::fixtures::cri::busybox_layout(&pause, &["/bin/sleep", "2147483647"]);
    skopeo_push(&pause, &format!("{}/pause:1", public.host()), &[]);

    // Two private disks in one repository, pushed with alice's credentials.
    let (one, two) = (scratch.path("one.qcow2"), scratch.path("two.qcow2"));
    for (disk, seed) in [(&one, 3), (&two, 4)] {
        make_qcow2(disk, "64M", &[]);
        write_random(disk, 1 << 20, 24 << 20, seed);
    }
    let counted = FaultProxy::counting(private.port);
    let host = counted.host();
    let (image1, image2) = (
        format!("{host}/vm/private:1"),
        format!("{host}/vm/private:2"),
    );
    let push_auth = scratch.path("push-auth.json");
    {
        use base64::Engine as _;
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("alice:{ALICE}"));
        std::fs::write(
            &push_auth,
            format!(r#"{{"auths":{{"{host}":{{"auth":"{auth}"}}}}}}"#),
        )
        .unwrap();
    }
    for (disk, image) in [(&one, &image1), (&two, &image2)] {
        vmdisk_ok(&[
            "push",
            "--auth-file",
            push_auth.to_str().unwrap(),
            disk.to_str().unwrap(),
            image,
        ]);
    }
    std::fs::remove_file(&push_auth).unwrap();

    let cri_socket = scratch.path("vmdisk/cri-image.sock");
    let daemon = Daemon::start(
        &scratch,
        &format!(
            "[cri]\nimage_service_address = \"{}\"\ncontainerd_address = \"{}\"\ncredentials_ttl = 600\n",
            cri_socket.display(),
            scratch.path("ctd/containerd.sock").display()
        ),
    );
    let ctd = CriContainerd::start(
        &scratch,
        &daemon.socket,
        &format!("{}/pause:1", public.host()),
        &[public.port, counted.port],
    );
    let path_as = |namespace: Option<&str>, image: &str| {
        let mut args = vec!["path"];
        if let Some(ns) = namespace {
            args.extend(["--namespace", ns]);
        }
        args.push(image);
        daemon.vmdisk(&args)
    };
    let refused = |out: std::process::Output, why: &str| {
        let text = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(
            !out.status.success(),
            "{why}: served {}",
            String::from_utf8_lossy(&out.stdout)
        );
        text
    };

    // Namespace A pulls its disk with alice's secret: a remote snapshot, a few KB from the
    // registry.
    let disk_len = std::fs::metadata(&one).unwrap().len();
    let before = counted.bytes_to_client();
    pull(&cri_socket, &image1, "tenant-a", Some(("alice", ALICE)))
        .unwrap_or_else(|e| panic!("A's PullImage: {e}\n{}", daemon.log_text()));
    let moved = counted.bytes_to_client() - before;
    assert_eq!(
        daemon.decisions().get("remote"),
        Some(&1),
        "{:?}\n{}",
        daemon.decisions(),
        daemon.log_text()
    );
    assert!(moved < disk_len / 10, "A's lazy pull moved {moved} bytes");
    // A's pod gets its disk (what the shim asks for it) and reads the head.
    let ready = String::from_utf8(path_as(Some("tenant-a"), &image1).stdout).unwrap();
    let ready = Path::new(ready.trim()).to_path_buf();
    assert!(ready.exists(), "A's disk: {ready:?}\n{}", daemon.log_text());
    run(
        "dd",
        &[
            &format!("if={}", ready.display()),
            "of=/dev/null",
            "bs=1M",
            "count=1",
            "iflag=direct",
        ],
    );

    // Namespace B, without a secret: refused by EnsureDisk (by tag, by digest, and for the
    // never-pulled tag), and its CRI pull fails as it would without vmdisk.
    let digest = manifest_digest(&ready);
    let by_digest = format!("{host}/vm/private@{digest}");
    let before = counted.bytes_to_client();
    for image in [&image1, &by_digest, &image2] {
        let text = refused(path_as(Some("tenant-b"), image), "B without a pull");
        assert!(text.contains("namespace tenant-b may not read"), "{text}");
    }
    let e = pull(&cri_socket, &image1, "tenant-b", None).unwrap_err();
    assert!(
        e.message().contains("401") || e.message().to_lowercase().contains("unauthorized"),
        "{e}"
    );
    // The node's operator uses the node's credentials (none), never a tenant's.
    let text = refused(
        path_as(None, &image2),
        "the operator without node credentials",
    );
    assert!(text.contains("401"), "{text}");
    // Refusals fetch nothing of the disks: a few manifest checks and token exchanges at most.
    let moved = counted.bytes_to_client() - before;
    assert!(moved < 64 << 10, "B's refused attempts moved {moved} bytes");

    // B pulls with a wrong password: containerd refuses it, and nothing changes for A. After
    // A's token expired, A's mount authorizes again with alice's credentials and reads its
    // whole disk, as KubeVirt's qemu (uid 107) does, through the container.
    assert!(pull(
        &cri_socket,
        &image1,
        "tenant-b",
        Some(("bob", "not-bobs-password"))
    )
    .is_err());
    assert!(pull(&cri_socket, &image1, "tenant-b", Some(("mallory", "guess"))).is_err());
    std::thread::sleep(Duration::from_secs(TOKEN_LIFETIME + 1));
    let logs = scratch.path("pod-logs");
    let sandbox = ctd
        .try_run_sandbox_in("tenant-a", "vm", &logs, "", &[])
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", ctd.log_text()));
    let id = ctd.start_container_as(
        &sandbox,
        "compute",
        &image1,
        &["/busybox", "sha256sum", "/disk/one.qcow2"],
        Some(107),
    );
    assert_eq!(
        ctd.wait_exit(&id, Duration::from_secs(300)),
        0,
        "{:?}\n{}",
        container_output(&logs.join("compute.log")),
        daemon.servers_log_text()
    );
    let out = container_output(&logs.join("compute.log"));
    let want = sha256_file(&one);
    assert!(
        out.first()
            .is_some_and(|l| want.ends_with(l.split_whitespace().next().unwrap_or("-"))),
        "uid 107 read {out:?}, want {want}"
    );
    // A's ready disk still serves A (its grant, not B's attempts).
    assert!(path_as(Some("tenant-a"), &image1).status.success());
    // B is still refused.
    refused(path_as(Some("tenant-b"), &image1), "B after a failed pull");

    // B with its own valid secret: its pull succeeds, and then B gets the disk.
    pull(&cri_socket, &image1, "tenant-b", Some(("bob", BOB)))
        .unwrap_or_else(|e| panic!("B's PullImage: {e}"));
    let b_ready = String::from_utf8(path_as(Some("tenant-b"), &image1).stdout).unwrap();
    assert_eq!(sha256_file(Path::new(b_ready.trim())), want);

    // Node state: another user on the node reads none of it; the VMM's group reads the ready
    // disk. (libvirt's qemu runs as libvirt-qemu in group kvm.)
    let state = &daemon.root;
    let ready_root = &daemon.ready;
    let mut private_paths = vec![
        state.to_path_buf(),
        state.join("metadata.db"),
        state.join("cache"),
        state.join("snapshots"),
        state.join("control"),
        state.join("fds"),
        state.join("servers"),
        ready_root.join("volumes"),
        ready.clone(),
        ready.parent().unwrap().join("disk.raw"),
        ready.parent().unwrap().join("metadata.json"),
    ];
    for dir in ["servers", "control", "fds", "cache"] {
        private_paths.extend(
            std::fs::read_dir(state.join(dir))
                .unwrap()
                .flatten()
                .map(|e| e.path()),
        );
    }
    for path in &private_paths {
        let p = path.to_str().unwrap();
        assert!(path.exists(), "{p} should exist");
        assert!(
            !as_user("nobody", &["cat", p]) && !as_user("nobody", &["ls", p]),
            "nobody reads {p}"
        );
    }
    let raw = ready.parent().unwrap().join("disk.raw");
    assert!(
        as_user(
            "libvirt-qemu",
            &[
                "dd",
                &format!("if={}", raw.display()),
                "of=/dev/null",
                "bs=1M",
                "count=4"
            ]
        ),
        "the VMM's group cannot read {}",
        raw.display()
    );

    // The passwords are in no file under the daemon's directory (configuration, state, cache,
    // the daemon's and the servers' logs).
    for secret in [ALICE, BOB] {
        let found = files_containing(&scratch.path("vmdisk"), secret.as_bytes());
        assert!(found.is_empty(), "a password is in {found:?}");
    }
}

/// The manifest digest of the ready disk at `ready` (from its metadata.json).
fn manifest_digest(ready: &Path) -> String {
    let meta: serde_json::Value = serde_json::from_slice(
        &std::fs::read(ready.parent().unwrap().join("metadata.json")).unwrap(),
    )
    .unwrap();
    let reference = meta["reference"].as_str().unwrap();
    reference.rsplit_once('@').unwrap().1.to_string()
}
