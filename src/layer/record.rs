//! What a lazily read layer is and what identifies it: the record the cache keeps of a layer
//! (`meta.json`), its kind and its key.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::seekable::{Compression, Layout};
use crate::format::zstd_chunked::TocLocation;
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;

/// What kind of layer it is, and so where its TOC or index is and how its bytes decode
/// ([`super::codec`] has one codec per kind).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// zstd:chunked: the TOC in a skippable frame near the end of the blob, pinned by the
    /// layer's annotation.
    ZstdChunked,
    /// eStargz: the TOC JSON in the last gzip member before the footer, pinned by the
    /// layer's annotation (the record's `toc_offset` is where that member starts).
    Estargz,
    /// An ordinary gzip or uncompressed tar layer, or a disk artifact's disk file, read
    /// through the seekable index found for it (the record's `toc_*` describe the index).
    Indexed(IndexSource),
}

impl LayerKind {
    /// What a layer's identity says of its kind (not where its index is).
    fn keyed(&self) -> Keyed {
        match self {
            LayerKind::ZstdChunked => Keyed::ZstdChunked,
            LayerKind::Estargz => Keyed::Estargz,
            LayerKind::Indexed(_) => Keyed::Indexed,
        }
    }
}

/// A [`LayerKind`] as its identity names it: the kind without where its index was found. Only
/// [`LayerId`] holds one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Keyed {
    ZstdChunked,
    Estargz,
    Indexed,
}

/// Where a layer's seekable index was found, and the layer's compression and layout.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct IndexSource {
    /// The repository holding the index (`registry/repository`; parsed, and so checked, when a
    /// record is read).
    pub repository: Reference,
    pub compression: Compression,
    /// A tar (an image layer) or the disk file itself (a disk artifact's layer).
    #[serde(default)]
    pub layout: Layout,
}

/// What identifies a lazily read layer: everything its (digest-pinned) manifest and config
/// say about it, and for an ordinary layer read through a seekable index, the index's digest.
/// The TOC (or index) digest pins every chunk's digest, so two images with the same id
/// serve the same bytes; the blob digest and the diff_id are claims, checked only once the
/// layer is complete (see `engine::integrity`), and part of the id so that an image that
/// lies about them never shares, or spoils, another image's cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerId {
    /// The blob digest the manifest names.
    pub layer: Digest,
    /// The blob size the manifest names.
    pub size: u64,
    /// The TOC digest the layer's annotation pins (of an indexed layer: the index blob's).
    pub toc: Digest,
    /// Where the annotation says the TOC is (the end of the tar data).
    pub toc_offset: u64,
    /// The uncompressed digest the image config claims (`rootfs.diff_ids`).
    pub diff_id: Digest,
    /// The disk's path in the layer, when an annotation names it.
    pub disk_path: Option<String>,
    kind: Keyed,
}

impl LayerId {
    /// The identity of a layer read through the seekable index `index` (at offset 0 of its
    /// own blob) that describes the blob `layer` of `size` bytes, whose uncompressed digest the
    /// manifest pins as `diff_id`; `disk_path` where an artifact names the disk's path.
    pub fn indexed(
        layer: Digest,
        size: u64,
        index: Digest,
        diff_id: Digest,
        disk_path: Option<String>,
    ) -> Self {
        LayerId {
            layer,
            size,
            toc: index,
            toc_offset: 0,
            diff_id,
            disk_path,
            kind: Keyed::Indexed,
        }
    }

    /// The single digest that names the layer in the cache, in mount paths and in the
    /// snapshotter's records.
    pub fn key(&self) -> Digest {
        let mut text = format!(
            "vmdisk layer v1\nblob {} {}\ntoc {} at {}\ndiff_id {}\ndisk {}\n",
            self.layer,
            self.size,
            self.toc,
            self.toc_offset,
            self.diff_id,
            self.disk_path.as_deref().unwrap_or("")
        );
        match self.kind {
            Keyed::ZstdChunked => {}
            Keyed::Indexed => text.push_str("seekable index\n"),
            Keyed::Estargz => text.push_str("estargz\n"),
        }
        Digest::of(text.as_bytes())
    }
}

/// Where a cached layer comes from, persisted as `meta.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "MetaRecord", into = "MetaRecord")]
pub struct LayerMeta {
    /// Registry and repository to fetch chunks from (the reference it was resolved from).
    pub reference: crate::oci::reference::Reference,
    pub layer_digest: Digest,
    pub layer_size: u64,
    pub toc_offset: u64,
    pub toc_length: u64,
    pub toc_uncompressed_length: u64,
    pub toc_digest: Digest,
    /// The disk's path in the layer, when an annotation named it.
    pub disk_path: Option<String>,
    /// The layer's uncompressed digest as the image config claims it.
    pub diff_id: Digest,
    pub kind: LayerKind,
}

impl LayerMeta {
    /// The layer's identity.
    pub fn id(&self) -> LayerId {
        LayerId {
            layer: self.layer_digest,
            size: self.layer_size,
            toc: self.toc_digest,
            toc_offset: self.toc_offset,
            diff_id: self.diff_id,
            disk_path: self.disk_path.clone(),
            kind: self.kind.keyed(),
        }
    }

    /// Where a zstd:chunked layer's TOC is, as the record says.
    pub fn toc_location(&self) -> TocLocation {
        TocLocation {
            offset: self.toc_offset,
            length: self.toc_length,
            uncompressed_length: self.toc_uncompressed_length,
            checksum: self.toc_digest,
        }
    }

    /// Where the index of a layer read through one was found.
    pub fn index_source(&self) -> Option<&IndexSource> {
        match &self.kind {
            LayerKind::Indexed(source) => Some(source),
            _ => None,
        }
    }
}

/// `meta.json` as written since the first release: the kind spelled as an optional index and
/// an eStargz flag, so caches of earlier versions keep their layers.
#[derive(Clone, Serialize, Deserialize)]
struct MetaRecord {
    reference: crate::oci::reference::Reference,
    layer_digest: Digest,
    layer_size: u64,
    toc_offset: u64,
    toc_length: u64,
    toc_uncompressed_length: u64,
    toc_digest: Digest,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    disk_path: Option<String>,
    diff_id: Digest,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    index: Option<IndexSource>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    estargz: bool,
}

impl TryFrom<MetaRecord> for LayerMeta {
    type Error = Error;

    fn try_from(r: MetaRecord) -> Result<Self> {
        let kind = match (r.index, r.estargz) {
            (None, false) => LayerKind::ZstdChunked,
            (None, true) => LayerKind::Estargz,
            (Some(source), false) => LayerKind::Indexed(source),
            (Some(_), true) => {
                return Err(Error::corrupt(
                    "the layer record is both eStargz and read through an index",
                ))
            }
        };
        Ok(LayerMeta {
            reference: r.reference,
            layer_digest: r.layer_digest,
            layer_size: r.layer_size,
            toc_offset: r.toc_offset,
            toc_length: r.toc_length,
            toc_uncompressed_length: r.toc_uncompressed_length,
            toc_digest: r.toc_digest,
            disk_path: r.disk_path,
            diff_id: r.diff_id,
            kind,
        })
    }
}

impl From<LayerMeta> for MetaRecord {
    fn from(m: LayerMeta) -> Self {
        let estargz = m.kind == LayerKind::Estargz;
        MetaRecord {
            reference: m.reference,
            layer_digest: m.layer_digest,
            layer_size: m.layer_size,
            toc_offset: m.toc_offset,
            toc_length: m.toc_length,
            toc_uncompressed_length: m.toc_uncompressed_length,
            toc_digest: m.toc_digest,
            disk_path: m.disk_path,
            diff_id: m.diff_id,
            index: match m.kind {
                LayerKind::Indexed(source) => Some(source),
                _ => None,
            },
            estargz,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(kind: LayerKind) -> LayerMeta {
        LayerMeta {
            reference: "r.example/vm:1".parse().unwrap(),
            layer_digest: Digest::of(b"blob"),
            layer_size: 10,
            toc_offset: 5,
            toc_length: 3,
            toc_uncompressed_length: 0,
            toc_digest: Digest::of(b"toc"),
            disk_path: None,
            diff_id: Digest::of(b"tar"),
            kind,
        }
    }

    /// The records and keys of earlier versions still read: a cache survives an upgrade.
    #[test]
    fn records_and_keys_are_those_of_earlier_versions() {
        let indexed = LayerKind::Indexed(IndexSource {
            repository: "r.example/vm".parse().unwrap(),
            compression: Compression::Gzip,
            layout: Layout::Tar,
        });
        for (kind, field) in [
            (LayerKind::ZstdChunked, None),
            (LayerKind::Estargz, Some("\"estargz\":true")),
            (indexed, Some("\"index\":{")),
        ] {
            let m = meta(kind);
            let json = serde_json::to_string(&m).unwrap();
            assert!(!json.contains("kind"), "{json}");
            match field {
                Some(f) => assert!(json.contains(f), "{json}"),
                None => assert!(
                    !json.contains("estargz") && !json.contains("index"),
                    "{json}"
                ),
            }
            assert_eq!(serde_json::from_str::<LayerMeta>(&json).unwrap(), m);
        }
        // The key text is the one the first release wrote.
        let key = |kind: Keyed, tail: &str| {
            let id = LayerId {
                kind,
                ..meta(LayerKind::ZstdChunked).id()
            };
            let text = format!(
                "vmdisk layer v1\nblob {} 10\ntoc {} at 5\ndiff_id {}\ndisk \n{tail}",
                Digest::of(b"blob"),
                Digest::of(b"toc"),
                Digest::of(b"tar")
            );
            assert_eq!(id.key(), Digest::of(text.as_bytes()));
        };
        key(Keyed::ZstdChunked, "");
        key(Keyed::Indexed, "seekable index\n");
        key(Keyed::Estargz, "estargz\n");
        let both = r#"{"reference":"r","layer_digest":"sha256:0000000000000000000000000000000000000000000000000000000000000000","layer_size":1,"toc_offset":0,"toc_length":1,"toc_uncompressed_length":0,"toc_digest":"sha256:0000000000000000000000000000000000000000000000000000000000000000","diff_id":"sha256:0000000000000000000000000000000000000000000000000000000000000000","index":{"repository":"r","compression":"gzip"},"estargz":true}"#;
        assert!(serde_json::from_str::<LayerMeta>(both).is_err());
    }
}
