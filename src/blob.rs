//! The one way vmdisk reads bytes of a blob by ranges: a [`Blob`]. The engine's chunks and
//! windows, the TOCs and the structure check's bytes fetched at resolution, `vmdisk inspect`'s
//! reads and `vmdisk preheat`'s all go through one, so every such read is shared with a
//! concurrent read of the same bytes, counted, and retried under the blob's one policy, whose
//! deadline bounds the read (tries, waits and bodies included). Bytes checked after they came
//! are fetched through [`crate::layer::fetch_checked`], the one place the rule "after a failed
//! check, ask the registry itself" is written.
//!
//! Where the bytes come from is a [`BlobSource`]: a registry read with HTTP Range requests in
//! production ([`RegistrySource`]), memory in the engine's tests.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::layer::{Ask, Fetch};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::registry::health::EndpointCounters;
use crate::registry::Registry;
use crate::retry::RetryPolicy;

/// Ranges of one blob, as they come (a [`Blob`] retries, shares and counts them).
pub trait BlobSource: Send + Sync {
    /// The bytes of `range` from the endpoints `ask` chooses; the length is checked by the
    /// source, the content by whoever asked.
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

/// How many of its blob's deadlines a background read (hydration's) may take, its tries
/// included (3 minutes under a mount's default): nobody waits on it, and a link a fleet's
/// hydrations share can give each request a small share (100 nodes behind 200 Mbit/s). Never
/// shared with a reader's read, which has the read's deadline.
const BACKGROUND_DEADLINES: u32 = 6;

/// The answer of a read others wait for (unset until it came).
type SharedFetch = watch::Sender<Option<bytes::Bytes>>;

/// Where a blob's reads are counted: a layer's counters when an engine reads it
/// (`engine::stats::Stats`), nowhere otherwise.
pub trait FetchCounts: Send + Sync {
    /// A request is sent.
    fn requested(&self);
    /// A request answered `bytes` bytes after `took`.
    fn fetched(&self, bytes: u64, took: Duration);
    /// A request failed.
    fn failed(&self);
}

/// Counts nothing: a blob read outside a layer's engine.
struct Uncounted;

impl FetchCounts for Uncounted {
    fn requested(&self) {}
    fn fetched(&self, _: u64, _: Duration) {}
    fn failed(&self) {}
}

/// One blob, read by ranges (see the module docs). `'s`: what its source borrows (a registry
/// client a resolution borrows; `'static` for an engine's).
pub struct Blob<'s> {
    source: Box<dyn BlobSource + 's>,
    /// The blob in errors: "layer sha256:…".
    what: String,
    /// How each read is retried, and its deadline.
    policy: RetryPolicy,
    /// Where its requests, failures, bytes and time are counted.
    counts: Arc<dyn FetchCounts>,
    /// Reads in flight, by range: whoever asks any endpoint for the same bytes meanwhile waits
    /// for that answer instead of asking again.
    shared: Mutex<HashMap<(u64, u64), SharedFetch>>,
}

impl<'s> Blob<'s> {
    /// Blob `what` (for errors) read from `source`, retried under `policy`.
    pub fn new(source: impl BlobSource + 's, what: impl Into<String>, policy: RetryPolicy) -> Self {
        Blob {
            source: Box::new(source),
            what: what.into(),
            policy,
            counts: Arc::new(Uncounted),
            shared: Mutex::new(HashMap::new()),
        }
    }

    /// Blob `digest` of `reference`'s repository in the registry `client` speaks to, retried
    /// under the client's policy.
    pub fn in_registry(
        client: impl Into<Client<'s>>,
        reference: &Reference,
        digest: Digest,
    ) -> Self {
        let client = client.into();
        let policy = client.get().retry_policy();
        let source = RegistrySource {
            client,
            reference: reference.clone(),
            blob: digest,
        };
        Blob::new(source, format!("blob {digest}"), policy)
    }

    /// Layer blob `digest` of `reference`'s repository ([`Blob::in_registry`]), named as a
    /// layer in errors ("layer sha256:…").
    pub fn layer(client: impl Into<Client<'s>>, reference: &Reference, digest: Digest) -> Self {
        Blob::in_registry(client, reference, digest).named(format!("layer {digest}"))
    }

    /// This blob as a reader reads it: each read within `deadline` ([`RetryPolicy::demand_range`]),
    /// counted in `counts`.
    pub fn for_reads(self, deadline: Duration, counts: Arc<dyn FetchCounts>) -> Self {
        Blob {
            policy: RetryPolicy::demand_range(deadline),
            counts,
            ..self
        }
    }

    /// What the blob is, as errors name it ("layer sha256:…").
    pub fn what(&self) -> &str {
        &self.what
    }

    /// The blob named `what` in errors.
    pub fn named(self, what: impl Into<String>) -> Self {
        Blob {
            what: what.into(),
            ..self
        }
    }

    /// The bytes of `range`, exactly, from whom `ask` says, retried on network errors and cut
    /// answers under the blob's policy (a background read has [`BACKGROUND_DEADLINES`] of its
    /// deadline). Concurrent asks of any endpoint for the same bytes share one read (a gzip
    /// layer's first span is wanted by the structure check, for the tar header, and by the
    /// disk's head at once); a waiter whose sharer failed or was dropped asks on its own.
    pub async fn fetch(&self, range: Range<u64>, ask: Ask) -> Result<bytes::Bytes> {
        if ask != Ask::AnyEndpoint {
            return self.fetch_alone(range, ask).await;
        }
        let key = (range.start, range.end);
        let waiting = {
            let mut shared = self.shared.lock();
            match shared.get(&key) {
                Some(tx) => Some(tx.subscribe()),
                None => {
                    shared.insert(key, watch::channel(None).0);
                    None
                }
            }
        };
        if let Some(mut rx) = waiting {
            if let Ok(answer) = rx.wait_for(|v| v.is_some()).await {
                if let Some(bytes) = answer.clone() {
                    return Ok(bytes);
                }
            }
            return self.fetch_alone(range, ask).await;
        }
        // Dropped with the read (cancelled or failed): the entry goes, waiters see the sender
        // gone and ask on their own.
        struct Sharing<'b, 's>(&'b Blob<'s>, (u64, u64));
        impl Drop for Sharing<'_, '_> {
            fn drop(&mut self) {
                self.0.shared.lock().remove(&self.1);
            }
        }
        let sharing = Sharing(self, key);
        let result = self.fetch_alone(range, ask).await;
        if let Ok(bytes) = &result {
            if let Some(tx) = self.shared.lock().get(&key) {
                tx.send_replace(Some(bytes.clone()));
            }
        }
        drop(sharing);
        result
    }

    /// [`Blob::fetch`] without sharing.
    async fn fetch_alone(&self, range: Range<u64>, ask: Ask) -> Result<bytes::Bytes> {
        let policy = match ask {
            Ask::Background => self
                .policy
                .with_deadline(self.policy.deadline.saturating_mul(BACKGROUND_DEADLINES)),
            _ => self.policy.clone(),
        };
        let what = format!(
            "fetching bytes {}..{} of {}",
            range.start, range.end, self.what
        );
        policy
            .run(&what, || async {
                let started = Instant::now();
                self.counts.requested();
                match self.source.fetch(range.clone(), ask).await {
                    Ok(bytes) => {
                        self.counts.fetched(bytes.len() as u64, started.elapsed());
                        tracing::debug!(blob = %self.what, start = range.start, end = range.end, ?ask, ms = started.elapsed().as_millis() as u64, "fetched");
                        Ok(bytes)
                    }
                    Err(e) => {
                        self.counts.failed();
                        Err(e.context(what.as_str()))
                    }
                }
            })
            .await
    }

    /// Requests, failures and bytes per registry endpoint (the registry and its mirrors).
    pub fn endpoint_counters(&self) -> Vec<(String, EndpointCounters)> {
        self.source.endpoint_counters()
    }

    /// Until when background reads wait for a mirror that is filling the blob.
    pub fn filling(&self) -> Option<tokio::time::Instant> {
        self.source.filling()
    }

    /// Reads in flight others may join (none once every read ended).
    #[cfg(test)]
    pub(crate) fn reads_in_flight(&self) -> usize {
        self.shared.lock().len()
    }
}

/// Where a layer's bytes come from: its blob, and for a gzip layer read through a seekable
/// index, the index's windows blob.
pub struct Sources {
    pub blob: Blob<'static>,
    pub windows: Option<Blob<'static>>,
}

impl Sources {
    /// The layer blob `blob` in `reference`'s repository and its index's windows blob `windows`
    /// (in the repository where the index was found), in the registry `client` speaks to.
    pub fn in_registry(
        client: Arc<dyn Registry>,
        reference: &Reference,
        blob: Digest,
        windows: Option<(Reference, Digest)>,
    ) -> Self {
        let windows = windows.map(|(repository, digest)| {
            Blob::in_registry(Arc::clone(&client), &repository, digest)
                .named(format!("the index's windows blob {digest}"))
        });
        Sources {
            blob: Blob::layer(client, reference, blob),
            windows,
        }
    }

    /// These sources as a layer's reader reads them ([`Blob::for_reads`]).
    pub fn for_reads(self, deadline: Duration, counts: Arc<dyn FetchCounts>) -> Self {
        Sources {
            blob: self.blob.for_reads(deadline, Arc::clone(&counts)),
            windows: self.windows.map(|w| w.for_reads(deadline, counts)),
        }
    }

    /// The windows blob, or why there is none.
    pub fn windows(&self) -> Result<&Blob<'static>> {
        self.windows
            .as_ref()
            .ok_or_else(|| Error::corrupt("the layer's index names a windows blob nobody serves"))
    }
}

/// The codec's fetches of a layer's blob and windows blob, through its [`Blob`]s (the engine
/// and `vmdisk inspect`'s reads of an index's stream).
impl Fetch for Sources {
    fn blob(&self, range: Range<u64>, ask: Ask) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Box::pin(self.blob.fetch(range, ask))
    }

    fn windows(&self, range: Range<u64>, ask: Ask) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Box::pin(async move { self.windows()?.fetch(range, ask).await })
    }
}

/// The registry client a blob is read through: a share of it (an engine's, for the mount's
/// life) or one borrowed for a resolution, an inspection or a preheat.
pub enum Client<'c> {
    Shared(Arc<dyn Registry>),
    Borrowed(&'c dyn Registry),
}

impl Client<'_> {
    fn get(&self) -> &dyn Registry {
        match self {
            Client::Shared(client) => client.as_ref(),
            Client::Borrowed(client) => *client,
        }
    }
}

impl From<Arc<dyn Registry>> for Client<'static> {
    fn from(client: Arc<dyn Registry>) -> Self {
        Client::Shared(client)
    }
}

impl<'c> From<&'c dyn Registry> for Client<'c> {
    fn from(client: &'c dyn Registry) -> Self {
        Client::Borrowed(client)
    }
}

/// A blob in a registry, read with HTTP Range requests: the one caller of
/// [`Registry::get_blob_range`] outside the registry client.
struct RegistrySource<'c> {
    client: Client<'c>,
    reference: Reference,
    blob: Digest,
}

impl BlobSource for RegistrySource<'_> {
    fn fetch(&self, range: Range<u64>, ask: Ask) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Box::pin(
            self.client
                .get()
                .get_blob_range(&self.reference, &self.blob, range, ask),
        )
    }

    fn endpoint_counters(&self) -> Vec<(String, EndpointCounters)> {
        self.client.get().endpoint_counters()
    }

    fn filling(&self) -> Option<tokio::time::Instant> {
        self.client.get().filling(&self.reference, &self.blob)
    }
}
