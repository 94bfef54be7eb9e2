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
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::cache::CacheRoot;
use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::{ImageName, Reference};
use crate::oci::{self, ManifestKind};
use crate::policy::Verifier;
use crate::registry::Registry;
use crate::task::blocking;

pub const LABEL_TARGET: &str = "containerd.io/snapshot.ref";
pub const LABEL_IMAGE_REF: &str = "containerd.io/snapshot/cri.image-ref";
pub const LABEL_MANIFEST: &str = "containerd.io/snapshot/cri.manifest-digest";
pub const LABEL_LAYER: &str = "containerd.io/snapshot/cri.layer-digest";
/// Set on snapshots served lazily (the remote-snapshotter convention).
pub const LABEL_REMOTE: &str = "containerd.io/snapshot/remote";

/// What is asked of an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wanted {
    /// Whether the layer `digest` a pull unpacks is the image's disk. `candidate`: it carries
    /// vmdisk's layout annotations (published as a VM disk).
    Layer { digest: Digest, candidate: bool },
    /// The image's disk, which the management API's caller names the image for.
    Disk,
}

/// The outcome for one layer.
#[derive(Debug)]
pub enum Decision {
    /// Serve the layer lazily from `reference` (repository@manifest digest); `layer` is the
    /// layer's key ([`crate::layer::LayerId::key`]), what its cache and mount are named by.
    Remote { reference: Reference, layer: Digest },
    /// Let containerd download and apply it (the management API: no disk to make ready), and
    /// `why`. `candidate`: the layer looked like a published disk (our labels), so this is a
    /// fallback worth a warning.
    Ordinary {
        reason: Reason,
        why: Error,
        candidate: bool,
    },
}

/// Why a layer is left to containerd: the name its decision is counted and logged by
/// (`ordinary:<reason>`, `fallback:<reason>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// No CRI image labels: a `ctr` pull, or `disable_snapshot_annotations = true`.
    NoCriLabels,
    /// CRI labels that do not parse.
    MalformedLabels,
    /// The registry could not be asked (or answered wrongly).
    RegistryError,
    /// The manifest does not list the layer the labels name.
    LayerNotInManifest,
    /// The image runs a program (its config sets `Entrypoint` or `Cmd`): an ordinary container
    /// image, not a VM disk image, so no seekable index is searched for.
    NotDiskImage,
    /// Not the layer a disk image's disk would be in (below the topmost tar layer, or no layer
    /// with a TOC and no tar layer).
    NotLazy,
    /// The image has a disk layer, and this is another one.
    NotDiskLayer,
    /// A disk image with no (usable) seekable index.
    NoIndex,
    /// The image's disk cannot be read lazily as published.
    InvalidImage,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::NoCriLabels => "no_cri_labels",
            Reason::MalformedLabels => "malformed_labels",
            Reason::RegistryError => "registry_error",
            Reason::LayerNotInManifest => "layer_not_in_manifest",
            Reason::NotDiskImage => "not_disk_image",
            Reason::NotLazy => "not_lazy",
            Reason::NotDiskLayer => "not_disk_layer",
            Reason::NoIndex => "no_index",
            Reason::InvalidImage => "invalid_image",
        }
    }
}

impl Reason {
    /// Every reason, for those who list the decisions there can be.
    pub const ALL: [Reason; 9] = [
        Reason::NoCriLabels,
        Reason::MalformedLabels,
        Reason::RegistryError,
        Reason::LayerNotInManifest,
        Reason::NotDiskImage,
        Reason::NotLazy,
        Reason::NotDiskLayer,
        Reason::NoIndex,
        Reason::InvalidImage,
    ];
}

/// What a layer's Prepare came to: the one name its decision is counted by (`decision/…`),
/// shown by (`vmdisk stats`) and exported by (`vmdisk_prepare_decisions{decision, reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Served lazily: a new remote snapshot.
    Remote,
    /// Served lazily: the remote snapshot of that name was there already.
    Reused,
    /// An ordinary layer, left to containerd.
    Ordinary(Reason),
    /// A published VM-disk layer that containerd pulls normally, and why.
    Fallback(Reason),
    /// A VM-disk layer whose lazy mount failed: containerd pulls it normally.
    MountFailed,
    /// The signature policy refuses the image: the pull fails.
    RefusedByPolicy,
}

impl Outcome {
    /// Every outcome there can be.
    pub fn all() -> impl Iterator<Item = Outcome> {
        [
            Outcome::Remote,
            Outcome::Reused,
            Outcome::MountFailed,
            Outcome::RefusedByPolicy,
        ]
        .into_iter()
        .chain(Reason::ALL.into_iter().map(Outcome::Ordinary))
        .chain(Reason::ALL.into_iter().map(Outcome::Fallback))
    }

    /// The decision: `remote`, `reused`, `ordinary`, `fallback` or `refused`.
    pub fn decision(self) -> &'static str {
        match self {
            Outcome::Remote => "remote",
            Outcome::Reused => "reused",
            Outcome::Ordinary(_) => "ordinary",
            Outcome::Fallback(_) | Outcome::MountFailed => "fallback",
            Outcome::RefusedByPolicy => "refused",
        }
    }

    /// Why, for decisions that have a reason (else empty).
    pub fn reason(self) -> &'static str {
        match self {
            Outcome::Remote | Outcome::Reused => "",
            Outcome::Ordinary(r) | Outcome::Fallback(r) => r.as_str(),
            Outcome::MountFailed => "mount_failed",
            Outcome::RefusedByPolicy => "policy",
        }
    }

    /// Its name among the decisions: `<decision>[:<reason>]` (as `vmdisk stats` shows it).
    pub fn name(self) -> String {
        match self.reason() {
            "" => self.decision().to_string(),
            reason => format!("{}:{reason}", self.decision()),
        }
    }
}

/// Counted under `decision/` and its [`Outcome::name`].
impl crate::snapshotter::counters::Counted for Outcome {
    fn key(&self) -> String {
        format!("decision/{}", self.name())
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which images the classifier searches a seekable index for (`[registry] index_search`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IndexSearch {
    /// Images that run no program (a config with neither `Entrypoint` nor `Cmd`): what
    /// KubeVirt containerDisks, peer-pod VM images and image-volume data images are (`FROM
    /// scratch` and a disk). An ordinary container image costs no registry request.
    #[default]
    DataImages,
    /// Every image's topmost tar layer (a disk image built on a base that sets a command).
    AllImages,
}

/// How long a search that found no seekable index is believed, per repository and manifest:
/// the image's other layers, a second pull and the pause image sharing a layer ask no more.
const NO_INDEX_KEPT: Duration = Duration::from_secs(300);
/// Most such answers kept (the labels come from outside).
const NO_INDEX_ANSWERS: usize = 1024;

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
    search: IndexSearch,
    manifests: Mutex<HashMap<Reference, Arc<oci::Manifest>>>,
    /// Searches that found no seekable index, by image (repository@manifest digest), and when.
    no_index: Mutex<HashMap<Reference, Instant>>,
}

impl Classifier {
    pub fn new(client: Arc<dyn Registry>, cache: Option<CacheRoot>, trust: Arc<Verifier>) -> Self {
        Classifier {
            client,
            cache,
            content: None,
            trust,
            search: IndexSearch::default(),
            manifests: Mutex::new(HashMap::new()),
            no_index: Mutex::new(HashMap::new()),
        }
    }

    /// Which images a seekable index is searched for.
    pub fn with_index_search(mut self, search: IndexSearch) -> Self {
        self.search = search;
        self
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
        if let Some(m) = self.manifests.lock().get(reference) {
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
        cache.insert(reference.clone(), Arc::clone(&manifest));
        Ok(manifest)
    }

    /// Why `manifest`'s image is not served lazily, if it is not: under
    /// [`IndexSearch::DataImages`], an image whose config (containerd holds it before it
    /// unpacks) sets a program to run is an ordinary container image — whether its layers
    /// carry no TOC (no seekable index is searched for) or a TOC vmdisk did not publish
    /// (zstd:chunked from podman, eStargz: no TOC is fetched).
    async fn not_a_disk_image(
        &self,
        client: &dyn Registry,
        reference: &Reference,
        manifest: &oci::Manifest,
    ) -> Option<(Reason, Error)> {
        if self.search == IndexSearch::AllImages || crate::format::artifact::is_artifact(manifest) {
            return None;
        }
        match crate::resolve::image_config(client, self.cache(), reference, manifest).await {
            Ok(config) if oci::config_runs_program(&config) => Some((
                Reason::NotDiskImage,
                Error::new(ErrorKind::Unsupported, format!("{reference} runs a program (its config sets Entrypoint or Cmd), so it is an ordinary container image; a disk image built on such a base is searched for a seekable index with [registry] index_search = \"all-images\"")),
            )),
            Ok(_) => None,
            Err(e) => Some((Reason::RegistryError, e)),
        }
    }

    /// How long ago a search for `image`'s seekable index found none, if that is recent.
    fn searched_in_vain(&self, image: &Reference) -> Option<Duration> {
        let ago = self.no_index.lock().get(image)?.elapsed();
        (ago < NO_INDEX_KEPT).then_some(ago)
    }

    /// Why `layer` of `reference`'s `manifest`, which a pull unpacks, is not the disk served
    /// lazily, if it is not: not in the manifest, not the layer a disk would be in, an image
    /// that runs a program (`candidate`: the layer carries vmdisk's layout annotations, so that
    /// is not asked of a layer with a TOC), or an image searched in vain a moment ago.
    async fn not_the_disk(
        &self,
        client: &dyn Registry,
        reference: &Reference,
        manifest: &oci::Manifest,
        layer: Digest,
        candidate: bool,
    ) -> Option<(Reason, Error)> {
        let not_found =
            |reason: Reason, text: String| Some((reason, Error::new(ErrorKind::NotFound, text)));
        if !manifest.layers.iter().any(|l| l.digest == layer) {
            return not_found(
                Reason::LayerNotInManifest,
                format!("{reference} has no layer {layer}"),
            );
        }
        let disk = match crate::resolve::disk_layer(manifest) {
            Some(disk) => disk,
            None => {
                // No layer with a TOC: the disk, if any, is read through a seekable index.
                if let Some(not) = self.not_a_disk_image(client, reference, manifest).await {
                    return Some(not);
                }
                match crate::resolve::indexable_layer(manifest) {
                    Some((_, indexable, _)) if indexable.digest == layer => indexable,
                    // TOC annotations that are there but refused say why.
                    _ => return match crate::resolve::refused_toc(manifest) {
                        Some(refused) => Some((Reason::NotLazy, refused.context(reference))),
                        None => not_found(
                            Reason::NotLazy,
                            format!("{reference} has no zstd:chunked layer with a TOC, and {layer} is not its topmost tar layer"),
                        ),
                    },
                }
            }
        };
        if disk.digest != layer {
            return not_found(
                Reason::NotDiskLayer,
                format!(
                    "{reference}'s disk is in layer {}, not {layer}",
                    disk.digest
                ),
            );
        }
        // A layer with a TOC that vmdisk did not publish (podman's zstd:chunked, eStargz) in an
        // image that runs a program is an ordinary container image's: no TOC is fetched for it.
        if !candidate {
            if let Some(not) = self.not_a_disk_image(client, reference, manifest).await {
                return Some(not);
            }
        }
        let ago = self.searched_in_vain(reference)?;
        not_found(
            Reason::NoIndex,
            format!(
                "no seekable index was found for {reference} {} s ago (searched again {} s after that)",
                ago.as_secs(),
                NO_INDEX_KEPT.as_secs()
            ),
        )
    }

    /// Decides what `wanted` of image `reference` (pinned to its platform manifest) is,
    /// fetching what it needs with `client` (the node's credentials and those of the pull in
    /// flight). Manifests, configs and TOCs are verified by digest, whoever fetched them, so
    /// what was kept from an earlier decision serves this one: containerd asks during a pull it
    /// authorized.
    pub async fn classify(
        &self,
        client: &dyn Registry,
        reference: &Reference,
        wanted: Wanted,
    ) -> Decision {
        let candidate = match wanted {
            Wanted::Layer { candidate, .. } => candidate,
            Wanted::Disk => true,
        };
        let ordinary = |reason: Reason, why: Error| Decision::Ordinary {
            reason,
            why,
            candidate,
        };
        let Some(manifest_digest) = reference.digest else {
            let why = Error::new(
                ErrorKind::InvalidInput,
                format!("{reference} is not pinned to its manifest digest"),
            );
            return ordinary(Reason::MalformedLabels, why);
        };
        let manifest = match self.manifest(client, reference).await {
            Ok(m) => m,
            Err(e) => return ordinary(Reason::RegistryError, e),
        };
        // While a pull unpacks a layer, whether it is a disk image's disk is guessed; the
        // management API's caller names a disk image, so nothing is guessed for it.
        if let Wanted::Layer { digest, candidate } = wanted {
            if let Some((reason, why)) = self
                .not_the_disk(client, reference, &manifest, digest, candidate)
                .await
            {
                return ordinary(reason, why);
            }
        }
        let found = crate::resolve::disk_layer_id(
            client,
            self.cache(),
            &self.trust,
            reference,
            &manifest,
            manifest_digest,
            None,
        )
        .await;
        match found {
            Ok((_, meta)) => Decision::Remote {
                reference: reference.clone(),
                layer: meta.id().key(),
            },
            Err(e) if matches!(e.kind(), ErrorKind::Network | ErrorKind::BadAnswer) => {
                ordinary(Reason::RegistryError, e)
            }
            // An ordinary layer without a (usable) seekable index: the usual case.
            Err(e) if e.kind() == ErrorKind::NotFound => {
                if let Wanted::Layer { .. } = wanted {
                    self.note_no_index(reference.clone());
                }
                ordinary(Reason::NoIndex, e)
            }
            Err(e) => ordinary(Reason::InvalidImage, e),
        }
    }

    /// Keeps that the search for `searched`'s index found none, for [`NO_INDEX_KEPT`] (at most
    /// [`NO_INDEX_ANSWERS`] answers: the expired ones go first, then all).
    fn note_no_index(&self, searched: Reference) {
        let mut kept = self.no_index.lock();
        if kept.len() >= NO_INDEX_ANSWERS {
            kept.retain(|_, at| at.elapsed() < NO_INDEX_KEPT);
            if kept.len() >= NO_INDEX_ANSWERS {
                kept.clear();
            }
        }
        kept.insert(searched, Instant::now());
    }
}

/// What a Prepare's CRI labels say of the layer being unpacked and its image, read and parsed
/// once per Prepare: the classification, the signature check, the credentials of the pulls in
/// flight and the store's alias all take it from here. Each label is `None` where it is
/// missing, an error where it is malformed.
pub struct CriLabels {
    /// The image as the pull named it (`cri.image-ref`): the store's alias of the layer.
    pub image: Option<Result<ImageName>>,
    /// Its platform manifest (`cri.manifest-digest`).
    pub manifest: Option<Result<Digest>>,
    /// The layer being unpacked (`cri.layer-digest`).
    pub layer: Option<Result<Digest>>,
    /// Whether the layer carries vmdisk's layout annotations (published as a VM disk).
    pub candidate: bool,
}

impl CriLabels {
    /// The CRI labels among a Prepare's `labels`.
    pub fn read(labels: &BTreeMap<String, String>) -> Self {
        CriLabels {
            image: labels.get(LABEL_IMAGE_REF).map(|n| n.parse()),
            manifest: labels.get(LABEL_MANIFEST).map(|m| m.parse()),
            layer: labels.get(LABEL_LAYER).map(|l| l.parse()),
            candidate: labels
                .keys()
                .any(|k| k.starts_with(crate::format::layout::ANN_PREFIX)),
        }
    }

    /// The image, where its label is there and well formed.
    pub fn image(&self) -> Option<&Reference> {
        self.named().map(ImageName::reference)
    }

    /// The image as the pull named it, where its label is there and well formed.
    pub fn named(&self) -> Option<&ImageName> {
        self.image.as_ref()?.as_ref().ok()
    }

    /// The image as pulled, its platform manifest and the layer, asked of the image; the
    /// reason the layer is ordinary when the labels name none or are malformed.
    pub fn wanted_layer(
        &self,
    ) -> std::result::Result<(&Reference, Digest, Wanted), (Reason, Error)> {
        let (Some(image), Some(manifest), Some(layer)) = (&self.image, &self.manifest, &self.layer)
        else {
            return Err((
                Reason::NoCriLabels,
                Error::new(
                    ErrorKind::InvalidInput,
                    "no CRI image labels (a `ctr` pull, or disable_snapshot_annotations = true)",
                ),
            ));
        };
        let malformed = |e: &Error| {
            (
                Reason::MalformedLabels,
                Error::new(ErrorKind::InvalidInput, e.chain()),
            )
        };
        let image = image.as_ref().map_err(malformed)?.reference();
        let manifest = manifest.as_ref().map_err(malformed)?;
        let layer = layer.as_ref().map_err(malformed)?;
        let wanted = Wanted::Layer {
            digest: *layer,
            candidate: self.candidate,
        };
        Ok((image, *manifest, wanted))
    }

    /// The image as pulled and its platform manifest, for the signature policy; none without
    /// those labels (a pull outside CRI), an error naming the malformed one.
    pub fn pulled(&self) -> Result<Option<(&Reference, Digest)>> {
        let (Some(image), Some(manifest)) = (&self.image, &self.manifest) else {
            return Ok(None);
        };
        let owned = |e: &crate::error::Error| crate::error::Error::new(e.kind(), e.chain());
        Ok(Some((
            image.as_ref().map_err(owned)?.reference(),
            *manifest.as_ref().map_err(owned)?,
        )))
    }
}
