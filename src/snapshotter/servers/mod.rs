//! The snapshotter's side of the mount servers: stopping unused ones, the statuses and
//! counters they report, credentials handed to them, and mounting every recorded layer at
//! start.

pub mod control;
pub mod keeper;
pub mod supervisor;

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::registry::granted::Grant;
use crate::snapshotter::{blocking, Freshness, Snapshotter, PIN_USER};

impl Snapshotter {
    /// Stops the servers of `layers` that no snapshot or pin uses (after Remove, RemoveDisk or
    /// Cleanup); returns how many it stopped. Each layer is checked and stopped under its own
    /// lock, and its server's final counters are kept.
    pub async fn stop_unused(
        self: &Arc<Self>,
        layers: Vec<crate::oci::digest::Digest>,
    ) -> Result<u32> {
        let mut stopped = 0;
        for layer in layers {
            let _lock = self.layer_locks.lock(&layer).await;
            let me = Arc::clone(self);
            if blocking(move || me.remote_layers())
                .await?
                .contains_key(&layer)
            {
                continue;
            }
            match self.servers.stop(&layer).await {
                Ok(Some(last)) => {
                    self.observe(&last);
                    self.counters.forget(&last.instance);
                    stopped += 1;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(%layer, error = %e.chain(), "the unused layer's server keeps serving")
                }
            }
        }
        Ok(stopped)
    }

    /// Starts a successor to `layer`'s server, which died with its mounts up
    /// ([`supervisor::Supervisor::revive`]), under the layer's lock.
    pub async fn revive(self: Arc<Self>, layer: crate::oci::digest::Digest) {
        let _lock = self.layer_locks.lock(&layer).await;
        if let Err(e) = self.servers.revive(&layer).await {
            tracing::error!(%layer, error = %e.chain(), "the layer's mount server was not succeeded");
        }
    }

    /// Takes in a server's counters.
    pub fn observe(&self, status: &control::LayerStatus) {
        if let Some(counters) = &status.counters {
            self.counters.observe(&status.instance, counters);
        }
    }

    /// Hands the running servers of the images `digests` of `grant`'s repository covers the
    /// credentials of a pull of them that succeeded; a server that does not answer gets them
    /// at its next start.
    pub async fn hand_grant(
        self: &Arc<Self>,
        grant: &Grant,
        digests: &std::collections::BTreeSet<crate::oci::digest::Digest>,
    ) -> Result<()> {
        let me = Arc::clone(self);
        let layers = blocking(move || me.remote_layers()).await?;
        for (layer, (remote, _)) in layers {
            let r = &remote.reference;
            let covered = r.registry == grant.registry
                && r.repository == grant.repository
                && r.digest.is_some_and(|d| digests.contains(&d));
            if !covered {
                continue;
            }
            if let Err(e) = self.servers.hand_grant(&layer, grant).await {
                tracing::debug!(%layer, error = %e.chain(), "the layer's server did not take the credentials");
            }
        }
        Ok(())
    }

    /// What each of `layers`' servers says now (`None`: no server answered within the call
    /// deadline), asked all at once; their counters are taken in. `fresh`: how long to wait
    /// for them. `layers` are every recorded layer (the answers kept for others are dropped).
    pub async fn statuses(
        &self,
        layers: impl IntoIterator<Item = crate::oci::digest::Digest>,
        fresh: Freshness,
    ) -> HashMap<crate::oci::digest::Digest, Option<control::LayerStatus>> {
        let asked = layers.into_iter().map(|layer| async move {
            let recent = match fresh {
                Freshness::Prompt(wait) => {
                    self.recent.lock().get(&layer).cloned().map(|r| (wait, r))
                }
                Freshness::Now => None,
            };
            let status = match recent {
                Some((wait, recent)) => {
                    match tokio::time::timeout(wait, self.servers.status(&layer)).await {
                        Ok(status) => status,
                        Err(_) => return (layer, Some(recent), false),
                    }
                }
                None => self.servers.status(&layer).await,
            };
            (layer, status, true)
        });
        let answers = futures_util::future::join_all(asked).await;
        let mut recent = self.recent.lock();
        let statuses: HashMap<_, _> = answers
            .into_iter()
            .map(|(layer, status, answered)| {
                if answered {
                    match &status {
                        Some(status) => {
                            self.observe(status);
                            recent.insert(layer, status.clone());
                        }
                        None => {
                            recent.remove(&layer);
                        }
                    }
                }
                (layer, status)
            })
            .collect();
        // Callers ask for every recorded layer: what no longer is one is forgotten.
        recent.retain(|layer, _| statuses.contains_key(layer));
        statuses
    }

    /// Writes the counters if they changed, off the async workers.
    pub async fn save_counters(self: &Arc<Self>) -> Result<()> {
        for (event, n) in self.servers.take_events().counted() {
            self.counters.add(&event, n);
        }
        let me = Arc::clone(self);
        blocking(move || me.counters.save()).await
    }
}

impl Snapshotter {
    /// Mounts every layer the store records (adopting running servers), all at once; a layer
    /// that cannot be mounted is logged and left for a later start.
    pub async fn mount_recorded(self: &Arc<Self>) -> Result<usize> {
        let me = Arc::clone(self);
        let layers = blocking(move || me.remote_layers()).await?;
        let mounted = layers.iter().map(|(layer, (remote, snapshots))| async move {
            let _lock = self.layer_locks.lock(layer).await;
            match self
                .servers
                .ensure(
                    &control::LayerPlan::recorded(
                        *layer,
                        &remote.reference,
                        remote.alias.as_ref(),
                        // A disk kept by EnsureDisk wants its ready-disk directory back.
                        match snapshots.iter().any(|u| u.starts_with(PIN_USER)) {
                            true => control::Need::ReadyDisk,
                            false => control::Need::Layer,
                        },
                    ),
                    // Recorded layers were checked when first served: nothing to fetch ahead.
                    None,
                )
                .await
            {
                Ok(mnt) => {
                    tracing::info!(%layer, mountpoint = %mnt.display(), snapshots = snapshots.len(), "remote snapshot layer mounted")
                }
                Err(e) => {
                    tracing::error!(%layer, error = %e.chain(), "cannot mount a remote snapshot's layer; reads of it fail until a restart mounts it")
                }
            }
        });
        futures_util::future::join_all(mounted).await;
        Ok(layers.len())
    }

    /// Makes sure every remote layer under snapshot `key` (its own and its parents') is served
    /// before containerd is handed mounts that use it. An unserved layer's mountpoint is an
    /// empty directory (after a reboot) or a dead connection (after its server died): a
    /// container or an image volume on it would start on an empty filesystem, and a VM would
    /// find no disk. Such a layer is served again, as at the daemon's start; one that cannot
    /// be fails the call, naming the layer and why. `key` "" has no layers.
    pub async fn serve_chain(self: &Arc<Self>, key: &str) -> Result<()> {
        if key.is_empty() {
            return Ok(());
        }
        let me = Arc::clone(self);
        let key = key.to_string();
        let unserved = blocking(move || me.unserved_layers(&key)).await?;
        for remote in unserved {
            let layer = remote.layer;
            let _lock = self.layer_locks.lock(&layer).await;
            let served = self
                .servers
                .ensure(
                    &control::LayerPlan::recorded(
                        layer,
                        &remote.reference,
                        remote.alias.as_ref(),
                        control::Need::Layer,
                    ),
                    None,
                )
                .await;
            match served {
                Ok(mnt) => {
                    tracing::warn!(%layer, mountpoint = %mnt.display(), "a remote snapshot's layer was not served; it is served again")
                }
                Err(e) => {
                    return Err(Error::new(
                        ErrorKind::FailedPrecondition,
                        format!(
                            "layer {layer} of {} is not served and cannot be served again ({}); \
                             vmdisk does not hand containerd its empty mountpoint, on which a \
                             container or image volume would start with no files: make the \
                             registry serve the image again, or remove the image and pull it",
                            remote.reference,
                            e.chain()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}
