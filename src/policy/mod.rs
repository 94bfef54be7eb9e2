//! Signature policies: whether an image — its manifest digest — and a seekable index may be
//! served, decided before any byte of either is.
//!
//! Two policies, each optional, both enforced when both are set:
//! - a containers-policy.json ([`containers`]) whose `sigstoreSigned` requirements take
//!   cosign's key-based signatures ([`cosign`]);
//! - a Notary Project trust policy and trust store ([`notation`]).
//!
//! An image is accepted when its platform manifest digest is signed, or when the reference
//! names an index that lists that digest and the index's digest is signed (what `cosign sign`
//! and `notation sign` sign for a multi-platform tag). A seekable index (`vmdisk index`) is an
//! artifact in a repository, and the policy for that repository applies to the digest of its
//! artifact manifest: a policy that requires signatures there requires a signed index.
//!
//! Decisions are kept in the cache by what was checked — the policy files' digest (keys and
//! certificates included), the repository and the manifest digest — so a restart does not
//! fetch signatures again, and a changed policy checks again.

pub mod containers;
pub mod cosign;
mod keys;
pub mod notation;
mod read;

pub use read::read_bounded;

use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use crate::cache::CacheRoot;
use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::{Digest, Hasher};
use crate::oci::reference::Reference;
use crate::oci::ManifestKind;
use crate::registry::Registry;
use crate::task::blocking;

/// Decisions remembered in memory (each also kept in the cache).
const MEMO: usize = 1024;

/// The policy files a node or a command names.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyFiles {
    /// A containers-policy.json (`/etc/containers/policy.json`); empty: none.
    pub policy: PathBuf,
    /// A Notary Project `trustpolicy.json` (or `trustpolicy.oci.json`); empty: none.
    pub notation_trust_policy: PathBuf,
    /// notation's trust store directory; empty: `truststore` beside the trust policy.
    pub notation_trust_store: PathBuf,
}

/// What is checked: an image or a seekable index (for messages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Subject {
    Image,
    Index,
}

impl std::fmt::Display for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Subject::Image => "image",
            Subject::Index => "seekable index",
        })
    }
}

/// The loaded policies and the decisions taken under them.
pub struct Verifier {
    containers: Option<containers::Policy>,
    notation: Option<notation::TrustPolicy>,
    /// The digest of every file read to load the policies, in order.
    fingerprint: Digest,
    accepted: Mutex<std::collections::HashMap<Digest, u64>>,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier")
            .field("containers", &self.containers.as_ref().map(|p| &p.path))
            .field("notation", &self.notation.as_ref().map(|p| &p.path))
            .finish()
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What a decision is kept under: the policies (`fingerprint`), the image or index as named
/// by what was checked, and its digest.
fn decision_key(fingerprint: &Digest, reference: &Reference, digest: &Digest) -> Digest {
    let mut h = Hasher::new();
    h.update(fingerprint.bytes());
    h.update(reference.to_string().as_bytes());
    h.update(b"\0");
    h.update(digest.bytes());
    h.finish()
}

impl Default for Verifier {
    fn default() -> Self {
        Verifier::none()
    }
}

impl Verifier {
    /// No policy: everything is accepted, nothing is fetched.
    pub fn none() -> Verifier {
        Verifier {
            containers: None,
            notation: None,
            fingerprint: Digest::of(b""),
            accepted: Mutex::new(Default::default()),
        }
    }

    /// Loads the policies `files` names (blocking file reads: call off the async workers).
    pub fn load(files: &PolicyFiles) -> Result<Verifier> {
        let set = |p: &PathBuf| (!p.as_os_str().is_empty()).then(|| p.clone());
        let containers = set(&files.policy)
            .map(|p| containers::Policy::load(&p))
            .transpose()?;
        let notation = match set(&files.notation_trust_policy) {
            Some(path) => {
                let store = set(&files.notation_trust_store)
                    .unwrap_or_else(|| path.parent().unwrap_or(Path::new("/")).join("truststore"));
                Some((notation::TrustPolicy::load(&path, &store)?, store))
            }
            None => None,
        };
        // What the decisions depend on: the policy files and the keys and certificates they
        // name, as read.
        let mut hasher = Hasher::new();
        for part in containers
            .iter()
            .flat_map(|p| p.material())
            .chain(notation.iter().flat_map(|(p, _)| p.material()))
        {
            hasher.update(&(part.len() as u64).to_le_bytes());
            hasher.update(part);
        }
        Ok(Verifier {
            containers,
            notation: notation.map(|(p, _)| p),
            fingerprint: hasher.finish(),
            accepted: Mutex::new(Default::default()),
        })
    }

    /// Whether any policy is set.
    pub fn is_set(&self) -> bool {
        self.containers.is_some() || self.notation.is_some()
    }

    /// Checks image `digest` (its platform manifest) of `reference` (as named: by tag or
    /// digest). Refuses ([`ErrorKind::Refused`]) naming the image, the policy entry and why.
    pub async fn check_image(
        &self,
        client: &dyn Registry,
        cache: Option<&CacheRoot>,
        reference: &Reference,
        digest: Digest,
    ) -> Result<()> {
        if !self.is_set() {
            return Ok(());
        }
        let refused = match self
            .check(client, cache, reference, digest, Subject::Image)
            .await
        {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::Refused => e,
            Err(e) => return Err(e),
        };
        // A multi-platform tag is signed as its index.
        if let Ok(top) = client.get_manifest(reference).await {
            if let ManifestKind::Index(index) = &top.manifest {
                if top.digest != digest && index.manifests.iter().any(|m| m.digest == digest) {
                    let by_index = reference.with_digest(top.digest);
                    return self
                        .check(client, cache, &by_index, top.digest, Subject::Image)
                        .await
                        .map_err(|_| refused);
                }
            }
        }
        Err(refused)
    }

    /// Checks the seekable index artifact `digest` in repository `repo`.
    pub async fn check_index(
        &self,
        client: &dyn Registry,
        cache: Option<&CacheRoot>,
        repo: &Reference,
        digest: Digest,
    ) -> Result<()> {
        if !self.is_set() {
            return Ok(());
        }
        self.check(
            client,
            cache,
            &repo.with_digest(digest),
            digest,
            Subject::Index,
        )
        .await
    }

    /// Whether a decision kept in a cache accepted `digest` as `reference` names it, for a
    /// node that cannot reach the registry (blocking: call off the async workers).
    pub fn accepted_offline(
        &self,
    ) -> impl Fn(&CacheRoot, &Reference, &Digest) -> bool + Send + 'static {
        let fingerprint = self.fingerprint;
        move |cache, reference, digest| {
            let now = now_secs();
            cache
                .verdict(&decision_key(&fingerprint, reference, digest))
                .is_some_and(|until| until > now)
        }
    }

    /// The key decisions about `digest` as `reference` names it are kept under.
    fn key(&self, reference: &Reference, digest: &Digest) -> Digest {
        decision_key(&self.fingerprint, reference, digest)
    }

    async fn check(
        &self,
        client: &dyn Registry,
        cache: Option<&CacheRoot>,
        reference: &Reference,
        digest: Digest,
        subject: Subject,
    ) -> Result<()> {
        let key = self.key(reference, &digest);
        let now = now_secs();
        if self
            .accepted
            .lock()
            .get(&key)
            .is_some_and(|&until| until > now)
        {
            return Ok(());
        }
        if let Some(c) = cache.cloned() {
            if let Some(until) = blocking(move || Ok(c.verdict(&key)))
                .await?
                .filter(|&until| until > now)
            {
                self.remember(key, until);
                return Ok(());
            }
        }
        let until = self.decide(client, reference, &digest, subject).await?;
        tracing::info!(%reference, %digest, %subject, "accepted by the signature policy");
        self.remember(key, until);
        if let Some(c) = cache.cloned() {
            if let Err(e) = blocking(move || c.save_verdict(&key, until)).await {
                tracing::debug!(error = %e.chain(), "keeping a signature decision failed");
            }
        }
        Ok(())
    }

    fn remember(&self, key: Digest, until: u64) {
        let mut memo = self.accepted.lock();
        if memo.len() >= MEMO {
            memo.clear();
        }
        memo.insert(key, until);
    }

    /// Asks every policy; `Ok(until)` when all accept.
    async fn decide(
        &self,
        client: &dyn Registry,
        reference: &Reference,
        digest: &Digest,
        subject: Subject,
    ) -> Result<u64> {
        let refuse = |why: String| {
            Error::new(
                ErrorKind::Refused,
                format!("{subject} {reference} ({digest}) is refused by {why}"),
            )
        };
        let mut until = u64::MAX;
        if let Some(policy) = &self.containers {
            let applicable = policy.applicable(reference);
            let entry = format!("{} {}", policy.path.display(), applicable.entry);
            let mut found = None;
            for (i, requirement) in applicable.requirements.iter().enumerate() {
                let at = format!("{entry}[{i}]");
                match requirement {
                    containers::Requirement::Accept => {}
                    containers::Requirement::Reject => {
                        return Err(refuse(format!("{at} (reject)")))
                    }
                    containers::Requirement::Unchecked(why) => {
                        return Err(refuse(format!("{at}: {why}")))
                    }
                    containers::Requirement::Sigstore { keys, identity } => {
                        if found.is_none() {
                            found = Some(cosign::signatures(client, reference, digest).await?);
                        }
                        let found = found.as_ref().expect("fetched above");
                        if found.is_empty() {
                            return Err(refuse(format!(
                                "{at} (sigstoreSigned): it has no cosign signature"
                            )));
                        }
                        let results: Vec<std::result::Result<(), String>> = found
                            .iter()
                            .map(|s| {
                                s.check(keys, identity, reference, digest)
                                    .map_err(|why| format!("{}: {why}", s.origin))
                            })
                            .collect();
                        if results.iter().any(|r| r.is_ok()) {
                            continue;
                        }
                        let reasons: Vec<String> =
                            results.into_iter().filter_map(|r| r.err()).collect();
                        return Err(refuse(format!(
                            "{at} (sigstoreSigned): no signature satisfies it: {}",
                            reasons.join("; ")
                        )));
                    }
                }
            }
        }
        if let Some(policy) = &self.notation {
            match policy.check(client, reference, digest).await? {
                Ok(t) => until = until.min(t),
                Err(why) => return Err(refuse(why)),
            }
        }
        Ok(until)
    }
}
