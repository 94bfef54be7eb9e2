//! Real parts for the integration tests: a `docker-registry` process on a free loopback port
//! (optionally with htpasswd auth), a containerd process with its own root, OCI image layouts
//! written from code and pushed with skopeo, qemu tools. Everything lives in a scratch
//! directory that is removed when the test ends; processes are killed on drop.

#![allow(dead_code)]

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};

/// Fails the test with a clear message when a tool the suite needs is missing.
pub fn require(tool: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false);
    assert!(found, "{tool} is not installed: run `make test` (it installs the test dependencies) or see README.md");
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_for_port(port: u16, what: &str, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "{what} did not start listening on {port}: {}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// A scratch directory for one test.
pub struct Scratch {
    pub dir: tempfile::TempDir,
}

impl Scratch {
    pub fn new() -> Self {
        let base = std::env::var_os("VMDISK_TEST_TMP")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        std::fs::create_dir_all(&base).unwrap();
        Scratch {
            dir: tempfile::Builder::new()
                .prefix("vmdisk-it-")
                .tempdir_in(base)
                .unwrap(),
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// A running CNCF distribution registry.
pub struct Registry {
    child: Child,
    pub port: u16,
    pub root: PathBuf,
}

impl Registry {
    pub fn start(scratch: &Scratch) -> Self {
        Self::start_with(scratch, "")
    }

    /// With `auth` YAML inserted (e.g. an htpasswd block).
    pub fn start_with(scratch: &Scratch, auth: &str) -> Self {
        let port = free_port();
        let root = scratch.path(&format!("registry-{port}"));
        std::fs::create_dir_all(root.join("data")).unwrap();
        Self::spawn(port, root.clone(), &root.join("data"), "", auth)
    }

    /// A second registry serving this one's storage over HTTPS, for 127.0.0.1 (and the name
    /// localhost), with the certificate of a CA made for it; returns it and the CA certificate's PEM file.
    pub fn tls_front(&self, scratch: &Scratch) -> (Self, PathBuf) {
        self.tls_front_with(scratch, "")
    }

    /// [`Self::tls_front`] with `extra` YAML in its configuration (a `middleware` block).
    pub fn tls_front_with(&self, scratch: &Scratch, extra: &str) -> (Self, PathBuf) {
        let port = free_port();
        let root = scratch.path(&format!("registry-{port}"));
        std::fs::create_dir_all(&root).unwrap();
        let file = |name: &str| root.join(name).display().to_string();
        let (ca, ca_key, key, req, cert, ext) = (
            file("ca.pem"),
            file("ca.key"),
            file("key.pem"),
            file("req.pem"),
            file("cert.pem"),
            file("ext"),
        );
        #[rustfmt::skip]
        run("openssl", &["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=vmdisk-test-ca", "-keyout", &ca_key, "-out", &ca]);
        #[rustfmt::skip]
        run("openssl", &["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", &key, "-out", &req]);
        std::fs::write(&ext, "subjectAltName=IP:127.0.0.1,DNS:localhost\n").unwrap();
        #[rustfmt::skip]
        run("openssl", &["x509", "-req", "-in", &req, "-CA", &ca, "-CAkey", &ca_key, "-CAcreateserial", "-days", "2", "-extfile", &ext, "-out", &cert]);
        let tls = format!(", tls: {{ certificate: {cert}, key: {key} }}");
        let front = Self::spawn(port, root.clone(), &self.root.join("data"), &tls, extra);
        (front, root.join("ca.pem"))
    }

    /// A docker-registry on `port` serving `data`, its files in `root`; `http` is added to
    /// its `http` settings, `auth` YAML to its configuration.
    fn spawn(port: u16, root: PathBuf, data: &Path, http: &str, auth: &str) -> Self {
        require("docker-registry");
        let config = root.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog: {{ level: warn }}\nstorage: {{ filesystem: {{ rootdirectory: {} }}, delete: {{ enabled: true }} }}\nhttp: {{ addr: 127.0.0.1:{port}{http} }}\n{auth}",
                data.display()
            ),
        )
        .unwrap();
        let log = root.join("registry.log");
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(root.join("registry.err")).unwrap())
            .spawn()
            .expect("start docker-registry");
        wait_for_port(port, "docker-registry", &root.join("registry.err"));
        Registry { child, port, root }
    }

    /// A second registry serving this one's storage over plain HTTP with `extra` YAML in its
    /// configuration (an `auth` or `middleware` block).
    pub fn front_with(&self, scratch: &Scratch, extra: &str) -> Self {
        let port = free_port();
        let root = scratch.path(&format!("registry-{port}"));
        std::fs::create_dir_all(&root).unwrap();
        Self::spawn(port, root, &self.root.join("data"), "", extra)
    }

    /// An htpasswd-protected registry; returns it and the htpasswd user/password.
    pub fn start_htpasswd(scratch: &Scratch, user: &str, password: &str) -> Self {
        require("htpasswd");
        let file = scratch.path("htpasswd");
        let out = Command::new("htpasswd")
            .args(["-Bbn", user, password])
            .output()
            .unwrap();
        assert!(out.status.success());
        std::fs::write(&file, out.stdout).unwrap();
        Self::start_with(
            scratch,
            &format!(
                "auth: {{ htpasswd: {{ realm: test, path: {} }} }}\n",
                file.display()
            ),
        )
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// URL of `path` on this registry.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Tags of a repository (empty if the repository does not exist).
    pub fn tags(&self, repo: &str) -> Vec<String> {
        let out = curl(&["-s", &self.url(&format!("/v2/{repo}/tags/list"))]);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap_or(serde_json::Value::Null);
        v["tags"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|t| t.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Registry {
    /// Stops it answering (SIGSTOP): connections are accepted by the kernel and never answered,
    /// as of a hung registry or one behind a congested link.
    pub fn pause(&self) {
        run("kill", &["-STOP", &self.child.id().to_string()]);
    }

    /// Lets it answer again (SIGCONT).
    pub fn resume(&self) {
        run("kill", &["-CONT", &self.child.id().to_string()]);
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn curl(args: &[&str]) -> Vec<u8> {
    require("curl");
    let out = Command::new("curl").args(args).output().expect("run curl");
    assert!(
        out.status.success(),
        "curl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Runs the built `vmdisk` binary.
pub fn vmdisk(args: &[&str]) -> Output {
    vmdisk_env(args, &[])
}

pub fn vmdisk_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vmdisk"));
    cmd.args(args)
        .env("VMDISK_LOG", "warn")
        .env_remove("DOCKER_CONFIG")
        .env_remove("REGISTRY_AUTH_FILE")
        .env("HOME", "/nonexistent");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run vmdisk")
}

/// Runs vmdisk and returns stdout, failing the test with stderr if it failed.
pub fn vmdisk_ok(args: &[&str]) -> String {
    let out = vmdisk(args);
    assert!(
        out.status.success(),
        "vmdisk {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

pub fn run(program: &str, args: &[&str]) -> Vec<u8> {
    require(program);
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// `qemu-img convert -O raw SRC DST`: the reference the raw view is compared with.
/// Reads `path` start to end with `dd bs=<bs>` (as a sequential reader would), failing the
/// test if dd fails.
pub fn dd_read(path: &Path, bs: &str) {
    let out = Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args(["of=/dev/null", &format!("bs={bs}")])
        .output()
        .expect("run dd");
    assert!(
        out.status.success(),
        "dd of {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn qemu_img_raw(src: &Path, dst: &Path) {
    run(
        "qemu-img",
        &[
            "convert",
            "-O",
            "raw",
            src.to_str().unwrap(),
            dst.to_str().unwrap(),
        ],
    );
}

/// `overlay.qcow2` in `dir`, backed by a 16 MiB `base.qcow2` beside it (named relatively):
/// what `vmdisk push` refuses and other tools may publish.
pub fn qcow2_with_backing(dir: &Path) -> PathBuf {
    let base = dir.join("base.qcow2");
    make_qcow2(&base, "16M", &[(0, 1 << 20, 0x11)]);
    let overlay = dir.join("overlay.qcow2");
    run(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            overlay.to_str().unwrap(),
        ],
    );
    overlay
}

/// A qcow2 of `size` with pattern writes (`(offset, length, byte)`) at scattered places.
pub fn make_qcow2(path: &Path, size: &str, writes: &[(u64, u64, u8)]) {
    run(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", path.to_str().unwrap(), size],
    );
    let mut args = Vec::new();
    for (off, len, byte) in writes {
        args.push("-c".to_string());
        args.push(format!("write -P {byte:#x} {off} {len}"));
    }
    args.push(path.to_str().unwrap().to_string());
    run(
        "qemu-io",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
}

/// Writes `len` bytes of seeded pseudo-random data into the qcow2 at `offset` (incompressible
/// content, unlike qemu-io patterns).
pub fn write_random(qcow2: &Path, offset: u64, len: u64, seed: u64) {
    let raw = qcow2.with_extension("chunk.raw");
    let mut f = std::fs::File::create(&raw).unwrap();
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        for b in buf.iter_mut() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *b = state as u8;
        }
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n]).unwrap();
        left -= n as u64;
    }
    drop(f);
    // qemu-img dd cannot write at an offset into an existing image; use qemu-io's file load.
    run(
        "qemu-io",
        &[
            "-c",
            &format!("write -s {} {offset} {len}", raw.display()),
            qcow2.to_str().unwrap(),
        ],
    );
    std::fs::remove_file(raw).unwrap();
}

pub fn sha256_file(path: &Path) -> String {
    let mut f = std::fs::File::open(path).unwrap();
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).unwrap();
    format!("sha256:{}", hex::encode(h.finalize()))
}

pub fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// How a test image layer is compressed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    Tar,
    Gzip,
}

/// Writes an OCI image layout with one layer holding `disk` at `in_image` (e.g.
/// `disk/fedora.qcow2`), owned by 107:107 like a KubeVirt containerDisk.
pub fn oci_layout(dir: &Path, disk: &Path, in_image: &str, layer: Layer, arch: &str) {
    oci_layout_annotated(dir, disk, in_image, layer, arch, serde_json::json!({}));
}

/// [`oci_layout`] with annotations on the layer descriptor.
pub fn oci_layout_annotated(
    dir: &Path,
    disk: &Path,
    in_image: &str,
    layer: Layer,
    arch: &str,
    annotations: serde_json::Value,
) {
    let mut tar_bytes = Vec::new();
    {
        let mut b = tar::Builder::new(&mut tar_bytes);
        let parent = Path::new(in_image).parent().unwrap().to_str().unwrap();
        let mut h = tar::Header::new_ustar();
        h.set_path(format!("{parent}/")).unwrap();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o755);
        h.set_uid(107);
        h.set_gid(107);
        h.set_size(0);
        h.set_cksum();
        b.append(&h, std::io::empty()).unwrap();
        let mut h = tar::Header::new_ustar();
        h.set_path(in_image).unwrap();
        h.set_mode(0o644);
        h.set_uid(107);
        h.set_gid(107);
        h.set_size(std::fs::metadata(disk).unwrap().len());
        h.set_cksum();
        b.append(&h, std::fs::File::open(disk).unwrap()).unwrap();
        b.finish().unwrap();
    }
    let diff_id = sha256(&tar_bytes);
    let (layer_bytes, media_type) = match layer {
        Layer::Tar => (tar_bytes, "application/vnd.oci.image.layer.v1.tar"),
        Layer::Gzip => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(&tar_bytes).unwrap();
            (
                e.finish().unwrap(),
                "application/vnd.oci.image.layer.v1.tar+gzip",
            )
        }
    };
    write_layout(
        dir,
        &[(layer_bytes, media_type, diff_id, annotations)],
        arch,
        serde_json::json!({}),
    );
}

/// Writes an OCI image layout at `dir` (tag `latest`): the layers as given
/// (`(blob, media type, diff id, annotations)`), a config with `image_config`.
pub fn write_layout(
    dir: &Path,
    layers: &[(Vec<u8>, &str, String, serde_json::Value)],
    arch: &str,
    image_config: serde_json::Value,
) {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let put = |data: &[u8]| -> String {
        let d = sha256(data);
        std::fs::write(blobs.join(d.trim_start_matches("sha256:")), data).unwrap();
        d
    };
    let mut descriptors = Vec::new();
    let mut diff_ids = Vec::new();
    for (bytes, media_type, diff_id, annotations) in layers {
        let digest = put(bytes);
        descriptors.push(serde_json::json!({"mediaType": media_type, "digest": digest, "size": bytes.len(), "annotations": annotations}));
        diff_ids.push(diff_id.clone());
    }
    let config = serde_json::json!({"architecture": arch, "os": "linux", "rootfs": {"type": "layers", "diff_ids": diff_ids}, "config": image_config});
    let config_bytes = serde_json::to_vec(&config).unwrap();
    let config_digest = put(&config_bytes);
    let manifest = serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config_bytes.len()},
        "layers": descriptors
    });
    let manifest_bytes = serde_json::to_vec(&manifest).unwrap();
    let manifest_digest = put(&manifest_bytes);
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest, "size": manifest_bytes.len(), "annotations": {"org.opencontainers.image.ref.name": "latest"}}]});
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
}

/// `skopeo copy` of an OCI layout to the registry, with extra flags (e.g. zstd:chunked).
pub fn skopeo_push(layout: &Path, dest: &str, extra: &[&str]) {
    let src = format!("oci:{}:latest", layout.display());
    let dst = format!("docker://{dest}");
    let mut args = vec!["copy", "--quiet", "--dest-tls-verify=false"];
    args.extend_from_slice(extra);
    args.extend([src.as_str(), dst.as_str()]);
    run("skopeo", &args);
}

/// Parses `vmdisk inspect --json`.
pub fn inspect_json(reference: &str) -> serde_json::Value {
    serde_json::from_str(&vmdisk_ok(&["inspect", "--json", reference])).unwrap()
}

/// A tmpfs of `size` (e.g. "64m") at `dir`, unmounted when dropped: a cache disk with little
/// room.
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    pub fn mount(dir: &Path, size: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .unwrap();
        assert!(mounted.success(), "mounting a tmpfs at {}", dir.display());
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Program `tool` of the Debian packages `make deps` unpacked into `target/deps/<dir>`
/// (integration/debs.sh), e.g. `unpacked("signers/usr/bin", "cosign")`.
pub fn unpacked(dir: &str, tool: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/deps")
        .join(dir)
        .join(tool);
    assert!(
        path.exists(),
        "{} is missing: run `make deps` (it unpacks the Debian packages the tests run)",
        path.display()
    );
    path
}

/// The last line of a command's output (push and convert print the digest there).
pub fn last_line(text: &str) -> String {
    text.lines().last().unwrap_or_default().trim().to_string()
}

/// Faults a [`FaultProxy`] injects.
#[derive(Clone, Copy, Default)]
pub struct Faults {
    /// Cut the client-to-registry stream once, after this many bytes.
    pub cut_request_after: Option<u64>,
    /// Per registry-to-client buffer (up to 64 KiB): probability of a fault.
    pub response_fault_rate: f64,
    /// The response fault flips a byte (true) or cuts the connection mid-stream (false).
    pub flip: bool,
    pub seed: u64,
    /// Held before forwarding each registry-to-client buffer (a slow registry).
    pub response_delay: Option<Duration>,
    /// Per response (a buffer that starts an HTTP answer): probability of one fault of
    /// [`Fault`]'s four kinds, chosen at random; `response_fault_rate` is then not used.
    pub mixed_response_rate: f64,
}

/// What the fault proxy does to a response in mixed mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// One bit of the answer flipped.
    Flip,
    /// The answer cut short (the connection closed mid-way).
    Truncate,
    /// The connection reset (RST) before the answer.
    Reset,
    /// `503 Service Unavailable` instead of the answer.
    Unavailable,
}

/// The shipped regional cache (`config/nginx-regional-cache.conf`, Debian's nginx with its slice
/// module) in front of an origin, run by `integration/regional-cache.sh`; stopped with SIGTERM
/// (nginx's master stops its workers).
pub struct RegionalCache {
    child: Option<Child>,
    pub port: u16,
    pub dir: PathBuf,
}

impl RegionalCache {
    /// The cache of a plain-HTTP origin.
    pub fn start(scratch: &Scratch, origin: &str) -> Self {
        Self::start_with(scratch, origin, None)
    }

    /// The cache of an HTTPS origin whose certificate names `name` and is signed by `ca` (PEM),
    /// as the shipped file speaks to it (proxy_ssl_verify on).
    pub fn start_https(scratch: &Scratch, origin: &str, ca: &Path, name: &str) -> Self {
        Self::start_with(scratch, origin, Some((ca, name)))
    }

    fn start_with(scratch: &Scratch, origin: &str, https: Option<(&Path, &str)>) -> Self {
        let port = free_port();
        let dir = scratch.path(&format!("regional-cache-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("start.log");
        let mut cmd = Command::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/integration/regional-cache.sh"
        ));
        if let Some((ca, name)) = https {
            cmd.env("ORIGIN_CA", ca).env("ORIGIN_NAME", name);
        }
        cmd.env("FETCHER_PORT", free_port().to_string())
            .env("REDIRECTS_PORT", free_port().to_string());
        let child = cmd
            .arg(&dir)
            .arg(origin)
            .arg(port.to_string())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(dir.join("start.err")).unwrap())
            .spawn()
            .expect("run integration/regional-cache.sh");
        wait_for_port(port, "the regional cache (nginx)", &dir.join("start.err"));
        RegionalCache {
            child: Some(child),
            port,
            dir,
        }
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Its access log: one line per request (request, status, cache answer, slice, bytes).
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("access.log")).unwrap_or_default()
    }

    pub fn stop(mut self) {
        self.terminate();
    }

    fn terminate(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && child.try_wait().ok().flatten().is_none() {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for RegionalCache {
    fn drop(&mut self) {
        self.terminate();
    }
}

/// A TCP proxy in front of a registry: counts the bytes in each direction (the registry-side
/// measurement of what a client fetched) and injects faults: a request cut once, responses
/// truncated, reset or bit-flipped at random.
pub struct FaultProxy {
    pub port: u16,
    pub cuts: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Bytes the registry sent to clients through this proxy.
    pub to_client: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Response faults injected.
    pub response_faults: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Responses seen and faults injected of each kind (mixed mode): responses, flips,
    /// truncations, resets, 503s.
    pub mixed: std::sync::Arc<[std::sync::atomic::AtomicU64; 5]>,
    /// Connections accepted.
    pub connections: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl FaultProxy {
    pub fn start(upstream: u16, cut_after: Option<u64>) -> Self {
        Self::start_with(
            upstream,
            Faults {
                cut_request_after: cut_after,
                ..Faults::default()
            },
        )
    }

    /// A proxy that only counts.
    pub fn counting(upstream: u16) -> Self {
        Self::start_with(upstream, Faults::default())
    }

    pub fn start_with(upstream: u16, faults: Faults) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let sent = Arc::new(AtomicU64::new(0));
        let cut_done = Arc::new(AtomicBool::new(false));
        let cuts = Arc::new(AtomicU64::new(0));
        let to_client = Arc::new(AtomicU64::new(0));
        let response_faults = Arc::new(AtomicU64::new(0));
        let mixed: Arc<[AtomicU64; 5]> = Arc::new(Default::default());
        let (cuts_out, to_client_out, faults_out, mixed_out) = (
            Arc::clone(&cuts),
            Arc::clone(&to_client),
            Arc::clone(&response_faults),
            Arc::clone(&mixed),
        );
        let connections = Arc::new(AtomicU64::new(0));
        let connections_out = Arc::clone(&connections);
        std::thread::spawn(move || {
            let mut conn_no = 0u64;
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                conn_no += 1;
                connections.fetch_add(1, Ordering::SeqCst);
                let (sent, cut_done, cuts) =
                    (Arc::clone(&sent), Arc::clone(&cut_done), Arc::clone(&cuts));
                let (to_client, response_faults, mixed) = (
                    Arc::clone(&to_client),
                    Arc::clone(&response_faults),
                    Arc::clone(&mixed),
                );
                let (mut c_read, mut s_write) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (mut s_read, mut c_write) = (server, client);
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match std::io::Read::read(&mut c_read, &mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let total = sent.fetch_add(n as u64, Ordering::SeqCst) + n as u64;
                        if faults.cut_request_after.is_some_and(|limit| total > limit)
                            && !cut_done.swap(true, Ordering::SeqCst)
                        {
                            cuts.fetch_add(1, Ordering::SeqCst);
                            let _ = c_read.shutdown(std::net::Shutdown::Both);
                            let _ = s_write.shutdown(std::net::Shutdown::Both);
                            break;
                        }
                        if s_write.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = s_write.shutdown(std::net::Shutdown::Write);
                });
                std::thread::spawn(move || {
                    let mut rng = faults.seed ^ conn_no.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                    let mut next = move || {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        rng
                    };
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match std::io::Read::read(&mut s_read, &mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if let Some(delay) = faults.response_delay {
                            std::thread::sleep(delay);
                        }
                        if faults.mixed_response_rate > 0.0 && buf[..n].starts_with(b"HTTP/1.") {
                            mixed[0].fetch_add(1, Ordering::SeqCst);
                            let roll = (next() % 1_000_000) as f64 / 1e6;
                            let kind = (roll < faults.mixed_response_rate).then(|| {
                                [
                                    Fault::Flip,
                                    Fault::Truncate,
                                    Fault::Reset,
                                    Fault::Unavailable,
                                ][(next() % 4) as usize]
                            });
                            match kind {
                                None => {}
                                Some(Fault::Flip) => {
                                    mixed[1].fetch_add(1, Ordering::SeqCst);
                                    // In the body if there is one: a flipped header fails too,
                                    // but a flipped byte of data is the case to catch.
                                    let body = buf[..n]
                                        .windows(4)
                                        .position(|w| w == b"\r\n\r\n")
                                        .map_or(0, |p| p + 4);
                                    let at = body + (next() as usize) % (n - body).max(1);
                                    if at < n {
                                        buf[at] ^= 1 << (next() % 8);
                                    }
                                }
                                Some(Fault::Truncate) => {
                                    mixed[2].fetch_add(1, Ordering::SeqCst);
                                    let keep = (next() % n as u64) as usize;
                                    let _ = c_write.write_all(&buf[..keep]);
                                    let _ = c_write.shutdown(std::net::Shutdown::Both);
                                    let _ = s_read.shutdown(std::net::Shutdown::Both);
                                    break;
                                }
                                Some(Fault::Reset) => {
                                    mixed[3].fetch_add(1, Ordering::SeqCst);
                                    // Closed with no linger: an RST once the other
                                    // direction's thread, woken by the read shutdown, lets
                                    // go of its handle too.
                                    let _ = socket2::SockRef::from(&c_write)
                                        .set_linger(Some(Duration::ZERO));
                                    let _ = c_write.shutdown(std::net::Shutdown::Read);
                                    let _ = s_read.shutdown(std::net::Shutdown::Both);
                                    break;
                                }
                                Some(Fault::Unavailable) => {
                                    mixed[4].fetch_add(1, Ordering::SeqCst);
                                    let _ = c_write.write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                                    let _ = c_write.shutdown(std::net::Shutdown::Both);
                                    let _ = s_read.shutdown(std::net::Shutdown::Both);
                                    break;
                                }
                            }
                        }
                        let fault = faults.response_fault_rate > 0.0
                            && (next() % 1_000_000) as f64 / 1e6 < faults.response_fault_rate;
                        if fault {
                            response_faults.fetch_add(1, Ordering::SeqCst);
                            if faults.flip {
                                let at = (next() % n as u64) as usize;
                                buf[at] ^= 1 << (next() % 8);
                            } else {
                                let keep = (next() % n as u64) as usize;
                                let _ = c_write.write_all(&buf[..keep]);
                                to_client.fetch_add(keep as u64, Ordering::SeqCst);
                                let _ = c_write.shutdown(std::net::Shutdown::Both);
                                let _ = s_read.shutdown(std::net::Shutdown::Both);
                                break;
                            }
                        }
                        to_client.fetch_add(n as u64, Ordering::SeqCst);
                        if c_write.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = c_write.shutdown(std::net::Shutdown::Write);
                });
            }
        });
        FaultProxy {
            port,
            cuts: cuts_out,
            to_client: to_client_out,
            response_faults: faults_out,
            mixed: mixed_out,
            connections: connections_out,
        }
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn bytes_to_client(&self) -> u64 {
        self.to_client.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The disk's path on the mount that `vmdisk mount`'s `ready: … at PATH (…)` line names.
pub fn disk_of_ready_line(line: &str) -> PathBuf {
    let path = line
        .split(" at ")
        .nth(1)
        .and_then(|rest| rest.split(" (").next())
        .unwrap_or_else(|| panic!("not a ready line: {line:?}"));
    PathBuf::from(path)
}

/// A running `vmdisk mount` in the foreground, stopped with SIGINT.
pub struct Mount {
    child: Option<Child>,
    lines: std::sync::mpsc::Receiver<String>,
    /// Lines read while waiting for another one, in order: a later wait finds them (a
    /// hydration may end before the ready line is printed).
    passed: std::collections::VecDeque<String>,
    pub dir: PathBuf,
    /// The disk's path on the mount, from the ready line.
    pub disk: PathBuf,
}

impl Mount {
    /// Mounts `reference` at `dir` with cache `cache` and extra flags; waits until ready.
    pub fn start(reference: &str, cache: &Path, dir: &Path, extra: &[&str]) -> Self {
        Self::start_env(reference, cache, dir, extra, &[])
    }

    /// [`Mount::start`] with more environment (`SSL_CERT_FILE`, say).
    pub fn start_env(
        reference: &str,
        cache: &Path,
        dir: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vmdisk"));
        cmd.arg("mount")
            .arg("--stats")
            .arg("--cache")
            .arg(cache)
            .args(extra)
            .arg(reference)
            .arg(dir);
        cmd.env("VMDISK_LOG", "warn")
            .env("HOME", "/nonexistent")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("start vmdisk mount");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in
                std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(|l| l.ok())
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut mount = Mount {
            child: Some(child),
            lines,
            passed: std::collections::VecDeque::new(),
            dir: dir.to_path_buf(),
            disk: PathBuf::new(),
        };
        let ready = mount.wait_for("ready: ", Duration::from_secs(60));
        mount.disk = disk_of_ready_line(&ready);
        mount
    }

    /// Waits for a stdout line starting with `prefix`.
    pub fn wait_for(&mut self, prefix: &str, timeout: Duration) -> String {
        if let Some(at) = self.passed.iter().position(|l| l.starts_with(prefix)) {
            return self.passed.remove(at).expect("a line found");
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(line) => self.passed.push_back(line),
                Err(_) => {
                    let status = self
                        .child
                        .as_mut()
                        .and_then(|c| c.try_wait().ok().flatten());
                    panic!("vmdisk mount printed no {prefix:?} line in {timeout:?} (exit status {status:?})");
                }
            }
        }
    }

    /// Unmounts with SIGINT and returns the counters it printed. A mount that is busy stays
    /// until it is signalled again (`vmdisk mount` says so): a file this test process just
    /// closed can still be held by a child it is starting (between fork and exec the child has
    /// a copy of every descriptor), so the signal is sent again each second, for a minute.
    pub fn stop(mut self) -> serde_json::Value {
        let mut child = self.child.take().unwrap();
        let mut status = None;
        for _ in 0..60 {
            let _ = Command::new("kill")
                .arg("-INT")
                .arg(child.id().to_string())
                .status();
            let deadline = Instant::now() + Duration::from_secs(1);
            while status.is_none() && Instant::now() < deadline {
                status = child.try_wait().unwrap();
                std::thread::sleep(Duration::from_millis(20));
            }
            if status.is_some() {
                break;
            }
        }
        let stopped = status.is_some();
        if !stopped {
            let _ = child.kill();
        }
        let status = child.wait().unwrap();
        assert!(
            stopped,
            "vmdisk mount did not stop within a minute of SIGINTs"
        );
        assert!(status.success(), "vmdisk mount exited with {status}");
        let last = self.lines.iter().last().expect("stats line");
        serde_json::from_str(&last).unwrap_or_else(|e| panic!("stats line {last:?}: {e}"))
    }

    /// SIGKILL, as a crash; the stale FUSE mount is detached.
    pub fn kill(mut self) {
        let mut child = self.child.take().unwrap();
        let _ = child.kill();
        let _ = child.wait();
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-INT")
                .arg(child.id().to_string())
                .status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && child.try_wait().ok().flatten().is_none() {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

/// Waits (at most a minute) until `bytes` has not changed for two seconds: read-ahead and
/// prefetches started by earlier reads have finished, so the next reads are measured alone.
pub fn wait_until_quiet(bytes: impl Fn() -> u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = bytes();
    let mut quiet = 0;
    while quiet < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_secs(1));
        let now = bytes();
        quiet = if now == last { quiet + 1 } else { 0 };
        last = now;
    }
}

/// Drops the kernel's page cache, so the next reads reach the filesystem.
pub fn drop_caches() {
    std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches (needs root)");
}

/// Writes a file of `len` seeded pseudo-random bytes.
pub fn random_file(path: &Path, len: u64, seed: u64) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407)
        | 1;
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        for word in buf.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n]).unwrap();
        left -= n as u64;
    }
    f.flush().unwrap();
}

/// A 2 GiB-virtual qcow2 with data at scattered places, some incompressible.
pub fn scattered_qcow2(path: &Path) {
    make_qcow2(
        path,
        "2G",
        &[
            (0, 4 << 20, 0xab),
            (700 << 20, 3 << 20, 0xcd),
            ((2 << 30) - (1 << 20), 1 << 20, 0x11),
        ],
    );
    write_random(path, 1 << 30, 8 << 20, 7);
}

/// Whether two files have the same bytes (`cmp`).
pub fn files_identical(a: &Path, b: &Path) -> bool {
    Command::new("cmp")
        .arg(a)
        .arg(b)
        .status()
        .expect("run cmp")
        .success()
}

/// The guest's bytes of qcow2 disk `qcow2` (what its raw view must read), converted by qemu-img
/// into a file beside it.
pub fn guest_bytes(qcow2: &Path) -> PathBuf {
    let raw = qcow2.with_extension("guest.raw");
    run(
        "qemu-img",
        &[
            "convert",
            "-O",
            "raw",
            qcow2.to_str().unwrap(),
            raw.to_str().unwrap(),
        ],
    );
    raw
}

/// What a reader of a disk saw while it read it over and over.
#[derive(Debug, Default)]
pub struct ReaderSaw {
    pub reads: u64,
    /// Reads that failed (ENOTCONN, EIO, …).
    pub errors: u64,
    /// Reads that returned other bytes, or fewer, than the disk holds there.
    pub wrong_or_short: u64,
    /// The longest one read took.
    pub longest: Duration,
}

/// Reads `path` in 1 MiB pieces from one open file, in order and over again, comparing each
/// with `want`, until `stop`.
pub fn read_until(path: PathBuf, want: Vec<u8>, stop: &std::sync::atomic::AtomicBool) -> ReaderSaw {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut saw = ReaderSaw::default();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0usize;
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let started = Instant::now();
        let read = file.read_at(&mut buf, at as u64);
        saw.longest = saw.longest.max(started.elapsed());
        saw.reads += 1;
        let end = (at + buf.len()).min(want.len());
        match read {
            Err(_) => saw.errors += 1,
            Ok(n) if n != end - at || buf[..n] != want[at..end] => saw.wrong_or_short += 1,
            Ok(_) => {}
        }
        at = if end == want.len() { 0 } else { end };
    }
    saw
}

/// What qemu saw comparing a disk with the bytes it must hold, over and over.
#[derive(Debug, Default)]
pub struct QemuSaw {
    pub compares: u64,
    /// What `qemu-img compare` said when it did not find them identical.
    pub differences: Vec<String>,
}

/// A disk that must stay served while `during` runs (a restart or a replacement of what
/// serves it): a reader holding the raw disk `raw` open reads it in order, comparing with
/// `want_file`, and `qemu-img compare` reads it whole, over and over, from a second before
/// `during` to a second after. What each saw, and what `during` returned.
pub fn read_through<T>(
    raw: &Path,
    want_file: &Path,
    during: impl FnOnce() -> T,
) -> (ReaderSaw, QemuSaw, T) {
    let want = std::fs::read(want_file).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let reader = s.spawn(|| read_until(raw.to_path_buf(), want, &stop));
        let qemu = s.spawn(|| {
            let mut saw = QemuSaw::default();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let out = Command::new("qemu-img")
                    .args(["compare", "-f", "raw", "-F", "raw"])
                    .arg(raw)
                    .arg(want_file)
                    .output()
                    .unwrap();
                saw.compares += 1;
                if !out.status.success() {
                    saw.differences.push(format!(
                        "{}{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    ));
                }
            }
            saw
        });
        /// Stops the readers however `during` ends (a panic too: the scope waits for them).
        struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let stopping = Stop(&stop);
        std::thread::sleep(Duration::from_secs(1));
        let result = during();
        std::thread::sleep(Duration::from_secs(1));
        drop(stopping);
        (reader.join().unwrap(), qemu.join().unwrap(), result)
    })
}

/// Asserts that a disk read through `what` ([`read_through`]) was read, with no error, no wrong
/// or short read, no difference qemu found, and no read waiting 5 s or more.
pub fn assert_served_through(what: &str, saw: &ReaderSaw, qemu: &QemuSaw) {
    eprintln!(
        "{what}: the reader saw {saw:?}; qemu-img compared {} times",
        qemu.compares
    );
    assert!(
        saw.reads > 0 && qemu.compares > 0,
        "{what}: nothing was read"
    );
    assert_eq!(
        (saw.errors, saw.wrong_or_short),
        (0, 0),
        "{what}: the reader saw {saw:?}"
    );
    assert!(
        qemu.differences.is_empty(),
        "{what}: qemu-img compare: {:?}",
        qemu.differences
    );
    assert!(
        saw.longest < Duration::from_secs(5),
        "{what}: a read waited {:?}",
        saw.longest
    );
}

/// A Docker config file in `dir` holding `user`'s credentials for registry `host`.
pub fn docker_config(dir: &Path, host: &str, user: &str, password: &str) -> PathBuf {
    use base64::Engine as _;
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let path = dir.join(format!("config-{user}-{password}.json"));
    std::fs::write(
        &path,
        format!(r#"{{"auths":{{"{host}":{{"auth":"{auth}"}}}}}}"#),
    )
    .unwrap();
    path
}
