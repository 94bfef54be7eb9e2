//! Real parts for the snapshotter tests: the `vmdisk-snapshotter` daemon in a scratch root,
//! containerd 1.6 with the CRI plugin using it as its snapshotter (host networking, a local
//! sandbox image), a CRI client the way kubelet drives containerd, and small images built from
//! the host's busybox.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_cri::v1 as cri;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use tonic::transport::Channel;
use vmdisk::api::containerd::services::snapshots::v1 as pb;
use vmdisk::api::containerd::services::snapshots::v1::snapshots_client::SnapshotsClient;
use vmdisk::api::vmdisk::v1 as mpb;
use vmdisk::api::vmdisk::v1::manage_client::ManageClient;

use crate::harness::{require, sha256, Scratch};

/// A running `vmdisk-snapshotter`. Dropping it kills the daemon and its mount servers and
/// detaches their mounts.
pub struct Daemon {
    child: Option<Child>,
    pub root: PathBuf,
    pub socket: PathBuf,
    pub manage: PathBuf,
    pub config: PathBuf,
    pub log: PathBuf,
    /// Its ready-disk directory (outside its root, as /run/vmdisk/disks is).
    pub ready: PathBuf,
    /// Its containerd `hosts.toml` directory (`<registry>/hosts.toml`; empty at first).
    pub hosts: PathBuf,
    /// Environment variables it runs with besides the test's.
    env: Vec<(String, String)>,
}

impl Daemon {
    /// Writes a configuration under `scratch` (with `extra` TOML appended) and starts.
    pub fn start(scratch: &Scratch, extra: &str) -> Self {
        Self::start_in(scratch, "vmdisk", extra)
    }

    /// [`Daemon::start`] with its files under `scratch/<name>`: one of several daemons.
    pub fn start_in(scratch: &Scratch, name: &str, extra: &str) -> Self {
        Self::start_in_env(scratch, name, extra, &[])
    }

    /// [`Daemon::start`] with top-level settings `top` too.
    pub fn start_top(scratch: &Scratch, top: &str, extra: &str) -> Self {
        Self::configured(scratch, "vmdisk", top, extra, &[])
    }

    /// [`Daemon::start_in`] with environment variables `env` set.
    pub fn start_in_env(scratch: &Scratch, name: &str, extra: &str, env: &[(&str, &str)]) -> Self {
        Self::configured(scratch, name, "", extra, env)
    }

    /// A daemon under `scratch/<name>` whose configuration has `top` among its top-level
    /// settings and `extra` after its `[registry]` table, run with `env` set.
    fn configured(
        scratch: &Scratch,
        name: &str,
        top: &str,
        extra: &str,
        env: &[(&str, &str)],
    ) -> Self {
        let root = scratch.path(name);
        std::fs::create_dir_all(&root).unwrap();
        // The root of the containerd of this scratch directory ([`CriContainerd`]), made now so
        // the daemon links its image filesystem there as on a node.
        let containerd_root = scratch.path("ctd/root");
        std::fs::create_dir_all(&containerd_root).unwrap();
        let config = root.join("config.toml");
        let socket = root.join("snapshotter.sock");
        let manage = root.join("manage.sock");
        std::fs::write(
            &config,
            format!(
                "{top}root = \"{r}/state\"\nready_dir = \"{r}/run/disks\"\naddress = \"{s}\"\nmanage_address = \"{m}\"\nlog_level = \"info,vmdisk=debug\"\n[containerd]\nroot = \"{c}\"\n[registry]\nhosts_dir = \"{r}/hosts\"\nfetch_timeout = 5\nmount_timeout = 30\n{extra}",
                c = containerd_root.display(),
                r = root.display(),
                s = socket.display(),
                m = manage.display()
            ),
        )
        .unwrap();
        let mut d = Daemon {
            child: None,
            root: root.join("state"),
            socket,
            manage,
            config,
            log: root.join("daemon.log"),
            ready: root.join("run/disks"),
            hosts: root.join("hosts"),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        d.restart();
        d
    }

    /// Starts the daemon (again) and waits for its socket to answer.
    pub fn restart(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let _ = std::fs::remove_file(&self.socket);
        let child = Command::new(env!("CARGO_BIN_EXE_vmdisk-snapshotter"))
            .arg("--config")
            .arg(&self.config)
            .env("HOME", "/nonexistent")
            .env_remove("DOCKER_CONFIG")
            .env_remove("REGISTRY_AUTH_FILE")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start vmdisk-snapshotter");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::os::unix::net::UnixStream::connect(&self.socket).is_err() {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "vmdisk-snapshotter exited with {status}: {}",
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "vmdisk-snapshotter did not start: {}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `vmdisk ARGS --manage <this daemon's socket>`.
    pub fn vmdisk(&self, args: &[&str]) -> std::process::Output {
        let manage = self.manage.display().to_string();
        let mut all = args.to_vec();
        all.extend(["--manage", &manage]);
        crate::harness::vmdisk(&all)
    }

    /// [`Daemon::vmdisk`] that must succeed; its stdout.
    pub fn vmdisk_ok(&self, args: &[&str]) -> String {
        let out = self.vmdisk(args);
        assert!(
            out.status.success(),
            "vmdisk {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Kills the daemon with SIGKILL (a crash), leaving its mount servers.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops the daemon with SIGTERM and waits for it.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("daemon running");
        run_quiet("kill", &["-TERM", &c.id().to_string()]);
        c.wait().unwrap()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The logs of its mount servers, one after the other.
    pub fn servers_log_text(&self) -> String {
        let Ok(entries) = std::fs::read_dir(self.root.join("servers")) else {
            return String::new();
        };
        entries
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
            .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
            .collect()
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the daemon runs").id()
    }

    /// Pids of the mount servers, asked through their control sockets.
    pub fn server_pids(&self) -> Vec<u32> {
        let mut out = Vec::new();
        if let Ok(sockets) = std::fs::read_dir(self.root.join("control")) {
            for s in sockets.flatten() {
                let status =
                    rt().block_on(vmdisk::snapshotter::servers::control::status(&s.path()));
                out.extend(status.ok().map(|s| s.pid));
            }
        }
        out
    }

    pub async fn snapshots(&self) -> SnapshotsClient<Channel> {
        SnapshotsClient::new(vmdisk::api::unix::channel(&self.socket).await.unwrap())
    }

    pub async fn manage(&self) -> ManageClient<Channel> {
        ManageClient::new(vmdisk::api::unix::channel(&self.manage).await.unwrap())
    }

    /// Management `ListDisks`.
    pub fn disks(&self) -> Vec<mpb::Disk> {
        rt().block_on(async {
            self.manage()
                .await
                .list_disks(mpb::ListDisksRequest {})
                .await
                .unwrap()
                .into_inner()
                .disks
        })
    }

    /// Management `Status` decisions.
    pub fn decisions(&self) -> std::collections::HashMap<String, u64> {
        rt().block_on(async {
            self.manage()
                .await
                .status(mpb::StatusRequest {})
                .await
                .unwrap()
                .into_inner()
                .decisions
        })
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
        for pid in self.server_pids() {
            run_quiet("kill", &["-KILL", &pid.to_string()]);
        }
        unmount_under(&self.root);
        unmount_under(&self.ready);
    }
}

/// Detaches every mount below `dir` (deepest first).
pub fn unmount_under(dir: &Path) {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let prefix = dir.display().to_string();
    let mut points: Vec<&str> = mounts
        .lines()
        .filter_map(|l| l.split(' ').nth(1))
        .filter(|p| p.starts_with(&prefix))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        run_quiet("umount", &["-l", p]);
    }
}

pub fn run_quiet(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// A current-thread runtime for one blocking call from a synchronous test.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Performs containerd mounts at `target` the way containerd does (relative lower dirs when
/// the option string would pass the kernel's page limit).
pub fn mount_all(mounts: &[vmdisk::api::containerd::types::Mount], target: &Path, base: &Path) {
    for m in mounts {
        let mut opts = m.options.join(",");
        let mut cwd = PathBuf::from("/");
        if opts.len() > 3000 {
            let prefix = format!("{}/", base.display());
            opts = opts.replace(&prefix, "");
            cwd = base.to_path_buf();
        }
        let out = if m.r#type == "bind" {
            let ro = m.options.iter().any(|o| o == "ro");
            Command::new("mount")
                .args(["--rbind", &m.source, target.to_str().unwrap()])
                .output()
                .and_then(|o| {
                    if o.status.success() && ro {
                        Command::new("mount")
                            .args(["-o", "remount,bind,ro", target.to_str().unwrap()])
                            .output()
                    } else {
                        Ok(o)
                    }
                })
                .unwrap()
        } else {
            Command::new("mount")
                .current_dir(&cwd)
                .args([
                    "-t",
                    &m.r#type,
                    &m.source,
                    "-o",
                    &opts,
                    target.to_str().unwrap(),
                ])
                .output()
                .unwrap()
        };
        assert!(
            out.status.success(),
            "mount {m:?} at {}: {}",
            target.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

pub fn labels(pairs: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A Prepare request.
pub fn prepare_req(key: &str, parent: &str, l: &[(&str, &str)]) -> pb::PrepareSnapshotRequest {
    pb::PrepareSnapshotRequest {
        snapshotter: "vmdisk".into(),
        key: key.into(),
        parent: parent.into(),
        labels: labels(l),
    }
}

/// A containerd release the tests run: Debian 12's 1.6 (installed); 1.7 and 2.1 from newer
/// Debian releases, which `make deps` unpacks into `target/deps` (integration/debs.sh); 2.3 (the
/// long-term-support line) and 2.4, which `make deps` builds there from the Go module proxy
/// (integration/containerd-go.sh).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    V1_6,
    V1_7,
    V2_1,
    V2_3,
    V2_4,
}

impl Release {
    /// Every release, oldest first.
    pub const ALL: [Release; 5] = [
        Release::V1_6,
        Release::V1_7,
        Release::V2_1,
        Release::V2_3,
        Release::V2_4,
    ];

    /// The directory of its `containerd`, `ctr` and shims (1.6: the system's).
    pub fn bin_dir(self) -> PathBuf {
        let deps = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/deps");
        match self {
            Release::V1_6 => PathBuf::from("/usr/bin"),
            Release::V1_7 => deps.join("containerd-1.7/usr/bin"),
            Release::V2_1 => deps.join("containerd-2.1/usr/bin"),
            Release::V2_3 => deps.join("containerd-2.3/usr/bin"),
            Release::V2_4 => deps.join("containerd-2.4/usr/bin"),
        }
    }

    /// The containerd configuration snippet vmdisk ships for it.
    pub fn snippet(self) -> PathBuf {
        let name = match self {
            Release::V1_6 => "containerd-1.6.toml",
            Release::V1_7 => "containerd-1.7.toml",
            Release::V2_1 | Release::V2_3 | Release::V2_4 => "containerd-2.x.toml",
        };
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("config")
            .join(name)
    }

    /// Fails the test naming the install step when its binaries are missing.
    pub fn require(self) {
        let containerd = self.bin_dir().join("containerd");
        assert!(
            containerd.is_file(),
            "{} is missing: `make deps` unpacks containerd 1.7 and 2.1 and builds 2.3 and 2.4 into \
             target/deps",
            containerd.display()
        );
    }

    /// Its version as its `containerd --version` prints it (`2.3.7`).
    pub fn version(self) -> String {
        self.require();
        let out = Command::new(self.bin_dir().join("containerd"))
            .arg("--version")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace()
            .nth(2)
            .unwrap_or_else(|| panic!("{self:?}: containerd --version printed {text:?}"))
            .to_string()
    }

    /// Whether its configuration is version 3 (containerd 2.x's plugin names).
    pub fn v3(self) -> bool {
        matches!(self, Release::V2_1 | Release::V2_3 | Release::V2_4)
    }
}

/// How a node's containerd configuration file came to be before vmdisk was installed on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeFile {
    /// What `containerd config default` of the node's release prints, with kubeadm's
    /// documented change (`SystemdCgroup = true`): a node set up as its installer sets it up.
    OwnDefault,
    /// The same of the release before it ([`Release::previous`]), kept across an upgrade.
    Upgraded,
    /// No file: containerd's built-in defaults.
    Missing,
}

/// vmdisk's install steps, as docs/install.md gives them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InstallStep {
    /// The Debian package's: `vmdisk containerd-config --write` (vmdisk for every image).
    Package,
    /// The DaemonSet's init container: the same with `--only-handlers`.
    DaemonSet,
}

/// What vmdisk's install step did to a node's configuration file.
pub struct NodeInstall {
    /// The file before (empty: there was none).
    pub original: String,
    /// The file as vmdisk wrote it.
    pub written: String,
    /// What `vmdisk containerd-config` said.
    pub said: String,
}

impl Release {
    /// The release before it in the matrix, whose configuration a node upgraded to this one
    /// keeps.
    pub fn previous(self) -> Option<Release> {
        let at = Self::ALL.iter().position(|r| *r == self)?;
        at.checked_sub(1).map(|i| Self::ALL[i])
    }

    /// What `containerd config default` of this release prints, with kubeadm's documented
    /// change for the systemd cgroup driver (`SystemdCgroup = false` made `true`).
    pub fn default_config(self) -> String {
        self.require();
        let out = Command::new(self.bin_dir().join("containerd"))
            .args(["config", "default"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{self:?} containerd config default: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            text.contains("SystemdCgroup = false"),
            "{self:?}: no SystemdCgroup in its default configuration:\n{text}"
        );
        text.replace("SystemdCgroup = false", "SystemdCgroup = true")
    }
}

/// The settings this machine needs in a containerd configuration of `version` for a test's
/// containerd: its own root, state and sockets under `dir`, the sandbox image,
/// `restrict_oom_score_adj`, plain HTTP to loopback registries through the `hosts.toml`
/// directory `certs`, image stats every second, NRI off (two containerds would share its
/// socket); with `cgroupfs`, runc's cgroupfs driver (this machine runs no systemd).
pub(crate) fn machine_settings(
    release: Release,
    version: i64,
    dir: &Path,
    certs: &Path,
    sandbox_image: &str,
    cgroupfs: bool,
) -> String {
    let (d, c) = (dir.display(), certs.display());
    let socket = dir.join("containerd.sock");
    let s = socket.display();
    let paths = format!("root = \"{d}/root\"\nstate = \"{d}/state\"\n");
    let servers = if version >= 4 {
        format!(
            "[plugins.\"io.containerd.server.v1.grpc\"]\n  address = \"{s}\"\n[plugins.\"io.containerd.server.v1.ttrpc\"]\n  address = \"{s}.ttrpc\"\n"
        )
    } else {
        format!("[grpc]\n  address = \"{s}\"\n")
    };
    let cri = if version >= 3 {
        format!(
            r#"[plugins."io.containerd.cri.v1.images"]
  stats_collect_period = 1
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{sandbox_image}"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "{c}"
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
"#
        )
    } else {
        format!(
            r#"[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  disable_cgroup = true
  stats_collect_period = 1
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{c}"
"#
        )
    };
    let runc = match (cgroupfs, version >= 3) {
        (false, _) => String::new(),
        (true, true) => "[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.runc.options]\n  SystemdCgroup = false\n".into(),
        (true, false) => "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n  SystemdCgroup = false\n".into(),
    };
    let others = match release {
        Release::V1_6 => String::new(),
        _ => format!(
            "[plugins.\"io.containerd.transfer.v1.local\"]\n  config_path = \"{c}\"\n[plugins.\"io.containerd.nri.v1.nri\"]\n  disable = true\n"
        ),
    };
    format!("{paths}{servers}{cri}{runc}{others}")
}

/// A test containerd's directory (`<scratch>/ctd`) and its `hosts.toml` directory, which names
/// the loopback registries at `mirror_ports` over plain HTTP; fails the test if `release`'s
/// binaries or runc are missing.
fn node_dirs(scratch: &Scratch, release: Release, mirror_ports: &[u16]) -> (PathBuf, PathBuf) {
    release.require();
    require("runc");
    let dir = scratch.path("ctd");
    let certs = dir.join("certs.d");
    for p in mirror_ports {
        plain_http_host(&certs, &format!("127.0.0.1:{p}"));
    }
    (dir, certs)
}

/// Writes `certs/<host>/hosts.toml` so containerd speaks plain HTTP to the registry `host`.
pub fn plain_http_host(certs: &Path, host: &str) {
    hosts_entry(certs, host, "http");
}

/// Writes `certs/<host>/hosts.toml` so clients speak HTTPS to the registry `host` (a loopback
/// registry is spoken to over plain HTTP unless its hosts.toml says otherwise).
pub fn https_host(certs: &Path, host: &str) {
    hosts_entry(certs, host, "https");
}

/// `certs/<host>/hosts.toml` naming `scheme://host` as the server and its one pull endpoint.
fn hosts_entry(certs: &Path, host: &str, scheme: &str) {
    std::fs::create_dir_all(certs.join(host)).unwrap();
    std::fs::write(
        certs.join(host).join("hosts.toml"),
        format!("server = \"{scheme}://{host}\"\n[host.\"{scheme}://{host}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"),
    )
    .unwrap();
}

/// containerd with the CRI plugin using vmdisk as its snapshotter.
pub struct CriContainerd {
    child: Child,
    pub release: Release,
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub log: PathBuf,
    config: PathBuf,
    /// The process whose mount and PID namespaces containerd runs in (a node of its own,
    /// entered with nsenter), if not this machine's.
    node: Option<u32>,
}

impl CriContainerd {
    /// containerd 1.6; `mirror_ports`: loopback registries reachable over plain HTTP.
    pub fn start(
        scratch: &Scratch,
        snapshotter: &Path,
        sandbox_image: &str,
        mirror_ports: &[u16],
    ) -> Self {
        Self::start_with(scratch, snapshotter, sandbox_image, mirror_ports, "", &[])
    }

    /// [`CriContainerd::start`] with more TOML (e.g. runtime handlers) and environment.
    pub fn start_with(
        scratch: &Scratch,
        snapshotter: &Path,
        sandbox_image: &str,
        mirror_ports: &[u16],
        extra: &str,
        env: &[(&str, String)],
    ) -> Self {
        require("containerd");
        require("runc");
        let dir = scratch.path("ctd");
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("containerd.sock");
        let mut mirrors = String::new();
        for p in mirror_ports {
            mirrors.push_str(&format!(
                "[plugins.\"io.containerd.grpc.v1.cri\".registry.mirrors.\"127.0.0.1:{p}\"]\n  endpoint = [\"http://127.0.0.1:{p}\"]\n"
            ));
        }
        let config = format!(
            r#"version = 2
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{s}"
[proxy_plugins.vmdisk]
  type = "snapshot"
  address = "{snap}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  disable_cgroup = true
[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "vmdisk"
  disable_snapshot_annotations = false
{mirrors}{extra}"#,
            d = dir.display(),
            s = socket.display(),
            snap = snapshotter.display(),
        );
        std::fs::write(dir.join("config.toml"), config).unwrap();
        Self::launch(Release::V1_6, dir, socket, env)
    }

    /// containerd `release` configured with the snippet vmdisk ships for it, unchanged but for
    /// `daemon`'s socket and root, merged into what this machine needs (its own root, state and
    /// socket; the sandbox image; `restrict_oom_score_adj`; plain HTTP to the loopback
    /// registries through a `hosts.toml` directory; stats every second).
    pub fn start_release(
        scratch: &Scratch,
        release: Release,
        daemon: &Daemon,
        sandbox_image: &str,
        mirror_ports: &[u16],
    ) -> Self {
        let (dir, certs) = node_dirs(scratch, release, mirror_ports);
        let socket = dir.join("containerd.sock");
        let value = |p: &Path| toml_edit::Value::from(p.to_str().unwrap()).to_string();
        let mut config: toml_edit::DocumentMut = std::fs::read_to_string(release.snippet())
            .unwrap()
            .replace("\"/run/vmdisk/snapshotter.sock\"", &value(&daemon.socket))
            .replace("\"/var/lib/vmdisk-snapshotter\"", &value(&daemon.root))
            .parse()
            .unwrap();
        let version = config
            .get("version")
            .and_then(|v| v.as_integer())
            .unwrap_or(1);
        let machine = machine_settings(release, version, &dir, &certs, sandbox_image, false);
        // The product's merge (`vmdisk containerd-config`'s), the machine's settings over the
        // snippet's.
        vmdisk::setup::toml_merge::merge_into(&mut config, &machine.parse().unwrap());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.toml"), config.to_string()).unwrap();
        Self::launch(release, dir, socket, &[])
    }

    /// A node's containerd `release`: its configuration file as `file` leaves it, vmdisk's
    /// install `step` run on it (`vmdisk containerd-config --write`, learning the release from
    /// the installed binary, as on a node whose containerd is not running yet), then this
    /// machine's settings merged in ([`machine_settings`]; `cgroupfs` for pods of runc's
    /// default handler). `mirror_ports`: loopback registries reached over plain HTTP.
    #[allow(clippy::too_many_arguments)]
    pub fn start_node(
        scratch: &Scratch,
        release: Release,
        file: NodeFile,
        step: InstallStep,
        daemon: &Daemon,
        sandbox_image: &str,
        mirror_ports: &[u16],
        cgroupfs: bool,
    ) -> (Self, NodeInstall) {
        let (dir, certs) = node_dirs(scratch, release, mirror_ports);
        let config = dir.join("config.toml");
        let original = match file {
            NodeFile::OwnDefault => release.default_config(),
            NodeFile::Upgraded => release
                .previous()
                .unwrap_or_else(|| panic!("{release:?} has no release before it here"))
                .default_config(),
            NodeFile::Missing => String::new(),
        };
        if !original.is_empty() {
            std::fs::write(&config, &original).unwrap();
        }
        let mut args = vec![
            "containerd-config",
            "--config",
            config.to_str().unwrap(),
            "--containerd",
            "/nonexistent/containerd.sock",
            "--address",
            daemon.socket.to_str().unwrap(),
            "--root",
            daemon.root.to_str().unwrap(),
            "--write",
        ];
        if step == InstallStep::DaemonSet {
            args.push("--only-handlers");
        }
        let path = format!(
            "{}:/usr/sbin:/usr/bin:/sbin:/bin",
            release.bin_dir().display()
        );
        let out = crate::harness::vmdisk_env(&args, &[("PATH", &path)]);
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{release:?} {file:?} {step:?}: vmdisk containerd-config: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let written = std::fs::read_to_string(&config).unwrap();
        let mut doc: toml_edit::DocumentMut = written.parse().unwrap();
        let version = doc.get("version").and_then(|v| v.as_integer()).unwrap_or(1);
        let machine = machine_settings(release, version, &dir, &certs, sandbox_image, cgroupfs);
        vmdisk::setup::toml_merge::merge_into(&mut doc, &machine.parse().unwrap());
        std::fs::write(&config, doc.to_string()).unwrap();
        let socket = dir.join("containerd.sock");
        let ctd = Self::launch(release, dir, socket, &[]);
        (
            ctd,
            NodeInstall {
                original,
                written,
                said,
            },
        )
    }

    /// Whether containerd loaded vmdisk's proxy plugin (`ctr plugins ls`: status ok).
    pub fn proxy_plugin_ok(&self) -> bool {
        let out = self.ctr(&["plugins", "ls"]);
        String::from_utf8_lossy(&out.stdout).lines().any(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            words.len() >= 4
                && words[0] == "io.containerd.snapshotter.v1"
                && words[1] == "vmdisk"
                && words.last() == Some(&"ok")
        })
    }

    /// containerd's log lines that warn (level=warning) of what vmdisk wrote into its
    /// configuration: anything naming vmdisk or its proxy plugin, and, where vmdisk chose the
    /// file's version (`chose_version`), a migration of it.
    pub fn warnings_of_vmdisks_part(&self, chose_version: bool) -> Vec<String> {
        // The test's own directories are named after vmdisk too.
        let scratch = self.dir.parent().unwrap_or(&self.dir).display().to_string();
        self.log_text()
            .lines()
            .filter(|l| l.contains("level=warn"))
            .filter(|l| {
                let lower = l.replace(&scratch, "").to_ascii_lowercase();
                lower.contains("vmdisk") || (chose_version && lower.contains("migrated"))
            })
            .map(str::to_string)
            .collect()
    }

    /// containerd 1.6 as installed, with its own snapshotters (overlayfs) and nothing of
    /// vmdisk: what an ordinary node pulls a published image with (`ctr`).
    pub fn start_plain(scratch: &Scratch) -> Self {
        require("containerd");
        require("ctr");
        let dir = scratch.path("ctd");
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("containerd.sock");
        std::fs::write(
            dir.join("config.toml"),
            format!(
                "version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n[grpc]\n  address = \"{s}\"\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  disable_cgroup = true\n",
                d = dir.display(),
                s = socket.display()
            ),
        )
        .unwrap();
        Self::launch(Release::V1_6, dir, socket, &[])
    }

    /// `ctr images pull` (plain HTTP), then mounts the image's rootfs at `at` (`ctr images
    /// mount`) until the answer is dropped.
    pub fn pull_and_mount(
        &self,
        reference: &str,
        platform: Option<&str>,
        at: &Path,
    ) -> Mounted<'_> {
        let platform: Vec<&str> = platform.map(|p| vec!["--platform", p]).unwrap_or_default();
        let ctr = |args: &[&str]| {
            let out = self.ctr(args);
            assert!(
                out.status.success(),
                "ctr {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        ctr(&[
            &["images", "pull", "--plain-http"],
            &platform[..],
            &[reference],
        ]
        .concat());
        std::fs::create_dir_all(at).unwrap();
        let at_s = at.to_str().unwrap();
        ctr(&[&["images", "mount"], &platform[..], &[reference, at_s]].concat());
        Mounted {
            ctd: self,
            at: at.to_path_buf(),
        }
    }

    /// containerd `release` with the configuration the test wrote at `<scratch>/ctd/config.toml`
    /// (its `grpc.address` must be `<scratch>/ctd/containerd.sock`).
    pub fn start_config(scratch: &Scratch, release: Release) -> Self {
        release.require();
        let dir = scratch.path("ctd");
        let socket = dir.join("containerd.sock");
        Self::launch(release, dir, socket, &[])
    }

    /// Starts containerd `release` with `dir/config.toml` and waits for its CRI to answer.
    fn launch(release: Release, dir: PathBuf, socket: PathBuf, env: &[(&str, String)]) -> Self {
        let config = dir.join("config.toml");
        Self::launch_in(release, dir, socket, config, None, env)
    }

    /// containerd `release` with configuration `config` (whose `grpc.address` is `socket`, as
    /// `node` sees it), in the namespaces of process `node` if given; its log in `dir`.
    pub fn launch_in(
        release: Release,
        dir: PathBuf,
        socket: PathBuf,
        config: PathBuf,
        node: Option<u32>,
        env: &[(&str, String)],
    ) -> Self {
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("containerd.log");
        let c = CriContainerd {
            child: spawn_containerd(release, &config, &log, node, env),
            release,
            dir,
            socket,
            log,
            config,
            node,
        };
        c.wait_ready();
        c
    }

    /// containerd's own process (nsenter's child when it runs in a node of its own).
    fn pid(&self) -> u32 {
        let id = self.child.id();
        match self.node {
            None => id,
            Some(_) => children(id).first().copied().unwrap_or(id),
        }
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = rt().block_on(async {
                match self.runtime().await {
                    Ok(mut r) => r.version(cri::VersionRequest::default()).await.is_ok(),
                    Err(_) => false,
                }
            });
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "containerd's CRI did not answer: {}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops containerd (SIGTERM, as systemd does) and starts it again with the same
    /// configuration; containers keep running under their shims.
    pub fn restart(&mut self) {
        run_quiet("kill", &["-TERM", &self.pid().to_string()]);
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
        self.child = spawn_containerd(self.release, &self.config, &self.log, self.node, &[]);
        self.wait_ready();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn channel(&self) -> Result<Channel, vmdisk::error::Error> {
        vmdisk::api::unix::channel(&self.socket).await
    }

    pub async fn runtime(&self) -> Result<RuntimeServiceClient<Channel>, vmdisk::error::Error> {
        Ok(RuntimeServiceClient::new(self.channel().await?))
    }

    pub async fn images(&self) -> Result<ImageServiceClient<Channel>, vmdisk::error::Error> {
        Ok(ImageServiceClient::new(self.channel().await?))
    }

    /// CRI `PullImage`; returns the image id and the time it took.
    pub fn pull(&self, image: &str) -> Result<(String, Duration), tonic::Status> {
        self.pull_with(image, None)
    }

    /// CRI `PullImage` of `image` for a pod of config `sandbox` (kubelet sends the pod's
    /// config, whose annotations may choose the snapshotter); it must succeed.
    pub fn pull_for(&self, image: &str, sandbox: &cri::PodSandboxConfig) {
        if let Err(e) = self.pull_with(image, Some(sandbox)) {
            panic!(
                "{:?} PullImage {image}: {e}\n{}",
                self.release,
                self.log_text()
            )
        }
    }

    fn pull_with(
        &self,
        image: &str,
        sandbox: Option<&cri::PodSandboxConfig>,
    ) -> Result<(String, Duration), tonic::Status> {
        rt().block_on(async {
            let t = Instant::now();
            let r = self
                .images()
                .await
                .unwrap()
                .pull_image(cri::PullImageRequest {
                    image: Some(cri::ImageSpec {
                        image: image.into(),
                        ..Default::default()
                    }),
                    sandbox_config: sandbox.cloned(),
                    ..Default::default()
                })
                .await?;
            Ok((r.into_inner().image_ref, t.elapsed()))
        })
    }

    /// CRI `RemoveImage`.
    pub fn remove_image(&self, image: &str) {
        rt().block_on(async {
            self.images()
                .await
                .unwrap()
                .remove_image(cri::RemoveImageRequest {
                    image: Some(cri::ImageSpec {
                        image: image.into(),
                        ..Default::default()
                    }),
                })
                .await
                .unwrap();
        })
    }

    /// `ctr` against this containerd.
    pub fn ctr(&self, args: &[&str]) -> std::process::Output {
        Command::new(self.release.bin_dir().join("ctr"))
            .arg("-a")
            .arg(&self.socket)
            .args(args)
            .output()
            .unwrap()
    }

    /// What this containerd warns of as deprecated: the warnings its deprecation service lists
    /// (1.7 and later: `ctr deprecations list`, "<id>: <message>") and its log's warnings that
    /// name a deprecation.
    pub fn deprecations(&self) -> Vec<String> {
        let mut found = Vec::new();
        if self.release != Release::V1_6 {
            let out = self.ctr(&["deprecations", "list", "--format", "json"]);
            assert!(
                out.status.success(),
                "{:?} ctr deprecations list: {}",
                self.release,
                String::from_utf8_lossy(&out.stderr)
            );
            let listed: serde_json::Value =
                serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
            for w in listed.as_array().into_iter().flatten() {
                found.push(format!("{}: {}", w["id"], w["message"]));
            }
        }
        found.extend(
            self.log_text()
                .lines()
                .filter(|l| l.contains("level=warn") && l.to_ascii_lowercase().contains("deprecat"))
                .map(str::to_string),
        );
        found
    }

    /// A host-network pod sandbox; returns its id and config.
    pub fn run_sandbox(&self, name: &str, logs: &Path) -> (String, cri::PodSandboxConfig) {
        self.try_run_sandbox(name, logs, "", &[])
            .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", self.log_text()))
    }

    /// The bundle `config.json` containerd wrote for a task.
    pub fn bundle_spec(&self, id: &str) -> serde_json::Value {
        let path = self
            .dir
            .join("state/io.containerd.runtime.v2.task/k8s.io")
            .join(id)
            .join("config.json");
        serde_json::from_slice(
            &std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
        .unwrap()
    }

    /// A host-network pod sandbox with a runtime handler and pod annotations.
    pub fn try_run_sandbox(
        &self,
        name: &str,
        logs: &Path,
        handler: &str,
        annotations: &[(&str, &str)],
    ) -> Result<(String, cri::PodSandboxConfig), tonic::Status> {
        self.try_run_sandbox_in("default", name, logs, handler, annotations)
    }

    /// The config of a host-network pod sandbox `name` in `namespace` with `annotations`, as
    /// kubelet sends it with RunPodSandbox and with PullImage.
    pub fn sandbox_config(
        namespace: &str,
        name: &str,
        logs: &Path,
        annotations: &[(&str, &str)],
    ) -> cri::PodSandboxConfig {
        std::fs::create_dir_all(logs).unwrap();
        cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: name.into(),
                uid: format!("uid-{namespace}-{name}"),
                namespace: namespace.into(),
                attempt: 0,
            }),
            log_directory: logs.display().to_string(),
            annotations: labels(annotations),
            linux: Some(cri::LinuxPodSandboxConfig {
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: cri::NamespaceMode::Node as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// [`CriContainerd::try_run_sandbox`] for a pod of Kubernetes namespace `namespace`.
    pub fn try_run_sandbox_in(
        &self,
        namespace: &str,
        name: &str,
        logs: &Path,
        handler: &str,
        annotations: &[(&str, &str)],
    ) -> Result<(String, cri::PodSandboxConfig), tonic::Status> {
        let config = Self::sandbox_config(namespace, name, logs, annotations);
        // containerd redials a restarted snapshotter with backoff; until then its calls fail
        // with Unavailable, and kubelet retries. So does this.
        let deadline = Instant::now() + Duration::from_secs(60);
        let id = loop {
            let r = rt().block_on(async {
                self.runtime()
                    .await
                    .unwrap()
                    .run_pod_sandbox(cri::RunPodSandboxRequest {
                        config: Some(config.clone()),
                        runtime_handler: handler.to_string(),
                    })
                    .await
            });
            match r {
                Ok(r) => break r.into_inner().pod_sandbox_id,
                Err(e) if e.code() == tonic::Code::Unavailable && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(500))
                }
                Err(e) => return Err(e),
            }
        };
        Ok((id, config))
    }

    /// Creates and starts a container with the host's busybox at /busybox; returns its id.
    pub fn start_container(
        &self,
        sandbox: &(String, cri::PodSandboxConfig),
        name: &str,
        image: &str,
        command: &[&str],
    ) -> String {
        self.start_container_as(sandbox, name, image, command, None)
    }

    /// [`CriContainerd::start_container`] running as user and group `uid` (KubeVirt's qemu is
    /// 107) when given.
    pub fn start_container_as(
        &self,
        sandbox: &(String, cri::PodSandboxConfig),
        name: &str,
        image: &str,
        command: &[&str],
        uid: Option<i64>,
    ) -> String {
        rt().block_on(async {
            let mut rtc = self.runtime().await.unwrap();
            let config = cri::ContainerConfig {
                metadata: Some(cri::ContainerMetadata {
                    name: name.into(),
                    attempt: 0,
                }),
                image: Some(cri::ImageSpec {
                    image: image.into(),
                    ..Default::default()
                }),
                command: command.iter().map(|s| s.to_string()).collect(),
                log_path: format!("{name}.log"),
                mounts: vec![cri::Mount {
                    container_path: "/busybox".into(),
                    host_path: "/bin/busybox".into(),
                    readonly: true,
                    ..Default::default()
                }],
                linux: uid.map(|uid| cri::LinuxContainerConfig {
                    security_context: Some(cri::LinuxContainerSecurityContext {
                        run_as_user: Some(cri::Int64Value { value: uid }),
                        run_as_group: Some(cri::Int64Value { value: uid }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let id = rtc
                .create_container(cri::CreateContainerRequest {
                    pod_sandbox_id: sandbox.0.clone(),
                    config: Some(config),
                    sandbox_config: Some(sandbox.1.clone()),
                })
                .await
                .unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", self.log_text()))
                .into_inner()
                .container_id;
            rtc.start_container(cri::StartContainerRequest {
                container_id: id.clone(),
            })
            .await
            .unwrap_or_else(|e| panic!("StartContainer: {e}\n{}", self.log_text()));
            id
        })
    }

    /// Pulls `image` (a busybox image), runs `echo TEXT` in `sandbox` and checks it printed it.
    pub fn assert_echo(
        &self,
        sandbox: &(String, cri::PodSandboxConfig),
        image: &str,
        name: &str,
        text: &str,
        logs: &Path,
    ) {
        self.pull(image).unwrap();
        let id = self.start_container(
            sandbox,
            name,
            image,
            &["/bin/sh", "-c", &format!("echo {text}")],
        );
        assert_eq!(self.wait_exit(&id, Duration::from_secs(60)), 0);
        assert_eq!(container_output(&logs.join(format!("{name}.log"))), [text]);
    }

    /// Waits for a container to exit; returns its exit code.
    pub fn wait_exit(&self, id: &str, timeout: Duration) -> i32 {
        let deadline = Instant::now() + timeout;
        loop {
            let status = rt().block_on(async {
                self.runtime()
                    .await
                    .unwrap()
                    .container_status(cri::ContainerStatusRequest {
                        container_id: id.into(),
                        verbose: false,
                    })
                    .await
                    .unwrap()
                    .into_inner()
                    .status
                    .unwrap()
            });
            if status.state == cri::ContainerState::ContainerExited as i32 {
                return status.exit_code;
            }
            assert!(
                Instant::now() < deadline,
                "container {id} did not exit in {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Stops and removes a sandbox with its containers.
    pub fn remove_sandbox(&self, id: &str) {
        rt().block_on(async {
            let mut r = self.runtime().await.unwrap();
            r.stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: id.into(),
            })
            .await
            .unwrap();
            r.remove_pod_sandbox(cri::RemovePodSandboxRequest {
                pod_sandbox_id: id.into(),
            })
            .await
            .unwrap();
        })
    }
}

/// An image's rootfs mounted by `ctr images mount`; unmounted when dropped.
pub struct Mounted<'a> {
    ctd: &'a CriContainerd,
    pub at: PathBuf,
}

impl Drop for Mounted<'_> {
    fn drop(&mut self) {
        let _ = self
            .ctd
            .ctr(&["images", "unmount", self.at.to_str().unwrap()]);
    }
}

impl Drop for CriContainerd {
    fn drop(&mut self) {
        // Stop every task's processes first so nothing keeps the rootfs mounts busy.
        let _ = Command::new("pkill")
            .args(["-KILL", "-f", &self.dir.display().to_string()])
            .status();
        run_quiet("kill", &["-KILL", &self.pid().to_string()]);
        let _ = self.child.kill();
        let _ = self.child.wait();
        unmount_under(&self.dir);
    }
}

/// Starts containerd `release` with `config`, logging to `log`, in the namespaces of process
/// `node` (entered with nsenter) if given.
fn spawn_containerd(
    release: Release,
    config: &Path,
    log: &Path,
    node: Option<u32>,
    env: &[(&str, String)],
) -> Child {
    let path = format!(
        "{}:{}",
        release.bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let containerd = release.bin_dir().join("containerd");
    let mut command = match node {
        Some(pid) => {
            let mut c = Command::new("nsenter");
            c.args(["-t", &pid.to_string(), "-m", "-p", "--"])
                .arg(containerd);
            c
        }
        None => Command::new(containerd),
    };
    command
        .arg("--config")
        .arg(config)
        .env("PATH", path)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .unwrap(),
        )
        .spawn()
        .expect("start containerd")
}

/// The children of process `pid`.
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// The lines a container wrote, from a CRI log file (`<time> stdout F <line>`).
pub fn container_output(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.splitn(4, ' ').nth(3).map(str::to_string))
        .collect()
}

/// An OCI layout at `dir` of a busybox image: `/bin/busybox` plus `/bin/sh` and `/bin/sleep`
/// links, running `cmd`.
pub fn busybox_layout(dir: &Path, cmd: &[&str]) {
    require("busybox");
    let root = dir.with_extension("rootfs");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    for link in ["sh", "sleep", "echo", "cat", "sha256sum"] {
        let _ = std::os::unix::fs::symlink("busybox", root.join("bin").join(link));
    }
    let tar = Command::new("tar")
        .args(["--owner=0", "--group=0", "-C"])
        .arg(&root)
        .args(["-cf", "-", "bin"])
        .output()
        .unwrap();
    assert!(tar.status.success());
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &tar.stdout).unwrap();
    let layer = gz.finish().unwrap();
    crate::harness::write_layout(
        dir,
        &[(
            layer,
            "application/vnd.oci.image.layer.v1.tar+gzip",
            sha256(&tar.stdout),
            serde_json::json!({}),
        )],
        "amd64",
        serde_json::json!({"Cmd": cmd}),
    );
}
