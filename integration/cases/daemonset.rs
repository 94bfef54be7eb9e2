//! The shipped DaemonSet run as kubelet runs it, on a node of its own: a mount and PID
//! namespace whose `/etc`, `/var/lib` and `/run` are this machine's under a writable overlay,
//! with the node's containerd configuration, trust store (Debian's roots and a test CA, the
//! "public" CA of an HTTPS registry) and group file (its `kvm` group) bound in. The node's
//! containerd (1.7, 2.x; overlayfs) pulls the image `make image` builds; the pod spec of
//! `packaging/kubernetes/vmdisk.yaml` becomes the CRI calls kubelet makes for it (sandbox on the
//! host network, the init container to its end, the privileged daemon with its volumes as
//! kubelet mounts them, the readiness probe by exec); then, as install.md says, containerd is
//! restarted once and a KubeVirt-style pod (the `kubevirt` RuntimeClass and the annotation)
//! starts from a containerDisk pulled lazily over HTTPS and reads `/disk` identical. Then the
//! DaemonSet's pod is replaced under that disk (every process of its cgroup killed, the pod run
//! again) while a reader and qemu-img read the raw view: no error, no wrong byte.
//!
//! The node ends with its PID namespace: every process of it (containerd, shims, the pods, the
//! mount servers) is killed with its first process.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_cri::v1 as cri;
use serde_json::Value;

use crate::fixtures::cri::{children, rt, CriContainerd, Release};
use crate::fixtures::harness::*;

/// The group the node's hypervisor runs in, as the node's `/etc/group` names it.
const KVM_GID: u32 = 4242;

/// A node: the first process of its PID namespace holds its mounts.
struct Node {
    holder: Child,
    /// The node's first process, as this machine numbers it.
    init: u32,
    /// Where the node's own directories live on this machine.
    root: PathBuf,
}

/// The node's directories bound over this machine's paths.
const BINDS: [(&str, &str); 7] = [
    ("run-containerd", "/run/containerd"),
    ("run-vmdisk", "/run/vmdisk"),
    ("state", "/var/lib/vmdisk-snapshotter"),
    ("etc-containerd", "/etc/containerd"),
    ("etc-vmdisk", "/etc/vmdisk"),
    ("usr-local-bin", "/usr/local/bin"),
    ("certs", "/etc/ssl/certs"),
];

impl Node {
    /// A node whose trust store also trusts `ca` (a PEM file).
    fn start(scratch: &Scratch, ca: &Path) -> Self {
        require("unshare");
        require("nsenter");
        let root = scratch.path("node");
        for (dir, _) in BINDS {
            std::fs::create_dir_all(root.join(dir)).unwrap();
        }
        let mut roots = std::fs::read_to_string("/etc/ssl/certs/ca-certificates.crt").unwrap();
        roots.push_str(&std::fs::read_to_string(ca).unwrap());
        std::fs::write(root.join("certs/ca-certificates.crt"), roots).unwrap();
        let mut group: String = std::fs::read_to_string("/etc/group")
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with("kvm:"))
            .map(|l| format!("{l}\n"))
            .collect();
        group.push_str(&format!("kvm:x:{KVM_GID}:\n"));
        std::fs::write(root.join("group"), group).unwrap();
        let binds: String = BINDS
            .iter()
            .map(|(dir, at)| format!("mkdir -p {at}; mount --bind \"$N/{dir}\" {at}\n"))
            .collect();
        let script = format!(
            r#"set -eu
mount --make-rshared /
for d in etc var/lib run; do
  mkdir -p "$N/overlay/$d/upper" "$N/overlay/$d/work"
  mount -t overlay overlay -o "lowerdir=/$d,upperdir=$N/overlay/$d/upper,workdir=$N/overlay/$d/work" "/$d"
done
{binds}mount --bind "$N/group" /etc/group
touch "$N/up"
exec sleep infinity
"#
        );
        let holder = Command::new("unshare")
            .args([
                "--mount",
                "--pid",
                "--fork",
                "--mount-proc",
                "--propagation",
                "private",
                "sh",
                "-c",
                &script,
            ])
            .env("N", &root)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !root.join("up").exists() {
            assert!(Instant::now() < deadline, "the node's mounts were not made");
            std::thread::sleep(Duration::from_millis(50));
        }
        let init = children(holder.id())[0];
        Node { holder, init, root }
    }

    /// Runs `script` in the node's mount namespace; whether it succeeded.
    fn sh(&self, script: &str) -> bool {
        Command::new("nsenter")
            .args(["-t", &self.init.to_string(), "-m", "--", "sh", "-c", script])
            .status()
            .unwrap()
            .success()
    }

    /// This machine's number of the node's process `pid` (the node has a PID namespace).
    fn host_pid(&self, pid: u64) -> u64 {
        let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/pid")).ok();
        let node_ns = ns(&self.init.to_string());
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok())
            .find(|host| {
                let status =
                    std::fs::read_to_string(format!("/proc/{host}/status")).unwrap_or_default();
                let inner = status
                    .lines()
                    .find_map(|l| l.strip_prefix("NSpid:"))
                    .and_then(|ids| ids.split_whitespace().last()?.parse::<u64>().ok());
                inner == Some(pid) && ns(&host.to_string()) == node_ns
            })
            .unwrap_or_else(|| panic!("no process {pid} in the node"))
    }

    /// The path on this machine of the node's path `at` (one of [`BINDS`]).
    fn path(&self, at: &str) -> PathBuf {
        let (dir, rest) = BINDS
            .iter()
            .find_map(|(dir, b)| Path::new(at).strip_prefix(b).ok().map(|r| (dir, r)))
            .unwrap_or_else(|| panic!("{at} is not one of the node's own paths"));
        self.root.join(dir).join(rest)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // The PID namespace's first process: every process of the node ends with it.
        crate::fixtures::cri::run_quiet("kill", &["-KILL", &self.init.to_string()]);
        let _ = self.holder.wait();
    }
}

/// The network and PID namespaces kubelet asks for a pod spec's containers: the node's with
/// `hostNetwork` and `hostPID`, else the pod's network and a PID namespace per container.
fn namespaces(pod: &Value) -> (cri::NamespaceMode, cri::NamespaceMode) {
    let network = match pod["hostNetwork"] == true {
        true => cri::NamespaceMode::Node,
        false => cri::NamespaceMode::Pod,
    };
    let pid = match pod["hostPID"] == true {
        true => cri::NamespaceMode::Node,
        false => cri::NamespaceMode::Container,
    };
    (network, pid)
}

/// kubelet's part: the CRI calls for a pod spec's containers.
struct Kubelet<'a> {
    ctd: &'a CriContainerd,
    node: &'a Node,
    /// Where configMap volumes are written (kubelet's pods directory).
    pods: PathBuf,
    logs: PathBuf,
}

impl Kubelet<'_> {
    /// The sandbox of `pod` (named `name` in `namespace`) on `handler`, as kubelet asks for it.
    fn run_sandbox(
        &self,
        namespace: &str,
        name: &str,
        pod: &Value,
    ) -> (String, cri::PodSandboxConfig) {
        let privileged = containers(pod)
            .iter()
            .any(|c| c["securityContext"]["privileged"] == true);
        let (network, pid) = namespaces(pod);
        let config = cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: name.into(),
                uid: format!("uid-{name}"),
                namespace: namespace.into(),
                attempt: 0,
            }),
            log_directory: self.logs.display().to_string(),
            linux: Some(cri::LinuxPodSandboxConfig {
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: network as i32,
                        pid: pid as i32,
                        ..Default::default()
                    }),
                    privileged,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let id = rt().block_on(async {
            self.ctd
                .runtime()
                .await
                .unwrap()
                .run_pod_sandbox(cri::RunPodSandboxRequest {
                    config: Some(config.clone()),
                    runtime_handler: String::new(),
                })
                .await
                .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", self.ctd.log_text()))
                .into_inner()
                .pod_sandbox_id
        });
        (id, config)
    }

    /// The mounts kubelet makes for container `c`'s volumeMounts: a hostPath as it is (checked
    /// or created as its `type` says, on the node), a configMap's data written to a directory
    /// and mounted read-only (kubelet mounts those read-only whatever the spec says).
    fn mounts(&self, pod: &Value, c: &Value) -> Vec<cri::Mount> {
        let volumes = pod["volumes"].as_array().unwrap();
        let mut out = Vec::new();
        for m in c["volumeMounts"].as_array().into_iter().flatten() {
            let v = volumes
                .iter()
                .find(|v| v["name"] == m["name"])
                .unwrap_or_else(|| panic!("no volume {}", m["name"]));
            let (host_path, forced_ro) = if let Some(map) = v["configMap"]["name"].as_str() {
                let dir = self.pods.join(map);
                std::fs::create_dir_all(&dir).unwrap();
                let data = self.config_map(map);
                for (key, text) in data.as_object().unwrap() {
                    std::fs::write(dir.join(key), text.as_str().unwrap()).unwrap();
                }
                (dir.display().to_string(), true)
            } else {
                let path = v["hostPath"]["path"].as_str().unwrap();
                let check = match v["hostPath"]["type"].as_str().unwrap_or("") {
                    "DirectoryOrCreate" => format!("mkdir -p {path}"),
                    "Directory" => format!("test -d {path}"),
                    "File" => format!("test -f {path}"),
                    "CharDevice" => format!("test -c {path}"),
                    other => panic!("hostPath type {other:?}"),
                };
                assert!(
                    self.node.sh(&check),
                    "hostPath {path}: `{check}` failed on the node"
                );
                (path.to_string(), false)
            };
            let propagation = match m["mountPropagation"].as_str().unwrap_or("None") {
                "Bidirectional" => cri::MountPropagation::PropagationBidirectional,
                "HostToContainer" => cri::MountPropagation::PropagationHostToContainer,
                _ => cri::MountPropagation::PropagationPrivate,
            };
            out.push(cri::Mount {
                container_path: m["mountPath"].as_str().unwrap().into(),
                host_path,
                readonly: forced_ro || m["readOnly"] == true,
                propagation: propagation as i32,
                ..Default::default()
            });
        }
        out
    }

    /// The ConfigMap `name` of the manifest, with the daemon's `orphan_grace` set to
    /// [`ORPHAN_GRACE`] (as an operator sets a key of it).
    fn config_map(&self, name: &str) -> Value {
        let mut data = manifest()
            .into_iter()
            .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no ConfigMap {name}"))["data"]
            .clone();
        if let Some(text) = data.get("snapshotter.toml").and_then(Value::as_str) {
            assert!(
                text.contains("\norphan_grace = 900\n"),
                "the ConfigMap sets no orphan_grace"
            );
            let grace = format!("\norphan_grace = {}\n", ORPHAN_GRACE.as_secs());
            data["snapshotter.toml"] =
                Value::String(text.replace("\norphan_grace = 900\n", &grace));
        }
        data
    }

    /// Creates and starts container `c` of `pod` in `sandbox` from `image`; its id.
    fn start(
        &self,
        sandbox: &(String, cri::PodSandboxConfig),
        pod: &Value,
        c: &Value,
        image: &str,
    ) -> String {
        let name = c["name"].as_str().unwrap();
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .into_iter()
                .flatten()
                .map(|s| s.as_str().unwrap().to_string())
                .collect()
        };
        let config = cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: name.into(),
                attempt: 0,
            }),
            image: Some(cri::ImageSpec {
                image: image.into(),
                ..Default::default()
            }),
            command: strings(&c["command"]),
            args: strings(&c["args"]),
            log_path: format!("{name}.log"),
            mounts: self.mounts(pod, c),
            linux: Some(cri::LinuxContainerConfig {
                security_context: Some(cri::LinuxContainerSecurityContext {
                    privileged: c["securityContext"]["privileged"] == true,
                    namespace_options: Some(cri::NamespaceOption {
                        network: namespaces(pod).0 as i32,
                        pid: namespaces(pod).1 as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        rt().block_on(async {
            let mut r = self.ctd.runtime().await.unwrap();
            let id = r
                .create_container(cri::CreateContainerRequest {
                    pod_sandbox_id: sandbox.0.clone(),
                    config: Some(config),
                    sandbox_config: Some(sandbox.1.clone()),
                })
                .await
                .unwrap_or_else(|e| panic!("CreateContainer {name}: {e}\n{}", self.ctd.log_text()))
                .into_inner()
                .container_id;
            r.start_container(cri::StartContainerRequest {
                container_id: id.clone(),
            })
            .await
            .unwrap_or_else(|e| panic!("StartContainer {name}: {e}\n{}", self.ctd.log_text()));
            id
        })
    }

    /// Runs `probe`'s exec command in container `id` until it succeeds (kubelet's readiness),
    /// within `within`.
    fn wait_ready(&self, id: &str, probe: &Value, within: Duration) {
        let cmd: Vec<String> = probe["exec"]["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect();
        let timeout = probe["timeoutSeconds"].as_i64().unwrap_or(1);
        let deadline = Instant::now() + within;
        loop {
            let answer = rt().block_on(async {
                self.ctd
                    .runtime()
                    .await
                    .unwrap()
                    .exec_sync(cri::ExecSyncRequest {
                        container_id: id.into(),
                        cmd: cmd.clone(),
                        timeout,
                    })
                    .await
            });
            let last = match answer {
                Ok(r) if r.get_ref().exit_code == 0 => return,
                Ok(r) => String::from_utf8_lossy(&r.into_inner().stderr).into_owned(),
                Err(e) => e.to_string(),
            };
            assert!(
                Instant::now() < deadline,
                "the readiness probe {cmd:?} did not pass: {last}\n{}",
                std::fs::read_to_string(self.logs.join("snapshotter.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

/// The manifest's documents.
fn manifest() -> Vec<Value> {
    crate::fixtures::node::yaml_documents(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes/vmdisk.yaml"),
    )
}

/// A pod spec's init containers then its containers.
fn containers(pod: &Value) -> Vec<&Value> {
    ["initContainers", "containers"]
        .iter()
        .filter_map(|k| pod[k].as_array())
        .flatten()
        .collect()
}

/// The node's containerd (overlayfs) as the installer left it, with a `hosts.toml` for the
/// registry `https` that names no CA (its certificate is checked against the trust store).
fn node_containerd(release: Release, scratch: &Scratch, node: &Node, https: &str) -> CriContainerd {
    let hosts = node.path("/etc/containerd/certs.d").join(https);
    std::fs::create_dir_all(&hosts).unwrap();
    std::fs::write(
        hosts.join("hosts.toml"),
        format!("server = \"https://{https}\"\n[host.\"https://{https}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"),
    )
    .unwrap();
    let ctd_dir = scratch.path("ctd");
    let config = node.path("/etc/containerd/config.toml");
    let text = crate::fixtures::node::node_config(
        release,
        &ctd_dir,
        &format!("{https}/pause:1"),
        Path::new("/etc/containerd/certs.d"),
    )
    .replace(
        &format!("{}/containerd.sock", ctd_dir.display()),
        "/run/containerd/containerd.sock",
    )
    // This machine runs no systemd: kubelet's cgroupfs driver.
    .replace("SystemdCgroup = true", "SystemdCgroup = false");
    std::fs::write(&config, text).unwrap();
    CriContainerd::launch_in(
        release,
        ctd_dir,
        node.path("/run/containerd/containerd.sock"),
        config,
        Some(node.init),
        &[],
    )
}

/// kubelet's part for the DaemonSet's `pod` from `image`: the image, the sandbox, the init
/// containers to their end, the daemon until its readiness probe passes.
fn run_daemonset_pod(kubelet: &Kubelet, pod: &Value, image: &str) -> String {
    let (ctd, release) = (kubelet.ctd, kubelet.ctd.release);
    ctd.pull(image)
        .unwrap_or_else(|e| panic!("{release:?} pulling {image}: {e}\n{}", ctd.log_text()));
    let sandbox = kubelet.run_sandbox("vmdisk-system", "vmdisk-snapshotter-node", pod);
    for c in pod["initContainers"].as_array().unwrap() {
        let id = kubelet.start(&sandbox, pod, c, image);
        let code = ctd.wait_exit(&id, Duration::from_secs(60));
        let name = c["name"].as_str().unwrap();
        let log = std::fs::read_to_string(kubelet.logs.join(format!("{name}.log")));
        assert_eq!(code, 0, "{release:?} init container {name}: {log:?}");
    }
    let daemon = &pod["containers"][0];
    let id = kubelet.start(&sandbox, pod, daemon, image);
    kubelet.wait_ready(&id, &daemon["readinessProbe"], Duration::from_secs(60));
    sandbox.0
}

/// The disk's mount server killed, then the DaemonSet's pod replaced under a running VM's disk,
/// as a rolling update, a crash or an OOM kill does it: every process of the pod's cgroup
/// killed (what the runtime does), the pod removed and run again. A reader holding the raw view open and qemu reading it see no error
/// and no wrong byte, and the new daemon adopts the mount server. The servers left the pod's
/// cgroup (`server_cgroup`) in the node's PID namespace (`hostPID`).
fn replacing_the_pod_leaves_the_disk_served(
    kubelet: &Kubelet,
    pod: &Value,
    image: &str,
    sandbox: &str,
    disk_image: &str,
    disk: &Path,
) -> String {
    let (ctd, node, release) = (kubelet.ctd, kubelet.node, kubelet.ctd.release);
    // Asked on the node, as a runtime there asks: the ready disk is the node's mount.
    let asked = Command::new("nsenter")
        .args(["-t", &node.init.to_string(), "-m", "--"])
        .arg(env!("CARGO_BIN_EXE_vmdisk"))
        .args([
            "path",
            "--raw",
            "--manage",
            "/run/vmdisk/manage.sock",
            disk_image,
        ])
        .output()
        .unwrap();
    assert!(
        asked.status.success(),
        "{release:?}: vmdisk path --raw: {}",
        String::from_utf8_lossy(&asked.stderr)
    );
    let raw = String::from_utf8(asked.stdout).unwrap();
    let raw = PathBuf::from(format!("/proc/{}/root{}", node.init, raw.trim()));
    let want_file = guest_bytes(disk);
    let disk_server = || {
        listed(node)
            .iter()
            .find(|d| {
                d["reference"]
                    .as_str()
                    .is_some_and(|r| r.contains("/disk:1"))
                    && d["serving"] == true
            })
            .and_then(|d| d["server_pid"].as_u64())
    };
    let killed = disk_server()
        .unwrap_or_else(|| panic!("{release:?}: no server of {disk_image}: {:?}", listed(node)));
    // The disk's server dies first (SIGKILL): the pod's daemon starts a successor that takes its
    // FUSE connections over; the pod replaced after that adopts the successor.
    let (saw, qemu, server) = read_through(&raw, &want_file, || {
        crate::fixtures::harness::drop_caches();
        crate::fixtures::cri::run_quiet("kill", &["-KILL", &node.host_pid(killed).to_string()]);
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(pid) = disk_server().filter(|p| *p != killed) {
                return pid;
            }
            assert!(
                Instant::now() < deadline,
                "{release:?}: no successor of the killed server: {:?}",
                listed(node)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    assert_served_through(&format!("{release:?}: the server's crash"), &saw, &qemu);
    // The daemon: the server's parent, whose cgroup is the pod's.
    let status = |pid: u64, field: &str| -> String {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .unwrap_or_else(|| panic!("no {field} for process {pid}"))
            .trim()
            .to_string()
    };
    // (This machine's /proc numbers the parent as this machine does.)
    let daemon = status(node.host_pid(server), "PPid:");
    let pod_cgroup = cgroup_procs(&daemon);
    let (saw, qemu, took) = read_through(&raw, &want_file, || {
        let started = Instant::now();
        // Every process of the pod's cgroup, killed as the runtime kills them.
        let pids = std::fs::read_to_string(&pod_cgroup).unwrap();
        for pid in pids.split_whitespace() {
            crate::fixtures::cri::run_quiet("kill", &["-KILL", pid]);
        }
        ctd.remove_sandbox(sandbox);
        let replaced = run_daemonset_pod(kubelet, pod, image);
        (replaced, started.elapsed())
    });
    let (replaced, took) = took;
    eprintln!("{release:?}: pod replaced in {took:?}");
    assert_served_through(&format!("{release:?}: the pod's replacement"), &saw, &qemu);
    // The new daemon adopted the server that kept serving.
    let after = listed(node);
    assert!(
        after
            .iter()
            .any(|d| d["server_pid"].as_u64() == Some(server) && d["serving"] == true),
        "{release:?}: the server {server} was not adopted: {after:?}"
    );
    replaced
}

/// The `orphan_grace` the node's DaemonSet runs with (its ConfigMap's, shortened from the
/// default 900 s so that the test waits seconds, not minutes; longer than the pod's
/// replacement takes here).
const ORPHAN_GRACE: Duration = Duration::from_secs(30);

/// Whether process `pid` runs: it exists and has not exited (the node's first process reaps
/// no orphan, as a real node's init would: one that ended stays a zombie).
fn running(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// The node's running processes (this machine's numbers) whose name is `comm`.
fn node_processes(node: &Node, comm: &str) -> Vec<u64> {
    let ns = |p: u64| std::fs::read_link(format!("/proc/{p}/ns/pid")).ok();
    let node_ns = ns(u64::from(node.init));
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok())
        .filter(|&p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == comm)
                && ns(p) == node_ns
                && running(p)
        })
        .collect()
}

/// The DaemonSet deleted for good (its pod's processes killed and the pod removed, no new one),
/// as install.md's uninstall says, with two disks served: `held`'s raw view kept open by a
/// reader (and qemu-img) until after the grace period, the other unused. The unused disk's
/// server stops within the grace period; the held one serves its reader with no error until it
/// closes, then stops too; no mount server and no FUSE mount of vmdisk remain on the node.
fn deleting_the_daemonset_leaves_nothing_behind(
    kubelet: &Kubelet,
    sandbox: &str,
    held: &str,
    disk: &Path,
) {
    let (ctd, node, release) = (kubelet.ctd, kubelet.node, kubelet.ctd.release);
    let disks = listed(node);
    let servers: Vec<(String, u64)> = disks
        .iter()
        .map(|d| {
            let pid = node.host_pid(d["server_pid"].as_u64().unwrap());
            (d["reference"].as_str().unwrap().to_string(), pid)
        })
        .collect();
    let held_server = servers
        .iter()
        .find(|(r, _)| r.contains(held))
        .unwrap_or_else(|| panic!("{release:?}: no server of {held}: {disks:?}"))
        .1;
    assert!(
        servers.len() >= 2,
        "{release:?}: one disk unused and one held: {disks:?}"
    );
    let asked = Command::new("nsenter")
        .args(["-t", &node.init.to_string(), "-m", "--"])
        .arg(env!("CARGO_BIN_EXE_vmdisk"))
        .args(["path", "--raw", "--manage", "/run/vmdisk/manage.sock", held])
        .output()
        .unwrap();
    let raw = String::from_utf8(asked.stdout).unwrap();
    let raw = PathBuf::from(format!("/proc/{}/root{}", node.init, raw.trim()));
    let alive = |pid: u64| running(pid);
    let (saw, qemu, unused_gone) = read_through(&raw, &guest_bytes(disk), || {
        let pod_cgroup = cgroup_procs(
            &node_processes(node, "vmdisk-snapshot")
                .into_iter()
                .find(|p| !servers.iter().any(|(_, s)| s == p))
                .expect("the DaemonSet's daemon")
                .to_string(),
        );
        let deleted = Instant::now();
        for pid in std::fs::read_to_string(&pod_cgroup)
            .unwrap()
            .split_whitespace()
        {
            crate::fixtures::cri::run_quiet("kill", &["-KILL", pid]);
        }
        ctd.remove_sandbox(sandbox);
        let left: Vec<u64> = node_processes(node, "vmdisk-snapshot")
            .into_iter()
            .filter(|p| !servers.iter().any(|(_, s)| s == p))
            .collect();
        assert!(
            left.is_empty(),
            "{release:?}: vmdisk processes other than the servers outlived the pod: {left:?}"
        );
        // The unused disks' servers end within the grace period (and a check's interval).
        while servers.iter().any(|&(_, p)| p != held_server && alive(p))
            && deleted.elapsed() < ORPHAN_GRACE + Duration::from_secs(15)
        {
            std::thread::sleep(Duration::from_millis(200));
        }
        let gone = deleted.elapsed();
        // The reader goes on past the grace period: its disk stays served.
        std::thread::sleep((ORPHAN_GRACE + Duration::from_secs(5)).saturating_sub(gone));
        assert!(
            alive(held_server),
            "{release:?}: the server of a disk in use ended"
        );
        gone
    });
    eprintln!("{release:?}: the unused disks' servers ended {unused_gone:?} after the DaemonSet was deleted (grace {ORPHAN_GRACE:?})");
    assert_served_through(
        &format!("{release:?}: the DaemonSet's deletion"),
        &saw,
        &qemu,
    );
    let left: Vec<&(String, u64)> = servers
        .iter()
        .filter(|&&(_, p)| p != held_server && alive(p))
        .collect();
    let logs = || {
        let dir = node.path("/var/lib/vmdisk-snapshotter").join("servers");
        std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
            .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(
        left.is_empty(),
        "{release:?}: unused disks still served: {left:?}\n{}",
        logs()
    );
    assert!(
        // The grace counts from the daemon's last ask, up to a second before the pod was killed.
        unused_gone + Duration::from_secs(2) >= ORPHAN_GRACE,
        "{release:?}: the unused disks' servers ended before the grace period, after {unused_gone:?}"
    );
    // The reader closed: its server ends too, and nothing of vmdisk is left on the node.
    let closed = Instant::now();
    while alive(held_server) && closed.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        !alive(held_server),
        "{release:?}: the held disk's server still runs after its reader closed"
    );
    assert_eq!(
        node_processes(node, "vmdisk-snapshot"),
        Vec::<u64>::new(),
        "{release:?}: vmdisk processes remain"
    );
    assert!(
        node.sh("! grep -q ' fuse.vmdisk ' /proc/self/mountinfo"),
        "{release:?}: a FUSE mount of vmdisk remains on the node"
    );
}

/// The `cgroup.procs` of process `pid`'s cgroup in the v1 devices hierarchy (runc lists a
/// container's processes there), or its cgroup v2.
fn cgroup_procs(pid: &str) -> PathBuf {
    let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let (root, path) = own
        .lines()
        .find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            controllers
                .split(',')
                .any(|c| c == "devices")
                .then_some(("/sys/fs/cgroup/devices", path))
        })
        .or_else(|| {
            own.lines()
                .find_map(|l| l.strip_prefix("0::").map(|p| ("/sys/fs/cgroup", p)))
        })
        .unwrap_or_else(|| panic!("no cgroup of {pid}: {own}"));
    Path::new(root)
        .join(path.trim_start_matches('/'))
        .join("cgroup.procs")
}

/// The node's disks, as `vmdisk ls --json` on its management socket lists them.
fn listed(node: &Node) -> Vec<Value> {
    let manage = node.path("/run/vmdisk/manage.sock");
    let out = vmdisk_ok(&["ls", "--manage", manage.to_str().unwrap(), "--json"]);
    serde_json::from_str(&out).unwrap()
}

/// The annotation that makes containerd pull with the kubevirt handler's snapshotter.
const KUBEVIRT_PULL: [(&str, &str); 1] = [("io.containerd.cri.runtime-handler", "kubevirt")];

/// A pod `name` annotated for the kubevirt handler's pull, on runtime `handler`, as kubelet
/// starts it: its sandbox, then `image` pulled with the pod's config.
fn annotated_pod(
    ctd: &CriContainerd,
    logs: &Path,
    name: &str,
    handler: &str,
    image: &str,
) -> (String, cri::PodSandboxConfig) {
    let sandbox = ctd
        .try_run_sandbox(name, logs, handler, &KUBEVIRT_PULL)
        .unwrap_or_else(|e| panic!("{:?} RunPodSandbox: {e}\n{}", ctd.release, ctd.log_text()));
    ctd.pull_for(image, &sandbox.1);
    sandbox
}

/// A virt-launcher pod as install.md sets it up (the kubevirt RuntimeClass's handler and the
/// annotation): kubelet runs its sandbox, pulls `image` with the pod's config — lazily, into
/// vmdisk — and its container reads `/disk` with `disk`'s digest, every byte through vmdisk.
fn kubevirt_pod_reads_the_disk(
    ctd: &CriContainerd,
    node: &Node,
    logs: &Path,
    image: &str,
    disk: &Path,
) {
    let release = ctd.release;
    let sandbox = annotated_pod(ctd, logs, "virt-launcher", "kubevirt", image);
    let pulled = listed(node);
    assert_eq!(pulled.len(), 1, "{release:?}: {pulled:?}");
    // The pull brings the TOC and, in a request beside it, the blob's first 256 KiB: the disk's
    // first chunks (24 of this small disk's 56 compress into them), never the whole disk.
    assert!(
        pulled[0]["chunks_cached"].as_u64().unwrap() < pulled[0]["chunks"].as_u64().unwrap(),
        "{release:?}: the pull fetched the disk: {pulled:?}"
    );
    let want = sha256_file(disk);
    crate::fixtures::node::reads_the_disk(ctd, &sandbox, logs, "compute", image, &want);
    // Over HTTPS, checked against the node's trust store (the image's own roots lack the CA).
    let read = listed(node);
    eprintln!("{release:?} vmdisk ls: {read:?}");
    // Its 8 MiB of random data, less what came whole with the blob's first 256 KiB at the pull.
    assert!(
        read[0]["registry_bytes"].as_u64().unwrap() >= (8 << 20) - (256 << 10),
        "{release:?}: {read:?}"
    );
}

/// A pod with the annotation but no RuntimeClass (runc's sandbox): its pull of `image` is lazy,
/// its containers cannot use it (containerd refuses them), and the daemon, whose log is
/// `daemon_log`, says so, naming the pod and the cure — and only of it.
fn annotated_only_pod_is_warned_of(
    ctd: &CriContainerd,
    logs: &Path,
    daemon_log: &Path,
    image: &str,
) {
    let release = ctd.release;
    let sandbox = annotated_pod(ctd, logs, "annotated-only", "", image);
    let deadline = Instant::now() + Duration::from_secs(15);
    let warned = loop {
        let text = std::fs::read_to_string(daemon_log).unwrap_or_default();
        if let Some(line) = text
            .lines()
            .find(|l| l.contains("pod default/annotated-only"))
        {
            break line.to_string();
        }
        assert!(
            Instant::now() < deadline,
            "{release:?}: no warning for the annotated pod on runc:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("{release:?}: {warned}");
    assert!(
        warned.contains("WARN")
            && warned.contains("\"kubevirt\"")
            && warned.contains("RuntimeClass"),
        "{release:?}: {warned}"
    );
    let made = rt().block_on(async {
        let mut r = ctd.runtime().await.unwrap();
        r.create_container(cri::CreateContainerRequest {
            pod_sandbox_id: sandbox.0.clone(),
            config: Some(cri::ContainerConfig {
                metadata: Some(cri::ContainerMetadata {
                    name: "compute".into(),
                    attempt: 0,
                }),
                image: Some(cri::ImageSpec {
                    image: image.into(),
                    ..Default::default()
                }),
                command: vec!["/busybox".into(), "true".into()],
                ..Default::default()
            }),
            sandbox_config: Some(sandbox.1.clone()),
        })
        .await
    });
    // What the warning foretells (containerd 1.7 and 2.x alike).
    let refused = made.expect_err("a container of an annotated pod on runc was made");
    assert!(
        refused.message().contains("not found"),
        "{release:?}: {refused:?}"
    );
    let text = std::fs::read_to_string(daemon_log).unwrap();
    assert!(
        !text.contains("virt-launcher") && !text.contains("vmdisk-snapshotter-node"),
        "{release:?}: pods set up as install.md says were warned of: {text}"
    );
}

fn daemonset(release: Release) {
    release.require();
    require("skopeo");
    let scratch = Scratch::new();
    let (reg, disk) = crate::fixtures::images::registry_with_images(&scratch, 8);
    // The node image as `make image` builds it, in the registry the node reaches over HTTPS.
    let docs = manifest();
    let ds = docs.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
    let pod = &ds["spec"]["template"]["spec"];
    let shipped = containers(pod)[0]["image"].as_str().unwrap().to_string();
    crate::fixtures::node::packaging(
        "image.sh",
        &[
            crate::fixtures::node::bin_dir().to_str().unwrap(),
            &format!("docker://{}/{shipped}", reg.host()),
        ],
    );
    // A second disk (layers of their own: a pull of it asks vmdisk again).
    let other_disk = scratch.path("disk-b.qcow2");
    std::fs::copy(&disk, &other_disk).unwrap();
    write_random(&other_disk, 0, 1 << 20, 12);
    vmdisk_ok(&[
        "push",
        other_disk.to_str().unwrap(),
        &format!("{}/disk-b:1", reg.host()),
    ]);
    let (front, ca) = reg.tls_front(&scratch);
    let https = front.host();
    let node = Node::start(&scratch, &ca);
    let mut ctd = node_containerd(release, &scratch, &node, &https);

    let kubelet = Kubelet {
        ctd: &ctd,
        node: &node,
        pods: scratch.path("kubelet/pods"),
        logs: scratch.path("kubelet/logs"),
    };
    std::fs::create_dir_all(&kubelet.logs).unwrap();
    let sandbox = run_daemonset_pod(&kubelet, pod, &format!("{https}/{shipped}"));
    // The hypervisor's group is the node's (the image names none but root).
    let ready_dir = node.path("/run/vmdisk/disks");
    assert_eq!(
        std::os::unix::fs::MetadataExt::gid(&std::fs::metadata(&ready_dir).unwrap()),
        KVM_GID,
        "{release:?}: the ready-disk directory's group"
    );
    // What install.md says next: restart containerd once.
    ctd.restart();

    let logs = scratch.path("pod-logs");
    kubevirt_pod_reads_the_disk(&ctd, &node, &logs, &format!("{https}/disk:1"), &disk);
    let kubelet = Kubelet {
        ctd: &ctd,
        node: &node,
        pods: scratch.path("kubelet/pods"),
        logs: scratch.path("kubelet/logs"),
    };
    let sandbox = replacing_the_pod_leaves_the_disk_served(
        &kubelet,
        pod,
        &format!("{https}/{shipped}"),
        &sandbox,
        &format!("{https}/disk:1"),
        &disk,
    );
    annotated_only_pod_is_warned_of(
        &ctd,
        &logs,
        &scratch.path("kubelet/logs/snapshotter.log"),
        &format!("{https}/disk-b:1"),
    );
    deleting_the_daemonset_leaves_nothing_behind(
        &kubelet,
        &sandbox,
        &format!("{https}/disk:1"),
        &disk,
    );
}

#[test]
fn the_shipped_daemonset_serves_a_kubevirt_pod_on_containerd_1_7() {
    daemonset(Release::V1_7);
}

#[test]
fn the_shipped_daemonset_serves_a_kubevirt_pod_on_containerd_2_3() {
    daemonset(Release::V2_3);
}
