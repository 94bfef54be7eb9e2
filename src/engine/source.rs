//! Where the engine's bytes come from: ranges of a layer's blob, and of its index's windows
//! blob when it is read through a seekable index. In production both are blobs in a registry
//! read with HTTP Range requests ([`RegistrySource`]); the engine's unit tests serve them from
//! memory.

use std::ops::Range;
use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::layer::{Ask, Fetch};
use crate::reference::Reference;
use crate::registry::health::EndpointCounters;
use crate::registry::Registry;

/// Ranges of one blob.
pub trait BlobSource: Send + Sync {
    /// The bytes of `range`; the length is checked by the source, the content by the engine.
    fn fetch(&self, range: Range<u64>) -> BoxFuture<'_, Result<bytes::Bytes>>;
    /// The same for bytes that failed verification once: from the registry itself, not a
    /// mirror.
    fn refetch(&self, range: Range<u64>) -> BoxFuture<'_, Result<bytes::Bytes>> {
        self.fetch(range)
    }
    /// Requests, failures and bytes per registry endpoint, if the source has endpoints.
    fn endpoint_counters(&self) -> Vec<(String, EndpointCounters)> {
        Vec::new()
    }
}

/// Asks `source` for `range` as `ask` says.
pub fn ask(
    source: &dyn BlobSource,
    range: Range<u64>,
    ask: Ask,
) -> BoxFuture<'_, Result<bytes::Bytes>> {
    match ask {
        Ask::AnyEndpoint => source.fetch(range),
        Ask::Registry => source.refetch(range),
    }
}

/// Where a layer's bytes come from: its blob, and for a gzip layer read through a seekable
/// index, the index's windows blob.
pub struct Sources {
    pub blob: Box<dyn BlobSource>,
    pub windows: Option<Box<dyn BlobSource>>,
}

impl Sources {
    /// The sources of a layer's blob `blob` in `reference`'s repository and of its index's
    /// windows blob `windows` (in `index_repository`, where the index was found).
    pub fn in_registry(
        client: Arc<dyn Registry>,
        reference: &Reference,
        blob: Digest,
        windows: Option<(Reference, Digest)>,
    ) -> Self {
        let windows = windows.map(|(repository, digest)| {
            Box::new(RegistrySource {
                client: Arc::clone(&client),
                reference: repository,
                blob: digest,
            }) as Box<dyn BlobSource>
        });
        Sources {
            blob: Box::new(RegistrySource {
                client,
                reference: reference.clone(),
                blob,
            }),
            windows,
        }
    }

    /// The windows blob's source, or why there is none.
    pub fn windows(&self) -> Result<&dyn BlobSource> {
        self.windows
            .as_deref()
            .ok_or_else(|| Error::corrupt("the layer's index names a windows blob nobody serves"))
    }
}

/// Sources answer a codec directly (no counters, no deadline beyond the registry client's own):
/// what reading an index's stream outside a mount uses.
impl Fetch for Sources {
    fn blob(&self, range: Range<u64>, how: Ask) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Box::pin(exact(ask(self.blob.as_ref(), range.clone(), how), range))
    }

    fn windows(&self, range: Range<u64>, how: Ask) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Box::pin(async move {
            let source = self.windows()?;
            exact(ask(source, range.clone(), how), range).await
        })
    }
}

/// The answer of `fetch`, which must be exactly `range`'s bytes.
pub async fn exact(
    fetch: impl std::future::Future<Output = Result<bytes::Bytes>>,
    range: Range<u64>,
) -> Result<bytes::Bytes> {
    let bytes = fetch.await?;
    if bytes.len() as u64 != range.end - range.start {
        return Err(Error::corrupt(format!(
            "asked for {} bytes at {}, got {}",
            range.end - range.start,
            range.start,
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// A blob in a registry, read with HTTP Range requests.
pub struct RegistrySource {
    client: Arc<dyn Registry>,
    reference: Reference,
    blob: Digest,
}

impl BlobSource for RegistrySource {
    fn fetch(&self, range: Range<u64>) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Box::pin(
            self.client
                .get_blob_range(&self.reference, &self.blob, range),
        )
    }

    fn refetch(&self, range: Range<u64>) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Box::pin(
            self.client
                .get_blob_range_from_registry(&self.reference, &self.blob, range),
        )
    }

    fn endpoint_counters(&self) -> Vec<(String, EndpointCounters)> {
        self.client.endpoint_counters()
    }
}
