//! The OCI distribution client every part of vmdisk uses.
//!
//! It owns everything about talking to registries: endpoints (the registry itself, or mirrors
//! from a containerd `hosts.toml` directory), transport policy (HTTPS, plain HTTP only for
//! loopback or hosts the user names), authentication (anonymous, Basic, Bearer tokens from the
//! `WWW-Authenticate` challenge, credentials from docker config files), bounded retries with
//! backoff, and size limits. It never returns unverified bytes for anything fetched whole:
//! manifests fetched by digest, configs and blobs are checked against their digests here;
//! byte ranges are checked by the caller, who knows the chunk digests.

pub mod auth;
pub mod granted;
pub mod health;
pub mod hosts;
#[cfg(test)]
pub mod memory;
pub mod roots;

use std::collections::HashMap;
use std::io::Read;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use reqwest::header::{
    HeaderMap, HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE,
    LOCATION, RANGE, WWW_AUTHENTICATE,
};
use reqwest::{Method, StatusCode};

use self::auth::{Challenge, CredentialStore};
use self::hosts::Endpoint;
use crate::digest::{Digest, Hasher};
use crate::error::{Error, ErrorKind, Result};
use crate::oci::{self, Descriptor, ManifestKind};
use crate::reference::{is_loopback_host, Reference};

pub use crate::retry::RetryPolicy;

/// The name of the file in a cache where what clients learnt about mirrors is kept.
pub const MIRROR_NOTES: &str = "mirrors";

/// Client settings; the defaults are safe (HTTPS except on loopback).
#[derive(Clone, Debug, Default)]
pub struct RegistryConfig {
    /// Registry hosts (host[:port]) that may be spoken to over plain HTTP.
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
    /// Where what the client learns about mirrors is kept across processes (in the node's
    /// cache; [`health`]).
    pub notes: Option<PathBuf>,
}

impl RegistryClient {
    /// The retry policy in force, for callers that retry whole operations.
    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.shared.config.retry
    }
}

/// Upload segment sent in one PATCH. Three are alive at most while pushing (one on the wire,
/// one queued, one filling), so this bounds the push's buffer memory at 24 MiB; smaller
/// segments cost more round trips.
pub const UPLOAD_SEGMENT: usize = 8 << 20;

/// A registry client. Cheap to share behind an `Arc`; all methods take `&self`. It acts with
/// the node's own credentials and those it was granted ([`granted`]); clients made with
/// [`RegistryClient::with_grants`] share connections, endpoint health and tokens, each token
/// kept under the credential it was got with.
#[derive(Clone)]
pub struct RegistryClient {
    shared: std::sync::Arc<Shared>,
    granted: std::sync::Arc<granted::Granted>,
}

/// What every client made from one [`RegistryClient::new`] shares.
struct Shared {
    config: RegistryConfig,
    credentials: CredentialStore,
    clients: Mutex<HashMap<TlsSettings, reqwest::Client>>,
    /// Authorization per endpoint base, scope and the principal it was got for.
    auth: Mutex<HashMap<(String, String, Principal), CachedAuth>>,
    hosts: hosts::HostsCache,
    health: health::Health,
}

/// Whose credential a request carries: the node's own (or none), or one granted, named by a
/// digest of user and secret (two grants with the same user name stay apart).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Principal {
    Node,
    Granted(String),
}

/// One credential a request may try, in the order they are tried.
struct Candidate {
    principal: Principal,
    credential: Option<auth::Credential>,
    /// Until when it may be used (a grant expires; the node's own does not).
    usable_until: Option<Instant>,
}

impl Candidate {
    fn describe(&self) -> String {
        match (&self.principal, &self.credential) {
            (Principal::Node, None) => "anonymous access (the node has no credentials for it: REGISTRY_AUTH_FILE, $DOCKER_CONFIG/config.json, ~/.docker/config.json)".into(),
            (Principal::Node, Some(c)) => format!("the node's credentials (user {})", c.username),
            (Principal::Granted(_), Some(c)) => format!("the credentials kubelet sent (user {})", c.username),
            (Principal::Granted(_), None) => "a grant without a credential".into(),
        }
    }
}

/// What distinguishes one HTTP client from another: TLS verification, CAs, client identity.
type TlsSettings = (bool, Vec<PathBuf>, Option<(PathBuf, Option<PathBuf>)>);

/// An `Authorization` header value and when it stops being valid (tokens expire).
struct CachedAuth {
    header: String,
    expires: Option<Instant>,
}

/// Which access a request needs, for token scopes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    Pull,
    Push,
}

fn scope(repo: &str, access: Access) -> String {
    match access {
        Access::Pull => format!("repository:{repo}:pull"),
        Access::Push => format!("repository:{repo}:pull,push"),
    }
}

/// A request to send, rebuilt for every try (bodies are cheap `Bytes` clones).
/// Only idempotent requests are retried ([`RegistryClient::send_retried`]); a PATCH that fails
/// part-way changes the upload's state, so [`BlobUpload::write`] resumes it instead.
struct Req {
    method: Method,
    url: String,
    headers: HeaderMap,
    body: Option<Bytes>,
    /// Extra scopes the token must cover (cross-repository mount source).
    extra_scope: Option<String>,
}

impl Req {
    fn new(method: Method, url: String) -> Self {
        Req {
            url,
            headers: HeaderMap::new(),
            body: None,
            extra_scope: None,
            method,
        }
    }

    /// A GET of `path` (e.g. `manifests/<tag>`) in `r`'s repository at `ep`.
    fn get(ep: &Endpoint, r: &Reference, path: &str) -> Self {
        Req::new(Method::GET, ep.url(&format!("{}/{path}", r.repository)))
    }

    fn header(mut self, name: reqwest::header::HeaderName, value: &str) -> Self {
        if let Ok(v) = HeaderValue::from_str(value) {
            self.headers.insert(name, v);
        }
        self
    }

    fn body(mut self, body: Bytes) -> Self {
        self.body = Some(body);
        self
    }
}

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

/// How long any response body may take: this much, plus its size at [`MIN_BODY_RATE`]. The
/// socket's idle timeout alone would let a registry trickle a byte every minute forever.
const BODY_DEADLINE: Duration = Duration::from_secs(30);
/// Slowest body rate accepted beyond [`BODY_DEADLINE`], bytes per second.
const MIN_BODY_RATE: u64 = 256 << 10;
/// How long a mirror may take to answer a request (its headers; the body has its own deadline)
/// before the next endpoint is asked: a hung mirror must not hold a guest's read for the
/// socket's timeouts.
const MIRROR_DEADLINE: Duration = Duration::from_secs(10);

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

/// The manifest and index media types asked for (`Accept`).
const MANIFEST_TYPES: [&str; 4] = [
    oci::OCI_MANIFEST,
    oci::OCI_INDEX,
    oci::DOCKER_MANIFEST,
    oci::DOCKER_MANIFEST_LIST,
];

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
    /// of each endpoint: the caller's retry policy owns the tries.
    fn get_blob_range<'a>(
        &'a self,
        r: &'a Reference,
        digest: &'a Digest,
        range: std::ops::Range<u64>,
    ) -> futures_util::future::BoxFuture<'a, Result<Bytes>>;
    /// The same from the registry itself, not its mirrors: for bytes that failed
    /// verification once.
    fn get_blob_range_from_registry<'a>(
        &'a self,
        r: &'a Reference,
        digest: &'a Digest,
        range: std::ops::Range<u64>,
    ) -> futures_util::future::BoxFuture<'a, Result<Bytes>> {
        self.get_blob_range(r, digest, range)
    }
    /// Requests, failures and bytes per endpoint (registry or mirror) so far.
    fn endpoint_counters(&self) -> Vec<(String, health::EndpointCounters)> {
        Vec::new()
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
    ) -> futures_util::future::BoxFuture<'a, Result<Bytes>> {
        Box::pin(RegistryClient::get_blob_range(self, r, digest, range))
    }

    fn get_blob_range_from_registry<'a>(
        &'a self,
        r: &'a Reference,
        digest: &'a Digest,
        range: std::ops::Range<u64>,
    ) -> futures_util::future::BoxFuture<'a, Result<Bytes>> {
        Box::pin(RegistryClient::get_blob_range_from_registry(
            self, r, digest, range,
        ))
    }

    fn endpoint_counters(&self) -> Vec<(String, health::EndpointCounters)> {
        self.shared.health.counters()
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
        let health = match &config.notes {
            Some(notes) => health::Health::with_notes(notes),
            None => health::Health::default(),
        };
        Ok(RegistryClient {
            shared: std::sync::Arc::new(Shared {
                config,
                credentials,
                clients: Mutex::new(HashMap::new()),
                auth: Mutex::new(HashMap::new()),
                hosts: hosts::HostsCache::default(),
                health,
            }),
            granted: std::sync::Arc::default(),
        })
    }

    /// A client that also acts with `granted` (after the node's own credentials, each only for
    /// its repository), sharing this one's connections, health and tokens.
    pub fn with_grants(&self, granted: std::sync::Arc<granted::Granted>) -> Self {
        RegistryClient {
            shared: std::sync::Arc::clone(&self.shared),
            granted,
        }
    }

    /// The credentials a request for `r` may carry, in the order they are tried: the node's
    /// own (or none), then each granted for `r`'s repository, newest first.
    async fn candidates(&self, r: &Reference) -> Result<Vec<Candidate>> {
        let mut all = vec![Candidate {
            principal: Principal::Node,
            credential: self.shared.credentials.get(&r.registry).await?,
            usable_until: None,
        }];
        for (credential, ttl) in self.granted.for_repository(&r.registry, &r.repository) {
            let key =
                Digest::of(format!("{}\0{}", credential.username, credential.secret).as_bytes());
            all.push(Candidate {
                principal: Principal::Granted(key.hex()[..16].to_string()),
                credential: Some(credential),
                usable_until: Some(Instant::now() + ttl),
            });
        }
        Ok(all)
    }

    fn http(&self, ep: &Endpoint) -> Result<reqwest::Client> {
        let key = (ep.skip_verify, ep.ca.clone(), ep.client_cert.clone());
        if let Some(c) = self.shared.clients.lock().get(&key) {
            return Ok(c.clone());
        }
        // Once per TLS settings: reading the CA files and the system's roots is blocking work,
        // done off the async workers and with no lock held (two first uses at once may both
        // build one; the first kept is used).
        let roots = &self.shared.config.roots;
        let client = crate::task::off_the_runtime(|| Self::build_http(ep, roots))?;
        Ok(self
            .shared
            .clients
            .lock()
            .entry(key)
            .or_insert(client)
            .clone())
    }

    /// A new HTTP client for endpoint `ep`'s TLS settings, trusting `roots` and the endpoint's
    /// CAs.
    fn build_http(ep: &Endpoint, roots: &roots::Roots) -> Result<reqwest::Client> {
        let mut builder = reqwest::Client::builder()
            .tls_built_in_root_certs(false)
            .user_agent(concat!("vmdisk/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(Duration::from_secs(60))
            .danger_accept_invalid_certs(ep.skip_verify);
        for root in roots.certificates().iter() {
            let cert = reqwest::Certificate::from_der(root)
                .map_err(|e| Error::invalid(format!("a TLS root certificate: {e}")))?;
            builder = builder.add_root_certificate(cert);
        }
        for path in &ep.ca {
            let pem = std::fs::read(path)
                .map_err(|e| Error::io(format!("reading CA certificate {}", path.display()), e))?;
            let cert = reqwest::Certificate::from_pem(&pem).map_err(|e| {
                Error::invalid(format!("CA certificate {} is not PEM: {e}", path.display()))
            })?;
            builder = builder.add_root_certificate(cert);
        }
        builder
            .build()
            .map_err(|e| Error::new(ErrorKind::Io, "building the HTTP client").with_source(e))
    }

    fn plain_http(&self, host: &str) -> bool {
        self.shared.config.plain_http
            || is_loopback_host(host)
            || self
                .shared
                .config
                .plain_http_hosts
                .iter()
                .any(|h| h == host)
    }

    /// Endpoints for `r`, mirrors first; `push` selects push-capable ones.
    fn endpoints(&self, r: &Reference, access: Access) -> Result<Vec<Endpoint>> {
        let upstream = Endpoint::upstream(r.api_host(), self.plain_http(&r.registry));
        let all = self.shared.hosts.endpoints(
            self.shared.config.hosts_dir.as_deref(),
            &r.registry,
            upstream.clone(),
        )?;
        let chosen: Vec<Endpoint> = all
            .into_iter()
            .filter(|e| match access {
                Access::Pull => e.pull,
                Access::Push => e.push,
            })
            .collect();
        Ok(if chosen.is_empty() {
            vec![upstream]
        } else {
            chosen
        })
    }

    /// Answers `challenge` for `candidate` and keeps the authorization under its principal.
    async fn authorize(
        &self,
        ep: &Endpoint,
        r: &Reference,
        challenge: &str,
        scope_key: &str,
        scopes: &[String],
        candidate: &Candidate,
    ) -> Result<()> {
        let host = &r.registry;
        let challenge =
            auth::parse_challenge(challenge).map_err(|e| e.context(format!("registry {host}")))?;
        let (credential, usable_until) = (&candidate.credential, candidate.usable_until);
        let (value, expiry) = match challenge {
            Challenge::Basic => {
                let c = credential.as_ref().ok_or_else(|| {
                    Error::new(ErrorKind::Auth, format!("registry {host} requires credentials and none were found; add them to a docker config file (REGISTRY_AUTH_FILE, $DOCKER_CONFIG/config.json or ~/.docker/config.json)"))
                })?;
                (c.basic_header(), usable_until)
            }
            Challenge::Bearer {
                realm,
                service,
                scope,
            } => {
                let mut url = url::Url::parse(&realm).map_err(|e| {
                    Error::new(
                        ErrorKind::Auth,
                        format!("registry {host}: token realm {realm:?} is not a URL: {e}"),
                    )
                })?;
                {
                    let mut q = url.query_pairs_mut();
                    if let Some(s) = &service {
                        q.append_pair("service", s);
                    }
                    let mut sent = false;
                    for s in scopes {
                        q.append_pair("scope", s);
                        sent = true;
                    }
                    if let (false, Some(s)) = (sent, &scope) {
                        q.append_pair("scope", s);
                    }
                }
                let realm_host = url.host_str().unwrap_or_default().to_string();
                if url.scheme() == "http"
                    && !self.plain_http(&realm_host)
                    && !is_loopback_host(&realm_host)
                {
                    return Err(Error::new(ErrorKind::Auth, format!("registry {host}: token realm {realm} is plain HTTP; refusing to send credentials")));
                }
                let mut req = self.http(ep)?.get(url);
                if let Some(c) = &credential {
                    req = req.header(AUTHORIZATION, c.basic_header());
                }
                let resp = req.send().await.map_err(|e| {
                    Error::new(
                        ErrorKind::Network,
                        format!("registry {host}: token request to {realm} failed"),
                    )
                    .with_source(e)
                })?;
                let status = resp.status();
                let body = read_limited(resp, 1 << 20, "token response").await?;
                if !status.is_success() {
                    let who = credential
                        .as_ref()
                        .map_or("anonymous access".to_string(), |c| {
                            format!("user {}", c.username)
                        });
                    return Err(Error::new(ErrorKind::Auth, format!("registry {host}: token server {realm} refused {who} (HTTP {status}: {})", registry_error_text(&body))));
                }
                #[derive(serde::Deserialize)]
                struct Token {
                    token: Option<String>,
                    access_token: Option<String>,
                    expires_in: Option<u64>,
                }
                let t: Token = serde_json::from_slice(&body).map_err(|e| {
                    Error::new(
                        ErrorKind::Auth,
                        format!("registry {host}: token response is malformed: {e}"),
                    )
                })?;
                let token = t
                    .token
                    .or(t.access_token)
                    .filter(|t| !t.is_empty())
                    .ok_or_else(|| {
                        Error::new(
                            ErrorKind::Auth,
                            format!("registry {host}: token response has no token"),
                        )
                    })?;
                let ttl = Duration::from_secs(t.expires_in.unwrap_or(60).clamp(10, 3600));
                let token_end = Instant::now() + ttl - Duration::from_secs(5);
                (
                    format!("Bearer {token}"),
                    // A token outlives neither itself nor the credential it was got with.
                    Some(usable_until.map_or(token_end, |u| u.min(token_end))),
                )
            }
        };
        self.shared.auth.lock().insert(
            (
                ep.base.clone(),
                scope_key.to_string(),
                candidate.principal.clone(),
            ),
            CachedAuth {
                header: value,
                expires: expiry,
            },
        );
        Ok(())
    }

    fn cached_auth(&self, ep: &Endpoint, scope_key: &str, principal: &Principal) -> Option<String> {
        let auth = self.shared.auth.lock();
        auth.get(&(ep.base.clone(), scope_key.to_string(), principal.clone()))
            .filter(|a| a.expires.is_none_or(|e| e > Instant::now()))
            .map(|a| a.header.clone())
    }

    /// Sends `req` to `ep` once, with the first credential whose authorization is kept, or
    /// none; answers a 401 by authorizing the next credential the client may use
    /// ([`RegistryClient::candidates`]) until one is accepted. Returns the registry's answer
    /// as it is (the caller checks its status) or a `Network` error; when every credential was
    /// refused, an `Auth` error naming each.
    async fn send(
        &self,
        ep: &Endpoint,
        r: &Reference,
        access: Access,
        req: &Req,
    ) -> Result<reqwest::Response> {
        let client = self.http(ep)?;
        let mut scopes = vec![scope(&r.repository, access)];
        scopes.extend(req.extra_scope.clone());
        let scope_key = scopes.join(" ");
        let candidates = self.candidates(r).await?;
        // Start with a credential authorized before, else with none; `current` is the
        // candidate whose authorization is sent, `fresh` whether it was got just now.
        let (mut current, mut fresh, mut header) = (None, false, None);
        for (i, c) in candidates.iter().enumerate() {
            if let Some(h) = self.cached_auth(ep, &scope_key, &c.principal) {
                (current, header) = (Some(i), Some(h));
                break;
            }
        }
        let mut refused = Vec::new();
        loop {
            let mut builder = client
                .request(req.method.clone(), &req.url)
                .headers(req.headers.clone());
            for (k, v) in &ep.headers {
                builder = builder.header(k.as_str(), v.as_str());
            }
            if let Some(a) = &header {
                builder = builder.header(AUTHORIZATION, a);
            }
            if let Some(b) = &req.body {
                builder = builder.body(b.clone());
            }
            let resp = builder.send().await.map_err(|e| {
                let how = if e.is_connect() {
                    "is unreachable"
                } else {
                    "did not answer"
                };
                Error::new(
                    ErrorKind::Network,
                    format!("{} {how} at {}", ep.describe(&r.registry), ep.base),
                )
                .with_source(e)
            })?;
            if resp.status() != StatusCode::UNAUTHORIZED {
                return Ok(resp);
            }
            let Some(challenge) = resp
                .headers()
                .get(WWW_AUTHENTICATE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
            else {
                return Err(Error::new(
                    ErrorKind::Auth,
                    format!(
                        "registry {} refused the request (HTTP 401) without saying how to authenticate",
                        r.registry
                    ),
                ));
            };
            // A kept authorization may have expired on the registry's side: authorize the
            // same credential again once; a fresh one refused means the next credential.
            let first = match current {
                None => 0,
                Some(i) if !fresh => i,
                Some(i) => {
                    refused.push(candidates[i].describe());
                    i + 1
                }
            };
            (current, header) = (None, None);
            for (i, candidate) in candidates.iter().enumerate().skip(first) {
                match self
                    .authorize(ep, r, &challenge, &scope_key, &scopes, candidate)
                    .await
                {
                    Ok(()) => {
                        header = self.cached_auth(ep, &scope_key, &candidate.principal);
                        (current, fresh) = (Some(i), true);
                        break;
                    }
                    Err(e) if e.kind() == ErrorKind::Auth => {
                        refused.push(format!("{} ({})", candidate.describe(), e.chain()))
                    }
                    Err(e) => return Err(e),
                }
            }
            if header.is_none() {
                return Err(Error::new(
                    ErrorKind::Auth,
                    format!(
                        "registry {} requires authentication for {}: refused {} (HTTP 401)",
                        r.registry,
                        r.repository,
                        refused.join("; ")
                    ),
                ));
            }
        }
    }

    /// [`RegistryClient::send`] of an idempotent request under the retry policy: a request
    /// that gets no answer, or a 5xx or 429 answer, is sent again.
    async fn send_retried(
        &self,
        ep: &Endpoint,
        r: &Reference,
        access: Access,
        req: &Req,
        what: &str,
    ) -> Result<reqwest::Response> {
        self.shared
            .config
            .retry
            .run(what, || async {
                let resp = self.send(ep, r, access, req).await?;
                let status = resp.status();
                if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS {
                    return Err(Error::new(
                        ErrorKind::Network,
                        format!(
                            "{what}: {} answered HTTP {status}",
                            ep.describe(&r.registry)
                        ),
                    ));
                }
                Ok(resp)
            })
            .await
    }

    async fn check(
        resp: reqwest::Response,
        what: &str,
        r: &Reference,
        ep: &Endpoint,
    ) -> Result<reqwest::Response> {
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body = read_limited(resp, 64 << 10, "error body")
            .await
            .unwrap_or_default();
        let detail = registry_error_text(&body);
        let (kind, outcome) = match status {
            StatusCode::NOT_FOUND => (ErrorKind::NotFound, "not found"),
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => (ErrorKind::Auth, "denied"),
            s if s.is_server_error() || s == StatusCode::TOO_MANY_REQUESTS => {
                (ErrorKind::Network, "failed on the registry side")
            }
            _ => (ErrorKind::InvalidInput, "refused"),
        };
        let detail = if detail.is_empty() {
            String::new()
        } else {
            format!(": {detail}")
        };
        let via = if ep.mirror {
            format!(", answered by mirror {}", ep.base)
        } else {
            String::new()
        };
        Err(Error::new(
            kind,
            format!(
                "{what} {outcome} in {}/{} (HTTP {status}{detail}{via})",
                r.registry, r.repository
            ),
        ))
    }

    /// Fetches something whose answer `take` reads and checks (status, length, digest), under
    /// the retry policy: each try goes to every pull endpoint in turn ([`Self::sweep`]), and
    /// a try that failed transiently everywhere (no answer, a reset, a 5xx, a cut or corrupt
    /// body) is made again after a backoff, until the policy's attempts or deadline run out.
    async fn pull<T, F>(
        &self,
        r: &Reference,
        what: &str,
        via_mirrors: bool,
        make: impl Fn(&Endpoint) -> Req,
        take: impl Fn(reqwest::Response, Endpoint) -> F,
    ) -> Result<T>
    where
        F: std::future::Future<Output = Result<T>>,
    {
        let what_where = format!("fetching {what} from {}/{}", r.registry, r.repository);
        self.shared
            .config
            .retry
            .run(&what_where, || {
                self.sweep(r, what, via_mirrors, None, &make, &take)
            })
            .await
    }

    /// One try of [`Self::pull`]: each pull endpoint until one answers with what `take`
    /// accepts, mirrors first, resting ones (see [`health`]) last; whatever fails at one
    /// endpoint sends the request on to the next. The error returned is the registry's own if
    /// it was asked, else the last mirror's. An authentication error from the registry itself
    /// is returned at once. For ranges of `blob`, a mirror that answers with the whole blob
    /// (a pull-through cache filling itself) has the blob rest there ([`health`]).
    async fn sweep<T, F>(
        &self,
        r: &Reference,
        what: &str,
        via_mirrors: bool,
        blob: Option<&Digest>,
        make: &impl Fn(&Endpoint) -> Req,
        take: &impl Fn(reqwest::Response, Endpoint) -> F,
    ) -> Result<T>
    where
        F: std::future::Future<Output = Result<T>>,
    {
        // The error to return, and whether the registry itself gave it.
        let mut returned: Option<(bool, Error)> = None;
        let mut endpoints = self.endpoints(r, Access::Pull)?;
        if !via_mirrors {
            endpoints.retain(|e| !e.mirror);
        }
        for ep in self.shared.health.order(endpoints, blob) {
            let req = make(&ep);
            self.shared.health.sent(&ep.base);
            let answer = async {
                let sent = self.send(&ep, r, Access::Pull, &req);
                let resp = if ep.mirror {
                    tokio::time::timeout(MIRROR_DEADLINE, sent)
                        .await
                        .unwrap_or_else(|_| {
                            Err(Error::new(
                                ErrorKind::Network,
                                format!(
                                    "{} did not answer {what} within {} s",
                                    ep.describe(&r.registry),
                                    MIRROR_DEADLINE.as_secs()
                                ),
                            ))
                        })?
                } else {
                    sent.await?
                };
                take(Self::check(resp, what, r, &ep).await?, ep.clone()).await
            };
            let outcome = answer.await;
            let e = match outcome {
                Ok(v) => {
                    self.shared
                        .health
                        .succeeded(&ep.base, blob.filter(|_| ep.mirror));
                    return Ok(v);
                }
                Err(e) => e,
            };
            let failure = match (e.kind(), blob) {
                (ErrorKind::NotFound, _) => health::Failure::NotFound,
                (ErrorKind::Auth, _) => health::Failure::Refused,
                (ErrorKind::Unsupported, Some(blob)) if ep.mirror => {
                    tracing::info!(endpoint = %ep.base, %blob, "the mirror answered a Range request with the whole blob (a pull-through cache filling itself): this blob's ranges pass it by for a while");
                    health::Failure::WholeBlob(*blob)
                }
                _ => health::Failure::Endpoint,
            };
            self.shared.health.failed(&ep.base, failure);
            if !ep.mirror && e.kind() == ErrorKind::Auth {
                return Err(e);
            }
            if ep.mirror && failure == health::Failure::Endpoint {
                tracing::warn!(endpoint = %ep.base, registry = %r.registry, error = %e.chain(), "mirror failed; trying the next endpoint, and this mirror after the others for a while");
            } else {
                tracing::debug!(endpoint = %ep.base, error = %e.chain(), "endpoint failed, trying next");
            }
            if !ep.mirror
                || returned
                    .as_ref()
                    .is_none_or(|(from_registry, _)| !from_registry)
            {
                returned = Some((!ep.mirror, e));
            }
        }
        Err(returned.map(|(_, e)| e).unwrap_or_else(|| {
            Error::invalid(format!(
                "no endpoint to pull {what} from: the hosts.toml of {} gives the registry itself no pull capability, and this request passes by its mirrors",
                r.registry
            ))
        }))
    }

    /// A whole response body of at most `limit` bytes, counted for `ep`.
    async fn body(
        &self,
        ep: &Endpoint,
        resp: reqwest::Response,
        limit: u64,
        what: &str,
    ) -> Result<Vec<u8>> {
        let body = read_limited(resp, limit, what).await?;
        self.shared.health.received(&ep.base, body.len() as u64);
        Ok(body)
    }

    /// Fetches the manifest or index `r` names. Verified against the digest when `r` has one;
    /// the returned digest is that of the bytes received.
    pub async fn get_manifest(&self, r: &Reference) -> Result<FetchedManifest> {
        let accept = MANIFEST_TYPES.join(", ");
        let object = r.object();
        let what = &format!("manifest {object}");
        let (media_type, bytes, manifest) = self
            .pull(
                r,
                what,
                true,
                |ep| Req::get(ep, r, &format!("manifests/{object}")).header(ACCEPT, &accept),
                |resp, ep| async move {
                    let media_type = resp
                        .headers()
                        .get(CONTENT_TYPE)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .split(';')
                        .next()
                        .unwrap_or("")
                        .trim()
                        .to_string();
                    // By tag, the digest the registry names for what it sends, when it
                    // names one (distribution does): a body cut or flipped on the way fails
                    // here and is fetched again, as a body fetched by digest does.
                    let named = resp
                        .headers()
                        .get("docker-content-digest")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<Digest>().ok());
                    let bytes = self.body(&ep, resp, oci::MAX_MANIFEST_SIZE, what).await?;
                    match (&r.digest, named) {
                        (Some(expected), _) => {
                            expected.verify(&bytes, &format!("manifest of {r}"))?
                        }
                        (None, Some(named)) => named.verify(
                            &bytes,
                            &format!("manifest of {r} (the registry's Docker-Content-Digest)"),
                        )?,
                        (None, None) => {}
                    }
                    let manifest = oci::parse_manifest(&bytes, Some(&media_type))
                        .map_err(|e| e.context(format!("{r}")))?;
                    Ok((media_type, bytes, manifest))
                },
            )
            .await?;
        let digest = Digest::of(&bytes);
        let media_type = match &manifest {
            ManifestKind::Image(m) => m.media_type.clone().unwrap_or(if media_type.is_empty() {
                oci::OCI_MANIFEST.into()
            } else {
                media_type
            }),
            ManifestKind::Index(i) => i.media_type.clone().unwrap_or(if media_type.is_empty() {
                oci::OCI_INDEX.into()
            } else {
                media_type
            }),
        };
        Ok(FetchedManifest {
            digest,
            media_type,
            bytes,
            manifest,
        })
    }

    /// Asks the registry (not a mirror: access is the registry's to grant) whether this client
    /// may read manifest `r`: a `HEAD` under the retry policy. Returns the digest the registry
    /// names (`Docker-Content-Digest`), which for a reference by digest must be that digest; a
    /// registry that names none for a tag is asked for the manifest itself.
    pub async fn check_manifest(&self, r: &Reference) -> Result<Digest> {
        let accept = MANIFEST_TYPES.join(", ");
        let object = r.object();
        let what = &format!("manifest {object}");
        let headed = self
            .pull(
                r,
                what,
                false,
                |ep| {
                    let mut req =
                        Req::get(ep, r, &format!("manifests/{object}")).header(ACCEPT, &accept);
                    req.method = Method::HEAD;
                    req
                },
                |resp, ep| async move {
                    let named = resp
                        .headers()
                        .get("docker-content-digest")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<Digest>().ok());
                    match (&r.digest, named) {
                        (Some(want), Some(got)) if *want != got => Err(Error::corrupt(format!(
                            "{} names manifest {got} for {r}",
                            ep.describe(&r.registry)
                        ))),
                        (Some(want), _) => Ok(*want),
                        (None, Some(got)) => Ok(got),
                        (None, None) => Err(Error::unsupported(format!(
                            "{} does not name the digest of {r} (no Docker-Content-Digest)",
                            ep.describe(&r.registry)
                        ))),
                    }
                },
            )
            .await;
        match headed {
            Err(e) if e.kind() == ErrorKind::Unsupported => {
                self.get_manifest(r).await.map(|m| m.digest)
            }
            other => other,
        }
    }

    /// The referrers (OCI 1.1) of manifest `digest` in `r`'s repository whose artifact type is
    /// one of `artifact_types`: from the referrers API, or where the registry has none from the
    /// fallback tag `sha256-<hex>`; empty if there are none.
    pub async fn referrers(
        &self,
        r: &Reference,
        digest: &Digest,
        artifact_types: &[&str],
    ) -> Result<Vec<Descriptor>> {
        let what = &format!("referrers of {digest}");
        // The API and the fallback tag are asked at once: a registry without the API costs no
        // second round trip (the tag's answer is used only where the API has none).
        let (api, fallback) = tokio::join!(
            self.pull(
                r,
                what,
                true,
                |ep| Req::get(ep, r, &format!("referrers/{digest}")).header(ACCEPT, oci::OCI_INDEX),
                |resp, ep| async move { self.body(&ep, resp, oci::MAX_MANIFEST_SIZE, what).await },
            ),
            self.fallback_referrers(r, digest)
        );
        let index = match api {
            Ok(bytes) => match oci::parse_manifest(&bytes, Some(oci::OCI_INDEX))? {
                ManifestKind::Index(index) => Some(index),
                ManifestKind::Image(_) => {
                    return Err(Error::corrupt(format!(
                        "{what} in {}/{}: the registry answered with a manifest, not an index",
                        r.registry, r.repository
                    )))
                }
            },
            // No referrers API (or nothing there yet): the fallback tag.
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::InvalidInput) => None,
            Err(e) => return Err(e),
        };
        let manifests = match index {
            Some(index) if !index.manifests.is_empty() => index.manifests,
            _ => fallback?.1,
        };
        Ok(manifests
            .into_iter()
            .filter(|d| {
                d.artifact_type
                    .as_deref()
                    .is_some_and(|t| artifact_types.contains(&t))
            })
            .collect())
    }

    /// The referrers fallback tag of manifest `digest` in `r`'s repository (`sha256-<hex>`,
    /// for registries without the referrers API) and the referrers its index lists (none if
    /// the tag does not exist or is not an index).
    pub async fn fallback_referrers(
        &self,
        r: &Reference,
        digest: &Digest,
    ) -> Result<(Reference, Vec<Descriptor>)> {
        let tag = Reference {
            tag: Some(format!("sha256-{}", digest.hex())),
            digest: None,
            ..r.clone()
        };
        let manifests = match self.get_manifest(&tag).await {
            Ok(FetchedManifest {
                manifest: ManifestKind::Index(index),
                ..
            }) => index.manifests,
            Ok(_) => Vec::new(),
            Err(e) if e.kind() == ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e.context("reading the referrers fallback tag")),
        };
        Ok((tag, manifests))
    }

    /// Publishes the blobs `layers` (already in `target`'s repository) as an OCI 1.1 artifact
    /// of `artifact_type` that refers to manifest `subject`: the empty config, the artifact
    /// manifest (with `annotations`), and the referrers fallback tag's index for registries
    /// without the referrers API, where it replaces an earlier artifact of the same type.
    /// Returns the artifact manifest's digest.
    pub async fn push_referrer(
        &self,
        target: &Reference,
        subject: Descriptor,
        artifact_type: &str,
        layers: Vec<Descriptor>,
        annotations: std::collections::BTreeMap<String, String>,
    ) -> Result<Digest> {
        let config = Descriptor::of(oci::OCI_EMPTY, b"{}");
        self.push_blob(target, &config.digest, Bytes::from_static(b"{}"))
            .await
            .map_err(|e| e.context("uploading the empty config"))?;
        let subject_digest = subject.digest;
        let manifest = oci::Manifest {
            schema_version: 2,
            media_type: Some(oci::OCI_MANIFEST.into()),
            artifact_type: Some(artifact_type.into()),
            config,
            layers,
            subject: Some(Box::new(Descriptor {
                platform: None,
                annotations: Default::default(),
                artifact_type: None,
                ..subject
            })),
            annotations: annotations.clone(),
        };
        let bytes = serde_json::to_vec(&manifest).expect("manifest serialises");
        let mut desc = Descriptor::of(oci::OCI_MANIFEST, &bytes);
        desc.artifact_type = Some(artifact_type.into());
        desc.annotations = annotations;
        self.put_manifest(target, None, oci::OCI_MANIFEST, bytes)
            .await
            .map_err(|e| e.context("uploading the artifact manifest"))?;
        let (tag, mut manifests) = self.fallback_referrers(target, &subject_digest).await?;
        manifests.retain(|d| d.artifact_type.as_deref() != Some(artifact_type));
        manifests.push(desc.clone());
        let index = oci::Index {
            schema_version: 2,
            media_type: Some(oci::OCI_INDEX.into()),
            manifests,
            annotations: Default::default(),
        };
        let bytes = serde_json::to_vec(&index).expect("index serialises");
        self.put_manifest(&tag, tag.tag.as_deref(), oci::OCI_INDEX, bytes)
            .await
            .map_err(|e| e.context("updating the referrers fallback tag"))?;
        Ok(desc.digest)
    }

    /// Fetches a whole blob of at most `limit` bytes and verifies it against `desc`.
    pub async fn get_blob(&self, r: &Reference, desc: &Descriptor, limit: u64) -> Result<Vec<u8>> {
        if desc.size > limit {
            return Err(Error::corrupt(format!(
                "blob {} is {} bytes, more than the {limit} accepted",
                desc.digest, desc.size
            )));
        }
        let what = &format!("blob {}", desc.digest);
        self.pull(
            r,
            what,
            true,
            |ep| Req::get(ep, r, &format!("blobs/{}", desc.digest)),
            |resp, ep| async move {
                let bytes = self.body(&ep, resp, desc.size, what).await?;
                if bytes.len() as u64 != desc.size {
                    return Err(Error::corrupt(format!(
                        "{what} from {} is {} bytes, the descriptor says {}",
                        ep.describe(&r.registry),
                        bytes.len(),
                        desc.size
                    )));
                }
                desc.digest.verify(&bytes, what)?;
                Ok(bytes)
            },
        )
        .await
    }

    /// Fetches `range` of a blob with an HTTP Range request, one try of each endpoint (the
    /// caller retries). The length is checked here; the content must be verified by the
    /// caller (chunk digests).
    pub async fn get_blob_range(
        &self,
        r: &Reference,
        digest: &Digest,
        range: std::ops::Range<u64>,
    ) -> Result<Bytes> {
        self.range(r, digest, range, true).await
    }

    /// [`Self::get_blob_range`] from the registry itself, passing by its mirrors: for bytes
    /// that failed verification once (a mirror may have sent them).
    pub async fn get_blob_range_from_registry(
        &self,
        r: &Reference,
        digest: &Digest,
        range: std::ops::Range<u64>,
    ) -> Result<Bytes> {
        self.range(r, digest, range, false).await
    }

    /// One try of a Range request ([`Self::sweep`]: each endpoint once, mirrors first): the
    /// caller's retry policy decides whether and when to try again.
    async fn range(
        &self,
        r: &Reference,
        digest: &Digest,
        range: std::ops::Range<u64>,
        via_mirrors: bool,
    ) -> Result<Bytes> {
        if range.is_empty() {
            return Ok(Bytes::new());
        }
        let what = &format!("bytes {}-{} of blob {digest}", range.start, range.end - 1);
        let header = format!("bytes={}-{}", range.start, range.end - 1);
        let expected = range.end - range.start;
        self.sweep(
            r,
            what,
            via_mirrors,
            Some(digest),
            &|ep| Req::get(ep, r, &format!("blobs/{digest}")).header(RANGE, &header),
            &|resp: reqwest::Response, ep: Endpoint| async move {
                let who = ep.describe(&r.registry);
                if resp.status() != StatusCode::PARTIAL_CONTENT {
                    return Err(Error::unsupported(format!(
                        "{who} answered {what} with HTTP {} instead of 206: it does not support \
                         Range requests (or, a pull-through cache, does not have the blob yet)",
                        resp.status()
                    )));
                }
                let asked = format!("{}-{}", range.start, range.end - 1);
                if let Some(cr) = resp.headers().get(CONTENT_RANGE) {
                    let cr = cr.to_str().unwrap_or("");
                    if cr.strip_prefix("bytes ").and_then(|s| s.split('/').next())
                        != Some(asked.as_str())
                    {
                        return Err(Error::new(
                            ErrorKind::BadAnswer,
                            format!("{who} answered a request for {what} with Content-Range {cr:?}: other bytes than asked for"),
                        ));
                    }
                }
                if let Some(len) = resp.content_length().filter(|&l| l != expected) {
                    return Err(Error::new(
                        ErrorKind::BadAnswer,
                        format!("{who} answered a request for the {expected} bytes {asked} of blob {digest} with a {len}-byte body"),
                    ));
                }
                let body = self.body(&ep, resp, expected, what).await?;
                if body.len() as u64 != expected {
                    return Err(Error::corrupt(format!(
                        "{what}: {who} sent {} bytes, expected {expected}",
                        body.len()
                    )));
                }
                Ok(Bytes::from(body))
            },
        )
        .await
    }

    /// A blocking reader over a whole blob that fails at the end unless the content matches
    /// `desc` (size and digest). Must be called inside a tokio runtime; read it from a
    /// blocking thread.
    pub async fn blob_reader(&self, r: &Reference, desc: &Descriptor) -> Result<BlobReader> {
        let what = format!("blob {}", desc.digest);
        let mut resp = self
            .pull(
                r,
                &what,
                true,
                |ep| Req::get(ep, r, &format!("blobs/{}", desc.digest)),
                |resp, _| async move { Ok(resp) },
            )
            .await?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<std::io::Result<Bytes>>(16);
        tokio::spawn(async move {
            loop {
                let item = match resp.chunk().await {
                    Ok(Some(b)) => Ok(b),
                    Ok(None) => break,
                    Err(e) => Err(std::io::Error::other(e)),
                };
                let failed = item.is_err();
                if tx.send(item).is_err() || failed {
                    break;
                }
            }
        });
        Ok(BlobReader {
            rx,
            current: Bytes::new(),
            hasher: Hasher::new(),
            expected: desc.clone(),
            done: false,
        })
    }

    /// Whether the repository already has the blob.
    pub async fn blob_exists(&self, r: &Reference, digest: &Digest) -> Result<bool> {
        let ep = self.push_endpoint(r)?;
        let req = Req::new(
            Method::HEAD,
            ep.url(&format!("{}/blobs/{digest}", r.repository)),
        );
        let resp = self
            .send_retried(
                &ep,
                r,
                Access::Push,
                &req,
                &format!("checking blob {digest}"),
            )
            .await?;
        match resp.status() {
            s if s.is_success() => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            _ => Self::check(resp, &format!("checking blob {digest}"), r, &ep)
                .await
                .map(|_| false),
        }
    }

    fn push_endpoint(&self, r: &Reference) -> Result<Endpoint> {
        Ok(self.endpoints(r, Access::Push)?.remove(0))
    }

    fn resolve_location(
        ep: &Endpoint,
        resp: &reqwest::Response,
        r: &Reference,
    ) -> Result<url::Url> {
        let loc = resp
            .headers()
            .get(LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| {
                Error::corrupt(format!(
                    "registry {} started an upload without a Location header",
                    r.registry
                ))
            })?;
        let base = url::Url::parse(&ep.base)
            .map_err(|e| Error::invalid(format!("endpoint {}: {e}", ep.base)))?;
        base.join(loc).map_err(|e| {
            Error::corrupt(format!(
                "registry {} sent an invalid upload Location {loc:?}: {e}",
                r.registry
            ))
        })
    }

    /// Starts an upload session.
    pub async fn start_upload(&self, r: &Reference) -> Result<BlobUpload<'_>> {
        let ep = self.push_endpoint(r)?;
        let req = Req::new(
            Method::POST,
            ep.url(&format!("{}/blobs/uploads/", r.repository)),
        )
        .header(CONTENT_LENGTH, "0");
        let resp = Self::check(
            self.send_retried(&ep, r, Access::Push, &req, "starting a blob upload")
                .await?,
            "starting a blob upload",
            r,
            &ep,
        )
        .await?;
        let location = Self::resolve_location(&ep, &resp, r)?;
        Ok(BlobUpload {
            client: self,
            ep,
            reference: r.clone(),
            location,
            offset: 0,
            disturbed: false,
        })
    }

    /// Uploads the file at `path` as blob `digest` (its sha256, computed by the caller) unless
    /// the repository has it already, reading it a segment at a time.
    pub async fn push_blob_file(
        &self,
        r: &Reference,
        digest: &Digest,
        path: &std::path::Path,
    ) -> Result<()> {
        use tokio::io::AsyncReadExt;
        if self.blob_exists(r, digest).await? {
            tracing::debug!(%digest, "blob exists, not uploading");
            return Ok(());
        }
        let shown = || path.display().to_string();
        let mut file = tokio::fs::File::open(path)
            .await
            .map_err(|e| Error::io(format!("opening {}", shown()), e))?;
        let mut upload = self.start_upload(r).await?;
        loop {
            let mut segment = Vec::with_capacity(UPLOAD_SEGMENT);
            let n = (&mut file)
                .take(UPLOAD_SEGMENT as u64)
                .read_to_end(&mut segment)
                .await
                .map_err(|e| Error::io(format!("reading {}", shown()), e))?;
            if n == 0 {
                break;
            }
            upload.write(Bytes::from(segment)).await?;
        }
        upload.finish(digest).await
    }

    /// Uploads `data` as one blob unless the repository has it already.
    pub async fn push_blob(&self, r: &Reference, digest: &Digest, data: Bytes) -> Result<()> {
        if self.blob_exists(r, digest).await? {
            tracing::debug!(%digest, "blob exists, not uploading");
            return Ok(());
        }
        let mut upload = self.start_upload(r).await?;
        upload.write(data).await?;
        upload.finish(digest).await
    }

    /// Mounts `digest` from repository `from` of the same registry. `Ok(false)` if the
    /// registry would not mount it (the caller uploads instead).
    pub async fn mount_blob(&self, r: &Reference, digest: &Digest, from: &str) -> Result<bool> {
        let ep = self.push_endpoint(r)?;
        let mut url = url::Url::parse(&ep.url(&format!("{}/blobs/uploads/", r.repository)))
            .map_err(|e| Error::invalid(e.to_string()))?;
        url.query_pairs_mut()
            .append_pair("mount", &digest.to_string())
            .append_pair("from", from);
        let mut req = Req::new(Method::POST, url.to_string()).header(CONTENT_LENGTH, "0");
        req.extra_scope = Some(scope(from, Access::Pull));
        let what = format!("mounting blob {digest} from {from}");
        let resp = self.send_retried(&ep, r, Access::Push, &req, &what).await?;
        match resp.status() {
            StatusCode::CREATED => Ok(true),
            StatusCode::ACCEPTED => {
                // The registry opened an ordinary upload instead; cancel it.
                if let Ok(loc) = Self::resolve_location(&ep, &resp, r) {
                    let _ = self
                        .send(
                            &ep,
                            r,
                            Access::Push,
                            &Req::new(Method::DELETE, loc.to_string()),
                        )
                        .await;
                }
                Ok(false)
            }
            _ => Self::check(resp, &format!("mounting blob {digest} from {from}"), r, &ep)
                .await
                .map(|_| false),
        }
    }

    /// Uploads a manifest or index under `tag` (or its digest when `tag` is `None`); returns
    /// its digest.
    pub async fn put_manifest(
        &self,
        r: &Reference,
        tag: Option<&str>,
        media_type: &str,
        bytes: Vec<u8>,
    ) -> Result<Digest> {
        let digest = Digest::of(&bytes);
        let object = tag.map_or_else(|| digest.to_string(), str::to_string);
        let ep = self.push_endpoint(r)?;
        let req = Req::new(
            Method::PUT,
            ep.url(&format!("{}/manifests/{object}", r.repository)),
        )
        .header(CONTENT_TYPE, media_type)
        .body(Bytes::from(bytes));
        let what = format!("uploading manifest {object}");
        Self::check(
            self.send_retried(&ep, r, Access::Push, &req, &what).await?,
            &what,
            r,
            &ep,
        )
        .await?;
        Ok(digest)
    }
}

/// An upload session (`POST`, then `PATCH` segments, then `PUT ?digest=`).
pub struct BlobUpload<'a> {
    client: &'a RegistryClient,
    ep: Endpoint,
    reference: Reference,
    location: url::Url,
    offset: u64,
    /// A request of this upload broke part-way and it was resumed: the registry's view of it
    /// may differ from ours, so its later refusals mean "start this blob again".
    disturbed: bool,
}

impl BlobUpload<'_> {
    /// After a broken request, a refusal (other than authentication) means the registry lost
    /// or distrusts the session: report it as a network failure so the caller uploads the
    /// blob again. The registry's digest check on completion keeps corrupt data out.
    fn after_disturbance(&self, e: Error) -> Error {
        if self.disturbed && e.kind() != ErrorKind::Auth && e.kind() != ErrorKind::Network {
            Error::new(
                ErrorKind::Network,
                "the registry rejected an upload that a broken request had disturbed",
            )
            .with_source(e)
        } else {
            e
        }
    }

    /// Bytes the registry has accepted so far.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Appends `data`. If a PATCH fails, asks the registry how much it kept and resends the
    /// rest, under the retry policy. If the registry cannot resume, the error is a `Network`
    /// error and the caller may start a new upload.
    pub async fn write(&mut self, data: Bytes) -> Result<()> {
        let r = self.reference.clone();
        let start = self.offset;
        // What the registry has of `data`, and where the session continues.
        let progress = tokio::sync::Mutex::new((0usize, self.location.clone(), false));
        let policy = self.client.shared.config.retry.clone();
        let tries = policy.run_when(
            "uploading blob data",
            || async {
                let mut p = progress.lock().await;
                let (sent, location, _) = &mut *p;
                let part = data.slice(*sent..);
                let from = start + *sent as u64;
                let req = Req::new(Method::PATCH, location.to_string())
                    .header(CONTENT_TYPE, "application/octet-stream")
                    .header(
                        CONTENT_RANGE,
                        &format!("{}-{}", from, from + part.len() as u64 - 1),
                    )
                    .body(part);
                let outcome = match self.client.send(&self.ep, &r, Access::Push, &req).await {
                    Ok(resp) => {
                        RegistryClient::check(resp, "uploading blob data", &r, &self.ep).await
                    }
                    Err(e) => Err(e),
                };
                match outcome {
                    Ok(resp) => {
                        *location = RegistryClient::resolve_location(&self.ep, &resp, &r)?;
                        *sent = data.len();
                        Ok(())
                    }
                    Err(e) if e.kind() == ErrorKind::Network => {
                        tracing::warn!(error = %e.chain(), "upload segment failed, asking the registry where to resume");
                        // Some registries (distribution 2.8) cancel an upload whose PATCH
                        // broke part-way; then only a new upload helps, which the caller
                        // decides.
                        let (have, at) = match upload_status(self.client, &self.ep, &r, location).await {
                            Ok(answer) => answer,
                            Err(status_error) => {
                                return Err(Error::new(ErrorKind::FailedPrecondition, format!(
                                    "the registry cannot resume the upload ({})",
                                    status_error.chain()
                                )).with_source(e))
                            }
                        };
                        if have < from || have > start + data.len() as u64 {
                            return Err(Error::new(ErrorKind::FailedPrecondition, format!(
                                "the registry kept {have} bytes, cannot resume"
                            )).with_source(e));
                        }
                        (*sent, *location, p.2) = ((have - start) as usize, at, true);
                        Err(e)
                    }
                    Err(e) => Err(e),
                }
            },
            |e| e.kind() == ErrorKind::Network,
        );
        let outcome = tries.await;
        let (_, location, disturbed) = progress.into_inner();
        (self.location, self.disturbed) = (location, self.disturbed || disturbed);
        match outcome {
            Ok(()) => {
                self.offset = start + data.len() as u64;
                Ok(())
            }
            // The upload cannot go on, a new one may (the registry dropped the session): a
            // network failure, for the caller to upload the blob again.
            Err(e) if e.kind() == ErrorKind::FailedPrecondition => Err(Error::new(
                ErrorKind::Network,
                "the registry could not resume a broken upload",
            )
            .with_source(e)),
            Err(e) => Err(self.after_disturbance(e)),
        }
    }

    /// Completes the upload as `digest`; the registry checks it too.
    pub async fn finish(self, digest: &Digest) -> Result<()> {
        let r = self.reference.clone();
        let mut url = self.location.clone();
        url.query_pairs_mut()
            .append_pair("digest", &digest.to_string());
        let req = Req::new(Method::PUT, url.to_string()).header(CONTENT_LENGTH, "0");
        let outcome = match self.client.send(&self.ep, &r, Access::Push, &req).await {
            Ok(resp) => {
                RegistryClient::check(
                    resp,
                    &format!("completing the upload of blob {digest}"),
                    &r,
                    &self.ep,
                )
                .await
            }
            Err(e) => Err(e),
        };
        outcome.map(drop).map_err(|e| self.after_disturbance(e))
    }
}

/// How many bytes the registry holds for the upload session at `location` (`GET` on it), and
/// where the session continues.
async fn upload_status(
    client: &RegistryClient,
    ep: &Endpoint,
    r: &Reference,
    location: &url::Url,
) -> Result<(u64, url::Url)> {
    let req = Req::new(Method::GET, location.to_string());
    let resp = RegistryClient::check(
        client.send(ep, r, Access::Push, &req).await?,
        "querying an upload",
        r,
        ep,
    )
    .await?;
    let range = resp
        .headers()
        .get(RANGE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("0-0")
        .to_string();
    let at = RegistryClient::resolve_location(ep, &resp, r).unwrap_or(location.clone());
    let end = range
        .trim_start_matches("bytes=")
        .split('-')
        .nth(1)
        .and_then(|e| e.parse::<u64>().ok())
        .unwrap_or(0);
    let have = if range.ends_with("0-0") && end == 0 {
        0
    } else {
        end + 1
    };
    Ok((have, at))
}

/// A blocking `Read` over a whole blob; the final read fails unless size and digest match.
pub struct BlobReader {
    rx: std::sync::mpsc::Receiver<std::io::Result<Bytes>>,
    current: Bytes,
    hasher: Hasher,
    expected: Descriptor,
    done: bool,
}

impl Read for BlobReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            if self.done {
                return Ok(0);
            }
            match self.rx.recv() {
                Ok(Ok(b)) => {
                    self.hasher.update(&b);
                    if self.hasher.len() > self.expected.size {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            format!(
                                "blob {} is longer than its descriptor's {} bytes",
                                self.expected.digest, self.expected.size
                            ),
                        ));
                    }
                    self.current = b;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    self.done = true;
                    let got = std::mem::take(&mut self.hasher);
                    let len = got.len();
                    let digest = got.finish();
                    if len != self.expected.size || digest != self.expected.digest {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            format!("blob {} arrived as {len} bytes with digest {digest}: corrupt or truncated", self.expected.digest),
                        ));
                    }
                    return Ok(0);
                }
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current[..n]);
        let _ = self.current.split_to(n);
        Ok(n)
    }
}

#[cfg(test)]
mod tests;
