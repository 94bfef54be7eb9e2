//! Where the engine's bytes come from: ranges of a layer's blob, and of its index's windows
//! blob when it is read through a seekable index. In production both are blobs in a registry
//! read with HTTP Range requests ([`RegistrySource`]); the engine's unit tests serve them from
//! memory.

use std::ops::Range;
use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::error::{Error, Result};
use crate::layer::{Ask, Fetch};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::registry::health::EndpointCounters;
use crate::registry::Registry;

/// Ranges of one blob.
pub trait BlobSource: Send + Sync {
    /// The bytes of `range` from the endpoints `ask` chooses; the length is checked by the
    /// source, the content by the engine.
    fn fetch(&self, range: Range<u64>, ask: Ask) -> BoxFuture<'_, Result<bytes::Bytes>>;
    /// Requests, failures and bytes per registry endpoint, if the source has endpoints.
    fn endpoint_counters(&self) -> Vec<(String, EndpointCounters)> {
        Vec::new()
    }
    /// Until when background reads wait for a mirror that is filling the blob
    /// ([`Registry::filling`]).
    fn filling(&self) -> Option<tokio::time::Instant> {
        None
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
        self.blob.fetch(range, how)
    }

    fn windows(&self, range: Range<u64>, how: Ask) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Box::pin(async move {
            let source = self.windows()?;
            source.fetch(range, how).await
        })
    }
}

/// A blob in a registry, read with HTTP Range requests.
pub struct RegistrySource {
    client: Arc<dyn Registry>,
    reference: Reference,
    blob: Digest,
}

impl BlobSource for RegistrySource {
    fn fetch(&self, range: Range<u64>, ask: Ask) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Box::pin(
            self.client
                .get_blob_range(&self.reference, &self.blob, range, ask),
        )
    }

    fn endpoint_counters(&self) -> Vec<(String, EndpointCounters)> {
        self.client.endpoint_counters()
    }

    fn filling(&self) -> Option<tokio::time::Instant> {
        self.client.filling(&self.reference, &self.blob)
    }
}
