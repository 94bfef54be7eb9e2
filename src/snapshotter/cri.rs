//! The CRI image-service proxy: kubelet's `--image-service-endpoint` points here.
//!
//! containerd uses the credentials kubelet sends with `PullImage` for its own requests and
//! tells a proxy snapshotter nothing of them, so without this a node needs a docker config
//! file for every private registry. This service forwards every image-service call to
//! containerd's CRI unchanged and, before forwarding a `PullImage` that carries credentials,
//! keeps them (in memory, per registry and repository, for `cri.credentials_ttl`) for the
//! classification and the lazy fetches of that image, and hands them to the mount servers of
//! that repository already running. Nothing of them is logged or written to disk.

use std::sync::Arc;
use std::time::Duration;

use k8s_cri::v1 as cri;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::image_service_server::{ImageService, ImageServiceServer};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use super::config::CriConfig;
use super::Snapshotter;
use crate::error::{Error, ErrorKind, Result};
use crate::reference::Reference;
use crate::registry::auth::Credential;
use crate::registry::pulled::PulledCredentials;

/// Deadline of a forwarded `PullImage` (an ordinary multi-GiB image can take this long).
const PULL_DEADLINE: Duration = Duration::from_secs(3600);
/// Deadline of every other forwarded call.
const CALL_DEADLINE: Duration = Duration::from_secs(120);

struct Proxy {
    containerd: ImageServiceClient<Channel>,
    pulled: Arc<PulledCredentials>,
    snapshotter: Arc<Snapshotter>,
    ttl: Duration,
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
    use base64::Engine as _;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(auth.auth.trim())
        .ok()?;
    let (user, password) = std::str::from_utf8(&decoded).ok()?.split_once(':')?;
    Some(Credential {
        username: user.to_string(),
        secret: password.to_string(),
    })
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

    /// Keeps the credentials of a PullImage of `image`, and hands them to the running servers
    /// of its repository.
    async fn keep(&self, image: &str, credential: Credential) {
        let Ok(r) = image.parse::<Reference>() else {
            // containerd will say what is wrong with the name.
            return;
        };
        self.pulled
            .insert(&r.registry, &r.repository, credential.clone(), self.ttl);
        if let Err(e) = self
            .snapshotter
            .hand_credentials(&r.registry, &r.repository, credential, self.ttl)
            .await
        {
            tracing::warn!(registry = %r.registry, repository = %r.repository, error = %e.chain(), "handing credentials to the mount servers failed");
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
        let image = pull.image.as_ref().map(|i| i.image.clone());
        if let (Some(image), Some(c)) = (image, pull.auth.as_ref().and_then(credential)) {
            self.keep(&image, c).await;
        }
        self.client()
            .pull_image(forward(request, PULL_DEADLINE))
            .await
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
pub async fn serve(
    config: CriConfig,
    pulled: Arc<PulledCredentials>,
    snapshotter: Arc<Snapshotter>,
) -> Result<()> {
    // Connected lazily: containerd may start after the daemon.
    let containerd = crate::api::unix::lazy_channel(&config.containerd_address);
    let listener = crate::api::unix::bind(&config.image_service_address, 0o660)?;
    let proxy = Proxy {
        containerd: ImageServiceClient::new(containerd),
        pulled,
        snapshotter,
        ttl: Duration::from_secs(config.credentials_ttl),
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
