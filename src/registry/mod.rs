//! The OCI distribution client every part of vmdisk uses.
//!
//! It owns everything about talking to registries: endpoints (the registry itself, or mirrors
//! from a containerd `hosts.toml` directory), transport policy (HTTPS, plain HTTP only for
//! loopback or hosts the user names), authentication (anonymous, Basic, Bearer tokens from the
//! `WWW-Authenticate` challenge, credentials from docker config files), bounded retries with
//! backoff, and size limits. It never returns unverified bytes for anything fetched whole:
//! manifests fetched by digest, configs and blobs are checked against their digests here;
//! byte ranges are checked by the caller, who knows the chunk digests.
//!
//! `transport.rs` sends (endpoints in turn, credentials, deadlines, redirects), `token.rs`
//! answers challenges, `locations.rs` keeps where redirected blobs are, `read.rs` and `push.rs`
//! are the two APIs built on them.

pub mod auth;
mod client;
mod credentials;
pub mod granted;
pub mod health;
pub mod hosts;
mod locations;
mod push;
mod read;
pub mod roots;
#[cfg(test)]
pub mod testing;
mod token;
mod transport;

use bytes::Bytes;

use crate::error::Result;
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::Descriptor;

pub use self::client::{
    Agent, Ask, AskUntilChecksFail, FetchedManifest, RegistryClient, RegistryConfig,
};
pub use self::push::{BlobUpload, UPLOAD_SEGMENT};
pub use self::read::BlobReader;
pub use crate::retry::RetryPolicy;

/// What the read side (classification, resolution, chunk fetches) needs from a registry: the
/// seam that unit tests replace with an in-memory image store. [`RegistryClient`] is the one
/// real implementation.
pub trait Registry: Send + Sync {
    /// The manifest or index `r` names, verified against its digest when `r` has one.
    fn get_manifest<'a>(
        &'a self,
        r: &'a Reference,
    ) -> futures_util::future::BoxFuture<'a, Result<FetchedManifest>>;
    /// A whole small blob (at most `limit` bytes), verified against its digest.
    fn get_blob<'a>(
        &'a self,
        r: &'a Reference,
        desc: &'a Descriptor,
        limit: u64,
    ) -> futures_util::future::BoxFuture<'a, Result<Vec<u8>>>;
    /// Exactly the bytes of `range` of a blob (the caller verifies what they mean), in one try
    /// of each endpoint `ask` chooses: the caller's retry policy owns the tries.
    fn get_blob_range<'a>(
        &'a self,
        r: &'a Reference,
        digest: &'a Digest,
        range: std::ops::Range<u64>,
        ask: Ask,
    ) -> futures_util::future::BoxFuture<'a, Result<Bytes>>;
    /// Requests, failures and bytes per endpoint (registry or mirror) so far.
    fn endpoint_counters(&self) -> Vec<(String, health::EndpointCounters)> {
        Vec::new()
    }
    /// Until when background reads of blob `digest` of `r`'s repository wait for a mirror
    /// that is filling it from the registry (a pull-through cache: [`Ask::Background`]); none
    /// when no mirror is.
    fn filling(&self, _r: &Reference, _digest: &Digest) -> Option<tokio::time::Instant> {
        None
    }
    /// The referrers of manifest `digest` in `r`'s repository with one of `artifact_types`
    /// (see [`RegistryClient::referrers`]); none where the store has no referrers.
    fn referrers<'a>(
        &'a self,
        _r: &'a Reference,
        _digest: &'a Digest,
        _artifact_types: &'a [&'a str],
    ) -> futures_util::future::BoxFuture<'a, Result<Vec<Descriptor>>> {
        Box::pin(async { Ok(Vec::new()) })
    }
    /// Repositories searched for seekable indexes after the image's own.
    fn index_repositories(&self) -> &[Reference] {
        &[]
    }
    /// The retry policy its callers' verified fetches follow (a range fetched and then checked
    /// against a digest the caller knows is retried by the caller under it).
    fn retry_policy(&self) -> crate::retry::RetryPolicy {
        crate::retry::RetryPolicy::default()
    }
    /// This store acting also with `granted` ([`RegistryClient::with_grants`]); a store that
    /// checks no credentials (a test double) is itself.
    fn with_grants(
        self: std::sync::Arc<Self>,
        granted: std::sync::Arc<granted::Granted>,
    ) -> std::sync::Arc<dyn Registry>;
    /// Succeeds if this client's credentials read manifest `r`, asked of the registry itself
    /// now (a `HEAD`, never a cache): whether access holds, not what the manifest says.
    fn check_manifest<'a>(
        &'a self,
        r: &'a Reference,
    ) -> futures_util::future::BoxFuture<'a, Result<Digest>>;
}

impl Registry for RegistryClient {
    fn get_manifest<'a>(
        &'a self,
        r: &'a Reference,
    ) -> futures_util::future::BoxFuture<'a, Result<FetchedManifest>> {
        Box::pin(RegistryClient::get_manifest(self, r))
    }

    fn get_blob<'a>(
        &'a self,
        r: &'a Reference,
        desc: &'a Descriptor,
        limit: u64,
    ) -> futures_util::future::BoxFuture<'a, Result<Vec<u8>>> {
        Box::pin(RegistryClient::get_blob(self, r, desc, limit))
    }

    fn get_blob_range<'a>(
        &'a self,
        r: &'a Reference,
        digest: &'a Digest,
        range: std::ops::Range<u64>,
        ask: Ask,
    ) -> futures_util::future::BoxFuture<'a, Result<Bytes>> {
        Box::pin(RegistryClient::get_blob_range(self, r, digest, range, ask))
    }

    fn endpoint_counters(&self) -> Vec<(String, health::EndpointCounters)> {
        self.shared.health.counters()
    }

    fn filling(&self, r: &Reference, digest: &Digest) -> Option<tokio::time::Instant> {
        RegistryClient::filling(self, r, digest)
    }

    fn referrers<'a>(
        &'a self,
        r: &'a Reference,
        digest: &'a Digest,
        artifact_types: &'a [&'a str],
    ) -> futures_util::future::BoxFuture<'a, Result<Vec<Descriptor>>> {
        Box::pin(RegistryClient::referrers(self, r, digest, artifact_types))
    }

    fn index_repositories(&self) -> &[Reference] {
        &self.shared.config.index_repositories
    }

    fn retry_policy(&self) -> crate::retry::RetryPolicy {
        self.shared.config.retry.clone()
    }

    fn with_grants(
        self: std::sync::Arc<Self>,
        granted: std::sync::Arc<granted::Granted>,
    ) -> std::sync::Arc<dyn Registry> {
        std::sync::Arc::new(RegistryClient::with_grants(&self, granted))
    }

    fn check_manifest<'a>(
        &'a self,
        r: &'a Reference,
    ) -> futures_util::future::BoxFuture<'a, Result<Digest>> {
        Box::pin(RegistryClient::check_manifest(self, r))
    }
}

// Reading a registry's response bodies (for the token service and every request): under a
// size limit and a deadline that grows with the size, and the text of its error bodies.

#[cfg(test)]
mod tests;
