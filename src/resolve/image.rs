//! An image's manifest and config: from the cache when it keeps them (re-verified), else
//! from the registry, then kept; and what the config claims of a layer.

use crate::cache::CacheRoot;
use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::{self, ManifestKind, Platform};
use crate::registry::Registry;
use crate::task::blocking;

/// The manifest or index `reference` names, and its digest: when `reference` is by digest
/// and `cache` keeps that blob, from there (re-verified, no round trip); otherwise from the
/// registry, and then kept.
pub(crate) async fn manifest_of(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    reference: &Reference,
) -> Result<(ManifestKind, Digest)> {
    if let (Some(cache), Some(digest)) = (cache, reference.digest) {
        let c = cache.clone();
        let kept = blocking(move || Ok(c.load_blob(&digest, oci::MAX_MANIFEST_SIZE))).await?;
        if let Some(manifest) = kept.and_then(|bytes| oci::parse_manifest(&bytes, None).ok()) {
            return Ok((manifest, digest));
        }
    }
    let fetched = client.get_manifest(reference).await?;
    keep(cache, fetched.digest, fetched.bytes).await;
    Ok((fetched.manifest, fetched.digest))
}

/// Keeps verified bytes in the cache's blob store; a failure only costs a round trip later.
pub(super) async fn keep(cache: Option<&CacheRoot>, digest: Digest, bytes: Vec<u8>) {
    let Some(cache) = cache.cloned() else { return };
    if let Err(e) = blocking(move || cache.save_blob(&digest, &bytes)).await {
        tracing::debug!(%digest, error = %e.chain(), "keeping a fetched blob failed");
    }
}

/// The image manifest of `reference` for the host's platform (through an index if there is
/// one), with its digest and platform. Manifests kept in `cache` save their round trips.
pub async fn platform_manifest(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    reference: &Reference,
) -> Result<(oci::Manifest, Digest, Platform)> {
    match manifest_of(client, cache, reference).await? {
        (ManifestKind::Image(m), digest) => Ok((m, digest, Platform::host())),
        (ManifestKind::Index(index), _) => {
            let host = Platform::host();
            let desc = index
                .manifests
                .iter()
                .find(|d| {
                    d.platform
                        .as_ref()
                        .is_some_and(|p| p.os == host.os && p.architecture == host.architecture)
                })
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::NotFound,
                        format!("{reference} has no image for {host}"),
                    )
                })?;
            match manifest_of(client, cache, &reference.with_digest(desc.digest)).await? {
                (ManifestKind::Image(m), _) => Ok((m, desc.digest, host)),
                (ManifestKind::Index(_), _) => {
                    Err(Error::unsupported(format!("{reference}: nested index")))
                }
            }
        }
    }
}

/// The diff_id the image config (`config`, verified JSON bytes) claims for layer `position`.
pub(super) fn diff_id_of(
    config: &[u8],
    manifest: &oci::Manifest,
    position: usize,
    reference: &Reference,
) -> Result<Digest> {
    let config: oci::ImageConfig = serde_json::from_slice(config).map_err(|e| {
        Error::corrupt(format!("the image config of {reference} is not valid: {e}"))
    })?;
    if config.rootfs.diff_ids.len() != manifest.layers.len() {
        return Err(Error::corrupt(format!(
            "the image config of {reference} lists {} diff_ids for {} layers",
            config.rootfs.diff_ids.len(),
            manifest.layers.len()
        )));
    }
    Ok(config.rootfs.diff_ids[position])
}

/// The image config of `manifest`: kept in `cache`, else fetched (by digest) and kept.
pub(crate) async fn image_config(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    reference: &Reference,
    manifest: &oci::Manifest,
) -> Result<Vec<u8>> {
    let digest = manifest.config.digest;
    if let Some(c) = cache.cloned() {
        if let Some(config) =
            blocking(move || Ok(c.load_blob(&digest, oci::MAX_CONFIG_SIZE))).await?
        {
            return Ok(config);
        }
    }
    let config = client
        .get_blob(reference, &manifest.config, oci::MAX_CONFIG_SIZE)
        .await
        .map_err(|e| e.context(format!("fetching the image config of {reference}")))?;
    keep(cache, digest, config.clone()).await;
    Ok(config)
}
