//! The read API: manifests (by tag or digest, verified by digest), referrers, whole small
//! blobs (verified), byte ranges of a blob (their length checked; the caller verifies their
//! content), and a blocking reader over a whole blob that fails unless it matches.

use bytes::Bytes;
use reqwest::header::{ACCEPT, CONTENT_RANGE, CONTENT_TYPE, RANGE};
use reqwest::{Method, StatusCode};

use super::client::{Ask, FetchedManifest, RegistryClient};
use super::hosts::Endpoint;
use super::transport::Req;
use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::{Digest, Hasher};
use crate::oci::reference::Reference;
use crate::oci::ManifestKind;
use crate::oci::{self, Descriptor};
use std::io::Read;

/// The manifest and index media types asked for (`Accept`).
pub(super) const MANIFEST_TYPES: [&str; 4] = [
    oci::OCI_MANIFEST,
    oci::OCI_INDEX,
    oci::DOCKER_MANIFEST,
    oci::DOCKER_MANIFEST_LIST,
];

impl RegistryClient {
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
                Ask::AnyEndpoint,
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
                Ask::Registry,
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
                Ask::AnyEndpoint,
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
            Ask::AnyEndpoint,
            |ep| Req::get(ep, r, &format!("blobs/{}", desc.digest)).of_blob(desc.digest, false),
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

    /// Fetches `range` of a blob with an HTTP Range request, one try of each endpoint `ask`
    /// chooses ([`Self::sweep`]): the caller's retry policy decides whether and when to try
    /// again. The length is checked here; the content must be verified by the caller (chunk
    /// digests).
    pub async fn get_blob_range(
        &self,
        r: &Reference,
        digest: &Digest,
        range: std::ops::Range<u64>,
        ask: Ask,
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
            ask,
            Some(digest),
            &|ep| {
                Req::get(ep, r, &format!("blobs/{digest}"))
                    .header(RANGE, &header)
                    .of_blob(*digest, ask == Ask::Registry)
            },
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
                Ask::AnyEndpoint,
                |ep| Req::get(ep, r, &format!("blobs/{}", desc.digest)).of_blob(desc.digest, false),
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
