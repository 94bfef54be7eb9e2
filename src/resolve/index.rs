//! Finding the seekable index of a layer with no TOC of its own: among the referrers of its
//! image manifest, in the image's repository and then in each configured index repository,
//! the newest whose artifact names that subject and whose index validates against the layer.

use super::choose::index_target;
use crate::cache::CacheRoot;
use crate::error::{Error, ErrorKind, Result};
use crate::format::seekable::{self, Compression, Expected, Layout, SeekIndex};
use crate::layer::{IndexSource, LayerId, LayerKind, LayerMeta};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::{self, Descriptor, ManifestKind};
use crate::policy::Verifier;
use crate::registry::Registry;
use crate::task::blocking;

/// The disk layer of an image or disk artifact with no TOC of its own, its record and the
/// bytes of the seekable index published for it. A disk artifact's identity is the
/// artifact's: the layer, the index, the disk's path in the view and the digest the artifact
/// pins for the disk (else the index's, checked once complete).
pub(super) async fn seekable_layer_id(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    trust: &Verifier,
    reference: &Reference,
    manifest: &oci::Manifest,
    manifest_digest: Digest,
) -> Result<(Descriptor, LayerMeta, Vec<u8>)> {
    let target = index_target(client, cache, reference, manifest).await?;
    let found = find_index(
        client,
        cache,
        trust,
        reference,
        manifest_digest,
        &target.expected,
        target.disk_path.as_deref(),
    )
    .await?;
    let (meta, bytes) = indexed_meta(reference, target.layer, found, target.disk_path);
    Ok((target.layer.clone(), meta, bytes))
}

/// The seekable index the disk layer of `manifest` (an image with no TOC, or a disk
/// artifact) is read through, found as the daemon finds it, with its record: what `inspect`
/// reports.
pub async fn seekable_layer(
    client: &dyn Registry,
    trust: &Verifier,
    reference: &Reference,
    manifest: &oci::Manifest,
    manifest_digest: Digest,
) -> Result<(LayerMeta, SeekIndex)> {
    let (_, meta, bytes) =
        seekable_layer_id(client, None, trust, reference, manifest, manifest_digest).await?;
    let source = meta
        .index_source()
        .expect("an indexed layer's record names its index");
    let expected = crate::layer::codec::indexed::expected(&meta, source);
    let index = blocking(move || SeekIndex::decode(&bytes, &expected)).await?;
    Ok((meta, index))
}

/// The record of `layer` read through the index `found`, and the index's bytes.
fn indexed_meta(
    reference: &Reference,
    layer: &Descriptor,
    found: FoundIndex,
    disk_path: Option<String>,
) -> (LayerMeta, Vec<u8>) {
    let meta = LayerMeta {
        reference: reference.clone(),
        layer_digest: layer.digest,
        layer_size: layer.size,
        toc_offset: 0,
        toc_length: found.bytes.len() as u64,
        toc_uncompressed_length: 0,
        toc_digest: found.digest,
        disk_path,
        diff_id: found.diff_id,
        kind: LayerKind::Indexed(IndexSource {
            repository: found.repository.clone(),
            compression: found.compression,
            layout: found.layout,
        }),
    };
    (meta, found.bytes)
}

/// A seekable index found for a layer: where, its blob digest and bytes (checked), and what
/// it says the layer is.
struct FoundIndex {
    repository: Reference,
    digest: Digest,
    bytes: Vec<u8>,
    compression: Compression,
    layout: Layout,
    /// The uncompressed stream's digest (equal to the pinned one, when something pins it).
    diff_id: Digest,
}

/// Most index artifacts tried per repository (newest first).
const MAX_INDEX_CANDIDATES: usize = 4;

/// The seekable index of layer `expected` of image manifest `manifest_digest`: among its
/// referrers in the image's repository, then in each configured index repository, the
/// newest that the signature policy accepts, whose manifest names that subject and whose
/// index validates against the layer. `disk_path` is where a disk artifact's disk appears
/// (part of its identity). NotFound (saying what was tried) when there is none.
async fn find_index(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    trust: &Verifier,
    reference: &Reference,
    manifest_digest: Digest,
    expected: &Expected,
    disk_path: Option<&str>,
) -> Result<FoundIndex> {
    let own = Reference {
        tag: None,
        digest: None,
        ..reference.clone()
    };
    let mut refused = Vec::new();
    for repo in std::iter::once(&own).chain(client.index_repositories()) {
        let candidates = client
            .referrers(repo, &manifest_digest, &[seekable::ARTIFACT_TYPE])
            .await
            .map_err(|e| e.context(format!("looking up seekable indexes in {repo}")))?;
        for desc in candidates.iter().rev().take(MAX_INDEX_CANDIDATES) {
            // Nothing of an index is read before the policy accepts it.
            match trust.check_index(client, cache, repo, desc.digest).await {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::Refused => {
                    tracing::warn!(repository = %repo, index = %desc.digest, error = %e.chain(), "refusing a seekable index");
                    refused.push(e.chain());
                    continue;
                }
                Err(e) => {
                    return Err(e.context(format!(
                        "checking the signatures of index {}@{}",
                        repo, desc.digest
                    )))
                }
            }
            let found = index_from(
                client,
                cache,
                repo,
                desc,
                manifest_digest,
                expected,
                disk_path,
            );
            match found.await {
                Ok(found) => return Ok(found),
                Err(e) if e.kind() == ErrorKind::Network => return Err(e),
                Err(e) => {
                    tracing::warn!(repository = %repo, index = %desc.digest, error = %e.chain(), "refusing a seekable index");
                    refused.push(format!("{repo}@{}: {}", desc.digest, e.chain()));
                }
            }
        }
    }
    let searched = std::iter::once(&own)
        .chain(client.index_repositories())
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    Err(Error::new(
        ErrorKind::NotFound,
        if refused.is_empty() {
            format!("{reference} has no lazily loadable layer: no seekable index for its layer {} (searched {searched}); publish one with `vmdisk index`, or republish the image with `vmdisk convert`", expected.layer)
        } else {
            format!(
                "no usable seekable index for layer {} of {reference}: {}",
                expected.layer,
                refused.join("; ")
            )
        },
    ))
}

/// The index artifact `desc` in `repo`, if it is one for `subject` and `expected`; its blob
/// from `cache` when a layer read through it is kept there (the daemon found it first).
async fn index_from(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    repo: &Reference,
    desc: &Descriptor,
    subject: Digest,
    expected: &Expected,
    disk_path: Option<&str>,
) -> Result<FoundIndex> {
    let fetched = client.get_manifest(&repo.with_digest(desc.digest)).await?;
    let ManifestKind::Image(m) = fetched.manifest else {
        return Err(Error::corrupt(
            "the referrer is an index, not an artifact manifest",
        ));
    };
    let (blob, windows) = artifact_blobs(&m, subject, expected)?;
    if let Some(found) = kept_index(cache, repo, blob, expected, disk_path).await? {
        return Ok(found);
    }
    let bytes = client
        .get_blob(repo, blob, seekable::MAX_INDEX_BYTES)
        .await?;
    let expected = *expected;
    let (bytes, index) = blocking(move || {
        let index = SeekIndex::decode(&bytes, &expected)?;
        if index.layout == Layout::Tar && index.disk_entry().is_none() {
            return Err(Error::unsupported(
                "the indexed layer has no regular file under /disk/ or /image/",
            ));
        }
        if index.windows != windows {
            return Err(Error::corrupt(format!(
                "the index names the windows blob {:?}, the artifact holds {windows:?}",
                index.windows
            )));
        }
        Ok((bytes, index))
    })
    .await?;
    Ok(FoundIndex {
        repository: repo.clone(),
        digest: blob.digest,
        bytes,
        compression: index.compression,
        layout: index.layout,
        diff_id: index.diff_id,
    })
}

/// The index blob and the windows blob (if any) of seekable-index artifact `m`, after checking
/// that it is one (its type), that it refers to image manifest `subject` and indexes the
/// expected layer, and that its blobs are an index and its windows.
fn artifact_blobs<'m>(
    m: &'m oci::Manifest,
    subject: Digest,
    expected: &Expected,
) -> Result<(&'m Descriptor, Option<seekable::Windows>)> {
    if m.artifact_type.as_deref() != Some(seekable::ARTIFACT_TYPE) {
        return Err(Error::corrupt(format!(
            "the artifact's type is {:?}, not {}",
            m.artifact_type,
            seekable::ARTIFACT_TYPE
        )));
    }
    match &m.subject {
        Some(s) if s.digest == subject => {}
        other => {
            return Err(Error::corrupt(format!(
                "the artifact refers to {}, not image manifest {subject}",
                other
                    .as_ref()
                    .map_or("nothing".into(), |s| s.digest.to_string())
            )))
        }
    }
    if m.annotations
        .get(seekable::ANN_LAYER)
        .is_some_and(|l| *l != expected.layer.to_string())
    {
        return Err(Error::corrupt(format!(
            "the artifact indexes layer {}, not {}",
            m.annotations[seekable::ANN_LAYER],
            expected.layer
        )));
    }
    let (blob, windows) = match m.layers.as_slice() {
        [blob] => (blob, None),
        [blob, windows] => (blob, Some(windows)),
        _ => {
            return Err(Error::corrupt(
                "the artifact has not one or two blobs (the index and its windows)",
            ))
        }
    };
    if blob.media_type != seekable::MEDIA_TYPE
        || windows.is_some_and(|w| w.media_type != seekable::WINDOWS_MEDIA_TYPE)
    {
        return Err(Error::corrupt(format!(
            "the artifact's blobs are {}, not {} and {}",
            m.layers
                .iter()
                .map(|l| l.media_type.as_str())
                .collect::<Vec<_>>()
                .join(" and "),
            seekable::MEDIA_TYPE,
            seekable::WINDOWS_MEDIA_TYPE
        )));
    }
    // The windows blob the index names must be the one the artifact holds (so the registry
    // keeps it).
    let windows = windows.map(|w| seekable::Windows {
        digest: w.digest,
        size: w.size,
    });
    Ok((blob, windows))
}

/// The index `blob` as the cache keeps it for a layer read through it before: kept under the
/// layer's identity, which needs the digest of the stream (known when the manifest pins it);
/// kept only after it was checked, and re-checked against its digest when loaded.
async fn kept_index(
    cache: Option<&CacheRoot>,
    repo: &Reference,
    blob: &Descriptor,
    expected: &Expected,
    disk_path: Option<&str>,
) -> Result<Option<FoundIndex>> {
    let (Some(cache), Some(diff_id)) = (cache.cloned(), expected.diff_id) else {
        return Ok(None);
    };
    let key = LayerId::indexed(
        expected.layer,
        expected.layer_size,
        blob.digest,
        diff_id,
        disk_path.map(str::to_string),
    )
    .key();
    let Some((meta, bytes)) = blocking(move || Ok(cache.load_layer_meta(&key))).await? else {
        return Ok(None);
    };
    let LayerKind::Indexed(source) = meta.kind else {
        return Ok(None);
    };
    Ok(Some(FoundIndex {
        repository: repo.clone(),
        digest: blob.digest,
        bytes,
        compression: source.compression,
        layout: source.layout,
        diff_id: meta.diff_id,
    }))
}
