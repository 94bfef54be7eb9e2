//! The registry client ([`RegistryClient`]): its settings, what its clients share, whom a
//! request asks, and how an answer's body is read (bounded, under a deadline).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use parking_lot::Mutex;

use super::auth::CredentialStore;
use super::credentials::{CachedAuth, Principal};
use super::granted;
use super::health;
use super::hosts;
use super::locations;
use super::roots;
use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::ManifestKind;
use crate::retry::RetryPolicy;

/// What distinguishes one HTTP client from another: TLS verification, CAs, client identity.
pub(super) type TlsSettings = (bool, Vec<PathBuf>, Option<(PathBuf, Option<PathBuf>)>);

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
    pub(super) fn purpose(self) -> health::Purpose {
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
    pub(super) shared: std::sync::Arc<Shared>,
    pub(super) granted: std::sync::Arc<granted::Granted>,
    pub(super) locations: std::sync::Arc<locations::Locations>,
}

/// What every client made from one [`RegistryClient::new`] shares.
pub(super) struct Shared {
    pub(super) config: RegistryConfig,
    pub(super) credentials: CredentialStore,
    pub(super) clients: Mutex<HashMap<TlsSettings, reqwest::Client>>,
    /// Authorization per endpoint base, scope and the principal it was got for.
    pub(super) auth: Mutex<HashMap<(String, String, Principal), CachedAuth>>,
    pub(super) hosts: hosts::HostsCache,
    pub(super) health: std::sync::Arc<health::Health>,
}

/// A fetched manifest or index, verified when fetched by digest.
#[derive(Clone, Debug)]
pub struct FetchedManifest {
    pub digest: Digest,
    pub media_type: String,
    pub bytes: Vec<u8>,
    pub manifest: ManifestKind,
}

/// How long any response body may take: this much, plus its size at [`MIN_BODY_RATE`]. The
/// socket's idle timeout alone would let a registry trickle a byte every minute forever.
pub(super) const BODY_DEADLINE: Duration = Duration::from_secs(30);

/// Slowest body rate accepted beyond [`BODY_DEADLINE`], bytes per second.
pub(super) const MIN_BODY_RATE: u64 = 256 << 10;

/// The text of a registry's error body: its `errors` (code: message), else its first 200 bytes.
pub(super) fn registry_error_text(body: &[u8]) -> String {
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
pub(super) async fn read_limited(
    mut resp: reqwest::Response,
    limit: u64,
    what: &str,
) -> Result<Vec<u8>> {
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
