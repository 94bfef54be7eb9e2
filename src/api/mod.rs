//! Generated gRPC code (see `build.rs` and `proto/`): containerd's snapshots service,
//! vmdisk's management API and the mount servers' control API; unix sockets and the channels
//! over them ([`unix`]); and the one mapping between error kinds and gRPC codes, both ways. The module tree mirrors
//! the protobuf packages, because the generated code refers to other packages by relative path.

#[allow(clippy::all, missing_docs)]
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
        pub mod version {
            pub mod v1 {
                tonic::include_proto!("containerd.services.version.v1");
            }
        }
    }
}

use crate::error::{Error, ErrorKind};

pub mod unix;

#[allow(clippy::all, missing_docs)]
pub mod vmdisk {
    pub mod v1 {
        tonic::include_proto!("vmdisk.v1");
    }
}

/// Each error kind and its gRPC code, with the codes containerd's `errdefs` turns back into
/// its own errors. The one table both conversions read.
const CODES: [(ErrorKind, tonic::Code); 12] = [
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
    (ErrorKind::Refused, tonic::Code::PermissionDenied),
    (ErrorKind::BadAnswer, tonic::Code::Aborted),
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
