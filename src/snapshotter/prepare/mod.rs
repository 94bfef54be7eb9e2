//! A Prepare with containerd's remote-snapshot handshake. [`Pulls`] judges the layer being
//! unpacked: whether the signature policy accepts its image, whether it is a lazily loadable
//! disk ([`classify`]), and what the CRI pulls of the image in flight may read with
//! ([`tenants`]); the snapshotter then starts the layer's server and records the target
//! snapshot ([`Snapshotter::prepare`]). The disks of the management API (`daemon/disks.rs`)
//! are read, checked and granted by the same [`Pulls`].

pub mod classify;
pub mod cri;
pub mod pods;
pub mod tenants;

use std::collections::BTreeMap;
use std::sync::Arc;

use self::classify::{Classifier, CriLabels, Decision, Outcome, LABEL_REMOTE, LABEL_TARGET};
use self::tenants::Tenants;
use crate::cache::CacheRoot;
use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::policy::Verifier;
use crate::registry::auth::Credential;
use crate::registry::granted::{Grant, Granted};
use crate::registry::Registry;
use crate::snapshotter::servers::control;
use crate::snapshotter::servers::supervisor::Ahead;
use crate::snapshotter::store::{Kind, RemoteLayerRef};
use crate::snapshotter::{blocking, Mount, Snapshotter};

/// What the daemon knows of image pulls, for a Prepare and the management API's disks alike:
/// how an image is read (the node's registry client, the cache of verified manifests), whether
/// it is trusted (the signature policy), whether a layer is a disk (the classifier), and what
/// each namespace's pulls granted (the tenants). Held by the [`Snapshotter`]; it keeps no
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

    /// Checks the image a Prepare with `labels` unpacks against the signature policy and
    /// classifies the layer, with the credentials of the CRI pulls of the image in flight
    /// (containerd is pulling it with them: that is why it asks). An error: the policy refuses
    /// the image. A layer classified as a disk is noted as one of that image's pulls.
    pub async fn judge(&self, labels: &BTreeMap<String, String>) -> Result<Judged> {
        let cri = CriLabels::read(labels);
        let image = cri.image();
        let pending = image.map_or_else(Vec::new, |i| self.tenants.pending_for(i));
        let client = self.client_with(image.cloned(), &pending);
        // The signatures are fetched while the layer is classified (manifest, config, TOC:
        // nothing of the disk), and nothing is served before both are done.
        let (checked, decision) = tokio::join!(
            self.check_policy(&cri, client.as_ref()),
            self.classifier.classify(&cri, client.as_ref())
        );
        checked?;
        if let (Decision::Remote { reference, .. }, Some(image)) = (&decision, image) {
            if let Some(digest) = reference.digest {
                self.tenants.note_classified(image, digest);
            }
        }
        Ok(Judged {
            cri,
            client,
            pending,
            decision,
        })
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
    async fn grants_for_server(&self, reference: &Reference, pending: &[Credential]) -> Vec<Grant> {
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

/// What a remote Prepare did: made the remote snapshot, or found it made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Served {
    Remote,
    Reused,
}

impl From<Served> for Outcome {
    fn from(served: Served) -> Outcome {
        match served {
            Served::Remote => Outcome::Remote,
            Served::Reused => Outcome::Reused,
        }
    }
}

impl Snapshotter {
    /// Prepare with containerd's remote-snapshot handshake. `Ok(None)`: the target snapshot
    /// now exists (answer AlreadyExists); `Ok(Some(mounts))`: an ordinary active snapshot.
    pub async fn prepare(
        self: &Arc<Self>,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Option<Vec<Mount>>> {
        if let Some(target) = labels.get(LABEL_TARGET).cloned() {
            use tracing::Instrument;
            let span = tracing::info_span!("prepare", key, target = %target);
            if self
                .try_remote(&target, parent, &labels)
                .instrument(span)
                .await?
            {
                return Ok(None);
            }
        }
        self.serve_chain(parent).await?;
        let me = Arc::clone(self);
        let (key, parent) = (key.to_string(), parent.to_string());
        blocking(move || me.create(&key, &parent, Kind::Active, labels))
            .await
            .map(Some)
    }

    /// Judges the layer ([`Pulls::judge`]) and, if it is a disk, serves it remotely; whether
    /// the target snapshot now exists. An image the policy refuses fails the Prepare (and so
    /// containerd's pull), whatever the layer: an ordinary pull of it would unpack the same
    /// unverified bytes. Every outcome is counted and logged.
    async fn try_remote(
        self: &Arc<Self>,
        target: &str,
        parent: &str,
        labels: &BTreeMap<String, String>,
    ) -> Result<bool> {
        let started = std::time::Instant::now();
        let judged = match self.pulls.judge(labels).await {
            Ok(judged) => judged,
            Err(e) => {
                self.counters.add(&Outcome::RefusedByPolicy, 1);
                tracing::warn!(error = %e.chain(), "the signature policy refuses the image; the pull fails");
                return Err(e);
            }
        };
        match &judged.decision {
            Decision::Remote { reference, layer } => {
                match self
                    .prepare_remote(target, parent, labels, (reference, *layer), &judged)
                    .await
                {
                    Ok(served) => {
                        let outcome = Outcome::from(served);
                        self.counters.add(&outcome, 1);
                        let ms = started.elapsed().as_millis() as u64;
                        tracing::info!(%layer, %reference, outcome = outcome.decision(), ms, "layer is served lazily");
                        self.lazily_pulled.notify_one();
                        return Ok(true);
                    }
                    Err(e) => {
                        self.counters.add(&Outcome::MountFailed, 1);
                        tracing::warn!(%layer, error = %e.chain(), "lazy mount failed; containerd pulls the layer normally");
                    }
                }
            }
            Decision::Ordinary {
                reason,
                detail,
                candidate,
            } => {
                if *candidate {
                    self.counters.add(&Outcome::Fallback(*reason), 1);
                    tracing::warn!(
                        reason = reason.as_str(),
                        detail,
                        "a published VM-disk layer is pulled normally"
                    );
                } else {
                    self.counters.add(&Outcome::Ordinary(*reason), 1);
                    tracing::info!(
                        reason = reason.as_str(),
                        detail,
                        "ordinary layer; containerd pulls it"
                    );
                }
            }
        }
        Ok(false)
    }

    /// Serves `layer` of `reference` (classified remote) as snapshot `target` with the
    /// Prepare's `labels`, as `judged` reads the image (the image as the pull named it is the
    /// store's alias).
    async fn prepare_remote(
        self: &Arc<Self>,
        target: &str,
        parent: &str,
        labels: &BTreeMap<String, String>,
        (reference, layer): (&Reference, Digest),
        judged: &Judged,
    ) -> Result<Served> {
        let ahead = self.pulls.fetch_ahead(&judged.client, layer);
        let me = Arc::clone(self);
        let name = target.to_string();
        if let Some(existing) = blocking(move || me.store.get(&name)).await? {
            if existing.kind == Kind::Committed && existing.parent == parent {
                return Ok(Served::Reused);
            }
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!("a different snapshot is named {target:?} already"),
            ));
        }
        let alias = judged.cri.named().cloned();
        let grants = self
            .pulls
            .grants_for_server(reference, &judged.pending)
            .await;
        let plan = control::LayerPlan {
            key: layer,
            reference: reference.clone(),
            alias: alias.clone(),
            need: control::Need::Layer,
            grants,
            verdict: control::Verdict::DecidedNow,
        };
        let lock = self.layer_locks.lock(&layer).await;
        self.servers.ensure(&plan, ahead).await?;
        let mut labels = labels.clone();
        labels.insert(LABEL_REMOTE.to_string(), "vmdisk".to_string());
        let remote = RemoteLayerRef {
            reference: reference.clone(),
            layer,
            alias,
        };
        let (me, target, parent) = (Arc::clone(self), target.to_string(), parent.to_string());
        let created = blocking(move || {
            let _g = me.guard();
            match me
                .store
                .create(&target, Kind::Committed, &parent, labels, Some(remote))
            {
                Ok(_) => Ok(Served::Remote),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(Served::Reused),
                Err(e) => Err(e),
            }
        })
        .await;
        drop(lock);
        created
    }
}
