//! OCI and Docker image types: descriptors, manifests, indexes and configs, with the media
//! types we read and write. Parsing is strict about what we use and tolerant of extra fields.

pub mod digest;
pub mod reference;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::oci::digest::Digest;

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// The empty descriptor's media type (an artifact's config `{}`).
pub const OCI_EMPTY: &str = "application/vnd.oci.empty.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
pub const DOCKER_LAYER_TAR: &str = "application/vnd.docker.image.rootfs.diff.tar";

/// Upper bound for any manifest or index we accept (the distribution spec suggests 4 MiB).
pub const MAX_MANIFEST_SIZE: u64 = 4 << 20;
/// Upper bound for an image config.
pub const MAX_CONFIG_SIZE: u64 = 8 << 20;

/// The compression of a layer, from its media type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerCompression {
    None,
    Gzip,
    Zstd,
}

/// How a layer media type is compressed, or `None` for media types that are not tar layers.
pub fn layer_compression(media_type: &str) -> Option<LayerCompression> {
    match media_type {
        OCI_LAYER_TAR | DOCKER_LAYER_TAR => Some(LayerCompression::None),
        OCI_LAYER_GZIP | DOCKER_LAYER_GZIP => Some(LayerCompression::Gzip),
        OCI_LAYER_ZSTD | "application/vnd.docker.image.rootfs.diff.tar.zstd" => {
            Some(LayerCompression::Zstd)
        }
        _ => None,
    }
}

/// A content descriptor.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    pub media_type: String,
    pub digest: Digest,
    pub size: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    /// What an artifact manifest holds (in referrers indexes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
}

impl Descriptor {
    /// A descriptor of `data` with `media_type`.
    pub fn of(media_type: &str, data: &[u8]) -> Self {
        Descriptor {
            media_type: media_type.to_string(),
            digest: Digest::of(data),
            size: data.len() as u64,
            annotations: BTreeMap::new(),
            platform: None,
            artifact_type: None,
        }
    }
}

/// An OS/architecture pair, e.g. `linux/amd64` or `linux/arm64/v8`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Platform {
    pub os: String,
    pub architecture: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
}

impl Platform {
    /// Parse `os/arch[/variant]`.
    pub fn parse(s: &str) -> Result<Self> {
        let parts: Vec<&str> = s.split('/').collect();
        let ok =
            |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        match parts.as_slice() {
            [os, arch] if ok(os) && ok(arch) => Ok(Platform {
                os: os.to_string(),
                architecture: arch.to_string(),
                variant: None,
            }),
            [os, arch, var] if ok(os) && ok(arch) && ok(var) => Ok(Platform {
                os: os.to_string(),
                architecture: arch.to_string(),
                variant: Some(var.to_string()),
            }),
            _ => Err(Error::invalid(format!(
                "platform {s:?} is not of the form os/arch[/variant], e.g. linux/amd64"
            ))),
        }
    }

    /// The platform of this machine, in OCI's names.
    pub fn host() -> Self {
        let arch = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            "powerpc64" => "ppc64le",
            other => other,
        };
        Platform {
            os: "linux".into(),
            architecture: arch.into(),
            variant: None,
        }
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// An image manifest (OCI or Docker schema 2).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    /// Set for artifacts (OCI 1.1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
    /// The manifest an artifact refers to (OCI 1.1 referrers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<Box<Descriptor>>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// An image index (OCI) or manifest list (Docker).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    pub manifests: Vec<Descriptor>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// The parts of an image config we write and read.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ImageConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<String>,
    pub architecture: String,
    pub os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
    #[serde(default)]
    pub config: ContainerConfig,
    pub rootfs: RootFs,
}

/// The platform an image or artifact config names, if it names one: artifacts may have an
/// empty config (`{}`) or one with only `os` and `architecture`.
pub fn config_platform(config: &[u8]) -> Option<Platform> {
    #[derive(Deserialize)]
    struct Named {
        os: String,
        architecture: String,
        #[serde(default)]
        variant: Option<String>,
    }
    let named: Named = serde_json::from_slice(config).ok()?;
    Some(Platform {
        os: named.os,
        architecture: named.architecture,
        variant: named.variant,
    })
}

/// Whether an image config sets a program to run (a non-empty `Entrypoint` or `Cmd`): what
/// every ordinary container image does and a data image (`FROM scratch` and files: a
/// containerDisk, a peer-pod VM image) does not. A config that does not parse sets none.
pub fn config_runs_program(config: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Image {
        #[serde(default)]
        config: Option<Runtime>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Runtime {
        #[serde(default)]
        entrypoint: Option<Vec<String>>,
        #[serde(default)]
        cmd: Option<Vec<String>>,
    }
    serde_json::from_slice::<Image>(config)
        .ok()
        .and_then(|i| i.config)
        .is_some_and(|r| {
            r.entrypoint.is_some_and(|e| !e.is_empty()) || r.cmd.is_some_and(|c| !c.is_empty())
        })
}

/// The runtime part of an image config.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ContainerConfig {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// The layer list of an image config.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RootFs {
    #[serde(rename = "type")]
    pub kind: String,
    pub diff_ids: Vec<Digest>,
}

/// What a manifest endpoint returned.
// A handful live at a time, for the length of a resolution: boxing the larger variant would
// buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum ManifestKind {
    Image(Manifest),
    Index(Index),
}

/// Parse a manifest or index, using the media type from the body or the HTTP header.
pub fn parse_manifest(bytes: &[u8], content_type: Option<&str>) -> Result<ManifestKind> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Probe {
        schema_version: Option<u32>,
        media_type: Option<String>,
        manifests: Option<serde_json::Value>,
    }
    let probe: Probe = serde_json::from_slice(bytes)
        .map_err(|e| Error::corrupt(format!("manifest is not valid JSON: {e}")))?;
    if probe.schema_version != Some(2) {
        return Err(Error::unsupported(format!(
            "manifest schemaVersion {:?} is not supported (only schema 2 / OCI)",
            probe.schema_version
        )));
    }
    let media_type = probe.media_type.as_deref().or(content_type).unwrap_or("");
    let is_index = matches!(media_type, OCI_INDEX | DOCKER_MANIFEST_LIST)
        || (media_type.is_empty() && probe.manifests.is_some());
    let parsed = if is_index {
        serde_json::from_slice(bytes).map(ManifestKind::Index)
    } else {
        serde_json::from_slice(bytes).map(ManifestKind::Image)
    };
    parsed.map_err(|e| Error::corrupt(format!("manifest ({media_type}) is malformed: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn platform_round_trip() {
        let p = Platform::parse("linux/arm64/v8").unwrap();
        assert_eq!(p.to_string(), "linux/arm64/v8");
        assert!(Platform::parse("linux").is_err());
        assert!(Platform::parse("linux/../x").is_err());
    }

    #[test]
    fn detects_index_and_manifest() {
        let d = Digest::of(b"c");
        let m = format!(
            r#"{{"schemaVersion":2,"config":{{"mediaType":"{OCI_CONFIG}","digest":"{d}","size":1}},"layers":[]}}"#
        );
        assert!(matches!(
            parse_manifest(m.as_bytes(), Some(OCI_MANIFEST)).unwrap(),
            ManifestKind::Image(_)
        ));
        let i = format!(r#"{{"schemaVersion":2,"mediaType":"{OCI_INDEX}","manifests":[]}}"#);
        assert!(matches!(
            parse_manifest(i.as_bytes(), None).unwrap(),
            ManifestKind::Index(_)
        ));
        assert!(parse_manifest(b"{\"schemaVersion\":1}", None).is_err());
        assert!(parse_manifest(b"not json", None).is_err());
    }
}
