//! The ready-disk directory: what a runtime is handed. This module owns its layout and names;
//! the mount server, the CLI and the shim ask it and never spell a path themselves.
//!
//! ```text
//! <ready_dir>/<manifest digest hex>/   a FUSE mount of the layer's disk:
//!     <published name>                 the disk as published (qcow2 or raw)
//!     disk.raw                         its raw view (absent when qcow2 features forbid one)
//!     metadata.json                    ReadyMetadata
//! <ready_dir>/by-name/<alias>          symlink to the directory, by image reference
//! <ready_dir>/volumes/<alias>.raw      symlinks for a libvirt `dir` pool
//! <ready_dir>/volumes/<alias>.qcow2
//! ```
//!
//! Names come from references, which are caller-supplied: [`alias_name`] is injective and never
//! yields a path separator, `.` or `..`.
//!
//! Only root and one group, the one the VMs' hypervisor runs in, may read the ready disks:
//! every directory here is 0750 and every file 0440, owned by root and that group
//! ([`prepare_root`], [`crate::dirs`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::disk::DiskFormat;
use crate::oci::digest::Digest;
use crate::oci::reference::ImageName;

/// The raw view's file name.
pub const RAW_NAME: &str = "disk.raw";
/// The metadata's file name.
pub const METADATA_NAME: &str = "metadata.json";
/// Names a ready-disk directory generates; a published disk never shadows them.
pub const GENERATED_NAMES: [&str; 2] = [RAW_NAME, METADATA_NAME];

/// `metadata.json` of a ready-disk directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReadyMetadata {
    pub reference: String,
    pub layer_digest: String,
    pub platform: String,
    /// `qcow2` or `raw`.
    pub format: crate::format::disk::DiskFormat,
    pub virtual_size: u64,
    /// Size of the disk file as published.
    pub disk_size: u64,
    /// The published disk's file name in this directory; the raw view is `disk.raw`.
    pub disk: String,
    /// The disk's path inside the image.
    pub path_in_image: String,
    /// Why there is no `disk.raw`, when there is none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_error: Option<String>,
}

/// Where one layer's ready-disk directory and its links go.
#[derive(Clone, Debug)]
pub struct ReadyDir {
    /// The configured `ready_dir` this directory is under.
    pub root: PathBuf,
    /// The group that may read it (besides root).
    pub group: u32,
    /// The mount point, e.g. `/run/vmdisk/disks/<manifest digest hex>`.
    pub dir: PathBuf,
    /// A readable name for it (a symlink to `dir`), e.g. `/run/vmdisk/disks/by-name/<ref>`.
    pub alias: Option<PathBuf>,
    /// Links for a libvirt `dir` pool: `<volumes>.raw` and `<volumes>.<format>` point at the
    /// raw view and the published disk, e.g. `/run/vmdisk/disks/volumes/<ref>`.
    pub volumes: Option<PathBuf>,
    /// The reference the layer was resolved from, for `metadata.json`.
    pub reference: String,
    /// The image's platform, for `metadata.json`.
    pub platform: String,
}

impl ReadyDir {
    /// The directory of the image `manifest` under `root` (the configured `ready_dir`), with
    /// links named after `alias` (the reference the user pulled), if any, readable by `group`.
    pub fn new(
        root: &Path,
        group: u32,
        manifest: &Digest,
        alias: Option<&ImageName>,
        reference: String,
        platform: String,
    ) -> Self {
        ReadyDir {
            root: root.to_path_buf(),
            group,
            dir: dir_of(root, manifest),
            alias: alias.map(|a| root.join("by-name").join(alias_name(a.as_str()))),
            volumes: alias.map(|a| root.join(VOLUMES_DIR).join(alias_name(a.as_str()))),
            reference,
            platform,
        }
    }

    /// The symlinks (link, target) to make for this directory: its alias and its volumes.
    pub fn links(&self, metadata: &ReadyMetadata) -> Vec<(PathBuf, PathBuf)> {
        let mut links = Vec::new();
        if let Some(alias) = &self.alias {
            links.push((alias.clone(), self.dir.clone()));
        }
        if let Some(volumes) = &self.volumes {
            let with = |ext: &str| {
                let mut name = volumes.as_os_str().to_owned();
                name.push(format!(".{ext}"));
                PathBuf::from(name)
            };
            if metadata.raw_error.is_none() {
                links.push((with("raw"), self.dir.join(RAW_NAME)));
            }
            if metadata.format != DiskFormat::Raw {
                links.push((with(metadata.format.name()), self.dir.join(&metadata.disk)));
            }
        }
        links
    }
}

/// Makes the ready-disk root and its link directories, readable by root and `group` only.
pub fn prepare_root(root: &Path, group: u32) -> Result<()> {
    crate::dirs::shared(root, group)?;
    crate::dirs::shared(&root.join("by-name"), group)?;
    crate::dirs::shared(&root.join(VOLUMES_DIR), group)
}

/// The ready-disk directory of the image whose manifest is `manifest`.
pub fn dir_of(root: &Path, manifest: &Digest) -> PathBuf {
    root.join(manifest.hex())
}

/// The name the published disk at `path_in_layer` has in its ready-disk directory: its own
/// file name, unless that is one of the [`GENERATED_NAMES`] (then `image-<name>`), so
/// `disk.raw` is always the raw view and `metadata.json` always the metadata.
pub fn published_name(path_in_layer: &str) -> String {
    let name = path_in_layer.rsplit('/').next().unwrap_or("disk");
    if GENERATED_NAMES.contains(&name) {
        format!("image-{name}")
    } else {
        name.to_string()
    }
}

/// The published disk's path in `ready_dir`, for a disk at `path_in_layer`.
pub fn published_path(ready_dir: &Path, path_in_layer: &str) -> PathBuf {
    ready_dir.join(published_name(path_in_layer))
}

/// The `disk.raw` of a ready-disk directory, or the reason it has none.
pub fn raw_view_path(ready_dir: &Path) -> Result<PathBuf> {
    let raw = ready_dir.join(RAW_NAME);
    if raw.exists() {
        return Ok(raw);
    }
    let why = std::fs::read(ready_dir.join(METADATA_NAME))
        .ok()
        .and_then(|m| serde_json::from_slice::<ReadyMetadata>(&m).ok())
        .and_then(|m| m.raw_error)
        .unwrap_or_else(|| format!("{} is not mounted", ready_dir.display()));
    Err(Error::unsupported(format!("no raw view: {why}")))
}

/// The directory under the ready-disk root that holds the libvirt volume links.
pub const VOLUMES_DIR: &str = "volumes";

/// Which file of a ready-disk directory a runtime is handed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handed {
    /// The disk as published (qcow2 or raw).
    AsPublished,
    /// Its raw view, `disk.raw` (the disk itself when it is raw).
    Raw,
}

/// The libvirt volume name of `reference`'s disk in a `dir` pool over `<ready_dir>/volumes`,
/// as a disk in `format`: the raw view (`raw`), or the qcow2 as published.
pub fn volume_name(reference: &str, format: DiskFormat) -> String {
    format!("{}.{}", alias_name(reference), format.name())
}

/// The file name of an image reference in `by-name/` and `volumes/` (a libvirt volume name).
///
/// Injective, so two references never share a name and one never re-points another's links:
/// ASCII letters, digits, `.` and `-` stay as they are, `/` becomes `_`, `:` becomes `+`, and
/// every other byte (`_`, `+` and `%` included) becomes `%XX`. `registry.example/vm/fedora:39`
/// is `registry.example_vm_fedora+39`. A name that would be longer than 200 bytes keeps its
/// first 120 and ends in `%%` and the reference's sha256 (no short name contains `%%`).
pub fn alias_name(reference: &str) -> String {
    let mut name = String::with_capacity(reference.len());
    for b in reference.bytes() {
        match b {
            b'/' => name.push('_'),
            b':' => name.push('+'),
            b if b.is_ascii_alphanumeric() || b == b'.' || b == b'-' => name.push(b as char),
            b => name.push_str(&format!("%{b:02X}")),
        }
    }
    if name.starts_with('.') {
        // ".", ".." and hidden names are not file names to hand out.
        name = format!("%2E{}", &name[1..]);
    }
    if name.len() > 200 {
        let mut cut = 120;
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        name = format!(
            "{}%%{}",
            &name[..cut],
            Digest::of(reference.as_bytes()).hex()
        );
    }
    name
}

/// Points `link` at `target`, replacing what was there atomically; `link`'s directory exists
/// ([`prepare_root`]).
pub fn replace_symlink(link: &Path, target: &Path) -> Result<()> {
    let mut tmp = link.as_os_str().to_owned();
    tmp.push(".new");
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)
        .and_then(|()| std::fs::rename(&tmp, link))
        .map_err(|e| Error::io(format!("linking {}", link.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alias_names_are_readable_and_injective() {
        assert_eq!(
            alias_name("registry.example/vm/fedora:39"),
            "registry.example_vm_fedora+39"
        );
        // These collided when `/` and `:` both became `_`.
        let colliding = [
            "a/b/c:1",
            "a/b_c:1",
            "a/b_c+1",
            "a/b%5Fc:1",
            "a_b/c:1",
            "a/b/c/1",
            "..",
            ".a",
            "%2Ea",
        ];
        let names: Vec<String> = colliding.iter().map(|r| alias_name(r)).collect();
        for (i, a) in names.iter().enumerate() {
            assert!(!a.contains('/') && a != "." && a != ".." && !a.starts_with('.'));
            for (j, b) in names.iter().enumerate() {
                assert!(
                    i == j || a != b,
                    "{} and {} share {a}",
                    colliding[i],
                    colliding[j]
                );
            }
        }
        // Long references keep a readable start and stay distinct.
        let long = |c: char| format!("r.example/{}:1", c.to_string().repeat(300));
        let (x, y) = (alias_name(&long('x')), alias_name(&long('y')));
        assert!(x.len() <= 200 && x.starts_with("r.example_xxx") && x.contains("%%"));
        assert_ne!(x, y);
        let same_prefix = |tag: &str| alias_name(&format!("r.example/{}:{tag}", "z".repeat(300)));
        assert_ne!(same_prefix("1"), same_prefix("2"));
    }

    #[test]
    fn layout_and_links() {
        let manifest = Digest::of(b"manifest");
        let ready = ReadyDir::new(
            Path::new("/run/vmdisk/disks"),
            0,
            &manifest,
            Some(&"r.example/vm:1".parse().unwrap()),
            "r.example/vm@sha256:x".into(),
            "linux/amd64".into(),
        );
        assert_eq!(
            ready.dir,
            Path::new("/run/vmdisk/disks").join(manifest.hex())
        );
        let mut metadata = ReadyMetadata {
            reference: ready.reference.clone(),
            layer_digest: String::new(),
            platform: ready.platform.clone(),
            format: DiskFormat::Qcow2,
            virtual_size: 1,
            disk_size: 1,
            disk: published_name("disk/disk.raw"),
            path_in_image: "/disk/disk.raw".into(),
            raw_error: None,
        };
        assert_eq!(metadata.disk, "image-disk.raw");
        let links = ready.links(&metadata);
        let names: Vec<String> = links.iter().map(|(l, _)| l.display().to_string()).collect();
        assert_eq!(
            names,
            [
                "/run/vmdisk/disks/by-name/r.example_vm+1",
                "/run/vmdisk/disks/volumes/r.example_vm+1.raw",
                "/run/vmdisk/disks/volumes/r.example_vm+1.qcow2",
            ]
        );
        assert_eq!(links[2].1, ready.dir.join("image-disk.raw"));
        assert_eq!(
            volume_name("r.example/vm:1", DiskFormat::Qcow2),
            "r.example_vm+1.qcow2"
        );
        metadata.raw_error = Some("external data file".into());
        assert_eq!(ready.links(&metadata).len(), 2);
    }
}
