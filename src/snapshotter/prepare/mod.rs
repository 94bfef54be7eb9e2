//! A Prepare with containerd's remote-snapshot handshake. [`Pulls`] judges the layer being
//! unpacked: whether the signature policy accepts its image, whether it is a lazily loadable
//! disk ([`classify`]), and what the CRI pulls of the image in flight may read with
//! ([`tenants`]); the snapshotter then plans and starts the layer's server and records the
//! target snapshot (`snapshotter/remote.rs`). The disks of the management API
//! (`daemon/disks.rs`) are read, checked and granted by the same [`Pulls`].

pub mod classify;
pub mod cri;
pub mod pods;
pub mod tenants;

use std::collections::BTreeMap;
use std::sync::Arc;

use self::classify::{Classifier, CriLabels, Decision, Wanted};
use self::tenants::Tenants;
use crate::cache::CacheRoot;
use crate::error::{ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::policy::Verifier;
use crate::registry::auth::Credential;
use crate::registry::granted::{Grant, Granted};
use crate::registry::Registry;
use crate::snapshotter::servers::supervisor::Ahead;

/// What the daemon knows of image pulls, for a Prepare and the management API's disks alike:
/// how an image is read (the node's registry client, the cache of verified manifests), whether
/// it is trusted (the signature policy), whether a layer is a disk (the classifier), and what
/// each namespace's pulls granted (the tenants). Held by the [`crate::snapshotter::Snapshotter`]; it keeps no
/// snapshot and starts no server.
pub struct Pulls {
    classifier: Classifier,
    /// Which namespace's pulls granted what.
    pub tenants: Tenants,
}

/// A Prepare's layer as [`Pulls::judge`] found it.
pub struct Judged {
    /// What the Prepare's CRI labels say of the layer and its image.
    pub cri: CriLabels,
    /// A client that reads the image: the node's credentials, then those of the CRI pulls of
    /// it in flight.
    pub client: Arc<dyn Registry>,
    /// Those pulls' credentials.
    pub pending: Vec<Credential>,
    /// What the layer is.
    pub decision: Decision,
}

impl Pulls {
    pub fn new(classifier: Classifier, tenants: Tenants) -> Self {
        Pulls {
            classifier,
            tenants,
        }
    }

    /// The registry client, with the node's own credentials.
    pub fn client(&self) -> &Arc<dyn Registry> {
        self.classifier.client()
    }

    /// The node's signature policy.
    pub fn trust(&self) -> &Verifier {
        self.classifier.trust()
    }

    /// The cache that keeps verified manifests and configs, if any.
    pub fn cache(&self) -> Option<&CacheRoot> {
        self.classifier.cache()
    }

    /// Judges the layer a Prepare with `labels` unpacks ([`Pulls::decide`]), with the
    /// credentials of the CRI pulls of the image in flight (containerd is pulling it with them:
    /// that is why it asks). An error: the policy refuses the image. A layer decided a disk is
    /// noted as one of that image's pulls.
    pub async fn judge(&self, labels: &BTreeMap<String, String>) -> Result<Judged> {
        let cri = CriLabels::read(labels);
        let image = cri.image();
        let pending = image.map_or_else(Vec::new, |i| self.tenants.pending_for(i));
        let client = self.client_with(image.cloned(), &pending);
        let decision = match cri.wanted_layer() {
            Ok((image, manifest, wanted)) => {
                let decision = self
                    .decide(client.as_ref(), image, manifest, wanted)
                    .await?;
                if let Decision::Remote { .. } = decision {
                    self.tenants.note_classified(image, manifest);
                }
                decision
            }
            Err((reason, why)) => {
                // Labels that name the image but not the layer: its policy still holds.
                self.check_policy(&cri, client.as_ref()).await?;
                Decision::Ordinary {
                    reason,
                    why,
                    candidate: cri.candidate,
                }
            }
        };
        Ok(Judged {
            cri,
            client,
            pending,
            decision,
        })
    }

    /// Decides what `wanted` of `image` (pinned to its platform `manifest`) is, read with
    /// `client`: the one decision behind a Prepare ([`Pulls::judge`]) and the management API's
    /// disks (`daemon/disks.rs`). The signatures are fetched while the layer is classified
    /// (manifest, config, TOC: nothing of the disk), and nothing is decided before both are
    /// done. An error: the signature policy refuses the image.
    pub async fn decide(
        &self,
        client: &dyn Registry,
        image: &Reference,
        manifest: Digest,
        wanted: Wanted,
    ) -> Result<Decision> {
        let pinned = image.with_digest(manifest);
        let (checked, decision) = tokio::join!(
            self.trust()
                .check_image(client, self.cache(), image, manifest),
            self.classifier.classify(client, &pinned, wanted)
        );
        checked?;
        Ok(decision)
    }

    /// Whether the signature policy accepts the image a Prepare with `cri`'s labels unpacks
    /// (the reference as pulled and the platform manifest digest). Without those labels
    /// containerd pulls outside CRI (`ctr`), and nothing is checked here.
    async fn check_policy(&self, cri: &CriLabels, client: &dyn Registry) -> Result<()> {
        let trust = self.trust();
        if !trust.is_set() {
            return Ok(());
        }
        let Some((image, digest)) = cri.pulled()? else {
            return Ok(());
        };
        trust.check_image(client, self.cache(), image, digest).await
    }

    /// The registry client acting with the node's credentials and `credentials` for the
    /// repository of `image` (tried after the node's, in order).
    fn client_with(
        &self,
        image: Option<Reference>,
        credentials: &[Credential],
    ) -> Arc<dyn Registry> {
        let base = Arc::clone(self.client());
        match image {
            Some(image) if !credentials.is_empty() => {
                base.with_grants(Arc::new(Granted::of(credentials.iter().map(|c| {
                    Grant::new(
                        &image.registry,
                        &image.repository,
                        c.clone(),
                        self.tenants.ttl(),
                    )
                }))))
            }
            _ => base,
        }
    }

    /// Starts fetching the blob bytes the structure check of `layer`'s server reads, with
    /// `client` (one that read the image's manifest and TOC), when a cache keeps its record and
    /// TOC: from before the server is started, so that they come while it starts.
    pub fn fetch_ahead(&self, client: &Arc<dyn Registry>, layer: Digest) -> Option<Ahead> {
        self.cache()
            .map(|cache| Ahead::fetch(Arc::clone(client), cache.clone(), layer))
    }

    /// What a new mount server of `reference` (pinned by digest) may fetch with: the grants of
    /// succeeded pulls that covered it, and, if the node's own credentials do not read it, the
    /// first credential of a pull in flight that does (asked of the registry now, so a wrong
    /// one is never handed over).
    pub(crate) async fn grants_for_server(
        &self,
        reference: &Reference,
        pending: &[Credential],
    ) -> Vec<Grant> {
        let Some(digest) = reference.digest else {
            return Vec::new();
        };
        let mut grants = self.tenants.covering(reference, &digest);
        if pending.is_empty() {
            return grants;
        }
        match self.client().check_manifest(reference).await {
            Ok(_) => return grants,
            Err(e) if e.kind() == ErrorKind::Auth => {}
            Err(e) => {
                tracing::warn!(%reference, error = %e.chain(), "cannot tell which credentials read the image");
                return grants;
            }
        }
        for credential in pending {
            let client =
                self.client_with(Some(reference.clone()), std::slice::from_ref(credential));
            if client.check_manifest(reference).await.is_ok() {
                grants.push(Grant::new(
                    &reference.registry,
                    &reference.repository,
                    credential.clone(),
                    self.tenants.ttl(),
                ));
                break;
            }
        }
        grants
    }
}
