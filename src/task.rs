//! Keeping blocking work off the async runtime's workers.

use crate::error::{Error, ErrorKind, Result};

/// Runs blocking file-system, store or CPU-heavy work on the runtime's blocking threads.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::new(ErrorKind::Io, "a blocking task panicked").with_source(e))?
}

/// Runs CPU- or disk-bound `work` that borrows from its caller (decompressing, hashing and
/// writing chunks) without holding up the runtime's other tasks: on a multi-threaded runtime
/// the worker first hands its queue to another thread. Elsewhere (single-threaded test
/// runtimes) it simply runs.
pub fn off_the_runtime<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}
