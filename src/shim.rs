//! `containerd-shim-vmdisk-v2`: a runtime plugin that hands a VM runtime a ready disk.
//!
//! containerd starts a shim v2 as `containerd-shim-<name>-v2 -namespace NS -address SOCK
//! -publish-binary BIN -id ID start`, with the bundle (`config.json`, `rootfs/`) as working
//! directory, and reads the task service's address from its stdout. This shim does not serve
//! the task API itself: for a pod sandbox whose pod has the annotation `vmdisk.io/image: REF`
//! it asks vmdisk-snapshotter to make REF's disk ready (management API), writes
//! `io.katacontainers.config.hypervisor.image` into the bundle's `config.json`, and then
//! replaces itself with the delegate runtime's shim (`exec`, same arguments, environment and
//! directory), so containerd talks to the delegate directly. `delete` and every other call are
//! handed to the delegate unchanged; without the annotation nothing is changed at all.
//!
//! Settings come from a TOML file (`VMDISK_SHIM_CONFIG`, default `/etc/vmdisk/shim.toml`),
//! one section per runtime name: the binary `containerd-shim-vmdisk-v2` reads `[runtimes.vmdisk]`,
//! a link named `containerd-shim-vmdisk-kata-v2` (runtime type `io.containerd.vmdisk-kata.v2`)
//! reads `[runtimes.vmdisk-kata]`. That is how one binary serves several RuntimeClass handlers
//! with different delegates: containerd 1.6 tells a shim nothing else about its handler.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::format::disk::DiskFormat;
use crate::serve::ready::Handed;

/// The pod annotation naming the VM image.
pub const ANN_IMAGE: &str = "vmdisk.io/image";
/// Optional: `raw` (default) or `qcow2`, the form handed to the runtime.
pub const ANN_FORMAT: &str = "vmdisk.io/format";
/// What Kata (and peer pods) read the guest image from.
pub const ANN_KATA_IMAGE: &str = "io.katacontainers.config.hypervisor.image";
const ANN_CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
/// The pod's namespace, written by containerd's CRI (a pod cannot set it).
const ANN_SANDBOX_NAMESPACE: &str = "io.kubernetes.cri.sandbox-namespace";

/// What the runtime is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Provider {
    /// The absolute path of the disk (the raw view unless `vmdisk.io/format: qcow2`).
    Kata,
    /// A volume name in a libvirt `dir` pool over `<ready_dir>/volumes`.
    Libvirt,
    /// The image reference, unchanged (for providers that resolve names themselves).
    Name,
}

/// One runtime section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// The runtime type to hand over to, e.g. `io.containerd.kata.v2`.
    pub delegate: String,
    pub provider: Provider,
}

/// The shim's configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShimConfig {
    /// vmdisk-snapshotter's management socket.
    #[serde(default = "default_manage")]
    pub manage_address: PathBuf,
    /// Seconds the daemon may take to make a disk ready before the sandbox fails saying so.
    #[serde(default = "default_timeout")]
    pub timeout: u64,
    pub runtimes: BTreeMap<String, RuntimeConfig>,
}

fn default_manage() -> PathBuf {
    PathBuf::from("/run/vmdisk/manage.sock")
}

fn default_timeout() -> u64 {
    60
}

/// The default configuration file.
pub const DEFAULT_CONFIG: &str = "/etc/vmdisk/shim.toml";

/// `containerd-shim-vmdisk-v2 --help`.
pub const HELP: &str = "\
containerd-shim-vmdisk-v2: a containerd runtime shim (v2) that hands a VM runtime a ready disk.

containerd runs it for runtime_type io.containerd.<name>.v2, where <name> is the part of the
binary's name between containerd-shim- and -v2 (link it under each name you use):

  containerd-shim-<name>-v2 -namespace NS -address SOCK -publish-binary BIN -id ID start|delete

For a pod sandbox whose pod has the annotation vmdisk.io/image: REF it asks vmdisk-snapshotter
to make REF's disk ready for the pod's namespace, writes io.katacontainers.config.hypervisor.image
into the bundle's config.json (the raw view, the qcow2 with vmdisk.io/format: qcow2, a libvirt
volume name or the reference, as the runtime's provider says), and then becomes the delegate
runtime's shim with the same arguments. Anything else goes to the delegate unchanged.

Configuration: $VMDISK_SHIM_CONFIG, default /etc/vmdisk/shim.toml, one [runtimes.<name>] section
per name (delegate, provider), manage_address, timeout (seconds the daemon may take).
  -v, --version   print the version
  -h, --help      print this help
";

impl ShimConfig {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::io(
                format!(
                    "reading the vmdisk shim configuration {} (set VMDISK_SHIM_CONFIG)",
                    path.display()
                ),
                e,
            )
        })?;
        toml::from_str(&text).map_err(|e| {
            Error::invalid(format!("{}: {}", path.display(), e.to_string().trim_end()))
        })
    }
}

/// The runtime name a shim binary serves: `containerd-shim-vmdisk-kata-v2` → `vmdisk-kata`.
pub fn runtime_name(argv0: &str) -> Option<&str> {
    let base = argv0.rsplit('/').next()?;
    base.strip_prefix("containerd-shim-")?.strip_suffix("-v2")
}

/// The shim binary of a runtime type: `io.containerd.kata.v2` → `containerd-shim-kata-v2`.
pub fn shim_binary(runtime_type: &str) -> Result<String> {
    let parts: Vec<&str> = runtime_type.split('.').collect();
    match parts.as_slice() {
        [.., name, version] if !name.is_empty() && version.starts_with('v') => {
            Ok(format!("containerd-shim-{name}-{version}"))
        }
        _ => Err(Error::invalid(format!(
            "delegate {runtime_type:?} is not a runtime type like io.containerd.runc.v2"
        ))),
    }
}

/// The shim action: the last argument that is not a flag's value.
pub fn action(args: &[String]) -> Option<&str> {
    args.last()
        .map(String::as_str)
        .filter(|a| !a.starts_with('-'))
}

/// What to write into the bundle for `annotations` (from `config.json`), if anything.
pub fn wanted_image(annotations: &BTreeMap<String, String>) -> Option<(String, Handed)> {
    if annotations.get(ANN_CONTAINER_TYPE).map(String::as_str) != Some("sandbox") {
        return None;
    }
    let image = annotations.get(ANN_IMAGE)?.trim().to_string();
    let handed = match annotations.get(ANN_FORMAT).map(String::as_str) {
        Some("qcow2") => Handed::AsPublished,
        _ => Handed::Raw,
    };
    Some((image, handed))
}

/// The value of the Kata image annotation for `provider`.
pub fn image_value(
    provider: Provider,
    reference: &str,
    disk: &crate::api::vmdisk::v1::Disk,
    handed: Handed,
) -> String {
    let dir = Path::new(&disk.ready_dir);
    match (provider, handed) {
        (Provider::Kata, Handed::AsPublished) => {
            crate::serve::ready::published_path(dir, &disk.disk_path)
                .display()
                .to_string()
        }
        (Provider::Kata, Handed::Raw) => dir
            .join(crate::serve::ready::RAW_NAME)
            .display()
            .to_string(),
        (Provider::Libvirt, Handed::AsPublished) => {
            crate::serve::ready::volume_name(reference, DiskFormat::Qcow2)
        }
        (Provider::Libvirt, Handed::Raw) => {
            crate::serve::ready::volume_name(reference, DiskFormat::Raw)
        }
        (Provider::Name, _) => reference.to_string(),
    }
}

/// Rewrites `config.json` in `bundle` with `annotation = value`, atomically.
pub fn annotate_bundle(bundle: &Path, annotation: &str, value: &str) -> Result<()> {
    let path = bundle.join("config.json");
    let text =
        std::fs::read(&path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let mut spec: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| Error::corrupt(format!("{} is not JSON", path.display())).with_source(e))?;
    let obj = spec
        .as_object_mut()
        .ok_or_else(|| Error::corrupt(format!("{} is not an OCI spec", path.display())))?;
    let annotations = obj
        .entry("annotations")
        .or_insert_with(|| serde_json::json!({}))
        .as_object_mut()
        .ok_or_else(|| {
            Error::corrupt(format!("{}: annotations is not an object", path.display()))
        })?;
    annotations.insert(
        annotation.to_string(),
        serde_json::Value::String(value.to_string()),
    );
    let tmp = bundle.join("config.json.vmdisk");
    std::fs::write(&tmp, serde_json::to_vec(&spec).expect("JSON"))
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// Reads the annotations of the bundle's `config.json`.
pub fn bundle_annotations(bundle: &Path) -> Result<BTreeMap<String, String>> {
    let path = bundle.join("config.json");
    let text =
        std::fs::read(&path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    #[derive(Deserialize)]
    struct Spec {
        #[serde(default)]
        annotations: BTreeMap<String, String>,
    }
    let spec: Spec = serde_json::from_slice(&text).map_err(|e| {
        Error::corrupt(format!("{} is not an OCI spec", path.display())).with_source(e)
    })?;
    Ok(spec.annotations)
}

/// Does the work before the hand-over: for an annotated sandbox's `start`, makes the disk
/// ready and annotates the bundle. Returns the delegate's binary name.
pub async fn prepare(
    argv0: &str,
    args: &[String],
    bundle: &Path,
    config_path: &Path,
) -> Result<String> {
    let name = runtime_name(argv0).ok_or_else(|| {
        Error::invalid(format!(
            "{argv0}: a shim binary must be named containerd-shim-<runtime>-v2"
        ))
    })?;
    let config = ShimConfig::load(config_path)?;
    let runtime = config.runtimes.get(name).ok_or_else(|| {
        Error::invalid(format!(
            "{}: no [runtimes.{name}] section for {argv0}",
            config_path.display()
        ))
    })?;
    let delegate = shim_binary(&runtime.delegate)?;
    if action(args) != Some("start") {
        return Ok(delegate);
    }
    let annotations = bundle_annotations(bundle)?;
    let Some((reference, handed)) = wanted_image(&annotations) else {
        return Ok(delegate);
    };
    // The disk only if the pod's namespace may pull the image.
    let namespace = annotations
        .get(ANN_SANDBOX_NAMESPACE)
        .cloned()
        .unwrap_or_default();
    let deadline = std::time::Duration::from_secs(config.timeout);
    let disk = tokio::time::timeout(
        deadline,
        ensure_disk(&config.manage_address, &reference, &namespace),
    )
    .await
    .map_err(|_| {
        Error::new(
            crate::error::ErrorKind::Timeout,
            format!(
                "vmdisk: {ANN_IMAGE}={reference}: vmdisk-snapshotter at {} did not make the disk ready within {} s (timeout in {})",
                config.manage_address.display(),
                deadline.as_secs(),
                config_path.display()
            ),
        )
    })??;
    if runtime.provider != Provider::Name && handed == Handed::Raw {
        crate::serve::ready::raw_view_path(Path::new(&disk.ready_dir))
            .map_err(|e| e.context(format!("vmdisk: {ANN_IMAGE}={reference}")))?;
    }
    let value = image_value(runtime.provider, &reference, &disk, handed);
    annotate_bundle(bundle, ANN_KATA_IMAGE, &value)?;
    tracing::info!(reference, value, delegate, "disk ready; handing over");
    Ok(delegate)
}

async fn ensure_disk(
    manage: &Path,
    reference: &str,
    namespace: &str,
) -> Result<crate::api::vmdisk::v1::Disk> {
    use crate::api::vmdisk::v1::{manage_client::ManageClient, DiskRequest};
    let channel = crate::api::unix::channel(manage)
        .await
        .map_err(|e| e.context(format!("vmdisk: cannot make {ANN_IMAGE}={reference} ready")))?;
    ManageClient::new(channel)
        .ensure_disk(DiskRequest {
            reference: reference.to_string(),
            namespace: namespace.to_string(),
        })
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| {
            Error::from(s).context(format!("vmdisk: cannot make {ANN_IMAGE}={reference} ready"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_actions() {
        assert_eq!(
            runtime_name("/usr/local/bin/containerd-shim-vmdisk-v2"),
            Some("vmdisk")
        );
        assert_eq!(
            runtime_name("containerd-shim-vmdisk-kata-v2"),
            Some("vmdisk-kata")
        );
        assert_eq!(runtime_name("vmdisk-shim"), None);
        assert_eq!(
            shim_binary("io.containerd.kata.v2").unwrap(),
            "containerd-shim-kata-v2"
        );
        assert_eq!(
            shim_binary("io.containerd.runc.v2").unwrap(),
            "containerd-shim-runc-v2"
        );
        assert!(shim_binary("runc").is_err());
        let a = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            action(&a(&["-namespace", "k8s.io", "-id", "x", "start"])),
            Some("start")
        );
        assert_eq!(action(&a(&["-id", "x", "delete"])), Some("delete"));
        assert_eq!(action(&a(&["-v"])), None);
    }

    #[test]
    fn only_annotated_sandboxes_get_an_image() {
        let m = |v: &[(&str, &str)]| {
            v.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        assert_eq!(
            wanted_image(&m(&[(ANN_CONTAINER_TYPE, "sandbox"), (ANN_IMAGE, "r/x:1")])),
            Some(("r/x:1".into(), Handed::Raw))
        );
        assert_eq!(
            wanted_image(&m(&[
                (ANN_CONTAINER_TYPE, "sandbox"),
                (ANN_IMAGE, "r/x:1"),
                (ANN_FORMAT, "qcow2")
            ])),
            Some(("r/x:1".into(), Handed::AsPublished))
        );
        assert_eq!(
            wanted_image(&m(&[(ANN_CONTAINER_TYPE, "container"), (ANN_IMAGE, "r")])),
            None
        );
        assert_eq!(wanted_image(&m(&[(ANN_CONTAINER_TYPE, "sandbox")])), None);
    }

    #[test]
    fn values_per_provider() {
        let disk = crate::api::vmdisk::v1::Disk {
            ready_dir: "/run/vmdisk/disks/abc".into(),
            disk_path: "disk/fedora.qcow2".into(),
            ..Default::default()
        };
        assert_eq!(
            image_value(Provider::Kata, "r/f:1", &disk, Handed::Raw),
            "/run/vmdisk/disks/abc/disk.raw"
        );
        assert_eq!(
            image_value(Provider::Kata, "r/f:1", &disk, Handed::AsPublished),
            "/run/vmdisk/disks/abc/fedora.qcow2"
        );
        assert_eq!(
            image_value(Provider::Libvirt, "r/f:1", &disk, Handed::Raw),
            "r_f+1.raw"
        );
        assert_eq!(
            image_value(Provider::Name, "r/f:1", &disk, Handed::Raw),
            "r/f:1"
        );
    }

    #[test]
    fn shipped_config_parses() {
        let c = ShimConfig::load(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/shim.toml"
        )))
        .unwrap();
        assert_eq!(c.runtimes["vmdisk"].provider, Provider::Kata);
        assert_eq!(
            shim_binary(&c.runtimes["vmdisk-peerpods"].delegate).unwrap(),
            "containerd-shim-kata-remote-v2"
        );
    }

    #[test]
    fn annotates_the_bundle_atomically() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"ociVersion":"1.0.2","annotations":{"a":"b"},"process":{"args":["x"]}}"#,
        )
        .unwrap();
        annotate_bundle(dir.path(), ANN_KATA_IMAGE, "/d/disk.raw").unwrap();
        let a = bundle_annotations(dir.path()).unwrap();
        assert_eq!(a.get("a").map(String::as_str), Some("b"));
        assert_eq!(
            a.get(ANN_KATA_IMAGE).map(String::as_str),
            Some("/d/disk.raw")
        );
        let spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("config.json")).unwrap())
                .unwrap();
        assert_eq!(spec["process"]["args"][0], "x");
    }
}
