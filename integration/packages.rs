//! What a node installs: the Debian package (installed with dpkg on this Debian 12, its
//! service started with the default configuration as systemd would, then purged), and the
//! Kubernetes manifests with the node image they name (built by packaging/image.sh, pushed to
//! a registry, its files checked against every path the manifests use, its binary run).
//!
//! The package test installs into the machine itself (CI machines are fresh); it refuses to
//! run where vmdisk is installed or running already rather than touch that installation.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::*;

/// The directory of the binaries under test (target/debug or target/release).
fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_vmdisk-snapshotter"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `packaging/<script>` with `args` (it must succeed); the last line it printed.
fn packaging(script: &str, args: &[&str]) -> String {
    let out = run(
        repo().join("packaging").join(script).to_str().unwrap(),
        args,
    );
    String::from_utf8(out).unwrap().trim().to_string()
}

fn dpkg_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

/// Removes the package (and its state) however the test ends.
struct Installed;

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = Command::new("dpkg")
            .args(["--purge", "vmdisk"])
            .stdout(Stdio::null())
            .status();
        for sock in ["snapshotter.sock", "manage.sock"] {
            let _ = std::fs::remove_file(Path::new("/run/vmdisk").join(sock));
        }
    }
}

#[test]
fn the_deb_installs_and_its_service_starts_with_the_default_config() {
    require("dpkg-deb");
    assert!(
        !dpkg_installed("vmdisk") && !Path::new("/run/vmdisk/snapshotter.sock").exists(),
        "vmdisk is installed or running on this machine; this test installs and purges the package, so run it where it is not"
    );
    let scratch = Scratch::new();
    let deb = packaging(
        "deb.sh",
        &[
            bin_dir().to_str().unwrap(),
            scratch.path("deb").to_str().unwrap(),
        ],
    );
    let fields = String::from_utf8(run("dpkg-deb", &["-f", &deb, "Package", "Version"])).unwrap();
    assert!(
        fields.contains("Package: vmdisk")
            && fields.contains(&format!("Version: {}", env!("CARGO_PKG_VERSION"))),
        "{fields}"
    );

    let _installed = Installed;
    run("dpkg", &["-i", &deb]);
    for file in [
        "/usr/bin/vmdisk",
        "/usr/bin/vmdisk-snapshotter",
        "/usr/bin/containerd-shim-vmdisk-v2",
        "/usr/bin/containerd-shim-vmdisk-peerpods-v2",
        "/etc/vmdisk/snapshotter.toml",
        "/etc/vmdisk/shim.toml",
        "/lib/systemd/system/vmdisk-snapshotter.service",
        "/usr/share/vmdisk/vmdisk.yaml",
    ] {
        assert!(Path::new(file).exists(), "{file} is not installed");
    }
    let version = String::from_utf8(run("/usr/bin/vmdisk-snapshotter", &["--version"])).unwrap();
    assert_eq!(
        version.trim(),
        format!("vmdisk-snapshotter {}", env!("CARGO_PKG_VERSION"))
    );

    // The service as the unit starts it: its ExecStart, in the runtime directory systemd
    // would make. Where systemd runs, postinst has started it already.
    let unit = std::fs::read_to_string("/lib/systemd/system/vmdisk-snapshotter.service").unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart");
    let systemd = Path::new("/run/systemd/system").exists();
    let mut daemon = None;
    if !systemd {
        std::fs::create_dir_all("/run/vmdisk").unwrap();
        let mut words = exec.split_whitespace();
        daemon = Some(
            Command::new(words.next().unwrap())
                .args(words)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(scratch.path("service.log")).unwrap())
                .spawn()
                .unwrap(),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let stats = loop {
        let out = Command::new("/usr/bin/vmdisk")
            .args(["stats", "--manage", "/run/vmdisk/manage.sock"])
            .output()
            .unwrap();
        if out.status.success() {
            break String::from_utf8(out.stdout).unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "the service did not answer: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(scratch.path("service.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(stats.contains(env!("CARGO_PKG_VERSION")), "{stats}");
    assert!(Path::new("/run/vmdisk/snapshotter.sock").exists());
    if let Some(mut d) = daemon {
        let _ = Command::new("kill")
            .args(["-TERM", &d.id().to_string()])
            .status();
        assert!(d.wait().unwrap().success());
    }
    run("dpkg", &["--purge", "vmdisk"]);
    assert!(!Path::new("/usr/bin/vmdisk-snapshotter").exists());
    assert!(!Path::new("/etc/vmdisk/snapshotter.toml").exists());
}

/// The YAML documents of `file`, as JSON values.
fn yaml_documents(file: &Path) -> Vec<serde_json::Value> {
    let out = run(
        "python3",
        &[
            "-c",
            "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))",
            file.to_str().unwrap(),
        ],
    );
    serde_json::from_slice(&out).unwrap()
}

/// Whether `path` is `dir` or under it.
fn under(path: &Path, dir: &str) -> bool {
    path.starts_with(dir)
}

#[test]
fn the_manifests_name_the_node_image_and_the_paths_it_has() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let docs = yaml_documents(&repo().join("packaging/kubernetes/vmdisk.yaml"));
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "Namespace",
            "ConfigMap",
            "RuntimeClass",
            "RuntimeClass",
            "DaemonSet"
        ]
    );
    // The RuntimeClasses are those of config/runtimeclass.yaml (the handlers containerd knows).
    let classes = yaml_documents(&repo().join("config/runtimeclass.yaml"));
    for (a, b) in docs[2..4].iter().zip(&classes) {
        assert_eq!(a["handler"], b["handler"]);
    }
    // The ConfigMap's configuration is one the daemon accepts.
    let config_text = docs[1]["data"]["snapshotter.toml"].as_str().unwrap();
    let config_file = scratch.path("snapshotter.toml");
    std::fs::write(&config_file, config_text).unwrap();
    let config = vmdisk::snapshotter::config::Config::load(Some(&config_file)).unwrap();

    let pod = &docs[4]["spec"]["template"]["spec"];
    let containers: Vec<&serde_json::Value> = pod["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .chain(pod["containers"].as_array().unwrap())
        .collect();
    let image = containers[0]["image"].as_str().unwrap();
    assert!(containers.iter().all(|c| c["image"] == image));
    // What the daemon uses lives on host paths it shares with containerd, propagated both ways
    // (its FUSE mounts under its root and the ready-disk directory).
    let snapshotter = containers
        .iter()
        .find(|c| c["name"] == "snapshotter")
        .unwrap();
    let mounts = snapshotter["volumeMounts"].as_array().unwrap();
    let bidirectional: Vec<&str> = mounts
        .iter()
        .filter(|m| m["mountPropagation"] == "Bidirectional")
        .map(|m| m["mountPath"].as_str().unwrap())
        .collect();
    for path in [&config.root, &config.ready_dir] {
        assert!(
            bidirectional.iter().any(|d| under(path, d)),
            "{} is not under a Bidirectional mount ({bidirectional:?})",
            path.display()
        );
    }
    let mounted: Vec<&str> = mounts
        .iter()
        .map(|m| m["mountPath"].as_str().unwrap())
        .collect();
    for path in [
        &config.address,
        &config.manage_address,
        &config.cri.containerd_address,
        &config.registry.hosts_dir,
        Path::new("/dev/fuse"),
    ]
    .into_iter()
    .chain(config.registry.auth_files.iter().map(PathBuf::as_path))
    {
        assert!(
            mounted.iter().any(|d| under(path, d)),
            "{} is not on a host path ({mounted:?})",
            path.display()
        );
    }
    assert_eq!(snapshotter["securityContext"]["privileged"], true);
    // It never makes the node depend on it: kubelet's image service stays containerd's (a
    // pod kubelet must pull to restart cannot serve kubelet's pulls), host networking reaches
    // mirrors on the node's loopback, no service-account token, probes through the daemon's
    // own API.
    assert!(
        config.cri.image_service_address.as_os_str().is_empty(),
        "the DaemonSet serves kubelet's image service"
    );
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["automountServiceAccountToken"], false);
    for probe in ["readinessProbe", "livenessProbe"] {
        let command = snapshotter[probe]["exec"]["command"].as_array().unwrap();
        assert!(
            command.iter().any(|c| c == "stats") && command.iter().any(|c| c == "--timeout"),
            "{probe}: {command:?}"
        );
    }
    let volumes = pod["volumes"].as_array().unwrap();
    for m in mounts {
        assert!(
            volumes.iter().any(|v| v["name"] == m["name"]),
            "volume {} is not defined",
            m["name"]
        );
    }

    // The image, as `make image` builds it, pushed where the manifest's name points.
    let pushed = format!("{}/{image}", reg.host());
    packaging(
        "image.sh",
        &[bin_dir().to_str().unwrap(), &format!("docker://{pushed}")],
    );
    let layout = scratch.path("image");
    run(
        "skopeo",
        &[
            "copy",
            "--quiet",
            "--src-tls-verify=false",
            &format!("docker://{pushed}"),
            &format!("oci:{}:x", layout.display()),
        ],
    );
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let blob = |digest: &str| {
        layout
            .join("blobs/sha256")
            .join(digest.trim_start_matches("sha256:"))
    };
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(blob(index["manifests"][0]["digest"].as_str().unwrap())).unwrap(),
    )
    .unwrap();
    let rootfs = scratch.path("rootfs");
    std::fs::create_dir_all(&rootfs).unwrap();
    for layer in manifest["layers"].as_array().unwrap() {
        run(
            "tar",
            &[
                "-xzf",
                blob(layer["digest"].as_str().unwrap()).to_str().unwrap(),
                "-C",
                rootfs.to_str().unwrap(),
            ],
        );
    }
    // Every program and file the containers' commands and probes name is in the image (or on
    // a host path it mounts).
    for c in &containers {
        let mounted: Vec<&str> = c["volumeMounts"]
            .as_array()
            .map(|m| m.iter().map(|v| v["mountPath"].as_str().unwrap()).collect())
            .unwrap_or_default();
        let command: Vec<&str> = ["command"]
            .iter()
            .map(|k| &c[k])
            .chain(
                ["readinessProbe", "livenessProbe"]
                    .iter()
                    .map(|p| &c[p]["exec"]["command"]),
            )
            .filter_map(|v| v.as_array())
            .flatten()
            .map(|v| v.as_str().unwrap())
            .collect();
        let script = command.join(" ");
        for word in script.split(|ch: char| ch.is_whitespace() || ch == ';') {
            if word.starts_with('/') && !mounted.iter().any(|m| Path::new(word).starts_with(m)) {
                assert!(
                    rootfs.join(word.trim_start_matches('/')).exists(),
                    "{word} (container {}) is not in the image",
                    c["name"]
                );
            }
        }
    }
    // Its binaries run there, with the libraries it carries.
    let out = Command::new("chroot")
        .arg(&rootfs)
        .args(["/usr/bin/vmdisk-snapshotter", "--version"])
        .output()
        .unwrap();
    assert!(
        out.status.success()
            && String::from_utf8_lossy(&out.stdout).contains(env!("CARGO_PKG_VERSION")),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
