//! A Prepare with containerd's remote-snapshot handshake: the layer judged
//! ([`super::prepare::Pulls::judge`]), planned (a [`control::LayerPlan`]) and served
//! (`Supervisor::ensure`), the target snapshot recorded (docs/architecture.md, "judge → plan →
//! serve").

use std::collections::BTreeMap;
use std::sync::Arc;

use super::prepare::classify::{Decision, Outcome, LABEL_REMOTE, LABEL_TARGET};
use super::prepare::Judged;
use super::servers::control;
use super::store::{Kind, RemoteLayerRef};
use super::{blocking, Mount, Snapshotter};
use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;

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
                why,
                candidate,
            } => {
                let detail = why.chain();
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
