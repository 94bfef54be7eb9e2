//! The vmdisk image layout: what a published VM-disk layer says about itself and where its disk
//! is. The producer (`publish`), the readers (`resolve`, `inspect`) and the snapshotter's
//! classifier ask this module; none spells an annotation or a disk directory itself.
//!
//! - **Annotations** on the disk layer (and, as `vmdisk.io/` labels, in the config): format,
//!   sizes, digest and path of the disk, chunk size, and a copy of the TOC's position and
//!   digest. They describe; they never decide: the TOC pinned by the manifest does.
//! - **The disk** is the regular file the `path` annotation names, else the first regular file
//!   under `/disk/` (KubeVirt containerDisk) or `/image/` (peer-pod and Kata images); we
//!   publish it at `--path` or `/disk/<file name>`.

use crate::error::{Error, Result};
use crate::format::tree::clean_path;

/// Annotation (and snapshot label) prefix for our disk metadata.
pub const ANN_PREFIX: &str = "containerd.io/snapshot/vmdisk.";
/// Disk format, `qcow2` or `raw`.
pub const ANN_FORMAT: &str = "containerd.io/snapshot/vmdisk.format";
/// Virtual size of the disk in bytes.
pub const ANN_VIRTUAL_SIZE: &str = "containerd.io/snapshot/vmdisk.virtual-size";
/// Size of the disk file in bytes.
pub const ANN_DISK_SIZE: &str = "containerd.io/snapshot/vmdisk.disk-size";
/// sha256 of the disk file.
pub const ANN_DISK_DIGEST: &str = "containerd.io/snapshot/vmdisk.disk-digest";
/// Path of the disk in the layer, e.g. `disk/fedora.qcow2`.
pub const ANN_PATH: &str = "containerd.io/snapshot/vmdisk.path";
/// Chunk size used when publishing.
pub const ANN_CHUNK_SIZE: &str = "containerd.io/snapshot/vmdisk.chunk-size";
/// Copy of the TOC position, so a snapshotter has it among its labels.
pub const ANN_TOC_POSITION: &str = "containerd.io/snapshot/vmdisk.toc-position";
/// Copy of the TOC checksum.
pub const ANN_TOC_DIGEST: &str = "containerd.io/snapshot/vmdisk.toc-digest";
/// Config label prefix for the same metadata in the image config.
pub const LABEL_PREFIX: &str = "vmdisk.io/";

/// The directories a disk lives in: KubeVirt's `/disk/` and the peer-pod `/image/`.
pub const DISK_DIRS: [&str; 2] = ["disk/", "image/"];

/// KubeVirt's qemu user and group: a containerDisk's disk and the directories above it are
/// theirs, as KubeVirt's containerDisk build writes them, and so are vmdisk's.
pub const DISK_OWNER: u32 = 107;

/// An entry of the view of a disk as a containerDisk holds it ([`disk_view`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskViewEntry {
    pub path: String,
    pub dir: bool,
    pub mode: u32,
    pub owner: u32,
}

/// How a disk at `path` (a clean relative path) appears in a layer: the directories above it
/// (0755), outermost first, then the disk file (0644), all owned by [`DISK_OWNER`]. What
/// `vmdisk push` writes and how a disk artifact's disk file is shown.
pub fn disk_view(path: &str) -> impl Iterator<Item = DiskViewEntry> + '_ {
    let parts: Vec<&str> = path.split('/').collect();
    let dirs = parts.len() - 1;
    (1..=parts.len()).map(move |n| DiskViewEntry {
        path: parts[..n].join("/"),
        dir: n <= dirs,
        mode: if n <= dirs { 0o755 } else { 0o644 },
        owner: DISK_OWNER,
    })
}

/// Whether `path` (clean, relative) is the disk: the path the layer's annotation names
/// (`wanted`), or without one, a path under one of the [`DISK_DIRS`].
pub fn is_disk_path(path: &str, wanted: Option<&str>) -> bool {
    match wanted {
        Some(w) => path == w,
        None => DISK_DIRS.iter().any(|d| path.starts_with(d)),
    }
}

/// The in-layer path for a disk: `--path` (absolute, clean) or `disk/<file name>`.
pub fn layer_path(path: Option<&str>, file_name: &str) -> Result<String> {
    match path {
        Some(p) => {
            if !p.starts_with('/') || p.ends_with('/') {
                return Err(Error::invalid(format!(
                    "--path {p:?} must be an absolute file path such as /disk/disk.qcow2"
                )));
            }
            let clean = clean_path(p)
                .map_err(|_| Error::invalid(format!("--path {p:?} must not contain '..'")))?;
            if !clean.contains('/') {
                return Err(Error::invalid(format!(
                    "--path {p:?} must name a file inside a directory (e.g. /disk/{file_name})"
                )));
            }
            Ok(clean)
        }
        None => {
            if file_name.is_empty() || file_name.contains('/') || file_name.starts_with('.') {
                return Err(Error::invalid(format!(
                    "disk file name {file_name:?} cannot be used under /disk/"
                )));
            }
            Ok(format!("{}{file_name}", DISK_DIRS[0]))
        }
    }
}

/// Checks a publishing chunk size: a power of two from 64 KiB to 16 MiB.
pub fn check_chunk_size(size: usize) -> Result<usize> {
    if !size.is_power_of_two() || !((64 << 10)..=(16 << 20)).contains(&size) {
        return Err(Error::invalid(format!(
            "chunk size {size} must be a power of two between 64K and 16M"
        )));
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_paths() {
        assert!(is_disk_path("disk/fedora.qcow2", None));
        assert!(is_disk_path("image/podvm.qcow2", None));
        assert!(!is_disk_path("etc/disk/x", None));
        assert!(!is_disk_path("diskette", None));
        assert!(is_disk_path("vm/x.raw", Some("vm/x.raw")));
        assert!(!is_disk_path("disk/x.raw", Some("vm/x.raw")));
    }

    #[test]
    fn a_disk_appears_under_its_directories_owned_by_kubevirts_qemu() {
        let view: Vec<_> = disk_view("a/b/c.qcow2").collect();
        let paths: Vec<_> = view
            .iter()
            .map(|v| (v.path.as_str(), v.dir, v.mode))
            .collect();
        assert_eq!(
            paths,
            [
                ("a", true, 0o755),
                ("a/b", true, 0o755),
                ("a/b/c.qcow2", false, 0o644)
            ]
        );
        assert!(view.iter().all(|v| v.owner == 107));
    }

    #[test]
    fn chunk_sizes() {
        assert!(check_chunk_size(100_000).is_err());
        assert!(check_chunk_size(32 << 10).is_err());
        assert_eq!(check_chunk_size(1 << 20).unwrap(), 1 << 20);
    }

    #[test]
    fn layer_paths() {
        assert_eq!(
            layer_path(None, "fedora.qcow2").unwrap(),
            "disk/fedora.qcow2"
        );
        assert_eq!(
            layer_path(Some("/image/podvm.qcow2"), "x").unwrap(),
            "image/podvm.qcow2"
        );
        assert!(layer_path(Some("image/podvm.qcow2"), "x").is_err());
        assert!(layer_path(Some("/disk/../etc/x"), "x").is_err());
        assert!(layer_path(Some("/disk.qcow2"), "x").is_err());
        assert!(layer_path(None, ".hidden").is_err());
    }
}
