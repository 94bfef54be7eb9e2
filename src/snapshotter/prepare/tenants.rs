//! Who may use what on a node shared by tenants (Kubernetes namespaces).
//!
//! A lazy fetch uses credentials only from the node's own configuration (docker config files,
//! helpers, `hosts.toml`) or from a CRI `PullImage` that **succeeded** for that image in the
//! namespace the fetch serves. The CRI image-service proxy ([`crate::snapshotter::prepare::cri`]) sees each pull:
//! while containerd pulls, the pull's credentials are *pending* — the classification of that
//! very pull's layers may try them ([`Tenants::pending_for`]), and a mount server is handed one
//! only after a request of ours with it succeeded; once containerd's pull has succeeded they
//! become a [`PullGrant`] of that namespace for the image's manifest digests. A failed pull
//! leaves nothing, and one namespace's grant never replaces another's, so a wrong password
//! changes nothing for anyone else.
//!
//! A pod's disk (`EnsureDisk` from the shim, with the pod's namespace) is made ready only when
//! that namespace may pull the image: the node's own credentials read it, or a grant of the
//! namespace covers the digest the reference resolves to. What the node already holds for an
//! image (manifests, TOCs, chunks) is served to a namespace as [`Verification`] says.
//!
//! Everything here is memory only and bounded; a restart forgets it (pods pull again, running
//! mount servers keep what they were handed until it expires).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use serde::Deserialize;
use tokio::time::Instant;

use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::registry::auth::Credential;
use crate::registry::granted::Grant;

/// Most grants kept (namespace, repository and credential each); the one closest to expiring
/// makes room.
pub const MAX_GRANTS: usize = 4096;
/// Most digests one grant covers.
const MAX_DIGESTS: usize = 64;
/// Most pulls in flight whose credentials are kept.
const MAX_PENDING: usize = 1024;
/// Most images remembered as readable with the node's own credentials.
const MAX_OPEN: usize = 4096;

/// When a namespace is served what the node already holds of an image (KEP-2535's question,
/// asked of lazily loaded disks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verification {
    /// Never asked: anything the node holds is served to any namespace (Kubernetes before
    /// KEP-2535). New fetches still use only credentials granted for that image.
    Never,
    /// An image the node's own credentials read is served to anyone; one that needed a
    /// tenant's credentials only to a namespace whose own pull of it succeeded, or whose
    /// grants read it from the registry now.
    IfPrivate,
    /// Every namespace is checked every time: the registry must answer it (with the node's
    /// credentials or the namespace's own), or the namespace's own pull of that digest
    /// succeeded; nothing is served from what the node holds on trust.
    Always,
}

/// Credentials a namespace's pull of an image was granted by succeeding.
#[derive(Debug, Clone)]
pub struct PullGrant {
    pub namespace: String,
    pub registry: String,
    pub repository: String,
    pub credential: Credential,
    /// The manifest digests the pull fetched (the reference's and its platform's).
    pub digests: BTreeSet<Digest>,
    pub expires: Instant,
}

impl PullGrant {
    /// This grant as a registry client's grant for its repository.
    pub fn grant(&self) -> Grant {
        Grant {
            registry: self.registry.clone(),
            repository: self.repository.clone(),
            credential: self.credential.clone(),
            expires: self.expires,
        }
    }

    fn same(&self, other: &PullGrant) -> bool {
        self.namespace == other.namespace
            && self.registry == other.registry
            && self.repository == other.repository
            && self.credential == other.credential
    }
}

/// A pull in flight with credentials; its credentials are forgotten when it is dropped.
pub struct PendingPull<'a> {
    tenants: &'a Tenants,
    image: Reference,
    id: u64,
}

impl PendingPull<'_> {
    /// The manifest digests the pull's layers were classified under.
    pub fn digests(&self) -> BTreeSet<Digest> {
        let pending = self.tenants.pending.lock();
        pending
            .get(&self.image)
            .and_then(|pulls| pulls.iter().find(|p| p.id == self.id))
            .map(|p| p.digests.clone())
            .unwrap_or_default()
    }
}

impl Drop for PendingPull<'_> {
    fn drop(&mut self) {
        let mut pending = self.tenants.pending.lock();
        if let Some(pulls) = pending.get_mut(&self.image) {
            pulls.retain(|p| p.id != self.id);
            if pulls.is_empty() {
                pending.remove(&self.image);
            }
        }
    }
}

struct Pending {
    id: u64,
    credential: Credential,
    digests: BTreeSet<Digest>,
}

/// Pulls in flight, grants of succeeded pulls, and images the node's own credentials read.
pub struct Tenants {
    pub policy: Verification,
    /// How long a grant lasts from the pull that made it.
    ttl: Duration,
    /// Pulls in flight by image, as PullImage named it (parsed: the CRI labels name it alike).
    pending: Mutex<HashMap<Reference, Vec<Pending>>>,
    next_id: AtomicU64,
    grants: Mutex<Vec<PullGrant>>,
    open: Mutex<VecDeque<Digest>>,
}

impl Tenants {
    pub fn new(policy: Verification, ttl: Duration) -> Self {
        Tenants {
            policy,
            ttl,
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            grants: Mutex::new(Vec::new()),
            open: Mutex::new(VecDeque::new()),
        }
    }

    /// How long a grant lasts from the pull that made it (`cri.credentials_ttl`).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Keeps `credential` while containerd pulls `image` with it (until the guard is dropped);
    /// none for an image PullImage names in a way no reference parses.
    pub fn begin_pull(&self, image: &str, credential: Credential) -> Option<PendingPull<'_>> {
        let key: Reference = image.parse().ok()?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut pending = self.pending.lock();
        if pending.values().map(Vec::len).sum::<usize>() >= MAX_PENDING {
            tracing::warn!(
                image,
                "too many pulls in flight with credentials; this one's are not used lazily"
            );
            return None;
        }
        pending.entry(key.clone()).or_default().push(Pending {
            id,
            credential,
            digests: BTreeSet::new(),
        });
        Some(PendingPull {
            tenants: self,
            image: key,
            id,
        })
    }

    /// The credentials of the pulls of `image` in flight, oldest first.
    pub fn pending_for(&self, image: &Reference) -> Vec<Credential> {
        let pending = self.pending.lock();
        pending
            .get(image)
            .map(|pulls| pulls.iter().map(|p| p.credential.clone()).collect())
            .unwrap_or_default()
    }

    /// Notes that the pulls of `image` in flight classified layers under manifest `digest`.
    pub fn note_classified(&self, image: &Reference, digest: Digest) {
        let mut pending = self.pending.lock();
        for pull in pending.get_mut(image).into_iter().flatten() {
            if pull.digests.len() < MAX_DIGESTS {
                pull.digests.insert(digest);
            }
        }
    }

    /// Records that `namespace`'s pull of `image` with `credential` succeeded, covering
    /// `digests`; returns the grant (renewing one of the same namespace and credential).
    pub fn grant(
        &self,
        namespace: &str,
        image: &Reference,
        credential: Credential,
        digests: BTreeSet<Digest>,
    ) -> PullGrant {
        let mut grant = PullGrant {
            namespace: namespace.to_string(),
            registry: image.registry.clone(),
            repository: image.repository.clone(),
            credential,
            digests,
            expires: Instant::now() + self.ttl,
        };
        let now = Instant::now();
        let mut grants = self.grants.lock();
        grants.retain(|g| g.expires > now);
        if let Some(i) = grants.iter().position(|g| g.same(&grant)) {
            let old = grants.remove(i);
            grant.digests.extend(old.digests);
        }
        while grant.digests.len() > MAX_DIGESTS {
            let first = *grant.digests.iter().next().expect("not empty");
            grant.digests.remove(&first);
        }
        if grants.len() >= MAX_GRANTS {
            if let Some(i) = grants
                .iter()
                .enumerate()
                .min_by_key(|(_, g)| g.expires)
                .map(|(i, _)| i)
            {
                grants.remove(i);
            }
        }
        grants.push(grant.clone());
        grant
    }

    /// Adds `digest` (a platform manifest resolved through it) to the grants of `namespace`
    /// for `image`'s repository that cover `via`.
    pub fn extend(&self, namespace: &str, image: &Reference, via: &Digest, digest: Digest) {
        let mut grants = self.grants.lock();
        for g in grants.iter_mut().filter(|g| {
            g.namespace == namespace
                && g.registry == image.registry
                && g.repository == image.repository
                && g.digests.contains(via)
        }) {
            if g.digests.len() < MAX_DIGESTS {
                g.digests.insert(digest);
            }
        }
    }

    /// The unexpired grants for `image`'s repository that `keep` accepts, newest first.
    fn unexpired(&self, image: &Reference, keep: impl Fn(&PullGrant) -> bool) -> Vec<PullGrant> {
        let now = Instant::now();
        let grants = self.grants.lock();
        grants
            .iter()
            .rev()
            .filter(|g| {
                g.expires > now
                    && g.registry == image.registry
                    && g.repository == image.repository
                    && keep(g)
            })
            .cloned()
            .collect()
    }

    /// The unexpired grants of `namespace` for `image`'s repository, newest first.
    pub fn grants_of(&self, namespace: &str, image: &Reference) -> Vec<PullGrant> {
        self.unexpired(image, |g| g.namespace == namespace)
    }

    /// The unexpired grants of any namespace whose pull covered manifest `digest` of `image`'s
    /// repository: what the mount server of that image may fetch with (the image's own bytes,
    /// which that pull was allowed).
    pub fn covering(&self, image: &Reference, digest: &Digest) -> Vec<Grant> {
        self.unexpired(image, |g| g.digests.contains(digest))
            .iter()
            .map(PullGrant::grant)
            .collect()
    }

    /// Remembers that the node's own credentials read manifest `digest`.
    pub fn note_open(&self, digest: Digest) {
        let mut open = self.open.lock();
        if !open.contains(&digest) {
            if open.len() >= MAX_OPEN {
                open.pop_front();
            }
            open.push_back(digest);
        }
    }

    /// Whether the node's own credentials were seen to read manifest `digest`.
    pub fn is_open(&self, digest: &Digest) -> bool {
        self.open.lock().contains(digest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cred(user: &str) -> Credential {
        Credential {
            username: user.into(),
            secret: format!("{user}-secret"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn pending_credentials_live_only_as_long_as_their_pull() {
        let t = Tenants::new(Verification::IfPrivate, Duration::from_secs(60));
        let image: Reference = "r.example/vm/a:1".parse().unwrap();
        let a = t.begin_pull("r.example/vm/a:1", cred("alice")).unwrap();
        {
            let _b = t.begin_pull("r.example/vm/a:1", cred("mallory")).unwrap();
            let users: Vec<String> = t
                .pending_for(&image)
                .into_iter()
                .map(|c| c.username)
                .collect();
            assert_eq!(users, ["alice", "mallory"]);
            t.note_classified(&image, Digest::of(b"m"));
        }
        // Mallory's pull ended (failed): her credentials are gone, nothing was granted.
        assert_eq!(t.pending_for(&image).len(), 1);
        assert_eq!(a.digests(), BTreeSet::from([Digest::of(b"m")]));
        assert!(t
            .pending_for(&"r.example/vm/other:1".parse().unwrap())
            .is_empty());
        drop(a);
        assert!(t.pending_for(&image).is_empty());
        assert!(t.covering(&image, &Digest::of(b"m")).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn grants_are_per_namespace_by_digest_and_expire() {
        let t = Tenants::new(Verification::IfPrivate, Duration::from_secs(60));
        let image: Reference = "r.example/vm/a:1".parse().unwrap();
        let (d1, d2) = (Digest::of(b"1"), Digest::of(b"2"));
        t.grant("tenant-a", &image, cred("alice"), BTreeSet::from([d1]));
        t.grant("tenant-b", &image, cred("bob"), BTreeSet::from([d2]));
        assert_eq!(t.grants_of("tenant-a", &image).len(), 1);
        assert!(t.grants_of("tenant-c", &image).is_empty());
        let other: Reference = "r.example/vm/b:1".parse().unwrap();
        assert!(t.grants_of("tenant-a", &other).is_empty());
        // A mount server of d1 may use alice's grant only.
        let users: Vec<String> = t
            .covering(&image, &d1)
            .into_iter()
            .map(|g| g.credential.username)
            .collect();
        assert_eq!(users, ["alice"]);
        // A platform manifest resolved through d1 joins the grant.
        let platform = Digest::of(b"platform");
        t.extend("tenant-a", &image, &d1, platform);
        assert_eq!(t.covering(&image, &platform).len(), 1);
        t.extend("tenant-b", &image, &d1, Digest::of(b"x"));
        assert!(t.covering(&image, &Digest::of(b"x")).is_empty());
        // The same namespace and credential again: one grant, digests kept.
        t.grant("tenant-a", &image, cred("alice"), BTreeSet::from([d2]));
        let a = t.grants_of("tenant-a", &image);
        assert_eq!(a.len(), 1);
        assert!(a[0].digests.contains(&d1) && a[0].digests.contains(&d2));
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(t.grants_of("tenant-a", &image).is_empty());
        assert!(t.covering(&image, &d1).is_empty());
    }

    #[test]
    fn open_images_are_remembered_within_a_bound() {
        let t = Tenants::new(Verification::IfPrivate, Duration::from_secs(60));
        for i in 0..MAX_OPEN + 5 {
            t.note_open(Digest::of(&i.to_le_bytes()));
        }
        assert!(!t.is_open(&Digest::of(&0usize.to_le_bytes())));
        assert!(t.is_open(&Digest::of(&(MAX_OPEN + 4).to_le_bytes())));
    }
}
