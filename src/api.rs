//! Generated gRPC code (see `build.rs` and `proto/`): containerd's snapshots service and
//! vmdisk's management API. The module tree mirrors the protobuf packages, because the
//! generated code refers to other packages by relative path.

#![allow(clippy::all, missing_docs)]

pub mod containerd {
    pub mod types {
        tonic::include_proto!("containerd.types");
    }
    pub mod services {
        pub mod snapshots {
            pub mod v1 {
                tonic::include_proto!("containerd.services.snapshots.v1");
            }
        }
    }
}

pub mod vmdisk {
    pub mod v1 {
        tonic::include_proto!("vmdisk.v1");
    }
}

/// A gRPC channel to a unix socket (tonic speaks HTTP/2 over it; the URI is a placeholder).
pub async fn unix_channel(
    path: impl Into<std::path::PathBuf>,
) -> crate::error::Result<tonic::transport::Channel> {
    let path = path.into();
    let shown = path.display().to_string();
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .map_err(|e| {
            crate::error::Error::new(
                crate::error::ErrorKind::Network,
                format!("connecting to {shown}; is vmdisk-snapshotter running?"),
            )
            .with_source(e)
        })
}
