//! Registry credentials from kubelet: the daemon serves the CRI image service (kubelet's
//! `--image-service-endpoint`), forwards every call to containerd 1.6's CRI, and keeps the
//! `auth` of each PullImage in memory for the lazy fetches of that image. The node has no
//! docker config file; the registry requires a password. The credentials expire (here after
//! 15 s): then the fetches fail, until the next PullImage hands the running server new ones.

use std::path::Path;
use std::time::Duration;

use k8s_cri::v1 as cri;
use k8s_cri::v1::image_service_client::ImageServiceClient;

use crate::cri::{rt, CriContainerd, Daemon};
use crate::harness::*;

/// A password no file or log may contain.
const PASSWORD: &str = "kubelet-only-7f3a9c";
/// Seconds the daemon keeps a pull's credentials: long enough for the pull and a first read
/// on a busy machine.
const TTL: u64 = 15;

/// kubelet's PullImage of `image` with the pod's pull secret, sent to vmdisk's image service;
/// then a ListImages through it. The pulled image's id and the images listed.
fn pull_with_secret(socket: &Path, image: &str) -> (String, cri::ListImagesResponse) {
    rt().block_on(async {
        let channel = vmdisk::api::unix::channel(socket).await.unwrap();
        let mut images = ImageServiceClient::new(channel);
        let pulled = images
            .pull_image(cri::PullImageRequest {
                image: Some(cri::ImageSpec {
                    image: image.to_string(),
                    ..Default::default()
                }),
                auth: Some(cri::AuthConfig {
                    username: "kubelet".into(),
                    password: PASSWORD.into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("PullImage: {e}"))
            .into_inner();
        // Other calls go through unchanged.
        let listed = images
            .list_images(cri::ListImagesRequest::default())
            .await
            .unwrap()
            .into_inner();
        (pulled.image_ref, listed)
    })
}

/// Reads `count` MiB of `path` from MiB `skip`; whether that worked.
fn read_mib(path: &Path, skip: u64, count: u64) -> bool {
    std::process::Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args(["of=/dev/null", "bs=1M", "iflag=direct"])
        .arg(format!("skip={skip}"))
        .arg(format!("count={count}"))
        .output()
        .unwrap()
        .status
        .success()
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

#[test]
fn kubelet_credentials_reach_the_lazy_fetches_and_no_file() {
    let scratch = Scratch::new();
    let reg = Registry::start_htpasswd(&scratch, "kubelet", PASSWORD);
    let qcow2 = scratch.path("private.qcow2");
    make_qcow2(&qcow2, "64M", &[]);
    write_random(&qcow2, 1 << 20, 24 << 20, 3);
    let image = format!("{}/vm/private:1", reg.host());
    let push_auth = scratch.path("push-auth.json");
    {
        use base64::Engine as _;
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("kubelet:{PASSWORD}"));
        std::fs::write(
            &push_auth,
            format!(r#"{{"auths":{{"{}":{{"auth":"{auth}"}}}}}}"#, reg.host()),
        )
        .unwrap();
    }
    vmdisk_ok(&[
        "--auth-file",
        push_auth.to_str().unwrap(),
        "push",
        qcow2.to_str().unwrap(),
        &image,
    ]);
    std::fs::remove_file(&push_auth).unwrap();

    let cri_socket = scratch.path("vmdisk/cri-image.sock");
    let containerd_socket = scratch.path("ctd/containerd.sock");
    let daemon = Daemon::start(
        &scratch,
        &format!(
            "[cri]\nimage_service_address = \"{}\"\ncontainerd_address = \"{}\"\ncredentials_ttl = {TTL}\n",
            cri_socket.display(),
            containerd_socket.display()
        ),
    );
    // The daemon alone cannot read the image: the node has no credentials for it.
    let out = daemon.vmdisk(&["path", &image]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("401") || text.contains("credentials"),
        "{text}"
    );

    let ctd = CriContainerd::start(&scratch, &daemon.socket, &image, &[reg.port]);
    let pulled_at = std::time::Instant::now();
    let (image_ref, listed) = pull_with_secret(&cri_socket, &image);
    assert!(
        listed.images.iter().any(|i| i.id == image_ref),
        "{listed:?}"
    );
    assert_eq!(
        daemon.decisions().get("remote"),
        Some(&1),
        "a remote snapshot: {:?}\n{}\n{}",
        daemon.decisions(),
        daemon.log_text(),
        ctd.log_text()
    );
    // The lazy fetches of its disk use the pull's credentials.
    let path = daemon.vmdisk_ok(&["path", &image]);
    let path = Path::new(path.trim());
    assert!(
        read_mib(path, 0, 1),
        "reading the disk with the pull's credentials"
    );
    // Once they expire, what is not cached cannot be fetched...
    std::thread::sleep(Duration::from_secs(TTL + 1).saturating_sub(pulled_at.elapsed()));
    assert!(
        !read_mib(path, 20, 1),
        "a fetch after the credentials expired succeeded"
    );
    // ...until the next pull hands the running server new ones.
    pull_with_secret(&cri_socket, &image);
    assert_eq!(sha256_file(path), sha256_file(&qcow2));

    // The password is in no file under the daemon's directory (configuration, state, cache,
    // the daemon's and the servers' logs), and in containerd's log no more than before.
    for e in std::fs::read_dir(scratch.path("vmdisk/state/servers")).unwrap() {
        eprintln!("{}", std::fs::read_to_string(e.unwrap().path()).unwrap());
    }
    let found = files_containing(&scratch.path("vmdisk"), PASSWORD.as_bytes());
    assert!(found.is_empty(), "the password is in {found:?}");
}
