//! Disks made ready through the management API (`vmdisk path`, `prefetch`, `rm`, `gc`), with
//! the tenant checks: a namespace gets a disk only if it may pull the image.

use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::oci::reference::{ImageName, Reference};
use crate::registry::granted::Granted;
use crate::registry::Registry;
use crate::snapshotter::prepare::classify::{Decision, Wanted};
use crate::snapshotter::prepare::tenants;
use crate::snapshotter::servers::control;
use crate::snapshotter::store::RemoteLayerRef;
use crate::snapshotter::{blocking, Requester, Snapshotter};

/// How a requester may read a disk ([`Snapshotter::disk_source`]).
enum DiskSource {
    /// Through the registry with `client` (the node's credentials, or the namespace's `grant`).
    Fetch {
        client: Arc<dyn Registry>,
        grant: Option<tenants::PullGrant>,
    },
    /// What the node holds for the reference, without asking the registry.
    Held(RemoteLayerRef),
}

/// Disks made ready through the management API (`vmdisk path`, `prefetch`, `rm`, `gc`).
impl Snapshotter {
    /// Makes `reference`'s disk ready for `requester` and keeps it until
    /// [`Snapshotter::remove_disk`]; returns its layer. A namespace gets it only if it may pull
    /// the image ([`tenants`]). With the registry unreachable, a reference kept before is
    /// served from the cache to the node's operator, and to a namespace as the verification
    /// policy allows.
    pub async fn ensure_disk(
        self: &Arc<Self>,
        reference: &str,
        requester: &Requester,
    ) -> Result<crate::oci::digest::Digest> {
        let name: ImageName = reference.parse()?;
        let parsed = name.reference();
        let cache = self.pulls.cache();
        let (remote, grants, checked_now, ahead) = match self
            .disk_source(reference, parsed, requester)
            .await?
        {
            DiskSource::Fetch { client, grant } => {
                match crate::resolve::platform_manifest(client.as_ref(), cache, parsed).await {
                    Ok((_, digest, _)) => {
                        let decided = self
                            .pulls
                            .decide(client.as_ref(), parsed, digest, Wanted::Disk)
                            .await?;
                        let (pinned, layer) = match decided {
                            Decision::Remote { reference, layer } => (reference, layer),
                            Decision::Ordinary { why, .. } => return Err(why),
                        };
                        let mut grants = self.pulls.tenants.covering(parsed, &digest);
                        match (&grant, requester) {
                            (Some(g), Requester::Namespace(ns)) => {
                                // The platform manifest joins the grant it was read through.
                                for top in &g.digests {
                                    self.pulls.tenants.extend(ns, parsed, top, digest);
                                }
                                if !grants.iter().any(|h| h.credential == g.credential) {
                                    grants.push(g.grant());
                                }
                            }
                            _ => self.pulls.tenants.note_open(digest),
                        }
                        (
                            RemoteLayerRef {
                                reference: pinned,
                                layer,
                                alias: Some(name.clone()),
                            },
                            grants,
                            true,
                            self.pulls.fetch_ahead(&client, layer),
                        )
                    }
                    Err(e) if matches!(e.kind(), ErrorKind::Network | ErrorKind::Timeout) => {
                        let known = self.known(reference, parsed).await?;
                        let allowed = match requester {
                            Requester::Node => true,
                            Requester::Namespace(ns) => {
                                self.may_serve_held(ns, parsed, known.as_ref())
                            }
                        };
                        match known.filter(|_| allowed) {
                            Some(r) => {
                                tracing::warn!(reference, error = %e.chain(), "registry unreachable; serving the disk kept before");
                                (r, Vec::new(), false, None)
                            }
                            None => return Err(e),
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
            DiskSource::Held(r) => (r, Vec::new(), false, None),
        };
        if !checked_now {
            // Served from what the node holds: it must have been accepted under the policy in
            // force.
            self.held_accepted(&remote).await?;
        }
        let layer = remote.layer;
        let plan = control::LayerPlan {
            key: layer,
            reference: remote.reference.clone(),
            alias: remote.alias.clone(),
            need: control::Need::ReadyDisk,
            grants,
            verdict: match checked_now {
                true => control::Verdict::DecidedNow,
                false => control::Verdict::Recorded,
            },
        };
        let lock = self.layer_locks.lock(&layer).await;
        self.servers.ensure(&plan, ahead).await?;
        let (me, name) = (Arc::clone(self), reference.to_string());
        blocking(move || me.store.pin(&name, &remote)).await?;
        drop(lock);
        Ok(layer)
    }

    /// Refuses a disk the node holds unless the signature policy in force accepted it (as its
    /// pinned reference or the name it was pulled as) on this node.
    async fn held_accepted(&self, remote: &RemoteLayerRef) -> Result<()> {
        let trust = self.pulls.trust();
        if !trust.is_set() {
            return Ok(());
        }
        let accepted = trust.accepted_offline();
        let (cache, held) = (self.pulls.cache().cloned(), remote.clone());
        let ok = blocking(move || {
            let remote = held;
            let Some(cache) = cache else { return Ok(false) };
            let pinned = remote.reference.clone();
            let Some(digest) = pinned.digest else {
                return Ok(false);
            };
            let names = std::iter::once(pinned.clone())
                .chain(remote.alias.as_ref().map(|a| a.reference().clone()));
            Ok(names.into_iter().any(|n| accepted(&cache, &n, &digest)))
        })
        .await?;
        if ok {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::Refused,
                format!(
                    "{}: the registry was not asked and the signature policy in force has not accepted this image on this node",
                    remote.reference
                ),
            ))
        }
    }

    /// Whether `requester` may have `reference`'s disk, and how to read it. The node's
    /// operator reads with the node's credentials. A namespace may if its own pull of that
    /// digest succeeded, if the node's own credentials read the image, or if a grant of its
    /// own reads the digest it pulled; failing that, under [`tenants::Verification::Never`],
    /// it gets what the node holds for the reference.
    async fn disk_source(
        self: &Arc<Self>,
        reference: &str,
        parsed: &Reference,
        requester: &Requester,
    ) -> Result<DiskSource> {
        let base = Arc::clone(self.pulls.client());
        let Requester::Namespace(ns) = requester else {
            return Ok(DiskSource::Fetch {
                client: base,
                grant: None,
            });
        };
        let scoped = |g: &tenants::PullGrant| -> Arc<dyn Registry> {
            Arc::clone(&base).with_grants(Arc::new(Granted::of([g.grant()])))
        };
        let grants = self.pulls.tenants.grants_of(ns, parsed);
        // The namespace's own pull of this very digest succeeded.
        if let Some(g) = parsed
            .digest
            .and_then(|d| grants.iter().find(|g| g.digests.contains(&d)))
        {
            return Ok(DiskSource::Fetch {
                client: scoped(g),
                grant: Some(g.clone()),
            });
        }
        // The node's own credentials read it: anyone may have it.
        match base.check_manifest(parsed).await {
            Ok(digest) => {
                self.pulls.tenants.note_open(digest);
                return Ok(DiskSource::Fetch {
                    client: base,
                    grant: None,
                });
            }
            Err(e) if e.kind() == ErrorKind::Auth => {}
            Err(e) if matches!(e.kind(), ErrorKind::Network | ErrorKind::Timeout) => {
                let known = self.known(reference, parsed).await?;
                return match known.filter(|k| self.may_serve_held(ns, parsed, Some(k))) {
                    Some(k) => {
                        tracing::warn!(reference, namespace = ns, error = %e.chain(), "registry unreachable; serving the disk kept before");
                        Ok(DiskSource::Held(k))
                    }
                    None => Err(e.context(format!(
                        "cannot tell whether namespace {ns} may read {reference}"
                    ))),
                };
            }
            Err(e) => return Err(e),
        }
        // A grant of the namespace's own reads it, and its pull fetched that digest.
        let mut other = None;
        for g in &grants {
            match scoped(g).check_manifest(parsed).await {
                Ok(d) if g.digests.contains(&d) => {
                    return Ok(DiskSource::Fetch {
                        client: scoped(g),
                        grant: Some(g.clone()),
                    })
                }
                Ok(d) => other = Some(d),
                Err(e) if e.kind() == ErrorKind::Auth => {}
                Err(e) => return Err(e),
            }
        }
        if self.pulls.tenants.policy == tenants::Verification::Never {
            if let Some(k) = self.known(reference, parsed).await? {
                return Ok(DiskSource::Held(k));
            }
        }
        let why = match other {
            Some(d) => format!(
                "namespace {ns} pulled other digests of {}/{}, not {d}",
                parsed.registry, parsed.repository
            ),
            None => format!("no PullImage of it by a pod of namespace {ns} succeeded"),
        };
        Err(Error::new(
            ErrorKind::Auth,
            format!(
                "namespace {ns} may not read {reference}: the registry requires credentials, the node's own do not read it, and {why}; pull the image in a pod of that namespace (with its imagePullSecret) first, or give the node credentials for it"
            ),
        ))
    }

    /// What the node holds for `reference`: a disk kept by that name, or a remote snapshot's
    /// layer pulled by that name or pinned to that digest.
    async fn known(
        self: &Arc<Self>,
        reference: &str,
        parsed: &Reference,
    ) -> Result<Option<RemoteLayerRef>> {
        let (me, reference, parsed) = (Arc::clone(self), reference.to_string(), parsed.clone());
        blocking(move || {
            if let Some((_, r)) = me.store.pins()?.into_iter().find(|(n, _)| *n == reference) {
                return Ok(Some(r));
            }
            Ok(me.remote_layers()?.into_values().map(|(r, _)| r).find(|r| {
                r.alias.as_ref().map(ImageName::as_str) == Some(reference.as_str())
                    || parsed.digest.is_some_and(|d| {
                        let p = &r.reference;
                        p.digest == Some(d)
                            && p.registry == parsed.registry
                            && p.repository == parsed.repository
                    })
            }))
        })
        .await
    }

    /// Whether namespace `ns` may be served what the node holds (`held`) without the registry
    /// confirming it: as the verification policy says.
    fn may_serve_held(&self, ns: &str, parsed: &Reference, held: Option<&RemoteLayerRef>) -> bool {
        let Some(digest) = held.and_then(|h| h.reference.digest) else {
            return false;
        };
        let own = self
            .pulls
            .tenants
            .grants_of(ns, parsed)
            .iter()
            .any(|g| g.digests.contains(&digest));
        match self.pulls.tenants.policy {
            tenants::Verification::Never => true,
            tenants::Verification::IfPrivate => own || self.pulls.tenants.is_open(&digest),
            tenants::Verification::Always => own,
        }
    }

    /// Forgets a disk kept by [`Snapshotter::ensure_disk`]; returns whether its mount stopped.
    pub async fn remove_disk(self: &Arc<Self>, reference: &str) -> Result<bool> {
        let (me, name) = (Arc::clone(self), reference.to_string());
        let Some(pin) = blocking(move || me.store.unpin(&name)).await? else {
            return Err(Error::not_found(format!(
                "{reference} is not a disk kept by `vmdisk path` or `vmdisk prefetch` (see `vmdisk ls`)"
            )));
        };
        self.stop_unused(vec![pin.layer]).await?;
        Ok(self.servers.status(&pin.layer).await.is_none())
    }

    /// Stops unused mounts, removes stale directories, evicts unused cached layers down to
    /// `limit` (or the configured bound). Returns the bytes freed and the mounts stopped.
    pub async fn gc(self: &Arc<Self>, limit: Option<u64>) -> Result<(u64, u32)> {
        let me = Arc::clone(self);
        let unused = blocking(move || me.cleanup()).await?;
        let stopped = self.stop_unused(unused).await?;
        let freed = match limit.or(self.cache.limit) {
            Some(limit) => {
                let dir = self.cache.dir.clone();
                blocking(move || crate::cache::CacheRoot::open(&dir)?.evict(limit)).await?
            }
            None => 0,
        };
        Ok((freed, stopped))
    }

    /// The cache directory.
    pub fn cache_dir(&self) -> &Path {
        &self.cache.dir
    }
}
