//! The registry client against an in-process HTTP server (axum on loopback): retries, bearer
//! authentication, upload resume and the body deadline, each with the server's side of the
//! conversation checked. Paused tokio time stands in for the clock where a test waits on a
//! deadline. The real registry (distribution) is exercised in `integration/cases/publish.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::registry::Ask;

use axum::body::{Body, Bytes as AxumBytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::Response;
use bytes::Bytes;
use parking_lot::Mutex;

use super::{health, RegistryClient, RegistryConfig, RetryPolicy};
use crate::error::ErrorKind;
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;

/// What the test server saw and holds.
#[derive(Default)]
struct Server {
    /// Requests by "METHOD path".
    seen: Mutex<Vec<String>>,
    /// 503 answers still to give to manifest GETs.
    unavailable: AtomicUsize,
    /// The bearer token the registry accepts, and the user:password the token endpoint wants.
    token: Option<(String, String)>,
    /// Upload sessions: bytes kept so far; the first PATCH keeps half and fails.
    uploads: Mutex<HashMap<String, Vec<u8>>>,
    patches: AtomicUsize,
    /// Completed blobs.
    blobs: Mutex<HashMap<String, Vec<u8>>>,
    /// A manifest body that never ends.
    stall: bool,
    /// Blob GETs are answered with a 307 to this blob host (a CDN), with its current signature.
    redirect_to: Mutex<Option<Arc<BlobHost>>>,
    /// 429 answers (`Retry-After: 1`) still to give to blob GETs.
    busy: AtomicUsize,
}

/// A blob host as public registries redirect to (a CDN, S3): it serves a blob's ranges at
/// `/cdn/<digest>?sig=<n>` while `n` is its current signature, refuses other signatures with
/// 403 (expired or revoked) and any request that carries an `Authorization` (S3's 400).
#[derive(Default)]
struct BlobHost {
    base: Mutex<String>,
    blobs: Mutex<HashMap<String, Vec<u8>>>,
    signature: AtomicUsize,
    /// Requests by path and query, and whether they carried an Authorization header.
    seen: Mutex<Vec<(String, bool)>>,
    /// Redirect every request to this URL instead of answering it (a loop, a chain).
    redirect: Mutex<Option<String>>,
}

async fn blob_host_handle(
    State(host): State<Arc<BlobHost>>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let authorized = headers.contains_key(header::AUTHORIZATION);
    host.seen.lock().push((uri.to_string(), authorized));
    if let Some(to) = host.redirect.lock().clone() {
        return respond(StatusCode::TEMPORARY_REDIRECT)
            .header(header::LOCATION, to)
            .body(Body::empty())
            .unwrap();
    }
    if authorized {
        return respond(StatusCode::BAD_REQUEST)
            .body(Body::from("only one auth mechanism allowed"))
            .unwrap();
    }
    let sig = format!("sig={}", host.signature.load(Ordering::SeqCst));
    if uri.query() != Some(sig.as_str()) {
        return respond(StatusCode::FORBIDDEN)
            .body(Body::from("Request has expired"))
            .unwrap();
    }
    let digest = uri.path().trim_start_matches("/cdn/");
    match host.blobs.lock().get(digest) {
        Some(blob) => serve_blob(blob, &headers, true),
        None => respond(StatusCode::NOT_FOUND).body(Body::empty()).unwrap(),
    }
}

impl BlobHost {
    /// Serves a blob host on a loopback port of its own.
    async fn start() -> Arc<Self> {
        let host = Arc::new(BlobHost::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        *host.base.lock() = format!("http://{}", listener.local_addr().unwrap());
        let app = axum::Router::new()
            .route("/{*rest}", axum::routing::get(blob_host_handle))
            .with_state(Arc::clone(&host));
        tokio::spawn(async move { axum::serve(listener, app).await });
        host
    }

    /// Where the registry redirects a GET of blob `digest` now.
    fn url(&self, digest: &str) -> String {
        format!(
            "{}/cdn/{digest}?sig={}",
            self.base.lock(),
            self.signature.load(Ordering::SeqCst)
        )
    }

    fn requests(&self) -> usize {
        self.seen.lock().len()
    }
}

const MANIFEST: &str = r#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","size":2},"layers":[]}"#;

fn respond(status: StatusCode) -> axum::http::response::Builder {
    Response::builder().status(status)
}

async fn handle(
    State(server): State<Arc<Server>>,
    method: Method,
    Path(rest): Path<String>,
    uri: Uri,
    headers: HeaderMap,
    body: AxumBytes,
) -> Response {
    server.seen.lock().push(format!("{method} /{rest}"));
    if rest == "token" {
        return token_answer(&server, &headers);
    }
    if let Some(refused) = unauthorized(&server, &headers) {
        return refused;
    }
    if rest.contains("/manifests/") {
        return manifest_answer(&server, &rest);
    }
    if let Some(digest) = rest
        .strip_prefix("vm/disk/blobs/")
        .filter(|_| method == Method::GET)
    {
        if server
            .busy
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return respond(StatusCode::TOO_MANY_REQUESTS)
                .header(header::RETRY_AFTER, "1")
                .body(Body::empty())
                .unwrap();
        }
        if let Some(cdn) = server.redirect_to.lock().clone() {
            return respond(StatusCode::TEMPORARY_REDIRECT)
                .header(header::LOCATION, cdn.url(digest))
                .body(Body::empty())
                .unwrap();
        }
        if let Some(blob) = server.blobs.lock().get(digest) {
            return serve_blob(blob, &headers, true);
        }
    }
    upload_answer(&server, &method, &rest, &uri, &headers, &body)
}

/// The token service: a token for the one user and password it knows.
fn token_answer(server: &Server, headers: &HeaderMap) -> Response {
    let (token, userpass) = server.token.clone().unwrap();
    use base64::Engine as _;
    let want = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(userpass)
    );
    let ok = headers
        .get(header::AUTHORIZATION)
        .is_some_and(|v| v == want.as_str());
    if ok {
        respond(StatusCode::OK)
            .body(Body::from(format!(r#"{{"token":"{token}"}}"#)))
            .unwrap()
    } else {
        respond(StatusCode::UNAUTHORIZED)
            .body(Body::empty())
            .unwrap()
    }
}

/// A 401 with the Bearer challenge, when the server wants a token the request does not carry.
fn unauthorized(server: &Server, headers: &HeaderMap) -> Option<Response> {
    if let Some((token, _)) = &server.token {
        let bearer = format!("Bearer {token}");
        if headers
            .get(header::AUTHORIZATION)
            .is_none_or(|v| v != bearer.as_str())
        {
            let host = headers.get(header::HOST).unwrap().to_str().unwrap();
            return Some(respond(StatusCode::UNAUTHORIZED)
                .header(
                    header::WWW_AUTHENTICATE,
                    format!(r#"Bearer realm="http://{host}/token",service="test",scope="repository:vm/disk:pull""#),
                )
                .body(Body::empty())
                .unwrap());
        }
    }
    None
}

/// A manifest, unless the server is set to be unavailable for a while, or to stall its body.
fn manifest_answer(server: &Server, rest: &str) -> Response {
    if server
        .unavailable
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        return respond(StatusCode::SERVICE_UNAVAILABLE)
            .body(Body::empty())
            .unwrap();
    }
    if rest.ends_with("/missing") {
        return respond(StatusCode::NOT_FOUND).body(Body::empty()).unwrap();
    }
    let body = if server.stall {
        Body::from_stream(futures_util::stream::pending::<
            Result<Vec<u8>, std::io::Error>,
        >())
    } else {
        Body::from(MANIFEST)
    };
    respond(StatusCode::OK)
        .header(
            header::CONTENT_TYPE,
            "application/vnd.oci.image.manifest.v1+json",
        )
        .body(body)
        .unwrap()
}

/// The upload session's answers (POST, PATCH, GET, PUT; the first PATCH breaks part-way), or
/// 404.
fn upload_answer(
    server: &Server,
    method: &Method,
    rest: &str,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Response {
    if rest.ends_with("/blobs/uploads/") && method == Method::POST {
        server.uploads.lock().insert("u1".into(), Vec::new());
        return respond(StatusCode::ACCEPTED)
            .header(header::LOCATION, "/v2/vm/disk/blobs/uploads/u1")
            .body(Body::empty())
            .unwrap();
    }
    if rest.ends_with("/blobs/uploads/u1") {
        let mut uploads = server.uploads.lock();
        let kept = uploads.get_mut("u1").unwrap();
        let location = |b: axum::http::response::Builder| {
            b.header(header::LOCATION, "/v2/vm/disk/blobs/uploads/u1")
        };
        let range = |n: usize| format!("0-{}", n.saturating_sub(1));
        match *method {
            Method::PATCH => {
                let from: usize = headers[header::CONTENT_RANGE]
                    .to_str()
                    .unwrap()
                    .split('-')
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert_eq!(from, kept.len(), "a PATCH starts where the registry is");
                if server.patches.fetch_add(1, Ordering::SeqCst) == 0 {
                    // The request broke part-way: half of it arrived.
                    kept.extend_from_slice(&body[..body.len() / 2]);
                    return respond(StatusCode::INTERNAL_SERVER_ERROR)
                        .body(Body::empty())
                        .unwrap();
                }
                kept.extend_from_slice(body);
                return location(respond(StatusCode::ACCEPTED))
                    .header(header::RANGE, range(kept.len()))
                    .body(Body::empty())
                    .unwrap();
            }
            Method::GET => {
                return location(respond(StatusCode::NO_CONTENT))
                    .header(header::RANGE, range(kept.len()))
                    .body(Body::empty())
                    .unwrap();
            }
            Method::PUT => {
                let digest = url::form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
                    .find(|(k, _)| k == "digest")
                    .map(|(_, v)| v.into_owned())
                    .unwrap_or_default();
                if Digest::of(kept).to_string() != digest {
                    return respond(StatusCode::BAD_REQUEST)
                        .body(Body::empty())
                        .unwrap();
                }
                server.blobs.lock().insert(digest, kept.clone());
                return respond(StatusCode::CREATED).body(Body::empty()).unwrap();
            }
            _ => {}
        }
    }
    respond(StatusCode::NOT_FOUND).body(Body::empty()).unwrap()
}

/// `blob`, or the part a `Range: bytes=a-b` header asks for when `ranges` is set.
fn serve_blob(blob: &[u8], headers: &HeaderMap, ranges: bool) -> Response {
    let asked = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes="))
        .and_then(|v| v.split_once('-'))
        .map(|(a, b)| (a.parse::<usize>().unwrap(), b.parse::<usize>().unwrap()));
    match asked {
        Some((a, b)) if ranges => respond(StatusCode::PARTIAL_CONTENT)
            .header(
                header::CONTENT_RANGE,
                format!("bytes {a}-{b}/{}", blob.len()),
            )
            .body(Body::from(blob[a..=b].to_vec()))
            .unwrap(),
        _ => respond(StatusCode::OK)
            .body(Body::from(blob.to_vec()))
            .unwrap(),
    }
}

/// How a test mirror answers blob requests.
#[derive(Clone, Copy)]
enum Mirror {
    /// The whole blob with 200, whatever the Range (a pull-through cache that does not hold
    /// the blob yet).
    WholeBlob,
    /// The blob's ranges, and every answer declares a Range cache (nginx's slice cache).
    RangeCache,
    /// The blob's ranges, declaring nothing (a pull-through cache, or a registry, that holds
    /// the blob).
    Holds,
    /// Bytes that are not the blob's, from a mirror that declares a Range cache.
    WrongBytes,
    /// A Range cache's ranges after this long (a slice cache behind a busy link).
    SlowRanges(Duration),
}

impl Mirror {
    fn declares_ranges(self) -> bool {
        matches!(
            self,
            Mirror::RangeCache | Mirror::WrongBytes | Mirror::SlowRanges(_)
        )
    }
}

/// Serves a mirror of one blob that behaves as `how`; counts its blob requests (`hits`) and
/// the looks at its API root (`GET /v2/`).
async fn serve_mirror(
    how: Mirror,
    blob: Vec<u8>,
    hits: Arc<AtomicUsize>,
    looks: Arc<AtomicUsize>,
) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let host = listener.local_addr().unwrap().to_string();
    let declare = move |mut resp: Response| {
        if how.declares_ranges() {
            resp.headers_mut().insert(
                health::RANGE_CACHE_HEADER,
                header::HeaderValue::from_static("slice"),
            );
        }
        resp
    };
    let app = axum::Router::new()
        .route(
            "/v2/",
            axum::routing::get(move || {
                looks.fetch_add(1, Ordering::SeqCst);
                async move { declare(respond(StatusCode::OK).body(Body::from("{}")).unwrap()) }
            }),
        )
        .route(
            "/v2/{*rest}",
            axum::routing::get(move |headers: HeaderMap| {
                hits.fetch_add(1, Ordering::SeqCst);
                let blob = match how {
                    Mirror::WrongBytes => blob.iter().map(|b| b ^ 0xff).collect(),
                    _ => blob.clone(),
                };
                let ranges = !matches!(how, Mirror::WholeBlob);
                async move {
                    if let Mirror::SlowRanges(after) = how {
                        tokio::time::sleep(after).await;
                    }
                    declare(serve_blob(&blob, &headers, ranges))
                }
            }),
        );
    tokio::spawn(async move { axum::serve(listener, app).await });
    host
}

/// A client whose `hosts.toml` for `registry` lists `mirror` before the registry itself
/// (`with_server`) or alone.
fn mirrored_client(
    dir: &std::path::Path,
    registry: &str,
    mirror: &str,
    with_server: bool,
) -> RegistryClient {
    let conf = dir.join(registry);
    std::fs::create_dir_all(&conf).unwrap();
    let server = if with_server {
        format!("server = \"http://{registry}\"\n")
    } else {
        format!("server = \"http://{registry}\"\ncapabilities = [\"push\"]\n")
    };
    std::fs::write(
        conf.join("hosts.toml"),
        format!("{server}\n[host.\"http://{mirror}\"]\ncapabilities = [\"pull\", \"resolve\"]\n"),
    )
    .unwrap();
    RegistryClient::new(RegistryConfig {
        hosts_dir: Some(dir.to_path_buf()),
        ..config(vec![])
    })
    .unwrap()
}

/// An origin holding one 64 KiB blob, a mirror in front of it that misbehaves as `how`, and
/// a client whose hosts.toml lists the mirror (before the origin if `with_server`).
struct Mirrored {
    origin: Arc<Server>,
    host: String,
    blob: Vec<u8>,
    digest: Digest,
    mirror: String,
    /// Blob requests the mirror received.
    hits: Arc<AtomicUsize>,
    /// Looks at its API root (`GET /v2/`) it received.
    looks: Arc<AtomicUsize>,
    client: RegistryClient,
    _hosts_dir: tempfile::TempDir,
}

impl Mirrored {
    async fn start(how: Mirror, with_server: bool) -> Self {
        let origin = Arc::new(Server::default());
        let blob: Vec<u8> = (0..65536u32).map(|i| (i * 7 % 253) as u8).collect();
        let digest = Digest::of(&blob);
        origin.blobs.lock().insert(digest.to_string(), blob.clone());
        let host = serve(Arc::clone(&origin)).await;
        let (hits, looks) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let mirror = serve_mirror(how, blob.clone(), Arc::clone(&hits), Arc::clone(&looks)).await;
        let dir = tempfile::tempdir().unwrap();
        let client = mirrored_client(dir.path(), &host, &mirror, with_server);
        Mirrored {
            origin,
            host,
            blob,
            digest,
            mirror,
            hits,
            looks,
            client,
            _hosts_dir: dir,
        }
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    fn looks(&self) -> usize {
        self.looks.load(Ordering::SeqCst)
    }

    /// Reads `ranges` of the blob as a reader does, one after the other; checks each.
    async fn read(&self, ranges: &[std::ops::Range<u64>]) {
        let r = reference(&self.host, "1");
        for range in ranges {
            let got = self
                .client
                .get_blob_range(&r, &self.digest, range.clone(), Ask::AnyEndpoint)
                .await
                .unwrap();
            assert_eq!(
                &got[..],
                &self.blob[range.start as usize..range.end as usize]
            );
        }
    }

    /// The blob's descriptor.
    fn descriptor(&self) -> crate::oci::Descriptor {
        crate::oci::Descriptor {
            media_type: "application/octet-stream".into(),
            digest: self.digest,
            size: self.blob.len() as u64,
            annotations: Default::default(),
            platform: None,
            artifact_type: None,
        }
    }

    /// Blob GETs the origin received.
    fn origin_gets(&self) -> usize {
        count(&self.origin, &format!("GET /vm/disk/blobs/{}", self.digest))
    }
}

/// Serves `server` on a loopback port; returns the host:port.
async fn serve(server: Arc<Server>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let host = listener.local_addr().unwrap().to_string();
    let app = axum::Router::new()
        .route("/v2/", axum::routing::get(|| async { "{}" }))
        .route("/v2/{*rest}", axum::routing::any(handle))
        .route("/{*rest}", axum::routing::any(handle))
        // Upload segments are 8 MiB, as a registry takes them.
        .layer(axum::extract::DefaultBodyLimit::max(
            super::UPLOAD_SEGMENT * 2,
        ))
        .with_state(server);
    tokio::spawn(async move { axum::serve(listener, app).await });
    host
}

/// The tests' client settings: credentials only from `auth_files`, quick retries.
fn config(auth_files: Vec<std::path::PathBuf>) -> RegistryConfig {
    RegistryConfig {
        auth_files: Some(auth_files),
        retry: RetryPolicy::quick(),
        ..Default::default()
    }
}

fn client(auth_files: Vec<std::path::PathBuf>) -> RegistryClient {
    RegistryClient::new(config(auth_files)).unwrap()
}

fn reference(host: &str, tag: &str) -> Reference {
    format!("{host}/vm/disk:{tag}").parse().unwrap()
}

fn count(server: &Server, what: &str) -> usize {
    server
        .seen
        .lock()
        .iter()
        .filter(|s| s.starts_with(what))
        .count()
}

#[tokio::test]
async fn server_errors_are_retried_and_not_found_is_not() {
    let server = Arc::new(Server {
        unavailable: AtomicUsize::new(2),
        ..Default::default()
    });
    let host = serve(Arc::clone(&server)).await;
    let c = client(vec![]);
    let m = c.get_manifest(&reference(&host, "1")).await.unwrap();
    assert_eq!(m.bytes, MANIFEST.as_bytes());
    assert_eq!(
        count(&server, "GET /vm/disk/manifests/1"),
        3,
        "two 503s, then 200"
    );
    let e = c
        .get_manifest(&reference(&host, "missing"))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{}", e.chain());
    assert_eq!(
        count(&server, "GET /vm/disk/manifests/missing"),
        1,
        "404 is final"
    );
    // A registry that stays down fails after the policy's attempts, as a network error.
    server.unavailable.store(100, Ordering::SeqCst);
    let e = c.get_manifest(&reference(&host, "2")).await.unwrap_err();
    assert_eq!(count(&server, "GET /vm/disk/manifests/2"), 4);
    assert!(
        matches!(e.kind(), ErrorKind::Network | ErrorKind::Io),
        "{}",
        e.chain()
    );
}

#[tokio::test]
async fn bearer_tokens_come_from_the_realm_with_the_configured_credentials() {
    let server = Arc::new(Server {
        token: Some(("t0k3n".into(), "alice:s3cret".into())),
        ..Default::default()
    });
    let host = serve(Arc::clone(&server)).await;
    let dir = tempfile::tempdir().unwrap();
    let write_auth = |name: &str, userpass: &str| {
        use base64::Engine as _;
        let path = dir.path().join(name);
        let auth = base64::engine::general_purpose::STANDARD.encode(userpass);
        std::fs::write(
            &path,
            format!(r#"{{"auths":{{"{host}":{{"auth":"{auth}"}}}}}}"#),
        )
        .unwrap();
        path
    };
    let good = client(vec![write_auth("good.json", "alice:s3cret")]);
    good.get_manifest(&reference(&host, "1")).await.unwrap();
    assert_eq!(count(&server, "GET /token"), 1);
    // The token is cached: a second call needs no new one.
    good.get_manifest(&reference(&host, "1")).await.unwrap();
    assert_eq!(count(&server, "GET /token"), 1);
    let bad = client(vec![write_auth("bad.json", "alice:wrong")]);
    let e = bad.get_manifest(&reference(&host, "1")).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{}", e.chain());
    let none = client(vec![dir.path().join("absent.json")]);
    let e = none.get_manifest(&reference(&host, "1")).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{}", e.chain());
}

#[tokio::test]
async fn a_broken_upload_request_resumes_where_the_registry_is() {
    let server = Arc::new(Server::default());
    let host = serve(Arc::clone(&server)).await;
    let c = client(vec![]);
    let r = reference(&host, "1");
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let mut upload = c.start_upload(&r).await.unwrap();
    upload.write(Bytes::from(data.clone())).await.unwrap();
    assert_eq!(upload.offset(), data.len() as u64);
    let digest = Digest::of(&data);
    upload.finish(&digest).await.unwrap();
    assert_eq!(server.blobs.lock()[&digest.to_string()], data);
    // One PATCH broke after half, the status was asked, the rest was sent once.
    assert_eq!(server.patches.load(Ordering::SeqCst), 2);
    assert_eq!(count(&server, "GET /vm/disk/blobs/uploads/u1"), 1);
}

/// A blob from a file (a seekable index's windows) goes up a segment at a time, and a segment
/// whose request broke resumes where the registry is.
#[tokio::test]
async fn a_blob_file_uploads_a_segment_at_a_time() {
    let server = Arc::new(Server::default());
    let host = serve(Arc::clone(&server)).await;
    let c = client(vec![]);
    let r = reference(&host, "1");
    let data: Vec<u8> = (0..(super::UPLOAD_SEGMENT * 2 + 12_345) as u32)
        .map(|i| (i % 253) as u8)
        .collect();
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &data).unwrap();
    let digest = Digest::of(&data);
    c.push_blob_file(&r, &digest, file.path()).await.unwrap();
    assert!(server.blobs.lock()[&digest.to_string()] == data);
    // Three segments; the first one's request broke after half and its rest was sent again.
    assert_eq!(server.patches.load(Ordering::SeqCst), 4);
    assert_eq!(count(&server, "GET /vm/disk/blobs/uploads/u1"), 1);
}

/// Paused time: a body that never ends holds its fetch only until the retry policy's overall
/// deadline, which names what did not come.
#[tokio::test(start_paused = true)]
async fn a_body_that_never_ends_fails_at_its_deadline() {
    let server = Arc::new(Server {
        stall: true,
        ..Default::default()
    });
    let host = serve(server).await;
    let c = client(vec![]);
    let started = tokio::time::Instant::now();
    let e = c.get_manifest(&reference(&host, "1")).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{}", e.chain());
    assert!(e.chain().contains("manifest 1"), "{}", e.chain());
    let waited = started.elapsed();
    let deadline = c.retry_policy().deadline;
    assert!(
        waited >= deadline && waited <= deadline + Duration::from_secs(1),
        "failed after {waited:?} of (virtual) time"
    );
}

/// A reader's ranges pass by a mirror that does not declare itself a Range cache: asking a
/// pull-through cache for a blob it lacks would start its fill of the whole blob from the
/// origin during the boot. One look at its API root (which starts nothing) tells, once.
#[tokio::test]
async fn a_readers_ranges_pass_by_a_mirror_that_does_not_declare_itself_a_range_cache() {
    let m = Mirrored::start(Mirror::WholeBlob, true).await;
    let r = reference(&m.host, "1");
    m.read(&[100..4196, 0..10, 10..20]).await;
    assert_eq!(
        (m.looks(), m.hits(), m.origin_gets()),
        (1, 0, 3),
        "one look, no blob request at the mirror"
    );
    // A whole blob (a config) is fetched through it as from any mirror.
    assert_eq!(
        m.client
            .get_blob(&r, &m.descriptor(), 1 << 20)
            .await
            .unwrap(),
        m.blob
    );
    assert_eq!((m.hits(), m.origin_gets()), (1, 3));
}

/// Hydration (a background read of the whole blob) asks a mirror that does not declare itself
/// a Range cache: a pull-through cache's one fill serves the fleet. Answered whole, the read
/// does not go on to the registry: it, and later ones, wait for the fill; the blob rests there.
#[tokio::test]
async fn hydration_asks_a_pull_through_mirror_and_waits_for_its_fill() {
    let m = Mirrored::start(Mirror::WholeBlob, true).await;
    let r = reference(&m.host, "1");
    assert_eq!(m.client.filling(&r, &m.digest), None);
    let waits = m
        .client
        .get_blob_range(&r, &m.digest, 8..15, Ask::Background)
        .await
        .unwrap_err();
    assert_eq!(waits.kind(), ErrorKind::FailedPrecondition, "{waits}");
    assert_eq!(
        (m.looks(), m.hits(), m.origin_gets()),
        (0, 1, 0),
        "asked; the registry is not asked while the mirror fills"
    );
    let until = m.client.filling(&r, &m.digest).expect("waits for the fill");
    let wait = until - tokio::time::Instant::now();
    assert!(
        wait > Duration::from_secs(4) && wait <= health::BLOB_REST,
        "{wait:?}"
    );
    // Counted as a failure (not what was asked), though the mirror does not rest.
    let counters = m.client.shared.health.counters();
    let (_, mc) = counters
        .iter()
        .find(|(b, _)| *b == format!("http://{}", m.mirror))
        .unwrap();
    assert_eq!((mc.requests, mc.failures), (1, 1));
    // The registry itself is never waited for.
    let alone = client(vec![]);
    assert_eq!(alone.filling(&r, &m.digest), None);
}

/// A mirror that declares nothing but holds the blob (a pull-through cache after its fill, a
/// registry) gets a reader's ranges of it once a background read got a range of it there.
#[tokio::test]
async fn a_mirror_that_served_ranges_of_a_blob_gets_a_readers_ranges_of_it() {
    let m = Mirrored::start(Mirror::Holds, true).await;
    let r = reference(&m.host, "1");
    let read =
        |range: std::ops::Range<u64>, ask| m.client.get_blob_range(&r, &m.digest, range, ask);
    assert_eq!(
        &read(0..10, Ask::AnyEndpoint).await.unwrap()[..],
        &m.blob[..10]
    );
    assert_eq!((m.hits(), m.origin_gets()), (0, 1));
    assert_eq!(
        &read(10..20, Ask::Background).await.unwrap()[..],
        &m.blob[10..20]
    );
    assert_eq!((m.hits(), m.origin_gets()), (1, 1));
    assert_eq!(
        &read(20..30, Ask::AnyEndpoint).await.unwrap()[..],
        &m.blob[20..30]
    );
    assert_eq!(
        (m.hits(), m.origin_gets()),
        (2, 1),
        "served: readers go there"
    );
}

/// A mirror that declares itself a Range cache gets a reader's ranges from the first.
#[tokio::test]
async fn a_range_cache_gets_a_readers_ranges_from_the_first() {
    let m = Mirrored::start(Mirror::RangeCache, true).await;
    m.read(&[10..20, 30..40]).await;
    assert_eq!((m.looks(), m.hits(), m.origin_gets()), (1, 2, 0));
}

/// A reader waits for a mirror's first answer for a blob [`transport::MIRROR_HEDGE`] at
/// most: a cold cache behind a busy link may take seconds. The read goes to the registry, the
/// mirror's answer is learnt in the background, and while it is awaited the reader's next
/// ranges pass the mirror by; once it came (a range), they go there.
#[tokio::test]
async fn a_reader_does_not_wait_for_a_slow_first_answer_of_a_mirror() {
    let slow = Duration::from_secs(3);
    let m = Mirrored::start(Mirror::SlowRanges(slow), true).await;
    let r = reference(&m.host, "1");
    let started = std::time::Instant::now();
    let got = m
        .client
        .get_blob_range(&r, &m.digest, 0..10, Ask::AnyEndpoint)
        .await
        .unwrap();
    assert_eq!(&got[..], &m.blob[..10]);
    let waited = started.elapsed();
    assert!(
        waited >= super::transport::MIRROR_HEDGE && waited < slow,
        "{waited:?}"
    );
    let next = m
        .client
        .get_blob_range(&r, &m.digest, 10..20, Ask::AnyEndpoint)
        .await
        .unwrap();
    assert_eq!(&next[..], &m.blob[10..20]);
    assert_eq!(
        (m.hits(), m.origin_gets()),
        (1, 2),
        "one ask of the mirror in flight"
    );
    tokio::time::sleep(slow).await;
    let started = std::time::Instant::now();
    let third = m
        .client
        .get_blob_range(&r, &m.digest, 20..30, Ask::AnyEndpoint)
        .await
        .unwrap();
    assert_eq!(&third[..], &m.blob[20..30]);
    assert_eq!(
        (m.hits(), m.origin_gets()),
        (2, 2),
        "its range, learnt in the background, shows it serves the blob"
    );
    assert!(started.elapsed() >= slow, "asked, however slow it is now");
}

#[tokio::test]
async fn a_mirror_alone_that_cannot_serve_ranges_is_named_in_the_error() {
    let m = Mirrored::start(Mirror::WholeBlob, false).await;
    let e = m
        .client
        .get_blob_range(&reference(&m.host, "1"), &m.digest, 0..10, Ask::AnyEndpoint)
        .await
        .unwrap_err();
    let text = e.chain();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{text}");
    assert!(
        text.contains(&format!(
            "mirror http://{} of registry {}",
            m.mirror, m.host
        )) && text.contains("instead of 206"),
        "{text}"
    );
}

#[tokio::test]
async fn wrong_bytes_from_a_mirror_are_never_returned_for_a_verified_blob() {
    let m = Mirrored::start(Mirror::WrongBytes, true).await;
    let r = reference(&m.host, "1");
    let desc = m.descriptor();
    assert_eq!(m.client.get_blob(&r, &desc, 1 << 20).await.unwrap(), m.blob);
    assert_eq!(m.hits(), 1);
    assert_eq!(m.origin_gets(), 1);
    // Ranges cannot be checked here (their chunks are, by the engine, which asks the
    // registry itself for what failed): that request passes by the mirror.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let got = m
        .client
        .get_blob_range(&r, &m.digest, 5..9, Ask::Registry)
        .await
        .unwrap();
    assert_eq!(&got[..], &m.blob[5..9]);
    assert_eq!(m.hits(), 1);
}

#[tokio::test]
async fn a_mirror_that_is_down_costs_one_refused_connection() {
    let origin = Arc::new(Server::default());
    let blob = vec![7u8; 4096];
    let digest = Digest::of(&blob);
    origin.blobs.lock().insert(digest.to_string(), blob);
    let host = serve(Arc::clone(&origin)).await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let dir = tempfile::tempdir().unwrap();
    let c = mirrored_client(dir.path(), &host, &closed, true);
    let r = reference(&host, "1");
    for _ in 0..5 {
        c.get_blob_range(&r, &digest, 0..10, Ask::AnyEndpoint)
            .await
            .unwrap();
    }
    assert_eq!(count(&origin, &format!("GET /vm/disk/blobs/{digest}")), 5);
    let counters = c.shared.health.counters();
    let (_, m) = counters
        .iter()
        .find(|(b, _)| *b == format!("http://{closed}"))
        .unwrap();
    assert_eq!((m.requests, m.failures), (1, 1), "tried once, not retried");
}

/// A registry that redirects blob GETs to a blob host with signed, expiring URLs, as every
/// public registry does, behind a token: the first range of a blob asks the registry, the
/// others go to the blob host directly without the registry's authorization (which the blob
/// host would refuse), a burst of cold reads costs the registry one request, a URL the blob
/// host refuses (expired) is resolved again once and the read goes on, and every byte is
/// right.
#[tokio::test]
async fn a_blobs_redirect_is_resolved_once_and_kept_until_the_blob_host_refuses_it() {
    let cdn = BlobHost::start().await;
    let server = Arc::new(Server {
        token: Some(("t0k3n".into(), "alice:s3cret".into())),
        redirect_to: Mutex::new(Some(Arc::clone(&cdn))),
        ..Default::default()
    });
    let host = serve(Arc::clone(&server)).await;
    let blob: Vec<u8> = (0..1u32 << 20).map(|i| (i * 7 % 251) as u8).collect();
    let digest = Digest::of(&blob);
    cdn.blobs.lock().insert(digest.to_string(), blob.clone());
    let dir = tempfile::tempdir().unwrap();
    let auth = {
        use base64::Engine as _;
        let path = dir.path().join("auth.json");
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret");
        std::fs::write(
            &path,
            format!(r#"{{"auths":{{"{host}":{{"auth":"{auth}"}}}}}}"#),
        )
        .unwrap();
        path
    };
    let c = client(vec![auth]);
    let r = reference(&host, "1");
    let read = |at: u64| {
        let (c, r) = (c.clone(), r.clone());
        async move {
            c.get_blob_range(&r, &digest, at..at + 4096, Ask::AnyEndpoint)
                .await
                .map(|b| b.to_vec())
        }
    };
    let registry_gets = || count(&server, &format!("GET /vm/disk/blobs/{digest}"));
    // A burst of 16 cold reads at once.
    let burst: Vec<_> = (0..16u64).map(|i| tokio::spawn(read(i * 65536))).collect();
    for (i, got) in futures_util::future::join_all(burst)
        .await
        .into_iter()
        .enumerate()
    {
        let at = i * 65536;
        assert_eq!(got.unwrap().unwrap(), &blob[at..at + 4096]);
    }
    // The redirect's first ask carried the token (after the challenge); one ask resolved it.
    assert_eq!(registry_gets(), 2, "{:?}", server.seen.lock());
    for at in (0..200u64).map(|i| i * 4096) {
        assert_eq!(
            read(at).await.unwrap(),
            &blob[at as usize..at as usize + 4096]
        );
    }
    assert_eq!(registry_gets(), 2, "a kept URL asks the registry nothing");
    assert_eq!(cdn.requests(), 216);
    assert!(
        cdn.seen.lock().iter().all(|(_, authorized)| !authorized),
        "the registry's authorization reached the blob host"
    );
    // The URL expires: the next read is answered all the same, by a URL asked for once.
    cdn.signature.store(1, Ordering::SeqCst);
    for at in [0u64, 8192, 16384] {
        assert_eq!(
            read(at).await.unwrap(),
            &blob[at as usize..at as usize + 4096]
        );
    }
    assert_eq!(registry_gets(), 3, "{:?}", server.seen.lock());
    // A whole blob goes the same way.
    let desc = crate::oci::Descriptor::of("application/octet-stream", &blob);
    assert_eq!(c.get_blob(&r, &desc, 2 << 20).await.unwrap(), blob);
    assert_eq!(registry_gets(), 3);
}

/// Redirects that cannot be followed safely fail with an error that names them, after few
/// requests: a loop back to a URL already asked, a chain longer than a few hops.
#[tokio::test]
async fn a_redirect_loop_or_a_long_chain_is_refused() {
    let cdn = BlobHost::start().await;
    let server = Arc::new(Server {
        redirect_to: Mutex::new(Some(Arc::clone(&cdn))),
        ..Default::default()
    });
    let host = serve(Arc::clone(&server)).await;
    let digest = Digest::of(b"x");
    let c = client(vec![]);
    let r = reference(&host, "1");
    *cdn.redirect.lock() = Some(format!("http://{host}/v2/vm/disk/blobs/{digest}"));
    let e = c
        .get_blob_range(&r, &digest, 0..1, Ask::AnyEndpoint)
        .await
        .unwrap_err();
    assert!(e.chain().contains("redirect loop"), "{}", e.chain());
    assert_eq!(e.kind(), ErrorKind::BadAnswer);
    // Each hop goes to a new URL of the blob host: a chain.
    let n = Arc::new(AtomicUsize::new(0));
    let chain = {
        let n = Arc::clone(&n);
        axum::Router::new().route(
            "/{*rest}",
            axum::routing::get(move || {
                let n = n.fetch_add(1, Ordering::SeqCst);
                async move {
                    respond(StatusCode::FOUND)
                        .header(header::LOCATION, format!("/hop/{}", n + 1))
                        .body(Body::empty())
                        .unwrap()
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let chain_host = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, chain).await });
    *cdn.redirect.lock() = Some(format!("http://{chain_host}/hop/0"));
    let e = c
        .get_blob_range(&r, &digest, 0..1, Ask::AnyEndpoint)
        .await
        .unwrap_err();
    assert!(e.chain().contains("more than 5 redirects"), "{}", e.chain());
    assert!(
        n.load(Ordering::SeqCst) <= 5,
        "{} hops asked",
        n.load(Ordering::SeqCst)
    );
}

/// A registry that answers 429 with `Retry-After` is asked again no sooner.
#[tokio::test]
async fn a_busy_registrys_retry_after_is_honoured() {
    let server = Arc::new(Server {
        busy: AtomicUsize::new(1),
        ..Default::default()
    });
    let host = serve(Arc::clone(&server)).await;
    let blob = vec![7u8; 8192];
    let digest = Digest::of(&blob);
    server.blobs.lock().insert(digest.to_string(), blob.clone());
    let c = client(vec![]);
    let r = reference(&host, "1");
    let started = std::time::Instant::now();
    let got = RetryPolicy::quick()
        .run("a range", || {
            c.get_blob_range(&r, &digest, 0..4096, Ask::AnyEndpoint)
        })
        .await
        .unwrap();
    assert_eq!(&got[..], &blob[..4096]);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "asked again after {:?}, before its Retry-After",
        started.elapsed()
    );
    assert_eq!(count(&server, &format!("GET /vm/disk/blobs/{digest}")), 2);
}
