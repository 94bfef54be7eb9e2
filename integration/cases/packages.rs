//! What a node installs: the Debian package (installed with dpkg on this Debian 12, its
//! service started with the default configuration as systemd would, then purged), and the
//! Kubernetes manifests with the node image they name (built by packaging/image.sh, pushed to
//! a registry, its files checked against every path the manifests use, its binary run).
//!
//! The package test installs into the machine itself (CI machines are fresh); it refuses to
//! run where vmdisk is installed or running already rather than touch that installation.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::fixtures::harness::*;
use crate::fixtures::node::{bin_dir, packaging, repo, yaml_documents};

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

/// The Debian package: lintian accepts it (no error or warning); installed with dpkg on this
/// Debian 12, it brings binaries, manual pages and a unit that makes nothing depend on it;
/// its service (started as the unit starts it) tells systemd when it is ready; a real
/// containerd set up with `vmdisk containerd-config` keeps the node's CRI settings and pulls
/// through it; purging the package leaves that containerd running.
#[test]
fn the_deb_passes_lintian_installs_serves_containerd_and_leaves_it_running() {
    use crate::fixtures::cri::{CriContainerd, Release};
    require("dpkg-deb");
    require("lintian");
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
    let lintian = Command::new("lintian")
        .args(["--fail-on", "error,warning", &deb])
        .output()
        .unwrap();
    let tags = String::from_utf8_lossy(&lintian.stdout);
    eprintln!("lintian: {tags}");
    assert!(lintian.status.success(), "lintian: {tags}");

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
        "/usr/share/vmdisk/nginx-regional-cache.conf",
        "/usr/share/vmdisk/vmdisk-monitoring.yaml",
        "/usr/share/vmdisk/monitoring/vmdisk-alerts.yaml",
        "/usr/share/vmdisk/monitoring/vmdisk-dashboard.json",
        "/usr/share/man/man1/vmdisk.1.gz",
        "/usr/share/man/man1/vmdisk-containerd-config.1.gz",
        "/usr/share/man/man8/vmdisk-snapshotter.8.gz",
        "/usr/share/man/man8/containerd-shim-vmdisk-v2.8.gz",
        "/usr/share/doc/vmdisk/changelog.gz",
        "/usr/share/doc/vmdisk/copyright",
    ] {
        assert!(Path::new(file).exists(), "{file} is not installed");
    }
    let version = String::from_utf8(run("/usr/bin/vmdisk-snapshotter", &["--version"])).unwrap();
    assert_eq!(
        version.trim(),
        format!("vmdisk-snapshotter {}", env!("CARGO_PKG_VERSION"))
    );

    // The unit: containerd never depends on it (removing, upgrading or misconfiguring vmdisk
    // leaves containerd alone), it starts first, it is ready when its sockets are.
    let unit_path = "/lib/systemd/system/vmdisk-snapshotter.service";
    let unit = std::fs::read_to_string(unit_path).unwrap();
    for forbidden in [
        "RequiredBy",
        "Requires=",
        "BindsTo",
        "PartOf",
        "RequisiteOf",
    ] {
        assert!(!unit.contains(forbidden), "the unit has {forbidden}");
    }
    for wanted in [
        "Type=notify",
        "WantedBy=multi-user.target",
        "Before=containerd.service",
        "OOMScoreAdjust=-999",
        "KillMode=process",
    ] {
        assert!(unit.contains(wanted), "the unit lacks {wanted}");
    }
    let verify = Command::new("systemd-analyze")
        .args(["verify", unit_path])
        .output()
        .unwrap();
    let complaints = String::from_utf8_lossy(&verify.stderr);
    assert!(
        !complaints.contains("vmdisk-snapshotter.service"),
        "systemd-analyze verify: {complaints}"
    );

    // The service as the unit starts it (its ExecStart), with a notification socket as
    // systemd gives a Type=notify service. Where systemd runs, postinst has started it.
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart");
    let systemd = Path::new("/run/systemd/system").exists();
    let notify = scratch.path("notify.sock");
    let notifications = std::os::unix::net::UnixDatagram::bind(&notify).unwrap();
    notifications
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut daemon = None;
    if !systemd {
        std::fs::create_dir_all("/run/vmdisk").unwrap();
        let mut words = exec.split_whitespace();
        daemon = Some(
            Command::new(words.next().unwrap())
                .args(words)
                .env("NOTIFY_SOCKET", &notify)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(scratch.path("service.log")).unwrap())
                .spawn()
                .unwrap(),
        );
        let mut message = [0u8; 256];
        let n = notifications.recv(&mut message).unwrap_or_else(|e| {
            panic!(
                "no readiness notification ({e}): {}",
                std::fs::read_to_string(scratch.path("service.log")).unwrap_or_default()
            )
        });
        let message = String::from_utf8_lossy(&message[..n]);
        assert!(message.contains("READY=1"), "{message}");
        // Ready means its sockets are there.
        assert!(Path::new("/run/vmdisk/snapshotter.sock").exists());
    }
    let stats = || {
        let out = Command::new("/usr/bin/vmdisk")
            .args([
                "stats",
                "--manage",
                "/run/vmdisk/manage.sock",
                "--timeout",
                "10",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "the service did not answer: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(scratch.path("service.log")).unwrap_or_default()
        );
        String::from_utf8(out.stdout).unwrap()
    };
    assert!(stats().contains(env!("CARGO_PKG_VERSION")));

    // A node's containerd (1.6, Debian's), set up with the installed command: the node's CRI
    // settings survive, and its pulls go through the packaged daemon.
    let reg = Registry::start(&scratch);
    let pause = format!("{}/pause:1", reg.host());
    let image = scratch.path("pause");
    crate::fixtures::cri::busybox_layout(&image, &["/bin/sleep", "2147483647"]);
    skopeo_push(&image, &pause, &[]);
    let dir = scratch.path("ctd");
    let certs = dir.join("certs.d");
    crate::fixtures::cri::plain_http_host(&certs, &reg.host());
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        crate::fixtures::node::node_config(Release::V1_6, &dir, &pause, &certs),
    )
    .unwrap();
    let mut ctd = CriContainerd::start_config(&scratch, Release::V1_6);
    let before = crate::fixtures::node::cri_config(&ctd);
    let out = Command::new("/usr/bin/vmdisk")
        .args([
            "containerd-config",
            "--config",
            config.to_str().unwrap(),
            "--containerd",
        ])
        .arg(&ctd.socket)
        .arg("--write")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ctd.restart();
    let after = crate::fixtures::node::cri_config(&ctd);
    for pointer in [
        "/containerd/runtimes/runc/options/SystemdCgroup",
        "/sandboxImage",
        "/registry/configPath",
    ] {
        assert_eq!(before.pointer(pointer), after.pointer(pointer), "{pointer}");
    }
    assert_eq!(after["containerd"]["snapshotter"], "vmdisk", "{after}");
    ctd.pull(&format!("127.0.0.1:{}/pause:1", reg.port))
        .unwrap_or_else(|e| {
            panic!(
                "PullImage through the packaged daemon: {e}\n{}",
                ctd.log_text()
            )
        });
    assert!(
        stats().contains("ordinary:not_disk_image"),
        "the pull did not go through vmdisk"
    );

    if let Some(mut d) = daemon {
        let _ = Command::new("kill")
            .args(["-TERM", &d.id().to_string()])
            .status();
        assert!(d.wait().unwrap().success());
    }
    run("dpkg", &["--purge", "vmdisk"]);
    assert!(!Path::new("/usr/bin/vmdisk-snapshotter").exists());
    assert!(!Path::new("/etc/vmdisk/snapshotter.toml").exists());
    // containerd keeps running and answering; what it runs is unaffected.
    rt_version(&ctd);
}

/// containerd's CRI answers `Version`.
fn rt_version(ctd: &crate::fixtures::cri::CriContainerd) {
    crate::fixtures::cri::rt().block_on(async {
        ctd.runtime()
            .await
            .expect("containerd's socket")
            .version(k8s_cri::v1::VersionRequest::default())
            .await
            .expect("containerd answers after vmdisk was purged");
    });
}

/// Whether `path` is `dir` or under it.
fn under(path: &Path, dir: &str) -> bool {
    path.starts_with(dir)
}

/// The PrometheusRule and the dashboard's ConfigMap beside the DaemonSet are what
/// packaging/monitoring/kubernetes.py writes from the rules file and the dashboard (one source
/// each): the same alerts and panels as the package's.
#[test]
fn the_kubernetes_monitoring_manifest_holds_the_shipped_rules_and_dashboard() {
    let committed = repo().join("packaging/kubernetes/vmdisk-monitoring.yaml");
    let written = run(
        "python3",
        &[repo()
            .join("packaging/monitoring/kubernetes.py")
            .to_str()
            .unwrap()],
    );
    assert!(
        std::fs::read(&committed).unwrap() == written,
        "{} is not what packaging/monitoring/kubernetes.py writes: run it again",
        committed.display()
    );
    let docs = yaml_documents(&committed);
    let rules = yaml_documents(&repo().join("packaging/monitoring/vmdisk-alerts.yaml"));
    assert_eq!(docs[0]["kind"], "PrometheusRule");
    assert_eq!(docs[0]["spec"], rules[0]);
    assert_eq!(docs[1]["kind"], "ConfigMap");
    assert_eq!(docs[1]["metadata"]["labels"]["grafana_dashboard"], "1");
    let dashboard: serde_json::Value =
        serde_json::from_str(docs[1]["data"]["vmdisk.json"].as_str().unwrap()).unwrap();
    let shipped: serde_json::Value = serde_json::from_slice(
        &std::fs::read(repo().join("packaging/monitoring/vmdisk-dashboard.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(dashboard, shipped);
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
            "RuntimeClass",
            "DaemonSet"
        ]
    );
    // The RuntimeClasses: KubeVirt's (the handlers snippets' kubevirt runtime), then those of
    // config/runtimeclass.yaml (the handlers containerd knows).
    assert_eq!(docs[2]["handler"], "kubevirt");
    for snippet in [
        "containerd-1.7-handlers.toml",
        "containerd-2.x-handlers.toml",
    ] {
        let text = std::fs::read_to_string(repo().join("config").join(snippet)).unwrap();
        assert!(text.contains(".containerd.runtimes.kubevirt]"), "{snippet}");
    }
    let classes = yaml_documents(&repo().join("config/runtimeclass.yaml"));
    for (a, b) in docs[3..5].iter().zip(&classes) {
        assert_eq!(a["handler"], b["handler"]);
    }
    // The ConfigMap's configuration is one the daemon accepts.
    let config_text = docs[1]["data"]["snapshotter.toml"].as_str().unwrap();
    let config_file = scratch.path("snapshotter.toml");
    std::fs::write(&config_file, config_text).unwrap();
    let config = vmdisk::snapshotter::config::Config::load(Some(&config_file)).unwrap();

    let pod = &docs[5]["spec"]["template"]["spec"];
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
        // vmm_group by name, and the registries' CAs: the host's.
        Path::new("/etc/group"),
        Path::new("/etc/ssl/certs"),
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
    // Its mount servers outlive it (an update, a crash): they leave its cgroup, in the node's
    // PID namespace, and it updates rolling.
    assert_eq!(pod["hostPID"], true);
    assert!(!config.server_cgroup.is_empty(), "no server_cgroup");
    assert_eq!(docs[5]["spec"]["updateStrategy"]["type"], "RollingUpdate");
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
    // HTTPS registries with a public CA work without the host's trust store too: the image
    // carries TLS roots.
    let roots = std::fs::read_to_string(rootfs.join("etc/ssl/certs/ca-certificates.crt")).unwrap();
    assert!(
        roots.matches("BEGIN CERTIFICATE").count() > 50,
        "the image's TLS roots"
    );
}
