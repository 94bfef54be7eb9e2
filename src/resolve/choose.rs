//! Which layer of an image holds its disk, and what a seekable index of it must describe: the
//! rules every reader asks (the daemon's classifier, resolution, `vmdisk index`, `inspect`),
//! next to the image layout they read ([`crate::format::layout`]).
//!
//! - The disk layer of an image with a TOC of its own is its topmost zstd:chunked or eStargz
//!   layer ([`disk_layer`]).
//! - Else its topmost gzip or uncompressed tar layer, read through a seekable index
//!   ([`indexable_layer`]); a disk artifact's disk file is chosen by the artifact's own rules
//!   ([`crate::format::artifact`]). [`index_target`] says which, and what its index must say.

use super::image::{diff_id_of, image_config};
use crate::cache::CacheRoot;
use crate::error::{Error, Result};
use crate::format::seekable::{Compression, Expected, Layout};
use crate::format::zstd_chunked::TocLocation;
use crate::format::{artifact, estargz};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::{self, Descriptor};
use crate::registry::Registry;

/// What a layer's descriptor says it is, by its media type and annotations: the one place
/// this is read from them (resolution, the daemon's classifier through [`disk_layer`],
/// `vmdisk index`, `vmdisk inspect`).
#[derive(Debug)]
pub enum LayerForm {
    /// A layer with a TOC of its own, where its annotations pin it.
    Toc(TocPin),
    /// A tar layer with no TOC of its own, of this compression: read lazily only through a
    /// seekable index.
    Plain(oci::LayerCompression),
    /// Not a tar layer.
    NotTar,
}

/// Where a layer's annotations pin its TOC: a zstd:chunked layer's or an eStargz layer's
/// ([`crate::layer::LayerKind`] once resolved).
#[derive(Debug)]
pub enum TocPin {
    /// A zstd:chunked layer's: the skippable frame at this location, of this checksum.
    Frame(TocLocation),
    /// An eStargz layer's (gzip): the TOC JSON of this digest in the last member.
    Digest(Digest),
}

/// What `layer`'s descriptor says it is; an error names a TOC annotation that is there but
/// refused (malformed, out of bounds).
pub fn layer_form(layer: &Descriptor) -> Result<LayerForm> {
    let Some(compression) = oci::layer_compression(&layer.media_type) else {
        return Ok(LayerForm::NotTar);
    };
    Ok(match compression {
        oci::LayerCompression::Zstd => match TocLocation::from_annotations(&layer.annotations)? {
            Some(loc) => LayerForm::Toc(TocPin::Frame(loc)),
            None => LayerForm::Plain(compression),
        },
        oci::LayerCompression::Gzip => match layer.annotations.get(estargz::ANN_TOC_DIGEST) {
            Some(digest) => {
                LayerForm::Toc(TocPin::Digest(digest.parse().map_err(|e: Error| {
                    e.context(format!("annotation {}", estargz::ANN_TOC_DIGEST))
                })?))
            }
            None => LayerForm::Plain(compression),
        },
        oci::LayerCompression::None => LayerForm::Plain(compression),
    })
}

/// Picks the disk layer of a manifest: the topmost layer with a TOC, zstd:chunked or eStargz.
pub fn disk_layer(m: &oci::Manifest) -> Option<&Descriptor> {
    disk_layer_and_toc(m).map(|(layer, _)| layer)
}

/// [`disk_layer`] with where its TOC is pinned.
pub(super) fn disk_layer_and_toc(m: &oci::Manifest) -> Option<(&Descriptor, TocPin)> {
    m.layers.iter().rev().find_map(|l| match layer_form(l) {
        Ok(LayerForm::Toc(pin)) => Some((l, pin)),
        _ => None,
    })
}

/// Why `m` has no disk layer with a TOC though a layer's annotations name one: the topmost
/// TOC annotation that is there but refused, if any.
pub fn refused_toc(m: &oci::Manifest) -> Option<Error> {
    m.layers.iter().rev().find_map(|l| layer_form(l).err())
}

/// The disk's path in `layer`, when its annotation names one.
pub(super) fn disk_path_of(layer: &Descriptor) -> Result<Option<String>> {
    layer
        .annotations
        .get(crate::format::layout::ANN_PATH)
        .map(|p| crate::format::tree::clean_path(p))
        .transpose()
        .map_err(|e| {
            e.context(format!(
                "the {} annotation",
                crate::format::layout::ANN_PATH
            ))
        })
}

/// The layer of an ordinary image that may hold its disk: the topmost gzip or uncompressed tar
/// layer, its position and compression.
pub fn indexable_layer(m: &oci::Manifest) -> Option<(usize, &Descriptor, Compression)> {
    m.layers.iter().enumerate().rev().find_map(|(i, l)| {
        match oci::layer_compression(&l.media_type)? {
            oci::LayerCompression::Gzip => Some((i, l, Compression::Gzip)),
            oci::LayerCompression::None => Some((i, l, Compression::None)),
            oci::LayerCompression::Zstd => None,
        }
    })
}

/// The layer of an image with no TOC of its own, or of a disk artifact, that a seekable index
/// must describe, and what it must say about it.
pub struct IndexTarget<'m> {
    pub layer: &'m Descriptor,
    pub expected: Expected,
    /// Where a disk artifact's disk appears in the view (part of its identity).
    pub disk_path: Option<String>,
}

/// What a seekable index of `manifest` must describe: an image's topmost gzip or uncompressed
/// tar layer with the diff_id its config claims, or a disk artifact's disk file with the digest
/// the artifact pins for it. The one place both `vmdisk index` and the readers ask.
pub async fn index_target<'m>(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    reference: &Reference,
    manifest: &'m oci::Manifest,
) -> Result<IndexTarget<'m>> {
    if artifact::is_artifact(manifest) {
        let disk = artifact::disk_file(manifest).map_err(|e| {
            e.context(format!(
                "{reference} is an OCI artifact ({})",
                manifest
                    .artifact_type
                    .as_deref()
                    .unwrap_or(&manifest.config.media_type)
            ))
        })?;
        return Ok(IndexTarget {
            layer: disk.layer,
            expected: Expected {
                layer: disk.layer.digest,
                layer_size: disk.layer.size,
                compression: None,
                diff_id: disk.digest,
                layout: Layout::File,
            },
            disk_path: Some(disk.path),
        });
    }
    let Some((position, layer, compression)) = indexable_layer(manifest) else {
        return Err(Error::unsupported(format!("{reference} has no zstd:chunked layer and no gzip or uncompressed tar layer a seekable index could describe; republish it with `vmdisk convert`")));
    };
    let config = image_config(client, cache, reference, manifest).await?;
    Ok(IndexTarget {
        layer,
        expected: Expected {
            layer: layer.digest,
            layer_size: layer.size,
            compression: Some(compression),
            diff_id: Some(diff_id_of(&config, manifest, position, reference)?),
            layout: Layout::Tar,
        },
        disk_path: None,
    })
}
