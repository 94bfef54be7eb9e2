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

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;

use self::auth::CredentialStore;
use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::{Descriptor, ManifestKind};

pub use self::push::{BlobUpload, UPLOAD_SEGMENT};
pub use self::read::BlobReader;
use self::token::{CachedAuth, Principal};
use self::transport::TlsSettings;
pub use crate::retry::RetryPolicy;

/// Which endpoints a fetch asks: the one way a caller chooses, from resolution and the
/// engine down to the request ([`RegistryClient::get_blob_range`] and every whole fetch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ask {
    /// Any endpoint of the registry (a mirror first, if one is configured).
    AnyEndpoint,
    /// The registry itself, passing by its mirrors: for bytes that failed verification once
    /// (a mirror may have sent them).
    Registry,
    /// Any endpoint, for a read of the whole blob in the background (hydration): a mirror
    /// known to fill whole blobs (a pull-through cache) is asked even for a blob it does not
    /// hold — its one fill then serves the fleet — where a reader's ranges pass it by
    /// ([`health::Purpose`]); while it fills, the caller waits ([`Registry::filling`]).
    Background,
    /// The registry's mirrors only, never the registry itself, each asked as [`Ask::Background`]
    /// asks: warming them with a blob (`vmdisk preheat`).
    Mirrors,
}

impl Ask {
    /// What ranges asked this way are read for.
    fn purpose(self) -> health::Purpose {
        match self {
            Ask::AnyEndpoint | Ask::Registry => health::Purpose::Demand,
            Ask::Background | Ask::Mirrors => health::Purpose::Whole,
        }
    }
}

/// Whom the tries of one fetch ask when its bytes are checked after they came (a chunk, a
/// region between chunks, a span, a TOC by its pinned checksum, a layer's structure): where
/// the caller says (any endpoint, by default) until bytes failed their check, then the
/// registry itself — the mirror that sent them is not asked for them again, though it answered
/// (and so counts as healthy). The one place that rule is written.
#[derive(Debug)]
pub struct AskUntilChecksFail {
    first: Ask,
    failed: std::sync::atomic::AtomicBool,
}

impl Default for AskUntilChecksFail {
    fn default() -> Self {
        AskUntilChecksFail::new(Ask::AnyEndpoint)
    }
}

impl AskUntilChecksFail {
    /// Tries that ask `first` until bytes failed their check.
    pub fn new(first: Ask) -> Self {
        AskUntilChecksFail {
            first,
            failed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whom the next try asks.
    pub fn ask(&self) -> Ask {
        match self.failed.load(std::sync::atomic::Ordering::Acquire) {
            false => self.first,
            true => Ask::Registry,
        }
    }

    /// Passes a try's outcome on, noting bytes that failed their check.
    pub fn noted<T>(&self, tried: Result<T>) -> Result<T> {
        if matches!(&tried, Err(e) if e.kind() == ErrorKind::Corrupt) {
            self.failed
                .store(true, std::sync::atomic::Ordering::Release);
        }
        tried
    }
}

/// Client settings; the defaults are safe (HTTPS except on loopback).
#[derive(Clone, Debug, Default)]
pub struct RegistryConfig {
    /// Registry hosts (`host[:port]`) that may be spoken to over plain HTTP.
    pub plain_http_hosts: Vec<String>,
    /// Plain HTTP for every registry this client talks to (the `--plain-http` flag).
    pub plain_http: bool,
    /// A containerd `hosts.toml` directory (`/etc/containerd/certs.d`).
    pub hosts_dir: Option<PathBuf>,
    /// Docker config files to read credentials from, instead of the default search path.
    pub auth_files: Option<Vec<PathBuf>>,
    pub retry: RetryPolicy,
    /// Repositories searched for seekable indexes after the image's own (`vmdisk index --to`).
    pub index_repositories: Vec<Reference>,
    /// The CAs registries' certificates are checked against (beside an endpoint's own).
    pub roots: roots::Roots,
    /// Who asks, as the User-Agent header names it.
    pub agent: Agent,
}

/// Who asks a registry, named in the User-Agent of every request so that a registry's log
/// tells the node's own requests (the daemon's, the CLI's) from a mount server's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Agent {
    /// `vmdisk/<version>`: the daemon and the CLI.
    #[default]
    Node,
    /// `vmdisk/<version> (mount-server)`: a layer's mount server.
    MountServer,
}

impl Agent {
    /// The User-Agent header's value.
    pub fn user_agent(self) -> &'static str {
        match self {
            Agent::Node => concat!("vmdisk/", env!("CARGO_PKG_VERSION")),
            Agent::MountServer => concat!("vmdisk/", env!("CARGO_PKG_VERSION"), " (mount-server)"),
        }
    }
}

impl RegistryClient {
    /// The retry policy in force, for callers that retry whole operations.
    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.shared.config.retry
    }
}

/// A registry client. Cheap to share behind an `Arc`; all methods take `&self`. It acts with
/// the node's own credentials and those it was granted ([`granted`]); clients made with
/// [`RegistryClient::with_grants`] share connections, endpoint health and tokens, each token
/// kept under the credential it was got with. The blob URLs its endpoints redirected it to
/// ([`locations`]) are its own: a signed URL got with one client's credentials is never used
/// by a client with others.
#[derive(Clone)]
pub struct RegistryClient {
    shared: std::sync::Arc<Shared>,
    granted: std::sync::Arc<granted::Granted>,
    locations: std::sync::Arc<locations::Locations>,
}

/// What every client made from one [`RegistryClient::new`] shares.
struct Shared {
    config: RegistryConfig,
    credentials: CredentialStore,
    clients: Mutex<HashMap<TlsSettings, reqwest::Client>>,
    /// Authorization per endpoint base, scope and the principal it was got for.
    auth: Mutex<HashMap<(String, String, Principal), CachedAuth>>,
    hosts: hosts::HostsCache,
    health: std::sync::Arc<health::Health>,
}

/// A fetched manifest or index, verified when fetched by digest.
#[derive(Clone, Debug)]
pub struct FetchedManifest {
    pub digest: Digest,
    pub media_type: String,
    pub bytes: Vec<u8>,
    pub manifest: ManifestKind,
}

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

impl RegistryClient {
    /// A client with credentials from `config.auth_files` or the default docker config path.
    pub fn new(config: RegistryConfig) -> Result<Self> {
        let credentials = match &config.auth_files {
            Some(files) => CredentialStore::from_files(files)?,
            None => CredentialStore::from_env()?,
        };
        let health = health::Health::default();
        Ok(RegistryClient {
            shared: std::sync::Arc::new(Shared {
                config,
                credentials,
                clients: Mutex::new(HashMap::new()),
                auth: Mutex::new(HashMap::new()),
                hosts: hosts::HostsCache::default(),
                health: std::sync::Arc::new(health),
            }),
            granted: std::sync::Arc::default(),
            locations: std::sync::Arc::default(),
        })
    }

    /// A client that also acts with `granted` (after the node's own credentials, each only for
    /// its repository), sharing this one's connections, health and tokens.
    pub fn with_grants(&self, granted: std::sync::Arc<granted::Granted>) -> Self {
        RegistryClient {
            shared: std::sync::Arc::clone(&self.shared),
            granted,
            locations: std::sync::Arc::default(),
        }
    }
}

// Reading a registry's response bodies (for the token service and every request): under a
// size limit and a deadline that grows with the size, and the text of its error bodies.

/// How long any response body may take: this much, plus its size at [`MIN_BODY_RATE`]. The
/// socket's idle timeout alone would let a registry trickle a byte every minute forever.
const BODY_DEADLINE: Duration = Duration::from_secs(30);
/// Slowest body rate accepted beyond [`BODY_DEADLINE`], bytes per second.
const MIN_BODY_RATE: u64 = 256 << 10;

/// The text of a registry's error body: its `errors` (code: message), else its first 200 bytes.
fn registry_error_text(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Errors {
        errors: Vec<ErrorItem>,
    }
    #[derive(serde::Deserialize)]
    struct ErrorItem {
        code: String,
        #[serde(default)]
        message: String,
    }
    match serde_json::from_slice::<Errors>(body) {
        Ok(e) if !e.errors.is_empty() => e
            .errors
            .iter()
            .map(|i| format!("{}: {}", i.code, i.message))
            .collect::<Vec<_>>()
            .join("; "),
        _ => String::from_utf8_lossy(&body[..body.len().min(200)])
            .trim()
            .to_string(),
    }
}

/// `resp`'s body, at most `limit` bytes ([`BODY_DEADLINE`] plus its size at [`MIN_BODY_RATE`]);
/// `what` names it in errors.
async fn read_limited(mut resp: reqwest::Response, limit: u64, what: &str) -> Result<Vec<u8>> {
    if resp.content_length().is_some_and(|l| l > limit) {
        return Err(Error::corrupt(format!(
            "{what} is {} bytes, more than the {limit} accepted",
            resp.content_length().unwrap_or(0)
        )));
    }
    let size = resp.content_length().unwrap_or(limit).min(limit);
    let deadline = BODY_DEADLINE + Duration::from_secs(size / MIN_BODY_RATE);
    let body =
        async {
            let mut out = Vec::new();
            while let Some(chunk) = resp.chunk().await.map_err(|e| {
                Error::new(ErrorKind::Network, format!("reading {what}")).with_source(e)
            })? {
                if out.len() as u64 + chunk.len() as u64 > limit {
                    return Err(Error::corrupt(format!(
                        "{what} is more than the {limit} bytes accepted"
                    )));
                }
                out.extend_from_slice(&chunk);
            }
            Ok(out)
        };
    tokio::time::timeout(deadline, body)
        .await
        .unwrap_or_else(|_| {
            Err(Error::new(
                ErrorKind::Network,
                format!(
                    "{what}: the registry sent the body too slowly (over {} s)",
                    deadline.as_secs()
                ),
            ))
        })
}

#[cfg(test)]
mod tests;
