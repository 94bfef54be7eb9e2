//! The push API: blobs (existence, cross-repository mounts, uploads in segments that resume
//! where the registry is after a broken request), manifests and OCI 1.1 referrers.

use bytes::Bytes;
use reqwest::header::{CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, LOCATION, RANGE};
use reqwest::{Method, StatusCode};

use super::credentials::scope;

use super::client::RegistryClient;
use super::credentials::Access;
use super::hosts::Endpoint;
use super::transport::Req;
use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::{self, Descriptor};

/// Upload segment sent in one PATCH. Three are alive at most while pushing (one on the wire,
/// one queued, one filling), so this bounds the push's buffer memory at 24 MiB; smaller
/// segments cost more round trips.
pub const UPLOAD_SEGMENT: usize = 8 << 20;

impl RegistryClient {
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

    pub(super) fn push_endpoint(&self, r: &Reference) -> Result<Endpoint> {
        Ok(self.endpoints(r, Access::Push)?.remove(0))
    }

    pub(super) fn resolve_location(
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
