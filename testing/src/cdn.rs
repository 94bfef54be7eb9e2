//! A registry as the internet runs them, for the tests and benches: a front that passes every
//! request to a registry on this machine (CNCF distribution) but answers a blob GET (or HEAD)
//! with a `307` to a blob host — a signed URL that expires — as Docker Hub, quay.io, ghcr.io,
//! ECR, Google's and Azure's registries and distribution on object storage do; and the blob
//! host, which serves the blob's bytes from the registry's storage (distribution's filesystem
//! layout, as S3 serves the objects of a registry on S3), Ranges included, refusing a request
//! that carries an `Authorization` header (S3's `400`, "only one auth mechanism allowed") and
//! an expired, revoked or forged URL (`403`, "Request has expired"). The front redirects only a
//! request the registry itself would answer (it asks the registry first with the client's
//! credentials: a `401` or `404` is passed on as it is), so a registry that wants tokens still
//! gets them. Both count what they were asked ([`Counts`], also `GET /_cdn/stats` on the blob
//! host as JSON).
//!
//! Put each behind a link of its own (`examples/shaped-link.rs`) and give the front the address
//! clients reach the blob host at ([`Options::blob_url`]).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::Response;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

/// How the front signs and the blob host checks.
#[derive(Clone, Debug)]
pub struct Options {
    /// The registry behind the front: `http://127.0.0.1:5000`.
    pub origin: String,
    /// The registry's storage root (distribution's `rootdirectory`).
    pub storage: PathBuf,
    /// The blob host's base URL as clients reach it (through its link).
    pub blob_url: String,
    /// How long a signed URL is good for.
    pub lifetime: Duration,
}

/// What the front and the blob host were asked, and answered.
#[derive(Debug, Default)]
pub struct Counts {
    /// Blob GETs and HEADs the front was asked (each a registry API request).
    pub registry_blob_requests: AtomicU64,
    /// Other requests the front passed to the registry.
    pub registry_other_requests: AtomicU64,
    /// Requests the blob host was asked.
    pub blob_requests: AtomicU64,
    /// Of those, requests that carried an `Authorization` header (refused).
    pub blob_with_authorization: AtomicU64,
    /// Of those, requests refused for an expired, revoked or forged URL.
    pub blob_expired: AtomicU64,
    /// Body bytes the blob host sent.
    pub blob_bytes: AtomicU64,
}

impl Counts {
    /// The counts as JSON (what `GET /_cdn/stats` answers).
    pub fn json(&self) -> String {
        let n = |c: &AtomicU64| c.load(Ordering::SeqCst);
        format!(
            r#"{{"registry_blob_requests":{},"registry_other_requests":{},"blob_requests":{},"blob_with_authorization":{},"blob_expired":{},"blob_bytes":{}}}"#,
            n(&self.registry_blob_requests),
            n(&self.registry_other_requests),
            n(&self.blob_requests),
            n(&self.blob_with_authorization),
            n(&self.blob_expired),
            n(&self.blob_bytes),
        )
    }
}

/// A running front and blob host.
pub struct Cdn {
    options: Options,
    /// URLs signed under an older generation are refused (revoked).
    generation: AtomicU64,
    secret: String,
    client: reqwest::Client,
    pub counts: Counts,
    /// The blob host sends other bytes than the blob's (every byte inverted), as a CDN serving
    /// a damaged object would.
    pub lie: std::sync::atomic::AtomicBool,
}

impl Cdn {
    /// Serves the front on `front` and the blob host on `blobs` until the runtime ends.
    pub fn start(
        options: Options,
        front: tokio::net::TcpListener,
        blobs: tokio::net::TcpListener,
    ) -> Arc<Cdn> {
        let secret = format!("{:?}{}", SystemTime::now(), std::process::id());
        let cdn = Arc::new(Cdn {
            options,
            generation: AtomicU64::new(0),
            secret,
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("an HTTP client"),
            counts: Counts::default(),
            lie: Default::default(),
        });
        let front_app = axum::Router::new()
            .fallback(front_handle)
            .with_state(Arc::clone(&cdn));
        let blob_app = axum::Router::new()
            .fallback(blob_handle)
            .with_state(Arc::clone(&cdn));
        tokio::spawn(async move { axum::serve(front, front_app).await });
        tokio::spawn(async move { axum::serve(blobs, blob_app).await });
        cdn
    }

    /// Revokes every URL signed so far: the blob host refuses them as expired.
    pub fn revoke(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    fn signature(&self, path: &str, expires: u64, generation: u64) -> String {
        crate::sha256(format!("{}\0{path}\0{expires}\0{generation}", self.secret).as_bytes())[7..39]
            .to_string()
    }

    /// The signed URL of `repository`'s blob `digest`, good for the lifetime.
    fn signed(&self, repository: &str, digest: &str) -> String {
        let expires = now() + self.options.lifetime.as_secs().max(1);
        let path = format!("/{repository}/blobs/{digest}");
        let generation = self.generation.load(Ordering::SeqCst);
        let signature = self.signature(&path, expires, generation);
        format!(
            "{}{path}?Expires={expires}&Generation={generation}&Signature={signature}",
            self.options.blob_url
        )
    }

    /// Whether `path?query` is a URL this front signed that has not expired or been revoked.
    fn valid(&self, path: &str, query: &str) -> bool {
        let param = |name: &str| {
            query
                .split('&')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        };
        let (Some(expires), Some(generation), Some(signature)) = (
            param("Expires").and_then(|e| e.parse::<u64>().ok()),
            param("Generation").and_then(|g| g.parse::<u64>().ok()),
            param("Signature"),
        ) else {
            return false;
        };
        expires >= now()
            && generation == self.generation.load(Ordering::SeqCst)
            && signature == self.signature(path, expires, generation)
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn answer(status: StatusCode, text: &'static str) -> Response {
    Response::builder()
        .status(status)
        .body(Body::from(text))
        .expect("a response")
}

/// `/v2/<repository>/blobs/<digest>` (not an upload): the repository and the digest.
fn blob_path(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix("/v2/")?;
    let (repository, digest) = rest.rsplit_once("/blobs/")?;
    (!repository.is_empty() && digest.starts_with("sha256:") && !digest.contains('/'))
        .then_some((repository, digest))
}

/// The front: a blob GET or HEAD the registry would answer is redirected; anything else is
/// passed to the registry.
async fn front_handle(State(cdn): State<Arc<Cdn>>, request: Request) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    if let Some((repository, digest)) =
        blob_path(&path).filter(|_| method == Method::GET || method == Method::HEAD)
    {
        cdn.counts
            .registry_blob_requests
            .fetch_add(1, Ordering::SeqCst);
        // Asked of the registry with the client's credentials (a HEAD, without its Range):
        // anything but a 200 (a 401 with the challenge, a 404) and the request itself goes to
        // the registry, whose answer goes back as it is.
        let mut headers = request.headers().clone();
        headers.remove(header::RANGE);
        let asked = pass(&cdn, Method::HEAD, &path, "", &headers, Body::empty()).await;
        if asked.status() != StatusCode::OK {
            let headers = request.headers().clone();
            return pass(&cdn, method, &path, "", &headers, request.into_body()).await;
        }
        return Response::builder()
            .status(StatusCode::TEMPORARY_REDIRECT)
            .header(header::LOCATION, cdn.signed(repository, digest))
            .body(Body::empty())
            .expect("a response");
    }
    cdn.counts
        .registry_other_requests
        .fetch_add(1, Ordering::SeqCst);
    let query = request.uri().query().unwrap_or("").to_string();
    let headers = request.headers().clone();
    pass(&cdn, method, &path, &query, &headers, request.into_body()).await
}

/// Headers that belong to one hop of a connection, not to the request.
const HOP_BY_HOP: [header::HeaderName; 4] = [
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::TE,
];

/// `method path?query` with `headers` and `body` sent to the registry; its answer, streamed.
async fn pass(
    cdn: &Cdn,
    method: Method,
    path: &str,
    query: &str,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    let url = match query {
        "" => format!("{}{path}", cdn.options.origin),
        q => format!("{}{path}?{q}", cdn.options.origin),
    };
    let mut forwarded = headers.clone();
    for h in HOP_BY_HOP {
        forwarded.remove(h);
    }
    let sent = cdn
        .client
        .request(method, url)
        .headers(forwarded)
        .body(reqwest::Body::wrap_stream(body.into_data_stream()))
        .send()
        .await;
    let resp = match sent {
        Ok(resp) => resp,
        Err(_) => return answer(StatusCode::BAD_GATEWAY, "the registry did not answer"),
    };
    let mut out = Response::builder().status(resp.status().as_u16());
    for (name, value) in resp.headers() {
        if !HOP_BY_HOP.contains(name) {
            out = out.header(name, value);
        }
    }
    out.body(Body::from_stream(resp.bytes_stream()))
        .expect("a response")
}

/// The blob host: a blob's bytes (or a Range of them) from the registry's storage, for a URL
/// the front signed; `GET /_cdn/stats`: the counts.
async fn blob_handle(State(cdn): State<Arc<Cdn>>, request: Request) -> Response {
    let path = request.uri().path().to_string();
    if path == "/_cdn/stats" {
        return Response::builder()
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(cdn.counts.json()))
            .expect("a response");
    }
    cdn.counts.blob_requests.fetch_add(1, Ordering::SeqCst);
    if request.headers().contains_key(header::AUTHORIZATION) {
        cdn.counts
            .blob_with_authorization
            .fetch_add(1, Ordering::SeqCst);
        return answer(
            StatusCode::BAD_REQUEST,
            "InvalidArgument: only one auth mechanism allowed",
        );
    }
    if !cdn.valid(&path, request.uri().query().unwrap_or("")) {
        cdn.counts.blob_expired.fetch_add(1, Ordering::SeqCst);
        return answer(StatusCode::FORBIDDEN, "AccessDenied: Request has expired");
    }
    let Some(hex) = path
        .rsplit_once("/blobs/sha256:")
        .map(|(_, hex)| hex)
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
    else {
        return answer(StatusCode::NOT_FOUND, "NoSuchKey");
    };
    let file = cdn
        .options
        .storage
        .join("docker/registry/v2/blobs/sha256")
        .join(&hex[..2])
        .join(hex)
        .join("data");
    let Ok(mut data) = tokio::fs::File::open(&file).await else {
        return answer(StatusCode::NOT_FOUND, "NoSuchKey");
    };
    let len = match data.metadata().await {
        Ok(m) => m.len(),
        Err(_) => return answer(StatusCode::NOT_FOUND, "NoSuchKey"),
    };
    let range = request
        .headers()
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map(|v| parse_range(v, len));
    let (status, start, end) = match range {
        None => (StatusCode::OK, 0, len),
        Some(Some((a, b))) => (StatusCode::PARTIAL_CONTENT, a, b),
        Some(None) => {
            return Response::builder()
                .status(StatusCode::RANGE_NOT_SATISFIABLE)
                .header(header::CONTENT_RANGE, format!("bytes */{len}"))
                .body(Body::empty())
                .expect("a response")
        }
    };
    if data.seek(std::io::SeekFrom::Start(start)).await.is_err() {
        return answer(StatusCode::INTERNAL_SERVER_ERROR, "InternalError");
    }
    // As object stores answer a registry's blobs (stored as application/octet-stream):
    // clients such as stargz-snapshotter's read the type to tell a multipart answer.
    let mut out = Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, end - start)
        .header(header::ACCEPT_RANGES, "bytes");
    if status == StatusCode::PARTIAL_CONTENT {
        out = out.header(
            header::CONTENT_RANGE,
            format!("bytes {start}-{}/{len}", end - 1),
        );
    }
    if request.method() == Method::HEAD {
        return out.body(Body::empty()).expect("a response");
    }
    let counted = Arc::clone(&cdn);
    let stream = futures_util::stream::unfold(
        (data.take(end - start), counted),
        |(mut data, cdn)| async move {
            let mut buf = vec![0u8; 256 << 10];
            match data.read(&mut buf).await {
                Ok(0) => None,
                Ok(n) => {
                    buf.truncate(n);
                    if cdn.lie.load(Ordering::SeqCst) {
                        buf.iter_mut().for_each(|b| *b = !*b);
                    }
                    cdn.counts.blob_bytes.fetch_add(n as u64, Ordering::SeqCst);
                    Some((Ok::<_, std::io::Error>(buf), (data, cdn)))
                }
                Err(e) => Some((Err(e), (data, cdn))),
            }
        },
    );
    out.body(Body::from_stream(stream)).expect("a response")
}

/// A `bytes=a-b` (or `a-`) Range of a `len`-byte blob as `[start, end)`, or `None` if it asks
/// for nothing the blob has.
fn parse_range(value: &str, len: u64) -> Option<(u64, u64)> {
    let (a, b) = value.strip_prefix("bytes=")?.split_once('-')?;
    let start: u64 = a.trim().parse().ok()?;
    let end = match b.trim() {
        "" => len,
        b => b.parse::<u64>().ok()?.saturating_add(1).min(len),
    };
    (start < end).then_some((start, end))
}
