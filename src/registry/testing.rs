//! An in-memory registry behind the [`Registry`] seam, for the unit tests of the layers above
//! it (resolution, the snapshotter's decisions). Manifests by digest and tag, blobs whole and
//! by range, referrers by subject; `down` makes every call fail as an unreachable registry
//! would; with `private` set, only a client granted one of those credentials reads anything.
//! The real registry client is tested against a real registry (`integration/`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use futures_util::future::BoxFuture;
use parking_lot::Mutex;

use super::auth::Credential;
use super::granted::Granted;
use super::{FetchedManifest, Registry};
use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::Descriptor;

/// What the registry holds.
#[derive(Default)]
pub struct Images {
    pub manifests: Mutex<HashMap<Digest, Vec<u8>>>,
    pub blobs: Mutex<HashMap<Digest, Vec<u8>>>,
    pub tags: Mutex<HashMap<String, Digest>>,
    /// Referrers by subject manifest: (artifact type, descriptor of the referrer).
    pub referrers: Mutex<HashMap<Digest, Vec<(String, Descriptor)>>>,
    pub down: AtomicBool,
    pub private: Mutex<Option<Vec<Credential>>>,
    /// Manifest checks asked (HEADs).
    pub checks: AtomicU32,
    /// Range requests answered.
    pub ranges: AtomicU32,
    /// Referrers lookups asked.
    pub lookups: AtomicU32,
    /// A mirror before the registry that damages every range it answers: a range asked of
    /// any endpoint comes as zeros, one asked of the registry itself is sound.
    pub lying_mirror: AtomicBool,
    /// Ranges asked of the registry itself ([`crate::registry::Ask::Registry`]).
    pub registry_ranges: AtomicU32,
}

/// A client of [`Images`]: the node's (no credentials) or one with grants.
#[derive(Default)]
pub struct MemoryRegistry {
    pub images: Arc<Images>,
    pub granted: Arc<Granted>,
}

impl std::ops::Deref for MemoryRegistry {
    type Target = Images;
    fn deref(&self) -> &Images {
        &self.images
    }
}

impl MemoryRegistry {
    fn check(&self, r: &Reference) -> Result<()> {
        if self.down.load(Ordering::SeqCst) {
            return Err(Error::new(ErrorKind::Network, "registry unreachable"));
        }
        if let Some(accepted) = self.private.lock().as_ref() {
            let held = self.granted.for_repository(&r.registry, &r.repository);
            if !held.iter().any(|(c, _)| accepted.contains(c)) {
                return Err(Error::new(ErrorKind::Auth, "HTTP 401"));
            }
        }
        Ok(())
    }

    fn resolve(&self, r: &Reference) -> Result<Digest> {
        match (r.digest, &r.tag) {
            (Some(d), _) => Ok(d),
            (None, Some(t)) => self
                .tags
                .lock()
                .get(t)
                .copied()
                .ok_or_else(|| Error::not_found(format!("tag {t}"))),
            _ => Err(Error::invalid("no tag or digest")),
        }
    }

    /// Stores a blob; its digest.
    pub fn put_blob(&self, bytes: Vec<u8>) -> Digest {
        let digest = Digest::of(&bytes);
        self.blobs.lock().insert(digest, bytes);
        digest
    }

    /// Stores a manifest (JSON), tagged `tag` if given; its digest.
    pub fn put_manifest(&self, manifest: &serde_json::Value, tag: Option<&str>) -> Digest {
        let bytes = serde_json::to_vec(manifest).expect("JSON");
        let digest = Digest::of(&bytes);
        self.manifests.lock().insert(digest, bytes);
        if let Some(tag) = tag {
            self.tags.lock().insert(tag.to_string(), digest);
        }
        digest
    }

    /// Stores manifest `manifest` as a referrer of `subject` with `artifact_type`.
    pub fn put_referrer(&self, subject: Digest, artifact_type: &str, manifest: &serde_json::Value) {
        let digest = self.put_manifest(manifest, None);
        let bytes = self.manifests.lock()[&digest].clone();
        let desc = Descriptor::of(crate::oci::OCI_MANIFEST, &bytes);
        self.referrers
            .lock()
            .entry(subject)
            .or_default()
            .push((artifact_type.to_string(), desc));
    }
}

impl Registry for MemoryRegistry {
    fn get_manifest<'a>(&'a self, r: &'a Reference) -> BoxFuture<'a, Result<FetchedManifest>> {
        Box::pin(async move {
            self.check(r)?;
            let digest = self.resolve(r)?;
            let bytes = self
                .manifests
                .lock()
                .get(&digest)
                .cloned()
                .ok_or_else(|| Error::not_found(format!("manifest {digest}")))?;
            Ok(FetchedManifest {
                digest,
                media_type: crate::oci::OCI_MANIFEST.into(),
                manifest: crate::oci::parse_manifest(&bytes, Some(crate::oci::OCI_MANIFEST))?,
                bytes,
            })
        })
    }

    fn get_blob<'a>(
        &'a self,
        r: &'a Reference,
        desc: &'a Descriptor,
        _limit: u64,
    ) -> BoxFuture<'a, Result<Vec<u8>>> {
        Box::pin(async move {
            self.check(r)?;
            self.blobs
                .lock()
                .get(&desc.digest)
                .cloned()
                .ok_or_else(|| Error::not_found(format!("blob {}", desc.digest)))
        })
    }

    fn get_blob_range<'a>(
        &'a self,
        r: &'a Reference,
        digest: &'a Digest,
        range: std::ops::Range<u64>,
        ask: crate::registry::Ask,
    ) -> BoxFuture<'a, Result<bytes::Bytes>> {
        Box::pin(async move {
            self.check(r)?;
            self.ranges.fetch_add(1, Ordering::SeqCst);
            if ask == crate::registry::Ask::Registry {
                self.registry_ranges.fetch_add(1, Ordering::SeqCst);
            }
            let lie = ask == crate::registry::Ask::AnyEndpoint
                && self.lying_mirror.load(Ordering::SeqCst);
            let blobs = self.blobs.lock();
            let blob = blobs
                .get(digest)
                .ok_or_else(|| Error::not_found(format!("blob {digest}")))?;
            // Exactly the bytes asked for, as the client's answers are (a range past the end is
            // refused, as a registry's 416 is).
            match blob.get(range.start as usize..range.end as usize) {
                Some(bytes) if lie => Ok(bytes::Bytes::from(vec![0u8; bytes.len()])),
                Some(bytes) => Ok(bytes::Bytes::copy_from_slice(bytes)),
                None => Err(Error::invalid(format!(
                    "bytes {range:?} of blob {digest}: past its end ({} bytes)",
                    blob.len()
                ))),
            }
        })
    }

    fn referrers<'a>(
        &'a self,
        r: &'a Reference,
        digest: &'a Digest,
        artifact_types: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<Descriptor>>> {
        Box::pin(async move {
            self.lookups.fetch_add(1, Ordering::SeqCst);
            self.check(r)?;
            Ok(self
                .referrers
                .lock()
                .get(digest)
                .into_iter()
                .flatten()
                .filter(|(t, _)| artifact_types.contains(&t.as_str()))
                .map(|(_, d)| d.clone())
                .collect())
        })
    }

    fn with_grants(self: Arc<Self>, granted: Arc<Granted>) -> Arc<dyn Registry> {
        Arc::new(MemoryRegistry {
            images: Arc::clone(&self.images),
            granted,
        })
    }

    fn check_manifest<'a>(&'a self, r: &'a Reference) -> BoxFuture<'a, Result<Digest>> {
        Box::pin(async move {
            self.checks.fetch_add(1, Ordering::SeqCst);
            self.check(r)?;
            let digest = self.resolve(r)?;
            if !self.manifests.lock().contains_key(&digest) {
                return Err(Error::not_found(format!("manifest {digest}")));
            }
            Ok(digest)
        })
    }
}
