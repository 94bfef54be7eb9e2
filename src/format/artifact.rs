//! Disk artifacts: OCI artifacts whose layer *is* a VM disk file — raw or qcow2, gzip-compressed
//! or not, never a tar — described by annotations: KubeVirt's VM export, disks pushed with
//! `oras push`, build systems' disk images. They are not container images (no rootfs, often an
//! empty config), so containerd cannot pull or run them, but with a seekable index
//! (`vmdisk index`) the node serves their disk lazily like a containerDisk's: `vmdisk path` and
//! `mount`, the runtime shim, libvirt pools. An artifact may also carry an archive holding the
//! disk (the peer-pod images' `podvm.tar.xz`), which `vmdisk convert` republishes.
//!
//! This module owns the rules: what makes a manifest an artifact, which of its layers is the
//! disk, the disk's place in the lazy view and the digest the artifact pins for it. Media
//! types and titles only *select*; what a blob is compressed with is read from its first bytes
//! ([`Codec::sniff`]), because artifact media types are known to lie (a build system advertised
//! gzip for uncompressed qcow2).

use std::io::Read;

use crate::error::{Error, ErrorKind, Result};
use crate::format::layout::{is_disk_path, ANN_DISK_DIGEST, ANN_PATH, DISK_DIRS};
use crate::format::tree::clean_path;
use crate::oci::digest::Digest;
use crate::oci::{self, Descriptor, Manifest};

/// The file name a layer carries (OCI's standard annotation, set by oras).
pub const ANN_TITLE: &str = "org.opencontainers.image.title";
/// The name a disk gets in the lazy view when its title gives none that fits.
const DEFAULT_NAME: &str = "disk.img";

/// What a blob is compressed with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    Gzip,
    Xz,
    Zstd,
    Bzip2,
    /// Not compressed.
    Plain,
}

impl Codec {
    /// The codec a stream's first bytes announce (anything else is taken as plain).
    pub fn sniff(head: &[u8]) -> Codec {
        if head.starts_with(&[0x1f, 0x8b]) {
            Codec::Gzip
        } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
            Codec::Xz
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Codec::Zstd
        } else if head.starts_with(b"BZh") {
            Codec::Bzip2
        } else {
            Codec::Plain
        }
    }

    /// The codec a file-name or media-type suffix names (`gz`, `gzip`, `xz`, `zst`, ...).
    fn from_suffix(suffix: &str) -> Option<Codec> {
        match suffix {
            "gz" | "gzip" | "tgz" => Some(Codec::Gzip),
            "xz" | "txz" => Some(Codec::Xz),
            "zst" | "zstd" => Some(Codec::Zstd),
            "bz2" | "bzip2" => Some(Codec::Bzip2),
            _ => None,
        }
    }

    /// A reader of what `blob`, compressed with this codec, holds (concatenated members or
    /// streams, as the command-line tools write them).
    pub fn decoder<'a>(self, blob: impl Read + 'a) -> Result<Box<dyn Read + 'a>> {
        Ok(match self {
            Codec::Plain => Box::new(blob),
            Codec::Gzip => Box::new(flate2::read::MultiGzDecoder::new(blob)),
            Codec::Xz => Box::new(liblzma::read::XzDecoder::new_multi_decoder(blob)),
            Codec::Zstd => Box::new(
                zstd::stream::read::Decoder::new(blob)
                    .map_err(|e| Error::io("starting the zstd decoder", e))?,
            ),
            Codec::Bzip2 => {
                return Err(Error::unsupported(
                    "the layer is bzip2-compressed, which vmdisk does not read; recompress it with gzip, xz or zstd",
                ))
            }
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Codec::Gzip => "gzip",
            Codec::Xz => "xz",
            Codec::Zstd => "zstd",
            Codec::Bzip2 => "bzip2",
            Codec::Plain => "none",
        }
    }
}

/// What a layer of an artifact carries, as its title or media type says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Payload {
    /// A disk file (`*.qcow2`, `*.img`, `*.raw`, or a disk media type), perhaps compressed.
    Disk,
    /// A tar archive (`*.tar`, `*.tar.xz`, `*.tgz`, ...), which may hold a disk.
    Archive,
    /// Something else: a checksum file, metadata, a signature.
    Other,
    /// Nothing says.
    Unknown,
}

/// A layer of an artifact and what its descriptor says about it.
#[derive(Clone, Debug)]
pub struct ArtifactLayer<'a> {
    pub position: usize,
    pub layer: &'a Descriptor,
    pub payload: Payload,
    /// The compression the title or media type names (`None`: they do not say).
    pub compression: Option<Codec>,
    /// The file name the title gives, without its compression suffix.
    pub name: Option<String>,
}

/// The disk file of a disk artifact, and what the artifact pins about it.
#[derive(Clone, Debug)]
pub struct DiskFile<'a> {
    pub position: usize,
    pub layer: &'a Descriptor,
    /// Where the disk is in the lazy view: `disk/<name>`, or the layer's `vmdisk.path`.
    pub path: String,
    /// sha256 of the uncompressed disk, when the layer's annotation pins it.
    pub digest: Option<Digest>,
}

/// Whether `m` is an artifact rather than a container image: it says so (`artifactType`),
/// its config is not an image config, or none of its layers is a tar layer.
pub fn is_artifact(m: &Manifest) -> bool {
    m.artifact_type.is_some()
        || !matches!(
            m.config.media_type.as_str(),
            oci::OCI_CONFIG | oci::DOCKER_CONFIG
        )
        || m.layers
            .iter()
            .all(|l| oci::layer_compression(&l.media_type).is_none())
}

/// What `name` (a title or a media type's subtype, lower case) says: the payload its base
/// names and the compression its suffix names, and the base.
fn classify(name: &str) -> (Payload, Option<Codec>, &str) {
    let (base, codec) = match name.rsplit_once(['.', '+']) {
        Some((base, suffix)) => match Codec::from_suffix(suffix) {
            // `.tgz`/`.txz` are archives in one suffix.
            Some(c) if matches!(suffix, "tgz" | "txz") => return (Payload::Archive, Some(c), base),
            Some(c) => (base, Some(c)),
            None => (name, None),
        },
        None => (name, None),
    };
    let ext = base.rsplit_once(['.', '+']).map_or("", |(_, e)| e);
    let payload = match ext {
        "tar" => Payload::Archive,
        "qcow2" | "qcow" | "img" | "raw" => Payload::Disk,
        "sha256" | "sha512" | "sig" | "asc" | "json" | "txt" | "yaml" | "md" => Payload::Other,
        _ => Payload::Unknown,
    };
    (payload, codec, base)
}

/// What the descriptor of layer `position` says it carries.
fn describe(position: usize, layer: &Descriptor) -> ArtifactLayer<'_> {
    let title = layer
        .annotations
        .get(ANN_TITLE)
        .map(|t| t.to_ascii_lowercase());
    let media = layer.media_type.to_ascii_lowercase();
    let (mut payload, mut compression, mut name) = (Payload::Unknown, None, None);
    if let Some(title) = &title {
        let (p, c, base) = classify(title);
        (payload, compression) = (p, c);
        // The name keeps the title's case; only the suffix is dropped.
        let original = &layer.annotations[ANN_TITLE];
        name = Some(original[..base.len()].to_string());
    }
    // The media type decides what the title leaves open. oras labels every file it pushes
    // `application/vnd.oci.image.layer.v1.tar`, so an OCI tar media type says nothing here.
    let subtype = media.rsplit('/').next().unwrap_or("");
    if oci::layer_compression(&layer.media_type).is_none() {
        let (p, c, _) = classify(subtype);
        let names_disk = subtype.contains("qcow2")
            || subtype.contains(".disk")
            || subtype.contains("diskimage")
            || p == Payload::Disk;
        if payload == Payload::Unknown {
            payload = if names_disk { Payload::Disk } else { p };
        }
        if compression.is_none() {
            compression = c.or(match media.as_str() {
                "application/gzip" | "application/x-gzip" => Some(Codec::Gzip),
                _ => None,
            });
        }
    }
    ArtifactLayer {
        position,
        layer,
        payload,
        compression,
        name,
    }
}

/// Every layer of artifact `m`, described.
pub fn layers(m: &Manifest) -> Vec<ArtifactLayer<'_>> {
    m.layers
        .iter()
        .enumerate()
        .map(|(i, l)| describe(i, l))
        .collect()
}

/// The layer that holds `m`'s disk, as a file or inside an archive: the first disk layer, else
/// the first archive, else the only layer when nothing says what it is.
pub fn disk_source(m: &Manifest) -> Option<ArtifactLayer<'_>> {
    let all = layers(m);
    let first = |p: Payload| all.iter().find(|l| l.payload == p).cloned();
    first(Payload::Disk)
        .or_else(|| first(Payload::Archive))
        .or_else(|| match all.as_slice() {
            [only] if only.payload == Payload::Unknown => Some(only.clone()),
            _ => None,
        })
}

/// The disk file of disk artifact `m`: a layer that is the disk itself, gzip-compressed or not
/// (what a seekable index can read). Says why not when the artifact has none: no disk at all,
/// a disk in an archive, or one compressed with a codec that cannot be read from the middle.
pub fn disk_file(m: &Manifest) -> Result<DiskFile<'_>> {
    let Some(source) = disk_source(m) else {
        return Err(Error::new(
            ErrorKind::NotFound,
            "the artifact has no layer holding a disk (a *.qcow2, *.img or *.raw file, or a disk media type)",
        ));
    };
    let shown = source
        .layer
        .annotations
        .get(ANN_TITLE)
        .cloned()
        .unwrap_or_else(|| source.layer.digest.to_string());
    if source.payload == Payload::Archive {
        return Err(Error::unsupported(format!(
            "the artifact's disk is inside the archive {shown}, which cannot be read from the middle; republish it with `vmdisk convert`"
        )));
    }
    if let Some(c @ (Codec::Xz | Codec::Zstd | Codec::Bzip2)) = source.compression {
        return Err(Error::unsupported(format!(
            "the artifact's disk {shown} is {}-compressed, which cannot be read from the middle without a chunk index; republish it with `vmdisk convert`",
            c.name()
        )));
    }
    let path = match source.layer.annotations.get(ANN_PATH) {
        Some(p) => {
            let p = clean_path(p).map_err(|e| e.context(format!("the {ANN_PATH} annotation")))?;
            if !is_disk_path(&p, None) {
                return Err(Error::corrupt(format!(
                    "the {ANN_PATH} annotation puts the disk at {p}, outside /disk/ and /image/"
                )));
            }
            p
        }
        None => format!("{}{}", DISK_DIRS[0], view_name(source.name.as_deref())),
    };
    let digest = source
        .layer
        .annotations
        .get(ANN_DISK_DIGEST)
        .map(|d| d.parse::<Digest>())
        .transpose()
        .map_err(|e| e.context(format!("the {ANN_DISK_DIGEST} annotation of {shown}")))?;
    Ok(DiskFile {
        position: source.position,
        layer: source.layer,
        path,
        digest,
    })
}

/// Whether a file `name` (in an archive, say) is named like a disk: `*.qcow2`, `*.img`,
/// `*.raw`.
pub fn names_disk(name: &str) -> bool {
    classify(&name.to_ascii_lowercase()).0 == Payload::Disk
}

/// The file name the disk of `layer` gets: its title without a compression suffix when that
/// is a plain, printable name, else `disk.img`.
pub fn file_name(layer: &ArtifactLayer<'_>) -> String {
    view_name(layer.name.as_deref())
}

/// The disk's file name in the lazy view: the title's last component when it is a plain,
/// printable name, else [`DEFAULT_NAME`].
fn view_name(title: Option<&str>) -> String {
    let Some(name) = title.and_then(|t| t.rsplit('/').next()) else {
        return DEFAULT_NAME.into();
    };
    let plain = !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name.chars().all(|c| !c.is_control() && c != '\\');
    if plain {
        name.to_string()
    } else {
        DEFAULT_NAME.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn layer(media_type: &str, annotations: &[(&str, &str)]) -> Descriptor {
        Descriptor {
            annotations: annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
            ..Descriptor::of(media_type, media_type.as_bytes())
        }
    }

    fn artifact(layers: Vec<Descriptor>) -> Manifest {
        Manifest {
            schema_version: 2,
            media_type: Some(oci::OCI_MANIFEST.into()),
            artifact_type: Some("application/vnd.unknown.artifact.v1".into()),
            config: Descriptor::of(oci::OCI_EMPTY, b"{}"),
            layers,
            subject: None,
            annotations: BTreeMap::new(),
        }
    }

    #[test]
    fn artifacts_are_told_from_images() {
        let tar = layer(oci::OCI_LAYER_GZIP, &[]);
        let mut image = artifact(vec![tar.clone()]);
        image.artifact_type = None;
        image.config = Descriptor::of(oci::OCI_CONFIG, b"{}");
        assert!(!is_artifact(&image));
        assert!(is_artifact(&artifact(vec![tar.clone()])));
        // An image config over layers that are no tar (a build system's disk image).
        image.layers = vec![layer("application/vnd.diskimage.qcow2", &[])];
        assert!(is_artifact(&image));
    }

    #[test]
    fn the_disk_layer_is_chosen_by_title_or_media_type() {
        // oras push podvm.tar.xz: the tar media type oras gives every file, the title says.
        let m = artifact(vec![layer(
            oci::OCI_LAYER_TAR,
            &[(ANN_TITLE, "podvm.tar.xz")],
        )]);
        let s = disk_source(&m).unwrap();
        assert_eq!(
            (s.payload, s.compression, s.name.as_deref()),
            (Payload::Archive, Some(Codec::Xz), Some("podvm.tar"))
        );
        let e = disk_file(&m).unwrap_err();
        assert!(e.chain().contains("vmdisk convert"), "{}", e.chain());

        // KubeVirt's export: a gzip raw disk beside other layers.
        let m = artifact(vec![
            layer("text/plain", &[(ANN_TITLE, "SHA256SUMS")]),
            layer(
                "application/vnd.kubevirt.disk.raw+gzip",
                &[(ANN_TITLE, "rootdisk.raw.gz")],
            ),
        ]);
        let d = disk_file(&m).unwrap();
        assert_eq!(
            (d.position, d.path.as_str(), d.digest),
            (1, "disk/rootdisk.raw", None)
        );
        // Media type only, and a pinned digest.
        let digest = Digest::of(b"disk");
        let m = artifact(vec![layer(
            "application/vnd.kubevirt.disk.qcow2",
            &[(ANN_DISK_DIGEST, &digest.to_string())],
        )]);
        let d = disk_file(&m).unwrap();
        assert_eq!((d.path.as_str(), d.digest), ("disk/disk.img", Some(digest)));
        // One layer nobody describes is taken; a zstd disk is not lazily readable.
        let m = artifact(vec![layer(oci::OCI_LAYER_TAR, &[(ANN_TITLE, "fedora")])]);
        assert_eq!(disk_file(&m).unwrap().path, "disk/fedora");
        let m = artifact(vec![layer(
            "application/vnd.kubevirt.disk.raw+zstd",
            &[(ANN_TITLE, "rootdisk.raw.zst")],
        )]);
        assert!(disk_file(&m)
            .unwrap_err()
            .chain()
            .contains("zstd-compressed"));
        assert!(disk_file(&artifact(vec![layer(
            "text/plain",
            &[(ANN_TITLE, "a.json")]
        )]))
        .is_err());
    }

    #[test]
    fn crafted_annotations_never_place_the_disk_outside_its_directory() {
        let m = |title: &str, path: Option<&str>| {
            let mut a = vec![(ANN_TITLE, title)];
            if let Some(p) = path {
                a.push((ANN_PATH, p));
            }
            artifact(vec![layer("application/vnd.kubevirt.disk.qcow2", &a)])
        };
        assert_eq!(
            disk_file(&m("../../etc/x.qcow2", None)).unwrap().path,
            "disk/x.qcow2"
        );
        assert_eq!(disk_file(&m("..", None)).unwrap().path, "disk/disk.img");
        assert_eq!(
            disk_file(&m("a\nb.qcow2", None)).unwrap().path,
            "disk/disk.img"
        );
        assert_eq!(
            disk_file(&m(".hidden.img", None)).unwrap().path,
            "disk/disk.img"
        );
        assert_eq!(
            disk_file(&m("x.qcow2", Some("/image/podvm.qcow2")))
                .unwrap()
                .path,
            "image/podvm.qcow2"
        );
        assert!(disk_file(&m("x.qcow2", Some("etc/passwd"))).is_err());
        assert!(disk_file(&m("x.qcow2", Some("disk/../../x"))).is_err());
        let bad_digest = artifact(vec![layer(
            "application/vnd.kubevirt.disk.qcow2",
            &[(ANN_DISK_DIGEST, "md5:abc")],
        )]);
        assert!(disk_file(&bad_digest).is_err());
    }

    #[test]
    fn codecs_are_read_from_content() {
        assert_eq!(Codec::sniff(&[0x1f, 0x8b, 8, 0]), Codec::Gzip);
        assert_eq!(Codec::sniff(b"\xfd7zXZ\0\0"), Codec::Xz);
        assert_eq!(Codec::sniff(&[0x28, 0xb5, 0x2f, 0xfd, 0]), Codec::Zstd);
        assert_eq!(Codec::sniff(b"QFI\xfb"), Codec::Plain);
        assert_eq!(Codec::sniff(b""), Codec::Plain);
    }
}
