//! `vmdisk convert`: every platform of an image republished in the lazy layout — an image's
//! disk layer ([`super::convert`]) or a disk artifact's disk ([`super::from_artifact`]).

use super::conversion::Conversion;
use super::{check_target, tag_images, PublishOptions, Published};
use crate::error::{Error, Result, ResultExt};
use crate::format::artifact;
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::{self, ImageConfig, Manifest, ManifestKind, Platform};
use crate::registry::RegistryClient;

impl Conversion<'_> {
    /// Republishes `manifest`, the source's for `platform`: an image's disk layer, or a disk
    /// artifact's disk.
    async fn run(&self, manifest: &Manifest, platform: &Platform) -> Result<(Published, Vec<u8>)> {
        if artifact::is_artifact(manifest) {
            super::from_artifact::convert_artifact(self, manifest, platform).await
        } else {
            super::convert::convert_image(self, manifest, platform).await
        }
    }
}

/// `vmdisk convert`: republishes every platform of `source` at `target` in the lazy layout.
/// `platform` is the platform of a source that names none (a disk artifact with an empty
/// config).
pub async fn convert(
    client: &RegistryClient,
    source: &Reference,
    target: &Reference,
    opts: &PublishOptions,
    platform: &Platform,
) -> Result<Digest> {
    check_target(target)?;
    let fetched = client.get_manifest(source).await?;
    // Pre-flight: reach the target with push rights before any layer is streamed, so an
    // unreachable registry or refused credentials fail at once rather than after restarts.
    client
        .blob_exists(target, &Digest::of(b""))
        .await
        .context(format!("checking access to {target}"))?;
    let conversion = Conversion {
        client,
        source,
        target,
        opts,
    };
    let mut images = Vec::new();
    match fetched.manifest {
        ManifestKind::Image(m) => {
            let config = client
                .get_blob(source, &m.config, oci::MAX_CONFIG_SIZE)
                .await?;
            let named = if artifact::is_artifact(&m) {
                oci::config_platform(&config)
            } else {
                let cfg: ImageConfig = serde_json::from_slice(&config)
                    .map_err(|e| Error::corrupt(format!("image config of {source}: {e}")))?;
                Some(Platform {
                    os: cfg.os,
                    architecture: cfg.architecture,
                    variant: cfg.variant,
                })
            };
            let platform = named.unwrap_or_else(|| {
                tracing::warn!(%source, %platform, "the source names no platform; publishing it for the one given (--platform)");
                platform.clone()
            });
            images.push(conversion.run(&m, &platform).await?);
        }
        ManifestKind::Index(index) => {
            for desc in &index.manifests {
                let Some(platform) = desc.platform.clone().filter(|p| p.os != "unknown") else {
                    continue;
                };
                let child = client
                    .get_manifest(&source.with_digest(desc.digest))
                    .await?;
                let ManifestKind::Image(m) = child.manifest else {
                    return Err(Error::unsupported(format!(
                        "{source}: nested index {} is not supported",
                        desc.digest
                    )));
                };
                images.push(conversion.run(&m, &platform).await?);
            }
        }
    }
    tag_images(client, target, &images).await
}
