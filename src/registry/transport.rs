//! Sending requests: HTTP clients per TLS settings, the endpoints of a reference (mirrors from
//! `hosts.toml`, then the registry), one request with the credentials that are accepted and
//! the redirects it is answered with followed ([`RegistryClient::send`]), and one try of every
//! endpoint in turn with what each answer teaches the endpoints' health
//! ([`RegistryClient::sweep`]); the retry policy wraps a whole try ([`RegistryClient::pull`]).
//! Bodies are read under a size limit and a deadline (`read_limited` in `mod.rs`).
//!
//! Redirects are followed here, not by the HTTP client: at most [`MAX_REDIRECTS`] hops, never
//! from HTTPS to plain HTTP, never in a loop, and never with the registry's `Authorization`
//! or the endpoint's own headers (a blob host — a CDN, S3, GCS, Azure — refuses a request that
//! carries a second authentication, and must not learn the registry's). Where a blob's bytes
//! were redirected to is kept ([`super::locations`]) and asked directly from then on.

use std::time::{Duration, Instant};

use bytes::Bytes;
use reqwest::header::{HeaderMap, HeaderValue, AUTHORIZATION, LOCATION, WWW_AUTHENTICATE};
use reqwest::{Method, StatusCode};

use super::client::{read_limited, registry_error_text, Ask, RegistryClient};
use super::credentials::{scope, Access, Candidate, Principal};
use super::health;
use super::hosts::Endpoint;
use super::locations::Lookup;
use super::roots;
use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::{is_loopback_host, Reference};

/// A request to send, rebuilt for every try (bodies are cheap `Bytes` clones).
/// Only idempotent requests are retried ([`RegistryClient::send_retried`]); a PATCH that fails
/// part-way changes the upload's state, so [`BlobUpload::write`] resumes it instead.
pub(super) struct Req {
    pub(super) method: Method,
    pub(super) url: String,
    pub(super) headers: HeaderMap,
    pub(super) body: Option<Bytes>,
    /// Extra scopes the token must cover (cross-repository mount source).
    pub(super) extra_scope: Option<String>,
    /// The blob whose bytes a GET asks for: where the endpoint redirects it is kept.
    pub(super) blob: Option<BlobAsked>,
}

/// The blob a request asks for ([`Req::blob`]).
#[derive(Clone, Copy)]
pub(super) struct BlobAsked {
    pub(super) digest: Digest,
    /// Ask the endpoint where it is again, not the blob host it redirected to before: bytes
    /// from there failed their check.
    pub(super) refresh: bool,
}

/// The wait a 429 or 503 answer asks for (`Retry-After` in seconds).
fn asked_wait(resp: &reqwest::Response) -> Option<crate::retry::RetryAfter> {
    let status = resp.status();
    if status != StatusCode::TOO_MANY_REQUESTS && status != StatusCode::SERVICE_UNAVAILABLE {
        return None;
    }
    resp.headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(crate::retry::RetryAfter::parse)
}

/// How many redirects one request follows at most (a registry's API to a CDN, the CDN to an
/// edge or the object store).
pub(super) const MAX_REDIRECTS: usize = 5;

impl Req {
    pub(super) fn new(method: Method, url: String) -> Self {
        Req {
            url,
            headers: HeaderMap::new(),
            body: None,
            extra_scope: None,
            blob: None,
            method,
        }
    }

    /// This request as one for the bytes of blob `digest` ([`Req::blob`]).
    pub(super) fn of_blob(mut self, digest: Digest, refresh: bool) -> Self {
        self.blob = Some(BlobAsked { digest, refresh });
        self
    }

    /// A GET of `path` (e.g. `manifests/<tag>`) in `r`'s repository at `ep`.
    pub(super) fn get(ep: &Endpoint, r: &Reference, path: &str) -> Self {
        Req::new(Method::GET, ep.url(&format!("{}/{path}", r.repository)))
    }

    pub(super) fn header(mut self, name: reqwest::header::HeaderName, value: &str) -> Self {
        if let Ok(v) = HeaderValue::from_str(value) {
            self.headers.insert(name, v);
        }
        self
    }

    pub(super) fn body(mut self, body: Bytes) -> Self {
        self.body = Some(body);
        self
    }
}

/// How long a mirror may take to answer a request (its headers; the body has its own deadline)
/// before the next endpoint is asked: a hung mirror must not hold a guest's read for the
/// socket's timeouts.
pub(super) const MIRROR_DEADLINE: Duration = Duration::from_secs(10);

/// How long a reader waits for a mirror's answer to a first ask of a blob (one it has not
/// served ranges of) before it asks the next endpoint ([`RegistryClient::hedged`]): a range
/// cache answers a cold range within a round trip to the origin and a slice's fill; a
/// pull-through cache that lacks the blob may take seconds, all of which a guest would wait.
pub(super) const MIRROR_HEDGE: Duration = Duration::from_secs(1);

impl RegistryClient {
    /// The credentials a request for `r` may carry, in the order they are tried: the node's
    /// own (or none), then each granted for `r`'s repository, newest first.
    pub(super) async fn candidates(&self, r: &Reference) -> Result<Vec<Candidate>> {
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

    pub(super) fn http(&self, ep: &Endpoint) -> Result<reqwest::Client> {
        let key = (ep.skip_verify, ep.ca.clone(), ep.client_cert.clone());
        if let Some(c) = self.shared.clients.lock().get(&key) {
            return Ok(c.clone());
        }
        // Once per TLS settings: reading the CA files and the system's roots is blocking work,
        // done off the async workers and with no lock held (two first uses at once may both
        // build one; the first kept is used).
        let config = &self.shared.config;
        let client =
            crate::task::off_the_runtime(|| Self::build_http(ep, &config.roots, config.agent))?;
        Ok(self
            .shared
            .clients
            .lock()
            .entry(key)
            .or_insert(client)
            .clone())
    }

    /// A new HTTP client for endpoint `ep`'s TLS settings, trusting `roots` and the endpoint's
    /// CAs, naming `agent` as its User-Agent.
    pub(super) fn build_http(
        ep: &Endpoint,
        roots: &roots::Roots,
        agent: super::client::Agent,
    ) -> Result<reqwest::Client> {
        let mut builder = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .tls_built_in_root_certs(false)
            .user_agent(agent.user_agent())
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

    pub(super) fn plain_http(&self, host: &str) -> bool {
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
    pub(super) fn endpoints(&self, r: &Reference, access: Access) -> Result<Vec<Endpoint>> {
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

    /// Sends `req` to `ep` once ([`Self::send_authorized`]) and follows the redirects it is
    /// answered with ([`Self::follow`]); a request for a blob's bytes goes to where the
    /// endpoint redirected it before, if that is kept and the blob host still answers it
    /// (else the endpoint is asked again and its new redirect kept). Returns the final answer
    /// as it is (the caller checks its status), or an error.
    pub(super) async fn send(
        &self,
        ep: &Endpoint,
        r: &Reference,
        access: Access,
        req: &Req,
    ) -> Result<reqwest::Response> {
        let Some(blob) = req.blob.filter(|_| req.method == Method::GET) else {
            let resp = self.send_authorized(ep, r, access, req).await?;
            return Ok(self.follow(ep, r, req, resp).await?.0);
        };
        let locations = &self.locations;
        let (base, repository) = (ep.base.as_str(), r.repository.as_str());
        let mut claim = match locations
            .lookup(base, repository, &blob.digest, blob.refresh)
            .await
        {
            Lookup::Kept(url) => {
                match self.send_elsewhere(ep, r, &url, req).await {
                    Ok(resp) if resp.status().is_success() => return Ok(resp),
                    Ok(resp) => {
                        tracing::debug!(endpoint = %ep.base, blob = %blob.digest, status = %resp.status(), "the blob host refused the URL it was redirected to (expired or revoked): asking the endpoint again")
                    }
                    Err(e) => {
                        tracing::debug!(endpoint = %ep.base, blob = %blob.digest, error = %e.chain(), "the blob host it was redirected to failed: asking the endpoint again")
                    }
                }
                locations.forget(base, repository, &blob.digest, &url);
                match locations.lookup(base, repository, &blob.digest, true).await {
                    Lookup::Kept(url) => {
                        // Another request resolved it meanwhile.
                        return self.send_elsewhere(ep, r, &url, req).await;
                    }
                    Lookup::Endpoint => None,
                    Lookup::Resolve(claim) => Some(claim),
                }
            }
            Lookup::Endpoint => None,
            Lookup::Resolve(claim) => Some(claim),
        };
        let resp = self.send_authorized(ep, r, access, req).await?;
        let (resp, redirected) = self.follow(ep, r, req, resp).await?;
        if resp.status().is_success() {
            match (claim.take(), redirected) {
                (Some(claim), Some(url)) => claim.keep(url),
                (Some(claim), None) => claim.direct(),
                (None, _) => {}
            }
        }
        Ok(resp)
    }

    /// `resp` (the answer of `ep` to a GET or HEAD `req`) with the redirects it names followed: each hop
    /// sent without the registry's authorization or the endpoint's headers, at most
    /// [`MAX_REDIRECTS`], never from HTTPS to another scheme, never to a URL already asked.
    /// The final answer, and the URL it came from if it was redirected.
    async fn follow(
        &self,
        ep: &Endpoint,
        r: &Reference,
        req: &Req,
        mut resp: reqwest::Response,
    ) -> Result<(reqwest::Response, Option<reqwest::Url>)> {
        let who = ep.describe(&r.registry);
        let refused = |why: String| {
            Error::new(
                ErrorKind::BadAnswer,
                format!("{who} answered {} {}: {why}", req.method, req.url),
            )
        };
        let mut at = reqwest::Url::parse(&req.url)
            .map_err(|e| Error::invalid(format!("{}: {e}", req.url)))?;
        let mut asked = vec![at.clone()];
        loop {
            // Only reads are followed: an upload's redirect (none known) goes back as it is.
            let read = req.method == Method::GET || req.method == Method::HEAD;
            if !read || !matches!(resp.status().as_u16(), 301 | 302 | 303 | 307 | 308) {
                let redirected = (asked.len() > 1).then_some(at);
                return Ok((resp, redirected));
            }
            if asked.len() > MAX_REDIRECTS {
                return Err(refused(format!(
                    "more than {MAX_REDIRECTS} redirects (the last to {at}); refused"
                )));
            }
            let location = resp
                .headers()
                .get(LOCATION)
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| refused(format!("HTTP {} without a Location", resp.status())))?;
            let next = at
                .join(location)
                .map_err(|e| refused(format!("a redirect to {location:?}, not a URL ({e})")))?;
            if !matches!(next.scheme(), "https" | "http")
                || (at.scheme() == "https" && next.scheme() != "https")
            {
                return Err(refused(format!(
                    "a redirect from {} to {}: refused (a blob's bytes never leave HTTPS; the registry or its storage's address is misconfigured)",
                    at.scheme(),
                    next.scheme()
                )));
            }
            if asked.contains(&next) {
                return Err(refused(format!("a redirect loop back to {next}; refused")));
            }
            asked.push(next.clone());
            resp = self.send_elsewhere(ep, r, &next, req).await?;
            at = next;
        }
    }

    /// `req` sent to `url`, where `ep` redirected it: with its own headers (a Range) but
    /// neither the registry's authorization nor the endpoint's headers; to another host than
    /// the endpoint's with the client that trusts only the node's roots (the endpoint's CAs and
    /// `skip_verify` are for the endpoint).
    async fn send_elsewhere(
        &self,
        ep: &Endpoint,
        r: &Reference,
        url: &reqwest::Url,
        req: &Req,
    ) -> Result<reqwest::Response> {
        let same_host = reqwest::Url::parse(&ep.base).is_ok_and(|base| {
            base.host_str() == url.host_str()
                && base.port_or_known_default() == url.port_or_known_default()
        });
        let client = if same_host {
            self.http(ep)?
        } else {
            // The blob host as an endpoint of its own: the default TLS settings.
            self.http(&Endpoint::upstream(url.host_str().unwrap_or(""), false))?
        };
        client
            .request(req.method.clone(), url.clone())
            .headers(req.headers.clone())
            .send()
            .await
            .map_err(|e| {
                Error::new(
                    ErrorKind::Network,
                    format!(
                        "{} redirected to {}, which did not answer",
                        ep.describe(&r.registry),
                        url.host_str().unwrap_or("?")
                    ),
                )
                .with_source(e)
            })
    }

    /// Sends `req` to `ep` once, with the first credential whose authorization is kept, or
    /// none; answers a 401 by authorizing the next credential the client may use
    /// ([`RegistryClient::candidates`]) until one is accepted. Returns the registry's answer
    /// as it is (the caller checks its status) or a `Network` error; when every credential was
    /// refused, an `Auth` error naming each.
    async fn send_authorized(
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
            let resp = Self::send_once(&client, ep, r, req, header.as_deref()).await?;
            self.heard(ep, &resp);
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

    /// What an answer of `ep` tells: whether a mirror declares itself a Range cache.
    fn heard(&self, ep: &Endpoint, resp: &reqwest::Response) {
        if ep.mirror {
            let declares = resp.headers().contains_key(health::RANGE_CACHE_HEADER);
            self.shared.health.answered(&ep.base, declares);
        }
    }

    /// Learns whether mirror `ep` declares itself a Range cache, for a reader's ranges, if no
    /// answer has come from it yet: asks it `GET /v2/` (once per process, within
    /// [`MIRROR_HEDGE`]; an answer that starts no fill). A mirror that does not answer in time
    /// is taken for one that does not declare it (readers' ranges pass it by until it does).
    async fn look_at(&self, ep: &Endpoint, r: &Reference) {
        if self.shared.health.declares_ranges(&ep.base).is_some() {
            return;
        }
        self.shared
            .health
            .look(&ep.base, async {
                let Ok(client) = self.http(ep) else { return };
                let req = Req::new(Method::GET, ep.url(""));
                self.shared.health.sent(&ep.base);
                let asked = Self::send_once(&client, ep, r, &req, None);
                match tokio::time::timeout(MIRROR_HEDGE, asked).await {
                    Ok(Ok(resp)) => self.heard(ep, &resp),
                    _ => {
                        tracing::debug!(endpoint = %ep.base, "the mirror did not answer a look in time: readers' ranges pass it by until it declares itself a Range cache");
                        self.shared.health.failed(&ep.base, health::Failure::Endpoint);
                    }
                }
            })
            .await;
    }

    /// `req` sent to `ep` once with `client`, carrying authorization `header` if any: the
    /// answer as it is, or a `Network` error naming the endpoint.
    async fn send_once(
        client: &reqwest::Client,
        ep: &Endpoint,
        r: &Reference,
        req: &Req,
        header: Option<&str>,
    ) -> Result<reqwest::Response> {
        let mut builder = client
            .request(req.method.clone(), &req.url)
            .headers(req.headers.clone());
        for (k, v) in &ep.headers {
            builder = builder.header(k.as_str(), v.as_str());
        }
        if let Some(a) = header {
            builder = builder.header(AUTHORIZATION, a);
        }
        if let Some(b) = &req.body {
            builder = builder.body(b.clone());
        }
        builder.send().await.map_err(|e| {
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
        })
    }

    /// [`RegistryClient::send`] of an idempotent request under the retry policy: a request
    /// that gets no answer, or a 5xx or 429 answer, is sent again.
    pub(super) async fn send_retried(
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
                    let e = Error::new(
                        ErrorKind::Network,
                        format!(
                            "{what}: {} answered HTTP {status}",
                            ep.describe(&r.registry)
                        ),
                    );
                    return Err(match asked_wait(&resp) {
                        Some(wait) => e.with_source(wait),
                        None => e,
                    });
                }
                Ok(resp)
            })
            .await
    }

    pub(super) async fn check(
        resp: reqwest::Response,
        what: &str,
        r: &Reference,
        ep: &Endpoint,
    ) -> Result<reqwest::Response> {
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let wait = asked_wait(&resp);
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
        let e = Error::new(
            kind,
            format!(
                "{what} {outcome} in {}/{} (HTTP {status}{detail}{via})",
                r.registry, r.repository
            ),
        );
        Err(match wait {
            Some(wait) => e.with_source(wait),
            None => e,
        })
    }

    /// Until when background reads of blob `digest` wait for one of `r`'s mirrors to fill it
    /// ([`health::Health::filling`]).
    pub(super) fn filling(&self, r: &Reference, digest: &Digest) -> Option<tokio::time::Instant> {
        let endpoints = self.endpoints(r, Access::Pull).ok()?;
        let mirrors = endpoints
            .iter()
            .filter(|e| e.mirror)
            .map(|e| e.base.as_str());
        self.shared.health.filling(mirrors, digest)
    }

    /// Fetches something whose answer `take` reads and checks (status, length, digest), under
    /// the retry policy: each try goes to every pull endpoint in turn ([`Self::sweep`]), and
    /// a try that failed transiently everywhere (no answer, a reset, a 5xx, a cut or corrupt
    /// body) is made again after a backoff, until the policy's attempts or deadline run out.
    pub(super) async fn pull<T, F>(
        &self,
        r: &Reference,
        what: &str,
        ask: Ask,
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
            .run(&what_where, || self.sweep(r, what, ask, None, &make, &take))
            .await
    }

    /// One try of [`Self::pull`]: each pull endpoint until one answers with what `take`
    /// accepts, mirrors first, resting ones (see [`health`]) last; whatever fails at one
    /// endpoint sends the request on to the next. The error returned is the registry's own if
    /// it was asked, else the last mirror's. An authentication error from the registry itself
    /// is returned at once. For ranges of `blob`: a reader's pass by a mirror that neither
    /// declares itself a Range cache ([`Self::look_at`]) nor has served ranges of the blob; a
    /// mirror that has not served ranges of it is asked by one request at a time (the others
    /// wait for its answer [`MIRROR_HEDGE`] at most, then pass it by), a reader waits for that
    /// answer as long at most ([`Self::hedged`]), a whole-blob answer (a pull-through cache
    /// filling itself) or none has the blob rest there ([`health`]), and a background read does
    /// not ask the registry while a mirror fills the blob (it waits for the fill:
    /// [`super::Registry::filling`]).
    pub(super) async fn sweep<T, F>(
        &self,
        r: &Reference,
        what: &str,
        ask: Ask,
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
        match ask {
            Ask::Registry => endpoints.retain(|e| !e.mirror),
            Ask::Mirrors => endpoints.retain(|e| e.mirror),
            Ask::AnyEndpoint | Ask::Background => {}
        }
        let ranges = blob.map(|b| (b, ask.purpose()));
        if let Some((_, health::Purpose::Demand)) = ranges {
            for ep in endpoints.iter().filter(|e| e.mirror) {
                self.look_at(ep, r).await;
            }
        }
        for ep in self.shared.health.order(endpoints, ranges) {
            let mut asking = match ranges {
                Some((blob, _)) if ep.mirror => {
                    match self.shared.health.claim(&ep.base, blob, MIRROR_HEDGE).await {
                        Some(asking) => Some(asking),
                        None => continue,
                    }
                }
                _ => None,
            };
            if let Some((blob, health::Purpose::Whole)) = ranges.filter(|_| !ep.mirror) {
                if self.filling(r, blob).is_some() {
                    return Err(Error::new(
                        ErrorKind::FailedPrecondition,
                        format!("a mirror of {} is filling blob {blob} from the registry: a background read waits for it rather than ask the registry for {what}", r.registry),
                    ));
                }
            }
            let first = asking.as_ref().and_then(|a| a.first_of()).copied();
            let req = make(&ep);
            let unsettled = health::Unsettled::send(&self.shared.health, &ep.base);
            let answered = match (first, ranges) {
                (Some(_), Some((_, health::Purpose::Demand))) => {
                    let asking = asking.take().expect("a first ask is claimed");
                    match self.hedged(&ep, r, req, what, asking).await {
                        Some(answered) => answered,
                        None => {
                            // Its answer is learnt in the background.
                            unsettled.settle();
                            continue;
                        }
                    }
                }
                _ => self.ask(&ep, r, &req, what).await,
            };
            let outcome = match answered {
                Ok(resp) => take(resp, ep.clone()).await,
                Err(e) => Err(e),
            };
            unsettled.settle();
            drop(asking);
            let e = match outcome {
                Ok(v) => {
                    self.shared
                        .health
                        .succeeded(&ep.base, blob.filter(|_| ep.mirror));
                    return Ok(v);
                }
                Err(e) => e,
            };
            self.learn(&ep, r, &e, blob, first.is_some());
            if !ep.mirror && e.kind() == ErrorKind::Auth {
                return Err(e);
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
            Error::invalid(match ask {
                Ask::Mirrors => format!(
                    "no mirror to pull {what} from: the hosts.toml of {} lists none with the pull capability",
                    r.registry
                ),
                _ => format!(
                    "no endpoint to pull {what} from: the hosts.toml of {} gives the registry itself no pull capability, and this request passes by its mirrors",
                    r.registry
                ),
            })
        }))
    }

    /// `req` sent to `ep` and the answer's status checked; a mirror that sends no answer within
    /// [`MIRROR_DEADLINE`] fails with a `Timeout`.
    async fn ask(
        &self,
        ep: &Endpoint,
        r: &Reference,
        req: &Req,
        what: &str,
    ) -> Result<reqwest::Response> {
        let sent = self.send(ep, r, Access::Pull, req);
        let resp = if ep.mirror {
            tokio::time::timeout(MIRROR_DEADLINE, sent)
                .await
                .unwrap_or_else(|_| {
                    Err(Error::new(
                        ErrorKind::Timeout,
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
        Self::check(resp, what, r, ep).await
    }

    /// A reader's first ask of mirror `ep` for ranges of a blob (`asking`): its answer, if it
    /// comes within [`MIRROR_HEDGE`]; else none, and the ask is left to finish in the
    /// background (within [`MIRROR_DEADLINE`]), where its answer teaches what the mirror does
    /// with the blob — a range, the whole blob, none — and drops the body. It keeps the claim
    /// until then, so the reader's next requests pass the mirror by meanwhile: a reader never
    /// waits longer than the hedge on a mirror that has not served the blob (a pull-through
    /// cache answers a blob it lacks only once the origin has started sending it, which on a
    /// busy link takes seconds), and each such mirror has one ask of a blob in flight.
    async fn hedged(
        &self,
        ep: &Endpoint,
        r: &Reference,
        req: Req,
        what: &str,
        asking: health::Asking,
    ) -> Option<Result<reqwest::Response>> {
        let mut asked = tokio::spawn({
            let (client, ep, r, what) = (self.clone(), ep.clone(), r.clone(), what.to_string());
            async move { client.ask(&ep, &r, &req, &what).await }
        });
        let who = ep.describe(&r.registry);
        let lost = move |e: tokio::task::JoinError| {
            Error::new(ErrorKind::Network, format!("asking {who}: {e}"))
        };
        if let Ok(joined) = tokio::time::timeout(MIRROR_HEDGE, &mut asked).await {
            return Some(joined.unwrap_or_else(|e| Err(lost(e))));
        }
        tracing::debug!(endpoint = %ep.base, %what, "the mirror has not answered a first ask of this blob within the hedge: asking the next endpoint, and learning its answer in the background");
        let (client, ep, r) = (self.clone(), ep.clone(), r.clone());
        tokio::spawn(async move {
            let blob = asking.first_of().copied();
            let answered = asked.await.unwrap_or_else(|e| Err(lost(e)));
            match answered {
                Ok(resp) if resp.status() == StatusCode::PARTIAL_CONTENT => {
                    client.shared.health.succeeded(&ep.base, blob.as_ref())
                }
                Ok(resp) => {
                    let e = Error::unsupported(format!(
                        "{} answered a Range request with HTTP {}",
                        ep.describe(&r.registry),
                        resp.status()
                    ));
                    client.learn(&ep, &r, &e, blob.as_ref(), true)
                }
                Err(e) => client.learn(&ep, &r, &e, blob.as_ref(), true),
            }
            drop(asking);
        });
        None
    }

    /// What failure `e` of a request to `ep` (for ranges of `blob`; `first`: a mirror's first
    /// ask of it) tells the endpoints' health, logged.
    fn learn(&self, ep: &Endpoint, r: &Reference, e: &Error, blob: Option<&Digest>, first: bool) {
        let failure = match (e.kind(), blob) {
            (ErrorKind::NotFound, _) => health::Failure::NotFound,
            (ErrorKind::Auth, _) => health::Failure::Refused,
            (ErrorKind::Unsupported, Some(blob)) if ep.mirror => {
                tracing::info!(endpoint = %ep.base, %blob, "the mirror answered a Range request with the whole blob (a pull-through cache filling itself): this blob's ranges pass it by for a while");
                health::Failure::WholeBlob(*blob)
            }
            (ErrorKind::Timeout, Some(blob)) if ep.mirror && first => {
                tracing::info!(endpoint = %ep.base, %blob, "the mirror sent no answer in time to a first ask of this blob (filling it, or behind a busy link): this blob's ranges pass it by for a while");
                health::Failure::Silent(*blob)
            }
            _ => health::Failure::Endpoint,
        };
        self.shared.health.failed(&ep.base, failure);
        if ep.mirror && failure == health::Failure::Endpoint {
            tracing::warn!(endpoint = %ep.base, registry = %r.registry, error = %e.chain(), "mirror failed; trying the next endpoint, and this mirror after the others for a while");
        } else {
            tracing::debug!(endpoint = %ep.base, error = %e.chain(), "endpoint failed, trying next");
        }
    }

    /// A whole response body of at most `limit` bytes, counted for `ep`.
    pub(super) async fn body(
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
}
