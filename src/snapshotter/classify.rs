//! Deciding, during containerd's unpack, whether a layer is a lazily loadable VM disk.
//!
//! The CRI labels name the image (`cri.image-ref`), its platform manifest
//! (`cri.manifest-digest`) and the layer (`cri.layer-digest`). The manifest, fetched by digest
//! and so verified, is the only authority: a layer is remote when it is the manifest's disk
//! layer (zstd:chunked with a TOC, the topmost such layer). Our own `vmdisk.*` labels only mark
//! the layer as a candidate, so a fallback for a published disk is logged as a warning; labels
//! never decide alone, because they are caller-supplied text.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::cache::CacheRoot;
use crate::digest::Digest;
use crate::error::{ErrorKind, Result};
use crate::oci::{self, ManifestKind};
use crate::policy::Verifier;
use crate::reference::Reference;
use crate::registry::Registry;
use crate::task::blocking;

pub const LABEL_TARGET: &str = "containerd.io/snapshot.ref";
pub const LABEL_IMAGE_REF: &str = "containerd.io/snapshot/cri.image-ref";
pub const LABEL_MANIFEST: &str = "containerd.io/snapshot/cri.manifest-digest";
pub const LABEL_LAYER: &str = "containerd.io/snapshot/cri.layer-digest";
/// Set on snapshots served lazily (the remote-snapshotter convention).
pub const LABEL_REMOTE: &str = "containerd.io/snapshot/remote";

/// The outcome for one layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Serve the layer lazily from `reference` (repository@manifest digest); `layer` is the
    /// layer's key ([`crate::cache::LayerId::key`]), what its cache and mount are named by.
    Remote { reference: Reference, layer: Digest },
    /// Let containerd download and apply it. `candidate`: the layer looked like a published
    /// disk (our labels), so this is a fallback worth a warning.
    Ordinary {
        reason: &'static str,
        detail: String,
        candidate: bool,
    },
}

/// Manifests kept in memory, by reference; bounded because the labels come from outside.
const MANIFEST_CACHE: usize = 64;

/// containerd's content store, read only: before containerd unpacks a layer it holds the
/// image's manifest and config, by digest, under `blobs/sha256/`. What is read there is
/// verified like anything a registry sends.
#[derive(Clone, Debug)]
pub struct ContentStore {
    blobs: PathBuf,
}

impl ContentStore {
    /// The content store of the containerd whose root is `root`.
    pub fn of_root(root: &Path) -> Self {
        ContentStore {
            blobs: root.join("io.containerd.content.v1.content/blobs/sha256"),
        }
    }

    /// Blob `digest`, if containerd holds it whole, at most `max` bytes.
    fn blob(&self, digest: &Digest, max: u64) -> Option<Vec<u8>> {
        crate::cache::read_verified(&self.blobs.join(digest.hex()), digest, max)
    }

    /// Copies image manifest `digest` and its config from here into `cache` (where resolution
    /// looks before asking the registry), unless `cache` has the manifest already; what
    /// containerd does not hold (yet) is left to the registry.
    fn import_image(&self, cache: &CacheRoot, digest: &Digest) -> Result<()> {
        if cache.load_blob(digest, oci::MAX_MANIFEST_SIZE).is_some() {
            return Ok(());
        }
        let Some(bytes) = self.blob(digest, oci::MAX_MANIFEST_SIZE) else {
            return Ok(());
        };
        if let Ok(ManifestKind::Image(m)) = oci::parse_manifest(&bytes, None) {
            // The config first: a kept manifest says its config is kept too, if it can be.
            if let Some(config) = self.blob(&m.config.digest, oci::MAX_CONFIG_SIZE) {
                cache.save_blob(&m.config.digest, &config)?;
            }
        }
        cache.save_blob(digest, &bytes)
    }
}

/// Fetches manifests (once per digest) and classifies layers.
pub struct Classifier {
    client: Arc<dyn Registry>,
    /// Where verified manifests and configs are kept for the mount servers.
    cache: Option<CacheRoot>,
    /// containerd's content store, where the manifest and config of the image being pulled
    /// are found without a round trip.
    content: Option<ContentStore>,
    /// The node's signature policy.
    trust: Arc<Verifier>,
    manifests: Mutex<HashMap<String, Arc<oci::Manifest>>>,
}

impl Classifier {
    pub fn new(client: Arc<dyn Registry>, cache: Option<CacheRoot>, trust: Arc<Verifier>) -> Self {
        Classifier {
            client,
            cache,
            content: None,
            trust,
            manifests: Mutex::new(HashMap::new()),
        }
    }

    /// Reads manifests and configs from containerd's `content` store when it has them (used
    /// with a cache to keep them in).
    pub fn with_content_store(mut self, content: ContentStore) -> Self {
        self.content = Some(content);
        self
    }

    /// The node's signature policy.
    pub fn trust(&self) -> &Verifier {
        &self.trust
    }

    /// The registry client, with the node's own credentials.
    pub fn client(&self) -> &Arc<dyn Registry> {
        &self.client
    }

    /// The cache that keeps verified manifests and configs, if any.
    pub fn cache(&self) -> Option<&CacheRoot> {
        self.cache.as_ref()
    }

    async fn manifest(
        &self,
        client: &dyn Registry,
        reference: &Reference,
    ) -> Result<Arc<oci::Manifest>> {
        let key = reference.to_string();
        if let Some(m) = self.manifests.lock().get(&key) {
            return Ok(Arc::clone(m));
        }
        if let (Some(content), Some(cache), Some(digest)) =
            (self.content.clone(), self.cache.clone(), reference.digest)
        {
            let imported = blocking(move || content.import_image(&cache, &digest)).await;
            if let Err(e) = imported {
                tracing::debug!(%digest, error = %e.chain(), "keeping a manifest from containerd's content store failed");
            }
        }
        let manifest = match crate::resolve::manifest_of(client, self.cache(), reference)
            .await?
            .0
        {
            ManifestKind::Image(m) => Arc::new(m),
            ManifestKind::Index(_) => {
                return Err(crate::error::Error::unsupported(format!(
                    "{reference} is an index, not the platform manifest CRI names"
                )))
            }
        };
        let mut cache = self.manifests.lock();
        if cache.len() >= MANIFEST_CACHE {
            cache.clear();
        }
        cache.insert(key, Arc::clone(&manifest));
        Ok(manifest)
    }

    /// Classifies the layer a Prepare with `labels` is about to unpack, fetching what it needs
    /// with `client` (the node's credentials and those of the pull in flight). Manifests,
    /// configs and TOCs are verified by digest, whoever fetched them, so what was kept from an
    /// earlier classification serves this one: containerd asks during a pull it authorized.
    pub async fn classify(
        &self,
        labels: &BTreeMap<String, String>,
        client: &dyn Registry,
    ) -> Decision {
        let candidate = labels
            .keys()
            .any(|k| k.starts_with(crate::format::layout::ANN_PREFIX));
        let ordinary = |reason: &'static str, detail: String| Decision::Ordinary {
            reason,
            detail,
            candidate,
        };
        let (Some(image), Some(manifest), Some(layer)) = (
            labels.get(LABEL_IMAGE_REF),
            labels.get(LABEL_MANIFEST),
            labels.get(LABEL_LAYER),
        ) else {
            return ordinary(
                "no_cri_labels",
                "no CRI image labels (a `ctr` pull, or disable_snapshot_annotations = true)".into(),
            );
        };
        let parsed = (|| -> Result<(Reference, Digest)> {
            let image: Reference = image.parse()?;
            let manifest: Digest = manifest.parse()?;
            let layer: Digest = layer.parse()?;
            Ok((image.with_digest(manifest), layer))
        })();
        let (reference, layer) = match parsed {
            Ok(p) => p,
            Err(e) => return ordinary("malformed_labels", e.chain()),
        };
        let manifest = match self.manifest(client, &reference).await {
            Ok(m) => m,
            Err(e) => return ordinary("registry_error", e.chain()),
        };
        if !manifest.layers.iter().any(|l| l.digest == layer) {
            return ordinary(
                "layer_not_in_manifest",
                format!("{reference} has no layer {layer}"),
            );
        }
        let manifest_digest = reference.digest.expect("the reference is pinned above");
        let disk =
            match crate::resolve::disk_layer(&manifest) {
                Some(disk) => disk,
                None => match crate::resolve::indexable_layer(&manifest) {
                    Some((_, ordinary, _)) if ordinary.digest == layer => ordinary,
                    _ => return ordinary(
                        "not_lazy",
                        "no zstd:chunked layer with a TOC, and this is not the topmost tar layer"
                            .into(),
                    ),
                },
            };
        if disk.digest != layer {
            return ordinary("not_disk_layer", "another layer holds the disk".into());
        }
        match crate::resolve::disk_layer_id(
            client,
            self.cache(),
            &self.trust,
            &reference,
            &manifest,
            manifest_digest,
            None,
        )
        .await
        {
            Ok((_, meta)) => Decision::Remote {
                reference,
                layer: meta.id().key(),
            },
            Err(e) if matches!(e.kind(), ErrorKind::Network | ErrorKind::BadAnswer) => {
                ordinary("registry_error", e.chain())
            }
            // An ordinary layer without a (usable) seekable index: the usual case.
            Err(e) if e.kind() == ErrorKind::NotFound => ordinary("no_index", e.chain()),
            Err(e) => ordinary("invalid_image", e.chain()),
        }
    }
}
