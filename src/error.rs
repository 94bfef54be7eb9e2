//! The one error type of the library.
//!
//! Every failure carries a small, matchable [`ErrorKind`] (what went wrong, in terms a caller can
//! act on), a human sentence of context (which registry, digest, offset or path) and, where there
//! is one, the underlying source. Binaries turn kinds into exit codes; kinds and gRPC
//! status convert into each other in one place (the gRPC API module), the FUSE layer answers EIO.

use std::fmt;

/// What kind of failure this is; callers match on this, never on message text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The user gave something malformed: a reference, a flag, a file that is not a disk.
    InvalidInput,
    /// A manifest, blob, file or tag does not exist.
    NotFound,
    /// Bytes did not match their digest, or a structure from outside is malformed.
    Corrupt,
    /// Credentials missing or refused.
    Auth,
    /// The network or the remote side failed (connection, timeout, 5xx).
    Network,
    /// A format or feature we do not handle.
    Unsupported,
    /// Local I/O (files, child processes).
    Io,
    /// A deadline passed: a mount that did not come up, a process that did not answer.
    Timeout,
    /// The thing to create exists already (a snapshot key).
    AlreadyExists,
    /// The request is valid but the state forbids it (a snapshot with children, a parent that is
    /// not committed).
    FailedPrecondition,
    /// A signature policy refused the image or index ([`crate::policy`]).
    Refused,
    /// A registry (or mirror) answered something other than what was asked: a Range answer
    /// for other bytes, a body longer or shorter than its own headers say. Such an answer is
    /// the same every time, so it is not retried at the same endpoint.
    BadAnswer,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::InvalidInput => "invalid input",
            ErrorKind::NotFound => "not found",
            ErrorKind::Corrupt => "corrupt data",
            ErrorKind::Auth => "authentication failed",
            ErrorKind::Network => "network error",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Io => "I/O error",
            ErrorKind::Timeout => "timed out",
            ErrorKind::AlreadyExists => "already exists",
            ErrorKind::FailedPrecondition => "failed precondition",
            ErrorKind::Refused => "refused by the signature policy",
            ErrorKind::BadAnswer => "the registry's answer contradicts the request",
        })
    }
}

/// An error with its kind, a context sentence and an optional source.
#[derive(Debug, thiserror::Error)]
#[error("{context}")]
pub struct Error {
    kind: ErrorKind,
    context: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind` described by `context`.
    pub fn new(kind: ErrorKind, context: impl Into<String>) -> Self {
        Error {
            kind,
            context: context.into(),
            source: None,
        }
    }

    /// Attach the underlying cause.
    /// The kind of the first I/O error among its causes, if any (a refused or forbidden
    /// connection under a transport error, say).
    pub fn source_io_kind(&self) -> Option<std::io::ErrorKind> {
        let mut cause: Option<&(dyn std::error::Error + 'static)> =
            self.source.as_deref().map(|e| e as _);
        while let Some(e) = cause {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                return Some(io.kind());
            }
            cause = e.source();
        }
        None
    }

    pub fn with_source(
        mut self,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        self.source = Some(source.into());
        self
    }

    /// The matchable kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Prefix the context with what the caller was doing.
    pub fn context(mut self, what: impl fmt::Display) -> Self {
        self.context = format!("{what}: {}", self.context);
        self
    }

    /// The whole chain as one line, `context: cause: cause`.
    pub fn chain(&self) -> String {
        let mut out = self.context.clone();
        let mut next = self
            .source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static));
        while let Some(err) = next {
            let text = err.to_string();
            if !out.contains(&text) {
                out.push_str(": ");
                out.push_str(&text);
            }
            next = err.source();
        }
        out
    }

    pub(crate) fn not_found(context: impl Into<String>) -> Self {
        Error::new(ErrorKind::NotFound, context)
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        let kind = match source.kind() {
            std::io::ErrorKind::NotFound => ErrorKind::NotFound,
            _ => ErrorKind::Io,
        };
        Error::new(kind, context).with_source(source)
    }

    pub(crate) fn invalid(context: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidInput, context)
    }

    pub(crate) fn corrupt(context: impl Into<String>) -> Self {
        Error::new(ErrorKind::Corrupt, context)
    }

    pub(crate) fn unsupported(context: impl Into<String>) -> Self {
        Error::new(ErrorKind::Unsupported, context)
    }
}

/// Adds context to any `Result<T, Error>`.
pub trait ResultExt<T> {
    /// Prefix the error's context with `what`.
    fn context(self, what: impl fmt::Display) -> Result<T>;
}

impl<T> ResultExt<T> for Result<T> {
    fn context(self, what: impl fmt::Display) -> Result<T> {
        self.map_err(|e| e.context(what))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_lists_causes_once() {
        let io = std::io::Error::other("disk on fire");
        let err = Error::io("reading /x", io).context("pushing");
        assert_eq!(err.kind(), ErrorKind::Io);
        assert_eq!(err.chain(), "pushing: reading /x: disk on fire");
    }

    #[test]
    fn not_found_io_maps_to_not_found() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        assert_eq!(Error::io("open", io).kind(), ErrorKind::NotFound);
    }
}
