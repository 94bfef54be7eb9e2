//! Generated gRPC code (see `build.rs` and `proto/`): containerd's snapshots service,
//! vmdisk's management API and the mount servers' control API; the channel to a unix socket;
//! and the one mapping between error kinds and gRPC codes, both ways. The module tree mirrors
//! the protobuf packages, because the generated code refers to other packages by relative path.

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

use crate::error::{Error, ErrorKind};

pub mod vmdisk {
    pub mod v1 {
        tonic::include_proto!("vmdisk.v1");
    }
}

/// Each error kind and its gRPC code, with the codes containerd's `errdefs` turns back into
/// its own errors. The one table both conversions read.
const CODES: [(ErrorKind, tonic::Code); 10] = [
    (ErrorKind::NotFound, tonic::Code::NotFound),
    (ErrorKind::AlreadyExists, tonic::Code::AlreadyExists),
    (
        ErrorKind::FailedPrecondition,
        tonic::Code::FailedPrecondition,
    ),
    (ErrorKind::InvalidInput, tonic::Code::InvalidArgument),
    (ErrorKind::Unsupported, tonic::Code::Unimplemented),
    (ErrorKind::Network, tonic::Code::Unavailable),
    (ErrorKind::Auth, tonic::Code::Unauthenticated),
    (ErrorKind::Corrupt, tonic::Code::DataLoss),
    (ErrorKind::Timeout, tonic::Code::DeadlineExceeded),
    (ErrorKind::Io, tonic::Code::Internal),
];

/// The gRPC code of an error kind.
pub fn code(kind: ErrorKind) -> tonic::Code {
    CODES
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or(tonic::Code::Internal, |(_, c)| *c)
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        tonic::Status::new(code(e.kind()), e.chain())
    }
}

/// A status from a vmdisk server (or the transport) back into the error it was; codes no
/// vmdisk server sends (Unknown, Cancelled, …) are I/O errors; tonic reports a broken transport
/// as Unavailable, so it is a network error.
impl From<tonic::Status> for Error {
    fn from(s: tonic::Status) -> Self {
        let kind = CODES
            .iter()
            .find(|(_, c)| *c == s.code())
            .map_or(ErrorKind::Io, |(k, _)| *k);
        Error::new(kind, s.message().to_string())
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

/// A gRPC channel to the unix socket `path` that connects on first use (and again after the
/// peer restarts), with a 5 s connect deadline.
pub fn lazy_unix_channel(path: &std::path::Path) -> tonic::transport::Channel {
    let path = path.to_path_buf();
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_timeout(std::time::Duration::from_secs(5))
        .connect_with_connector_lazy(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_survives_a_round_trip_through_grpc() {
        for (kind, code) in CODES {
            let status = tonic::Status::from(Error::new(kind, "what happened"));
            assert_eq!(status.code(), code);
            let back = Error::from(status);
            assert_eq!(back.kind(), kind);
            assert_eq!(back.chain(), "what happened");
        }
    }
}
