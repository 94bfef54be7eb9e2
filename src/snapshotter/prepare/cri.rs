//! The CRI image-service proxy: kubelet's `--image-service-endpoint` points here.
//!
//! containerd uses the credentials kubelet sends with `PullImage` for its own requests and
//! tells a proxy snapshotter nothing of them, so without this a node needs a docker config
//! file for every private registry. This service forwards every image-service call to
//! containerd's CRI unchanged. A `PullImage` with credentials is watched: while containerd
//! pulls, they are pending (the classification of that pull's layers may use them); once the
//! pull succeeded they become a grant of the pod's namespace for the image's manifest digests
//! ([`crate::snapshotter::prepare::tenants`]), handed to the mount servers of that image. A failed pull grants
//! nothing. Nothing of them is logged or written to disk.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_cri::v1 as cri;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::image_service_server::{ImageService, ImageServiceServer};
use serde::Deserialize;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::registry::auth::Credential;
use crate::snapshotter::Snapshotter;

/// The CRI image-service proxy: kubelet's `--image-service-endpoint` points at it, so the
/// credentials of each PullImage reach the lazy fetches of that image.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CriConfig {
    /// Socket to serve the CRI image service on (mode 0660); empty: off.
    pub image_service_address: PathBuf,
    /// containerd's CRI socket, where every call is forwarded unchanged.
    pub containerd_address: PathBuf,
    /// Seconds the credentials of a PullImage that succeeded are kept (in memory only) for
    /// the lazy fetches of that image and its namespace's disks; each such pull renews them.
    pub credentials_ttl: u64,
    /// When a namespace is served what the node already holds of an image
    /// (`never`, `if-private`, `always`; [`super::tenants::Verification`]).
    pub verify_pulled_images: super::tenants::Verification,
}

impl Default for CriConfig {
    fn default() -> Self {
        CriConfig {
            image_service_address: PathBuf::new(),
            containerd_address: PathBuf::from("/run/containerd/containerd.sock"),
            credentials_ttl: 12 * 3600,
            verify_pulled_images: super::tenants::Verification::IfPrivate,
        }
    }
}

/// Deadline of a forwarded `PullImage` (an ordinary multi-GiB image can take this long).
const PULL_DEADLINE: Duration = Duration::from_secs(3600);
/// Deadline of every other forwarded call.
const CALL_DEADLINE: Duration = Duration::from_secs(120);

struct Proxy {
    containerd: ImageServiceClient<Channel>,
    snapshotter: Arc<Snapshotter>,
}

/// The credential an `AuthConfig` carries: username and password, or `auth` (base64 of
/// `user:password`). Registry and identity tokens are not used (containerd still gets them).
fn credential(auth: &cri::AuthConfig) -> Option<Credential> {
    if !auth.username.is_empty() {
        return Some(Credential {
            username: auth.username.clone(),
            secret: auth.password.clone(),
        });
    }
    Credential::from_auth(&auth.auth).ok()
}

/// `request` to forward, under `deadline`; its metadata (kubelet's, e.g. a trace id) goes
/// with it.
fn forward<T>(mut request: Request<T>, deadline: Duration) -> Request<T> {
    request.set_timeout(deadline);
    request
}

impl Proxy {
    fn client(&self) -> ImageServiceClient<Channel> {
        self.containerd.clone()
    }

    /// The manifest digests containerd's pull of `image` resolved to (its repo digests in
    /// `image`'s repository).
    async fn repo_digests(&self, image: &str, reference: &Reference) -> BTreeSet<Digest> {
        let mut request = Request::new(cri::ImageStatusRequest {
            image: Some(cri::ImageSpec {
                image: image.to_string(),
                ..Default::default()
            }),
            verbose: false,
        });
        request.set_timeout(CALL_DEADLINE);
        let answer = match self.client().image_status(request).await {
            Ok(a) => a.into_inner(),
            Err(e) => {
                tracing::warn!(image, error = %e, "asking containerd what the pull resolved to failed");
                return BTreeSet::new();
            }
        };
        answer
            .image
            .into_iter()
            .flat_map(|i| i.repo_digests)
            .filter_map(|d| d.parse::<Reference>().ok())
            .filter(|d| d.registry == reference.registry && d.repository == reference.repository)
            .filter_map(|d| d.digest)
            .collect()
    }

    /// Grants `namespace` the credentials of its pull of `image` that succeeded, for the
    /// manifests it resolved (and those its layers were classified under), and hands them to
    /// the running servers of that image.
    async fn granted(
        &self,
        image: &str,
        namespace: &str,
        credential: Credential,
        classified: BTreeSet<Digest>,
    ) {
        let Ok(reference) = image.parse::<Reference>() else {
            return;
        };
        let mut digests = self.repo_digests(image, &reference).await;
        digests.extend(classified);
        if digests.is_empty() {
            tracing::warn!(image, namespace, "the pull succeeded but its manifest digest is unknown; its credentials are not kept");
            return;
        }
        let grant = self
            .snapshotter
            .pulls
            .tenants
            .grant(namespace, &reference, credential, digests);
        tracing::info!(
            image,
            namespace,
            digests = grant.digests.len(),
            "a pull with credentials succeeded; its namespace may read the image"
        );
        if let Err(e) = self
            .snapshotter
            .hand_grant(&grant.grant(), &grant.digests)
            .await
        {
            tracing::warn!(image, error = %e.chain(), "handing credentials to the mount servers failed");
        }
    }
}

#[tonic::async_trait]
impl ImageService for Proxy {
    async fn list_images(
        &self,
        request: Request<cri::ListImagesRequest>,
    ) -> Result<Response<cri::ListImagesResponse>, Status> {
        self.client()
            .list_images(forward(request, CALL_DEADLINE))
            .await
    }

    async fn image_status(
        &self,
        request: Request<cri::ImageStatusRequest>,
    ) -> Result<Response<cri::ImageStatusResponse>, Status> {
        self.client()
            .image_status(forward(request, CALL_DEADLINE))
            .await
    }

    async fn pull_image(
        &self,
        request: Request<cri::PullImageRequest>,
    ) -> Result<Response<cri::PullImageResponse>, Status> {
        let pull = request.get_ref();
        let image = pull
            .image
            .as_ref()
            .map(|i| i.image.clone())
            .unwrap_or_default();
        let namespace = pull
            .sandbox_config
            .as_ref()
            .and_then(|c| c.metadata.as_ref())
            .map(|m| m.namespace.clone())
            .unwrap_or_default();
        let credential = pull.auth.as_ref().and_then(credential);
        // Pending while containerd pulls: that pull's own layers may be classified with them.
        let pending = credential
            .clone()
            .and_then(|c| self.snapshotter.pulls.tenants.begin_pull(&image, c));
        let answer = self
            .client()
            .pull_image(forward(request, PULL_DEADLINE))
            .await;
        if let (Ok(_), Some(c), Some(p)) = (&answer, credential, &pending) {
            self.granted(&image, &namespace, c, p.digests()).await;
        }
        drop(pending);
        answer
    }

    async fn remove_image(
        &self,
        request: Request<cri::RemoveImageRequest>,
    ) -> Result<Response<cri::RemoveImageResponse>, Status> {
        self.client()
            .remove_image(forward(request, CALL_DEADLINE))
            .await
    }

    async fn image_fs_info(
        &self,
        request: Request<cri::ImageFsInfoRequest>,
    ) -> Result<Response<cri::ImageFsInfoResponse>, Status> {
        self.client()
            .image_fs_info(forward(request, CALL_DEADLINE))
            .await
    }
}

/// Serves the CRI image service at `config.image_service_address` until the task is dropped.
pub async fn serve(config: CriConfig, snapshotter: Arc<Snapshotter>) -> Result<()> {
    // Connected lazily: containerd may start after the daemon.
    let containerd = crate::api::unix::lazy_channel(&config.containerd_address);
    let listener = crate::api::unix::bind(&config.image_service_address, 0o660)?;
    let proxy = Proxy {
        containerd: ImageServiceClient::new(containerd),
        snapshotter,
    };
    tracing::info!(address = %config.image_service_address.display(), containerd = %config.containerd_address.display(), "serving the CRI image service");
    tonic::transport::Server::builder()
        .add_service(ImageServiceServer::new(proxy))
        .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
        .await
        .map_err(|e| Error::new(ErrorKind::Io, "serving the CRI image service").with_source(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_come_from_username_and_password_or_auth() {
        let c = credential(&cri::AuthConfig {
            username: "alice".into(),
            password: "pw".into(),
            ..Default::default()
        })
        .unwrap();
        assert_eq!((c.username.as_str(), c.secret.as_str()), ("alice", "pw"));
        use base64::Engine as _;
        let c = credential(&cri::AuthConfig {
            auth: base64::engine::general_purpose::STANDARD.encode("bob:p:w"),
            ..Default::default()
        })
        .unwrap();
        assert_eq!((c.username.as_str(), c.secret.as_str()), ("bob", "p:w"));
        assert!(credential(&cri::AuthConfig {
            registry_token: "t".into(),
            ..Default::default()
        })
        .is_none());
        assert!(credential(&cri::AuthConfig {
            auth: "not base64!".into(),
            ..Default::default()
        })
        .is_none());
    }
}
