//! Image resolution: an image reference resolved to the layer that holds its disk — a
//! zstd:chunked or eStargz layer with its own TOC, an ordinary gzip or tar layer with the
//! seekable index published for it, or a disk artifact's disk file with its index — and that
//! layer's record and validated TOC (or index), ready to open as a [`Layer`].
//!
//! Resolution prefers the registry (manifest, config, then the TOC by one Range request,
//! verified against the annotation) and records the outcome in the cache under the layer's
//! identity ([`disk_layer_id`]: what the manifest and config say, never the blob digest
//! alone); when the registry cannot be reached, the last recorded resolution and the cached TOC
//! are used, so a node can re-mount what it has without network.
//!
//! - [`choose`]: which layer holds the disk, and what its index must describe.
//! - [`index`]: finding and checking the seekable index of a layer without a TOC.
//! - [`toc`]: fetching a TOC or index and checking it against what pins it.

pub mod choose;
mod image;
pub mod index;
#[cfg(test)]
mod tests;
pub mod toc;

use self::choose::{disk_layer_and_toc, disk_path_of};
use self::image::{diff_id_of, keep};
use self::index::seekable_layer_id;
use self::toc::fetch_toc_of;
use crate::cache::{CacheRoot, RefRecord};
use crate::error::{Error, ErrorKind, Result};
use crate::format::zstd_chunked::TocLocation;
use crate::layer::{Held, Layer, LayerKind, LayerMeta, Resolved};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::{self, Descriptor, Platform};
use crate::policy::Verifier;
use crate::registry::Registry;
use crate::task::blocking;

pub use self::choose::{
    disk_layer, index_target, indexable_layer, layer_form, refused_toc, IndexTarget, LayerForm,
    TocPin,
};
pub use self::image::platform_manifest;
pub(crate) use self::image::{image_config, manifest_of};
pub use self::index::seekable_layer;
pub use self::toc::{fetch_estargz_toc, fetch_structure_ahead, fetch_toc};

/// The disk layer of image manifest `manifest_digest` (`manifest`) of `reference`, and what
/// the cache records about it (its identity: [`LayerMeta::id`]): a zstd:chunked or eStargz
/// layer with its TOC, else an ordinary layer with a seekable index published for the image.
/// The config
/// (fetched by its digest) supplies the diff_id the layer claims. `expected`: the key the
/// caller expects the layer to have, whose kept record may save fetching an eStargz TOC
/// ([`kept_estargz_meta`]).
pub async fn disk_layer_id(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    trust: &Verifier,
    reference: &Reference,
    manifest: &oci::Manifest,
    manifest_digest: Digest,
    expected: Option<Digest>,
) -> Result<(Descriptor, LayerMeta)> {
    let Some((layer, pin)) = disk_layer_and_toc(manifest) else {
        // TOC annotations that are there but refused say why, not "no lazy layer".
        if let Some(e) = refused_toc(manifest) {
            return Err(e.context(reference));
        }
        let (layer, meta, index) =
            seekable_layer_id(client, cache, trust, reference, manifest, manifest_digest).await?;
        keep_layer(cache, &meta, index).await;
        return Ok((layer, meta));
    };
    let loc = match pin {
        TocPin::Frame(loc) => loc,
        TocPin::Digest(toc_digest) => {
            let estargz = EstargzLayer {
                reference,
                manifest,
                layer,
                toc_digest,
            };
            if let (Some(cache), Some(expected)) = (cache, expected) {
                if let Some(meta) = kept_estargz_meta(client, cache, &estargz, expected).await? {
                    return Ok((layer.clone(), meta));
                }
            }
            return estargz_layer_id(client, cache, &estargz).await;
        }
    };
    loc.check_within(layer.size)?;
    let disk_path = disk_path_of(layer)?;
    let (config, toc) = config_and_toc(client, cache, reference, manifest, layer, &loc).await?;
    let position = manifest
        .layers
        .iter()
        .rposition(|l| std::ptr::eq(l, layer))
        .expect("disk_layer returns one of the manifest's layers");
    let meta = LayerMeta {
        reference: reference.clone(),
        layer_digest: layer.digest,
        layer_size: layer.size,
        toc_offset: loc.offset,
        toc_length: loc.length,
        toc_uncompressed_length: loc.uncompressed_length,
        toc_digest: loc.checksum,
        disk_path,
        diff_id: diff_id_of(&config, manifest, position, reference)?,
        kind: LayerKind::ZstdChunked,
    };
    if let Some(toc) = toc {
        keep_layer(cache, &meta, toc).await;
    }
    Ok((layer.clone(), meta))
}

/// The image config of `manifest` (kept, or fetched by its digest and kept) and, when it was
/// fetched with a cache to keep it in, the TOC at `loc` of `layer`: what the layer's server
/// needs next, fetched alongside the config rather than a round trip later. (A TOC that fails
/// here is not this call's failure: the server fetches it again and says why.)
async fn config_and_toc(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    reference: &Reference,
    manifest: &oci::Manifest,
    layer: &Descriptor,
    loc: &TocLocation,
) -> Result<(Vec<u8>, Option<Vec<u8>>)> {
    let digest = manifest.config.digest;
    if let Some(c) = cache.cloned() {
        if let Some(config) =
            blocking(move || Ok(c.load_blob(&digest, oci::MAX_CONFIG_SIZE))).await?
        {
            return Ok((config, None));
        }
    }
    let fetch_config = async {
        client
            .get_blob(reference, &manifest.config, oci::MAX_CONFIG_SIZE)
            .await
            .map_err(|e| e.context(format!("fetching the image config of {reference}")))
    };
    let (config, toc) = match cache {
        Some(_) => {
            let mut config = std::pin::pin!(fetch_config);
            let mut toc = std::pin::pin!(fetch_toc(client, reference, &layer.digest, loc));
            let (config, toc) = tokio::select! {
                c = &mut config => {
                    // Waited for at most TOC_GRACE more: a slow TOC never holds up the
                    // decision (the server then fetches it under its deadlines).
                    let toc = match c {
                        Ok(_) => tokio::time::timeout(TOC_GRACE, &mut toc).await.ok(),
                        Err(_) => None,
                    };
                    (c, toc)
                }
                t = &mut toc => (config.await, Some(t)),
            };
            (config?, toc.and_then(|t| t.ok()))
        }
        None => (fetch_config.await?, None),
    };
    keep(cache, digest, config.clone()).await;
    Ok((config, toc))
}

/// Keeps a layer's record and its TOC (or index) in `cache` for the mount server, unless there
/// already; a failure only costs the server a fetch.
async fn keep_layer(cache: Option<&CacheRoot>, meta: &LayerMeta, toc: Vec<u8>) {
    let Some(cache) = cache.cloned() else { return };
    let meta = meta.clone();
    let kept = blocking(move || {
        if !cache.has_layer_meta(&meta.id().key()) {
            cache.save_layer_meta(&meta, &toc)?;
        }
        Ok(())
    });
    if let Err(e) = kept.await {
        tracing::debug!(error = %e.chain(), "keeping a fetched TOC or index failed");
    }
}

/// An eStargz disk layer `layer` of `manifest` (of `reference`), whose TOC has digest
/// `toc_digest` (its annotation).
struct EstargzLayer<'a> {
    reference: &'a Reference,
    manifest: &'a oci::Manifest,
    layer: &'a Descriptor,
    toc_digest: Digest,
}

impl EstargzLayer<'_> {
    /// The layer's record, from its verified image `config` and where its footer puts the TOC
    /// member (`toc_offset`, `toc_length` bytes of JSON): the one part of its identity the
    /// manifest and config do not give.
    fn meta(&self, config: &[u8], toc_offset: u64, toc_length: u64) -> Result<LayerMeta> {
        let position = self
            .manifest
            .layers
            .iter()
            .rposition(|l| std::ptr::eq(l, self.layer))
            .expect("disk_layer returns one of the manifest's layers");
        Ok(LayerMeta {
            reference: self.reference.clone(),
            layer_digest: self.layer.digest,
            layer_size: self.layer.size,
            toc_offset,
            toc_length,
            toc_uncompressed_length: 0,
            toc_digest: self.toc_digest,
            disk_path: disk_path_of(self.layer)?,
            diff_id: diff_id_of(config, self.manifest, position, self.reference)?,
            kind: LayerKind::Estargz,
        })
    }
}

/// The eStargz layer's record kept in `cache` under `expected` (by whoever classified the
/// layer: the snapshotter, for its mount servers), if the manifest and config still give that
/// key with the TOC offset the record holds; `None` when there is no such record or it is
/// another layer's. Its TOC was checked against the pinned digest when kept and is again when
/// loaded, so only the footer's word is taken from the record, and the key names it.
async fn kept_estargz_meta(
    client: &dyn Registry,
    cache: &CacheRoot,
    estargz: &EstargzLayer<'_>,
    expected: Digest,
) -> Result<Option<LayerMeta>> {
    let c = cache.clone();
    let Some(kept) =
        blocking(move || Ok(c.load_layer_meta(&expected).map(|(meta, _)| meta))).await?
    else {
        return Ok(None);
    };
    let config = image_config(client, Some(cache), estargz.reference, estargz.manifest).await?;
    let meta = estargz.meta(&config, kept.toc_offset, kept.toc_length)?;
    Ok((meta.id().key() == expected).then_some(meta))
}

/// The eStargz disk layer's record: its footer and TOC fetched (the TOC checked against its
/// digest) and kept in `cache` with the record.
async fn estargz_layer_id(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    estargz: &EstargzLayer<'_>,
) -> Result<(Descriptor, LayerMeta)> {
    let EstargzLayer {
        reference,
        manifest,
        layer,
        toc_digest,
    } = *estargz;
    // The config (for the diff_id) and the footer and TOC at once: neither needs the other.
    let (config, toc) = tokio::join!(
        image_config(client, cache, reference, manifest),
        fetch_estargz_toc(client, reference, layer.digest, layer.size, toc_digest)
    );
    let config = config?;
    let (toc_offset, json) =
        toc.map_err(|e| e.context(format!("layer {} of {reference}", layer.digest)))?;
    let meta = estargz.meta(&config, toc_offset, json.len() as u64)?;
    keep_layer(cache, &meta, json).await;
    Ok((layer.clone(), meta))
}

/// How long identifying a layer waits for its TOC once the config is there.
const TOC_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// What [`resolve`] is asked for.
#[derive(Clone, Copy, Debug)]
pub struct Wanted<'a> {
    /// The name a signature policy judges: what the image was asked for by (the daemon's mount
    /// servers get the name the daemon checked).
    pub named: &'a Reference,
    /// Where the image is read from.
    pub reference: &'a Reference,
    /// The layer key the caller expects (a mount server: the one the daemon classified), whose
    /// kept record saves fetching an eStargz TOC again ([`kept_estargz_meta`]).
    pub expected: Option<Digest>,
}

impl<'a> Wanted<'a> {
    /// `reference`, judged by its own name, with no key expected.
    pub fn image(reference: &'a Reference) -> Self {
        Wanted {
            named: reference,
            reference,
            expected: None,
        }
    }
}

async fn resolve_online(
    client: &dyn Registry,
    cache: &CacheRoot,
    trust: &Verifier,
    wanted: Wanted<'_>,
) -> Result<(Layer, Held)> {
    let Wanted {
        named,
        reference,
        expected,
    } = wanted;
    let (manifest, manifest_digest, platform) =
        platform_manifest(client, Some(cache), reference).await?;
    // The signatures are fetched alongside the TOC (nothing of the disk); the layer opens
    // only if both hold.
    let (checked, layer) = tokio::join!(
        trust.check_image(client, Some(cache), named, manifest_digest),
        disk_layer_id(
            client,
            Some(cache),
            trust,
            reference,
            &manifest,
            manifest_digest,
            expected,
        )
    );
    checked?;
    let (_, meta) = layer?;
    let key = meta.id().key();
    let c = cache.clone();
    // Usually there already: kept by this call's `disk_layer_id` or the snapshotter's.
    let cached = blocking(move || Ok(c.load_layer_meta(&key).map(|(_, toc)| toc))).await?;
    let (toc, held, fetched) = match cached {
        Some(toc) => (toc, Held::default(), false),
        None => {
            let (toc, held) = fetch_toc_of(client, &meta).await?;
            (toc, held, true)
        }
    };
    // A kept TOC matches its pinned checksum but is parsed and validated on every load:
    // parsing grows with the chunk count (tens of ms per 8 GiB), so off the async workers.
    let (cache, reference) = (cache.clone(), reference.clone());
    blocking(move || {
        let layer = crate::layer::codec::open(reference.clone(), meta, &toc, Resolved::Online)?;
        if fetched {
            cache.save_layer_meta(&layer.meta, &toc)?;
        }
        cache.save_ref(&RefRecord {
            reference: reference.to_string(),
            manifest_digest,
            layer_key: key,
            platform: platform.to_string(),
        })?;
        Ok((layer, held))
    })
    .await
}

/// The disk layer `key` of the image `reference` (pinned by digest) as the cache keeps it —
/// its record and TOC, checked against the key and the TOC's digest as they load — for a
/// layer whoever asks resolved from the registry and checked just now (the daemon, for the
/// mount server it starts): no request, no second resolution. The image's reference record
/// ([`RefRecord`]) is kept for it, as [`resolve`] keeps it. `None` when the cache has no
/// record of the layer.
pub async fn kept(cache: &CacheRoot, reference: &Reference, key: Digest) -> Result<Option<Layer>> {
    let manifest_digest = reference.digest.ok_or_else(|| {
        Error::invalid(format!(
            "{reference}: a decided layer's image is pinned by digest"
        ))
    })?;
    let (cache, reference) = (cache.clone(), reference.clone());
    blocking(move || {
        let Some((meta, toc)) = cache.load_layer_meta(&key) else {
            return Ok(None);
        };
        let layer = crate::layer::codec::open(reference.clone(), meta, &toc, Resolved::Online)?;
        cache.save_ref(&RefRecord {
            reference: reference.to_string(),
            manifest_digest,
            layer_key: key,
            platform: Platform::host().to_string(),
        })?;
        Ok(Some(layer))
    })
    .await
}

/// Resolves the image `wanted` to its disk layer, once `trust` accepts it as `wanted.named`
/// (a policy's scopes and identities are about that name) and the index it is read through:
/// from the registry, or from the cache when the registry is unreachable and the policy in
/// force accepted it before. With it, the blob's bytes fetched alongside its TOC ([`Held`]).
pub async fn resolve(
    client: &dyn Registry,
    cache: &CacheRoot,
    trust: &Verifier,
    wanted: Wanted<'_>,
) -> Result<(Layer, Held)> {
    match resolve_online(client, cache, trust, wanted).await {
        Ok(resolved) => Ok(resolved),
        Err(e) if e.kind() == ErrorKind::Network => {
            let (cache, reference, named) = (
                cache.clone(),
                wanted.reference.clone(),
                wanted.named.clone(),
            );
            let policy_set = trust.is_set();
            let accepted = trust.accepted_offline();
            blocking(move || {
                let record = cache.load_ref(&reference.to_string()).ok_or(e)?;
                if policy_set && !accepted(&cache, &named, &record.manifest_digest) {
                    return Err(Error::new(
                        ErrorKind::Refused,
                        format!("{reference}: the registry is unreachable and the signature policy has not accepted {} on this node", record.manifest_digest),
                    ));
                }
                let (meta, toc) = cache.load_layer_meta(&record.layer_key).ok_or_else(|| {
                    Error::new(
                        ErrorKind::Network,
                        format!(
                            "{reference}: the registry is unreachable and the cache has no TOC for it"
                        ),
                    )
                })?;
                tracing::warn!(%reference, layer = %meta.layer_digest, "registry unreachable; using the cached resolution");
                let layer = crate::layer::codec::open(reference, meta, &toc, Resolved::Offline)?;
                Ok((layer, Held::default()))
            })
            .await
        }
        Err(e) => Err(e),
    }
}
