//! The lazy disk engine: turns reads of a remote layer's files into verified chunk fetches
//! and cached data, and nothing else.
//!
//! - **One fetch per chunk.** A read claims the missing chunks it needs; concurrent readers of
//!   a claimed chunk wait for that fetch instead of starting their own.
//! - **Coalescing.** Adjacent missing chunks become one HTTP Range request (bounded in size);
//!   fetches run with bounded concurrency.
//! - **Verification.** Every chunk's bytes are decoded by the layer's codec within their
//!   announced size and checked against the chunk's digest before they are written to the
//!   cache; bytes that fail are fetched again from the registry itself (the one retry policy),
//!   then the read fails (EIO): unverified bytes are never served, and cached chunks are
//!   checked again once per process life before they are. Chunks marked `zeros` are verified
//!   too (the mark is only a claim: their frames must decode to zeros, a piece at a time, and
//!   their digest be that of as many zeros) and kept as holes. Once the layer is complete, [`integrity`] checks the whole tar stream
//!   against the config's diff_id and the TOC; a layer that fails serves nothing more.
//! - **Faults.** Network errors and truncated answers are retried with backoff until a
//!   deadline, which bounds every attempt too (a registry that trickles bytes cannot hold a
//!   read past it); then the read fails.
//! - **Dedup** ([`dedup`]). A chunk whose digest is already cached under another layer is
//!   copied locally, and checked like a fetch.
//! - **Beyond readers** ([`trace`], [`hydrate`]): boot traces recorded and replayed, and the
//!   whole layer fetched in the background while readers rest.
//!
//! What a chunk's bytes are and how they decode is the layer's codec's business
//! ([`crate::layer::codec`]): the engine asks it and never what kind the layer is. The engine
//! is async (tokio); the disk views (`crate::view`) call it for FUSE, which answers cached
//! reads on its own threads and misses from a task, so a missing chunk never blocks reads of
//! cached data.

mod check;
mod dedup;
mod hydrate;
pub mod integrity;
pub mod readahead;
pub mod stats;
mod touched;
mod trace;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;

use self::stats::Stats;
use crate::blob::Sources;
use crate::cache::layer::Kept;
use crate::cache::memory::MemoryBudget;
use crate::cache::{CacheRoot, Integrity, LayerCache};
use crate::error::{Error, ErrorKind, Result};
use crate::format::zstd_frames::all_zero;
use crate::layer::{Ask, Decoded, Fetch, Layer};
use crate::oci::digest::Digest;
use crate::task::off_the_runtime;

/// Tunables of the engine.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// How long a read keeps retrying a failing fetch before it fails with EIO.
    pub fetch_deadline: Duration,
    /// Range requests in flight at once.
    pub max_concurrent_fetches: usize,
    /// Largest coalesced request, in compressed bytes.
    pub max_request_bytes: u64,
    /// Fewest compressed bytes a reader's request asks for when the chunks after what it
    /// reads are missing ([`Engine::claim_small_followers`]); 0: just what it reads.
    pub min_request_bytes: u64,
    /// Most bytes fetched ahead of a sequential reader ([`readahead`]); 0 turns read-ahead
    /// off. Keep it above the link's bandwidth-delay product.
    pub readahead_bytes: u64,
    /// The node's budget for verified chunks a full disk keeps in memory
    /// ([`crate::cache::memory`]), in bytes.
    pub memory_budget: u64,
    /// The ledger directory through which the layers of the node share that budget; none: this
    /// process alone (`vmdisk mount`).
    pub memory_ledger: Option<std::path::PathBuf>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            fetch_deadline: Duration::from_secs(30),
            max_concurrent_fetches: 4,
            max_request_bytes: 4 << 20,
            min_request_bytes: MIN_REQUEST_BYTES,
            readahead_bytes: 32 << 20,
            memory_budget: crate::cache::memory::DEFAULT_BUDGET,
            memory_ledger: None,
        }
    }
}

/// How often a read fetches chunks it could not read back (found damaged, or let go from
/// memory on a full disk) before it fails.
const READ_TRIES: u32 = 3;

/// How long a read may run past the fetch deadline ([`EngineOptions::fetch_deadline`]): about
/// one more try of a request. Whatever fails under it — fetches retried on network errors,
/// bytes fetched again after they failed their check, chunks read back damaged — a read ends
/// within the deadline and this ([`Engine::read_unrecorded`]).
pub const READ_GRACE: Duration = Duration::from_secs(2);

/// The fewest compressed bytes a reader's request asks for by default when the chunks after
/// what it reads are missing ([`Engine::claim_small_followers`]): a quarter of what a 200 Mbit/s link
/// 10 ms away carries in one round trip, so it costs a reader a few hundred microseconds where
/// it saves a round trip whenever the next read wants them. Chunks of data that does not
/// compress are larger than this alone, so random readers fetch what they read.
const MIN_REQUEST_BYTES: u64 = 64 << 10;

/// How long a chunk whose fetch for a reader failed fails again at once
/// ([`Engine::recently_failed`]).
const FAILED_RECENTLY: Duration = Duration::from_secs(1);

/// Whose fetch it is: a reader's, or hydration's, which has slots of its own and, in the
/// background, waits while readers fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Priority {
    Demand,
    Hydration,
}

impl Priority {
    /// Whom its fetches ask: a reader's pass a pull-through mirror by for a blob it lacks,
    /// hydration's go through it (one fill for the fleet).
    fn ask(self) -> Ask {
        match self {
            Priority::Demand => Ask::AnyEndpoint,
            Priority::Hydration => Ask::Background,
        }
    }
}

/// How long readers must have needed nothing from the registry before background hydration
/// fetches its next batch (and after the layer was opened before it starts).
const READERS_REST: Duration = Duration::from_secs(5);

/// How long hydration waits before each batch while the cache's disk is full.
const HYDRATE_WHEN_FULL: Duration = Duration::from_secs(5);

/// A lazily loaded layer: its chunk index, its cache and the fetch machinery.
pub struct Engine {
    layer: Layer,
    cache: LayerCache,
    stats: Arc<Stats>,
    /// The layer's blobs, read for readers under the fetch deadline, counted in `stats`.
    sources: Sources,
    inflight: Mutex<HashMap<usize, watch::Sender<Option<bool>>>>,
    /// Chunks whose fetch failed, when and why ([`Engine::recently_failed`]).
    failed: Mutex<HashMap<usize, (Instant, ErrorKind, String)>>,
    /// Requests in flight for readers (demand) and for hydration, apart: a read never waits
    /// for a slot hydration holds.
    fetch_slots: Semaphore,
    hydrate_slots: Semaphore,
    /// When a reader last had to fetch ([`Engine::wait_until_readers_rest`]).
    last_demand: Mutex<Instant>,
    /// Chunks of other cached layers by digest; indexed after the mount is ready
    /// ([`Engine::index_other_layers`]), empty until then.
    other_layers: dedup::OtherLayers,
    /// What the check of the complete layer found, once it did (unset: pending); a failure
    /// stops every read. Set once, read lock-free on every read.
    integrity: std::sync::OnceLock<Integrity>,
    /// Held while that check runs, so it runs once however many ask.
    checking: tokio::sync::Mutex<()>,
    /// Records which chunks of the disk are read, once started ([`Engine::start_recording`]).
    recorder: std::sync::OnceLock<touched::Recorder>,
    opts: EngineOptions,
}

/// Completes claimed chunks exactly once, also when the fetching future is dropped.
struct Claim<'a> {
    engine: &'a Engine,
    chunks: Vec<usize>,
}

impl Claim<'_> {
    fn complete(mut self, ok: bool) {
        self.finish(ok);
    }

    fn finish(&mut self, ok: bool) {
        let mut inflight = self.engine.inflight.lock();
        for idx in self.chunks.drain(..) {
            if let Some(tx) = inflight.remove(&idx) {
                let _ = tx.send(Some(ok && self.engine.cache.is_kept(idx)));
            }
        }
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.finish(false);
    }
}

impl Engine {
    /// Opens the cache of a resolved `layer` whose bytes `sources` serve and restores the
    /// verdict of an earlier integrity check. Nothing may be served before
    /// [`Engine::check_structure`] passed.
    pub async fn open(
        layer: Layer,
        cache: &CacheRoot,
        sources: Sources,
        opts: EngineOptions,
    ) -> Result<Arc<Engine>> {
        let key = layer.key();
        let dir = cache.layer_dir(&key);
        let sizes: Vec<u64> = (0..layer.files.len()).map(|f| layer.file_size(f)).collect();
        let chunks = layer.chunks.len();
        let c = cache.clone();
        let (budget, ledger) = (opts.memory_budget, opts.memory_ledger.clone());
        let (layer_cache, integrity) = crate::task::blocking(move || {
            let budget = Arc::new(match ledger {
                Some(ledger) => MemoryBudget::shared(budget, ledger, key.hex()),
                None => MemoryBudget::alone(budget),
            });
            LayerCache::open(&dir, &sizes, chunks)
                .map(|lc| (lc.with_memory_budget(budget), c.load_integrity(&key)))
        })
        .await?;
        tracing::info!(reference = %layer.reference, layer = %layer.meta.layer_digest, %key, chunks, present = layer_cache.present_count(), resolved = ?layer.resolved, integrity = %integrity.clone().unwrap_or(Integrity::Pending), "layer opened");
        let engine = Self::with_source(layer, layer_cache, sources, opts);
        if let Some(known) = integrity.filter(|i| *i != Integrity::Pending) {
            let _ = engine.integrity.set(known);
        }
        engine.usable()?;
        Ok(engine)
    }

    /// Requests, failures and bytes per registry endpoint (the registry and its mirrors).
    pub fn endpoint_counters(&self) -> Vec<(String, crate::registry::health::EndpointCounters)> {
        self.sources.blob.endpoint_counters()
    }

    /// What the check of the complete layer found so far.
    pub fn integrity(&self) -> Integrity {
        self.integrity.get().cloned().unwrap_or(Integrity::Pending)
    }

    /// Fails if the layer was found to differ from its image config.
    pub fn usable(&self) -> Result<()> {
        match self.integrity.get() {
            Some(Integrity::Failed(why)) => Err(Error::corrupt(format!(
                "layer {} differs from what its image config says ({why}); it serves nothing more. Remove the image and report it to its publisher",
                self.layer.meta.layer_digest
            ))),
            _ => Ok(()),
        }
    }

    fn with_source(
        layer: Layer,
        cache: LayerCache,
        sources: Sources,
        opts: EngineOptions,
    ) -> Arc<Engine> {
        let stats = Arc::new(Stats::default());
        let sources = sources.for_reads(opts.fetch_deadline, Arc::clone(&stats) as _);
        Arc::new(Engine {
            layer,
            cache,
            stats,
            sources,
            inflight: Mutex::new(HashMap::new()),
            failed: Mutex::new(HashMap::new()),
            fetch_slots: Semaphore::new(opts.max_concurrent_fetches.max(1)),
            hydrate_slots: Semaphore::new(opts.max_concurrent_fetches.max(1)),
            last_demand: Mutex::new(Instant::now()),
            other_layers: Default::default(),
            integrity: std::sync::OnceLock::new(),
            checking: tokio::sync::Mutex::new(()),
            recorder: std::sync::OnceLock::new(),
            opts,
        })
    }

    /// Indexes the chunks of the other layers in `cache` by digest, so chunks they share
    /// with this one are copied instead of fetched. Reads every cached TOC: run it off the
    /// start-up path (blocking I/O); until it is done, shared chunks are simply fetched.
    pub fn index_other_layers(&self, cache: &CacheRoot) {
        let sources = self.other_layers.index(cache, &self.layer.key());
        tracing::info!(sources, "indexed chunks of other cached layers");
    }

    /// The engine's options.
    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    /// Whether all of `chunks` are present.
    pub fn all_present(&self, chunks: Range<usize>) -> bool {
        chunks.into_iter().all(|i| self.cache.is_present(i))
    }

    /// Makes every chunk in `chunks` present: fetches what is missing (claiming it), waits for
    /// what others are fetching. Fails if any chunk could not be fetched and verified.
    pub async fn ensure(&self, chunks: Range<usize>) -> Result<()> {
        self.ensure_as(chunks, Priority::Demand).await
    }

    /// [`Engine::ensure`] for `priority`'s fetches.
    async fn ensure_as(&self, chunks: Range<usize>, priority: Priority) -> Result<()> {
        self.usable()?;
        if priority == Priority::Demand {
            self.recently_failed(chunks.clone())?;
        }
        let mut waits = Vec::new();
        let mut claimed = Vec::new();
        {
            let mut inflight = self.inflight.lock();
            for idx in chunks {
                if self.cache.is_kept(idx) {
                    continue;
                }
                match inflight.get(&idx) {
                    Some(tx) => waits.push((idx, tx.subscribe())),
                    None => {
                        inflight.insert(idx, watch::channel(None).0);
                        claimed.push(idx);
                    }
                }
            }
        }
        if priority == Priority::Demand && !claimed.is_empty() {
            *self.last_demand.lock() = Instant::now();
            self.claim_small_followers(&mut claimed);
        }
        let runs = self.runs(&claimed);
        let fetches = runs.into_iter().map(|run| async move {
            let claim = Claim {
                engine: self,
                chunks: run.clone(),
            };
            let result = self.fetch_run(&run, priority).await;
            // A reader's failure only: hydration's fetches ask other endpoints under other
            // deadlines, and wait for a filling mirror by failing (`hydrate`).
            if let (Err(e), Priority::Demand) = (&result, priority) {
                self.note_failed(&run, e);
            }
            claim.complete(result.is_ok());
            result
        });
        let results = futures_util::future::join_all(fetches).await;
        let mut first_error = results.into_iter().find_map(|r| r.err());
        for (idx, mut rx) in waits {
            let ok = matches!(
                rx.wait_for(|v| v.is_some()).await.map(|v| *v),
                Ok(Some(true))
            );
            if !ok && first_error.is_none() && !self.cache.is_kept(idx) {
                first_error = Some(Error::new(
                    ErrorKind::Network,
                    format!("chunk {idx} could not be fetched (by a concurrent read)"),
                ));
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Adds to a reader's `claimed` chunks (ascending) the missing chunks that follow its last
    /// run in the blob while that run's request stays within `min_request_bytes`: chunks
    /// that compress to a few KiB (a file system's metadata, a qcow2's tables) come with the
    /// read that reaches them first instead of a round trip each (the default,
    /// [`MIN_REQUEST_BYTES`]). Nobody waits for them: chunks another fetch holds end the run.
    fn claim_small_followers(&self, claimed: &mut Vec<usize>) {
        let Some(&last) = claimed.last() else {
            return;
        };
        let first = claimed
            .iter()
            .rev()
            .zip((0..=last).rev())
            .take_while(|(&c, i)| c == *i)
            .last()
            .map_or(last, |(&c, _)| c);
        let start = self.layer.chunks[first].compressed.start;
        let mut inflight = self.inflight.lock();
        let mut end = last;
        loop {
            let next = end + 1;
            if next >= self.layer.chunks.len()
                || self.layer.chunks[next].compressed.end - start > self.opts.min_request_bytes
                || !self.joins_run(first, end, next)
                || self.cache.is_kept(next)
                || inflight.contains_key(&next)
            {
                break;
            }
            inflight.insert(next, watch::channel(None).0);
            claimed.push(next);
            end = next;
        }
    }

    /// Fails at once if a chunk of `chunks` that is kept nowhere failed to be fetched within
    /// [`FAILED_RECENTLY`]: a read that failed after the whole fetch deadline is sent again by
    /// the kernel at once (its read-ahead failed, then the page itself is read), and must not
    /// wait that long a second time. Readers only: a hydration asked for tries.
    fn recently_failed(&self, chunks: Range<usize>) -> Result<()> {
        let failed = self.failed.lock();
        if failed.is_empty() {
            return Ok(());
        }
        for idx in chunks {
            if let Some((at, kind, why)) = failed.get(&idx) {
                if at.elapsed() < FAILED_RECENTLY && !self.cache.is_kept(idx) {
                    return Err(Error::new(
                        *kind,
                        format!(
                            "chunk {idx} could not be fetched {} ms ago ({why}); not asked again so soon",
                            at.elapsed().as_millis()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Notes that fetching `run` failed with `e` ([`Engine::recently_failed`]).
    fn note_failed(&self, run: &[usize], e: &Error) {
        let mut failed = self.failed.lock();
        failed.retain(|_, (at, _, _)| at.elapsed() < FAILED_RECENTLY);
        let now = Instant::now();
        for &idx in run {
            failed.insert(idx, (now, e.kind(), e.chain()));
        }
    }

    /// Whether chunk `next` joins the run `first..=last` in one Range request: the next chunk
    /// of the same file, adjacent in the blob, and the request within `max_request_bytes`.
    /// The one place that decides what a request covers (demand runs, ranges in order, and so
    /// hydration's batches, which are claimed as demand runs are).
    fn joins_run(&self, first: usize, last: usize, next: usize) -> bool {
        let (last_file, last_chunk) = self.layer.chunk(last);
        let (file, chunk) = self.layer.chunk(next);
        last + 1 == next
            && last_file == file
            && adjacent(&last_chunk.compressed, &chunk.compressed)
            && chunk.compressed.end - self.layer.chunks[first].compressed.start
                <= self.opts.max_request_bytes
    }

    /// Chunk indices in `order` grouped into runs one Range request each can fetch
    /// ([`Engine::joins_run`]).
    fn request_runs(&self, order: impl IntoIterator<Item = usize>) -> Vec<Range<usize>> {
        let mut runs: Vec<Range<usize>> = Vec::new();
        for idx in order {
            match runs.last_mut() {
                Some(run) if self.joins_run(run.start, run.end - 1, idx) => run.end += 1,
                _ => runs.push(idx..idx + 1),
            }
        }
        runs
    }

    /// Claimed chunk indices in runs that one Range request can fetch.
    fn runs(&self, claimed: &[usize]) -> Vec<Vec<usize>> {
        let mut sorted = claimed.to_vec();
        sorted.sort_unstable();
        self.request_runs(sorted)
            .into_iter()
            .map(|run| run.collect())
            .collect()
    }

    /// Fetches one run: copies what another cached layer has, fetches the rest.
    async fn fetch_run(&self, run: &[usize], priority: Priority) -> Result<()> {
        let slots = match priority {
            Priority::Demand => &self.fetch_slots,
            Priority::Hydration => &self.hydrate_slots,
        };
        let _slot = slots.acquire().await.expect("semaphore never closed");
        let mut need: Vec<usize> = Vec::new();
        for &idx in run {
            if !self.copy_from_other_layer(idx) {
                need.push(idx);
            }
        }
        let mut start = 0;
        while start < need.len() {
            let mut end = start + 1;
            while end < need.len() && need[end] == need[end - 1] + 1 {
                end += 1;
            }
            self.fetch_verified(&need[start..end], priority.ask())
                .await?;
            start = end;
        }
        Ok(())
    }

    /// Keeps chunk `idx` copied from another cached layer ([`dedup`]); whether it did.
    fn copy_from_other_layer(&self, idx: usize) -> bool {
        let (file, chunk) = self.layer.chunk(idx);
        if chunk.zeros {
            return false; // its frame is a few bytes, and it is checked without being held
        }
        let Some(data) = chunk
            .digest
            .and_then(|d| self.other_layers.copy(&d, chunk.size))
        else {
            return false;
        };
        if self.keep(idx, file, chunk.offset, &data).is_err() {
            return false;
        }
        Stats::add(&self.stats.chunks_deduplicated, 1);
        Stats::add(&self.stats.bytes_deduplicated, chunk.size);
        true
    }

    /// Fetches contiguous chunks with one request (and the first one's window, if its codec
    /// needs one), has the codec verify each, and fetches failures once more on their own from
    /// the registry itself.
    async fn fetch_verified(&self, run: &[usize], ask: Ask) -> Result<()> {
        let codec = self.layer.codec();
        let range = self.run_range(run);
        let (bytes, window) =
            tokio::join!(self.fetch_range(range, ask), self.fetch_window(run[0], ask));
        let bytes = bytes?;
        // A window that does not decode fails its chunk, which is fetched again below.
        let window = match window {
            Err(e) if e.kind() != ErrorKind::Corrupt => return Err(e),
            other => other.ok(),
        };
        let mut failed = Vec::new();
        off_the_runtime(|| {
            codec.decode_run(&self.layer, run, &bytes, window.as_deref(), &mut |idx, decoded| {
                match decoded {
                    Ok(data) => self.store(idx, data),
                    Err(e) => {
                        Stats::add(&self.stats.verify_failures, 1);
                        tracing::warn!(layer = %self.layer.meta.layer_digest, chunk = idx, error = %e.chain(), "chunk failed verification; fetching it again");
                        failed.push(idx);
                        Ok(())
                    }
                }
            })
        })?;
        for idx in failed {
            let what = format!("chunk {idx} of layer {}", self.layer.meta.layer_digest);
            crate::layer::fetch_checked_again(&what, || self.fetch_chunk_again(idx))
                .await
                .map_err(|e| match e.kind() {
                    // Named once the tries ran out (each failed try is logged as it happens).
                    ErrorKind::Corrupt => {
                        let (file, chunk) = self.layer.chunk(idx);
                        e.context(format!(
                            "chunk {idx} (offset {} of {}) failed verification on each of {} fetches",
                            chunk.offset,
                            self.layer.file_path(file),
                            crate::layer::VERIFY_TRIES
                        ))
                    }
                    _ => e,
                })?;
        }
        Ok(())
    }

    /// Keeps the chunks whose whole frames `held` holds (blob bytes fetched with the TOC, or by
    /// the snapshotter while this process started: the disk's first chunks), verified as
    /// fetched chunks are; one that fails its check is left out and fetched when read, one
    /// that a read is fetching meanwhile is left to it. Returns how many were kept.
    pub fn keep_held(&self, held: &crate::layer::Held) -> usize {
        let codec = self.layer.codec();
        let mut claimed = Vec::new();
        {
            let mut inflight = self.inflight.lock();
            for idx in 0..self.layer.chunks.len() {
                if codec.window(idx).is_none()
                    && !self.cache.is_kept(idx)
                    && !inflight.contains_key(&idx)
                    && held.get(&self.layer.chunks[idx].compressed).is_some()
                {
                    inflight.insert(idx, watch::channel(None).0);
                    claimed.push(idx);
                }
            }
        }
        let mut kept = 0;
        for run in self.request_runs(claimed) {
            let claim = Claim {
                engine: self,
                chunks: run.collect(),
            };
            let Some(bytes) = held.get(&self.run_range(&claim.chunks)) else {
                continue;
            };
            let decoded = off_the_runtime(|| {
                codec.decode_run(&self.layer, &claim.chunks, &bytes, Some(&[]), &mut |idx, decoded| {
                    match decoded {
                        Ok(data) => self.store(idx, data).map(|()| kept += 1),
                        Err(e) => {
                            Stats::add(&self.stats.verify_failures, 1);
                            tracing::warn!(layer = %self.layer.meta.layer_digest, chunk = idx, error = %e.chain(), "a chunk fetched ahead failed verification; it is fetched when read");
                            Ok(())
                        }
                    }
                })
            });
            if let Err(e) = &decoded {
                tracing::warn!(layer = %self.layer.meta.layer_digest, error = %e.chain(), "chunks fetched ahead could not be kept; they are fetched when read");
            }
            claim.complete(decoded.is_ok());
        }
        kept
    }

    /// Chunk `idx`, whose bytes failed their check, fetched alone from the registry itself,
    /// verified and kept; `Corrupt` if it fails its check again.
    async fn fetch_chunk_again(&self, idx: usize) -> Result<()> {
        let chunk = &self.layer.chunks[idx];
        let (frame, window) = tokio::join!(
            self.fetch_range(chunk.compressed.clone(), Ask::Registry),
            self.fetch_window(idx, Ask::Registry)
        );
        let (frame, window) = (frame?, window?);
        off_the_runtime(|| {
            self.layer.codec().decode_run(
                &self.layer,
                &[idx],
                &frame,
                Some(&window),
                &mut |idx, decoded| {
                    let data =
                        decoded.inspect_err(|_| Stats::add(&self.stats.verify_failures, 1))?;
                    self.store(idx, data)
                },
            )
        })
    }

    /// The window chunk `idx` decodes from when it starts a fetch ([`crate::layer::codec::Codec::window`]):
    /// its frame in the windows blob, decoded; empty when it needs none.
    async fn fetch_window(&self, idx: usize, ask: Ask) -> Result<Vec<u8>> {
        let codec = self.layer.codec();
        let Some(frame) = codec.window(idx) else {
            return Ok(Vec::new());
        };
        let bytes = Fetch::windows(self, frame, ask).await?;
        off_the_runtime(|| codec.decode_window(idx, &bytes))
    }

    fn store(&self, idx: usize, decoded: Decoded<'_>) -> Result<()> {
        let (file, chunk) = self.layer.chunk(idx);
        match decoded {
            // The codec checked it is the zeros the TOC says (the mark is only a claim): the
            // data file's hole already reads as these bytes.
            Decoded::Zeros => self.cache.mark_hole(idx, file),
            // Only chunks the TOC marks as zeros are scanned.
            Decoded::Bytes(data) if chunk.zeros && all_zero(data) => {
                self.cache.mark_hole(idx, file)
            }
            Decoded::Bytes(data) => self.keep(idx, file, chunk.offset, data)?,
        }
        Stats::add(&self.stats.chunks_fetched, 1);
        Ok(())
    }

    /// Writes verified chunk `idx` to the cache (or keeps it in memory when the disk is full),
    /// with the digest it is checked against when read back if it carries none of its own.
    fn keep(&self, idx: usize, file: usize, offset: u64, data: &[u8]) -> Result<()> {
        let sum = self.layer.chunks[idx]
            .digest
            .is_none()
            .then(|| Digest::of(data));
        self.cache
            .write_chunk(idx, file, offset, data, sum.as_ref())
    }

    /// The layer this engine serves.
    pub fn layer(&self) -> &Layer {
        &self.layer
    }

    /// Whether every chunk of the layer is cached.
    pub fn complete(&self) -> bool {
        self.cache.complete()
    }

    /// How many chunks are cached.
    pub fn present_count(&self) -> usize {
        self.cache.present_count()
    }

    /// Whether every cached chunk was checked in this process.
    pub fn all_checked(&self) -> bool {
        self.cache.all_checked()
    }

    /// How many verified chunks found no space left on the cache's disk since the engine
    /// opened.
    pub fn unstored(&self) -> u64 {
        self.cache.unstored()
    }

    /// Says again that this layer still holds the chunks it keeps in memory (the node's
    /// memory ledger).
    pub fn renew_memory_note(&self) {
        self.cache.renew_memory_note();
    }

    /// Writes the presence bitmap and syncs the data files.
    pub fn flush(&self) -> Result<()> {
        self.cache.flush()
    }

    /// Counts what the FUSE front end saw of a read or an open.
    pub fn count(&self, seen: stats::Seen) {
        let counter = match seen {
            stats::Seen::ReadCall => &self.stats.read_calls,
            stats::Seen::CacheHit => &self.stats.cache_hits,
            stats::Seen::CacheMiss => &self.stats.cache_misses,
            stats::Seen::PassthroughOpen => &self.stats.passthrough_opens,
            stats::Seen::Answered(bytes) => return Stats::add(&self.stats.bytes_served, bytes),
            stats::Seen::Failed { timeout } => {
                if timeout {
                    Stats::add(&self.stats.read_timeouts, 1);
                }
                &self.stats.read_errors
            }
        };
        Stats::add(counter, 1);
    }

    /// The engine's counters now, with whether the cache's disk is full.
    pub fn counters(&self) -> stats::StatsSnapshot {
        stats::StatsSnapshot {
            cache_full: u64::from(self.cache.full()),
            memory_held: self.cache.memory_held(),
            ..self.stats.snapshot()
        }
    }

    /// The data file of file `file` for FUSE passthrough, where the kernel reads it without
    /// asking: only once every chunk is present and checked in this process, the file
    /// unchanged since, and the whole layer passed its integrity check (passthrough reads
    /// never reach the daemon, so they could not be stopped later).
    pub fn passthrough_file(&self, file: usize) -> Option<&std::fs::File> {
        let chunks = self.layer.chunks_of(file);
        let ready = self.integrity() == Integrity::Verified
            && !self.noticed_change(file)
            && chunks
                .into_iter()
                .all(|i| self.cache.is_present(i) && self.cache.is_checked(i));
        ready.then(|| self.cache.data_file(file))
    }

    /// Whether file `file` is complete in the cache and unchanged, and its chunks or the layer
    /// not yet checked by this process (see [`Engine::passthrough_file`]).
    pub fn passthrough_pending(&self, file: usize) -> bool {
        let chunks = self.layer.chunks_of(file);
        !matches!(self.integrity(), Integrity::Failed(_))
            && !self.noticed_change(file)
            && chunks.clone().into_iter().all(|i| self.cache.is_present(i))
            && (self.integrity() == Integrity::Pending
                || chunks.into_iter().any(|i| !self.cache.is_checked(i)))
    }

    /// Copies bytes `offset..` of file `file`, which `chunks` hold, into `buf` from where those
    /// are kept; false if one is kept nowhere (it went from memory meanwhile).
    fn copy_out(
        &self,
        file: usize,
        chunks: Range<usize>,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<bool> {
        let end = offset + buf.len() as u64;
        if chunks.clone().all(|i| self.cache.is_present(i)) {
            self.cache.read_at(file, buf, offset)?;
            return Ok(true);
        }
        for idx in chunks {
            let chunk = &self.layer.chunks[idx];
            let from = offset.max(chunk.offset);
            let to = end.min(chunk.offset + chunk.size);
            let out = &mut buf[(from - offset) as usize..(to - offset) as usize];
            match self.cache.kept(idx) {
                Some(Kept::File) => self.cache.read_at(file, out, from)?,
                Some(Kept::Memory(bytes)) => out.copy_from_slice(
                    &bytes[(from - chunk.offset) as usize..(to - chunk.offset) as usize],
                ),
                None => return Ok(false),
            }
        }
        Ok(true)
    }

    /// The blob bytes of a run of chunks.
    fn run_range(&self, run: &[usize]) -> Range<u64> {
        let first = &self.layer.chunks[run[0]];
        let last = &self.layer.chunks[run[run.len() - 1]];
        first.compressed.start..last.compressed.end
    }

    /// One Range request of the layer's blob for a reader or hydration ([`crate::blob::Blob::fetch`]:
    /// shared, retried on network errors until the fetch deadline, counted); `ask`: whom (the
    /// registry itself, for bytes that failed verification once).
    async fn fetch_range(&self, range: Range<u64>, ask: Ask) -> Result<bytes::Bytes> {
        self.sources.blob.fetch(range, ask).await
    }

    /// Reads `size` bytes of file `file` at `offset` (short at the end of the file),
    /// fetching what is missing: a reader's read (recorded when recording).
    pub async fn read(&self, file: usize, offset: u64, size: u64) -> Result<Vec<u8>> {
        let end = (offset + size).min(self.layer.file_size(file));
        self.note_read(file, offset..end);
        self.read_unrecorded(file, offset, size).await
    }

    /// A read not noted in the boot trace being recorded: [`Engine::read`]'s after it noted
    /// the reader's range, and our own reads (qcow2 metadata), which are not a boot's. One
    /// deadline bounds the whole read, every retry under it included: the fetch deadline and
    /// [`READ_GRACE`]. A read that runs out of it fails, and its missing chunks fail again at
    /// once for a moment ([`Engine::recently_failed`]), as after a fetch that ran out.
    pub async fn read_unrecorded(&self, file: usize, offset: u64, size: u64) -> Result<Vec<u8>> {
        let end = (offset + size).min(self.layer.file_size(file));
        if offset >= end {
            return Ok(Vec::new());
        }
        let deadline = self.opts.fetch_deadline + READ_GRACE;
        match tokio::time::timeout(deadline, self.read_range(file, offset, end)).await {
            Ok(read) => read,
            Err(_) => {
                let e = Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "reading bytes {offset}..{end} of {} did not finish within {} s (the fetch deadline and one more try)",
                        self.layer.file_path(file),
                        deadline.as_secs_f32()
                    ),
                );
                let missing: Vec<usize> = self
                    .layer
                    .chunks_for(file, offset..end)
                    .filter(|&i| !self.cache.is_kept(i))
                    .collect();
                self.note_failed(&missing, &e);
                Err(e)
            }
        }
    }

    /// [`Engine::read_unrecorded`] of bytes `offset..end`, with no deadline of its own.
    async fn read_range(&self, file: usize, offset: u64, end: u64) -> Result<Vec<u8>> {
        let chunks = self.layer.chunks_for(file, offset..end);
        // A cached chunk found damaged, or one the disk had no room for and memory let go, is
        // fetched again (through the one retry policy, at once): a few times, then the read
        // fails rather than serve anything else. Whatever else `ensure` fails with ends the
        // read: its fetches were retried below.
        crate::retry::RetryPolicy::checked(READ_TRIES)
            .run_when(
                "a read of cached chunks",
                || async {
                    self.ensure(chunks.clone()).await?;
                    let mut buf = vec![0u8; (end - offset) as usize];
                    let done = off_the_runtime(|| {
                        self.noticed_change(file);
                        if !self.check_present(chunks.clone()) {
                            return Ok(false);
                        }
                        self.copy_out(file, chunks.clone(), offset, &mut buf)
                    })?;
                    if done {
                        return Ok(buf);
                    }
                    Err(Error::new(
                        ErrorKind::FailedPrecondition,
                        format!(
                            "bytes {offset}..{end} of {} could not be kept long enough to be read (damaged cache chunks, or a full disk and little memory); see the log",
                            self.layer.file_path(file)
                        ),
                    ))
                },
                |e| e.kind() == ErrorKind::FailedPrecondition,
            )
            .await
    }

    /// Reads from the cache only; `None` if any needed chunk is missing.
    pub fn read_cached(&self, file: usize, offset: u64, size: u64) -> Option<Result<Vec<u8>>> {
        let mut buf = Vec::new();
        self.read_cached_into(file, offset, size, &mut buf)
            .map(|r| r.map(|()| buf))
    }

    /// [`Engine::read_cached`] appending to `out` (untouched when `None`): a view assembling
    /// one read from several pieces copies each once.
    pub fn read_cached_into(
        &self,
        file: usize,
        offset: u64,
        size: u64,
        out: &mut Vec<u8>,
    ) -> Option<Result<()>> {
        if let Err(e) = self.usable() {
            return Some(Err(e));
        }
        let end = (offset + size).min(self.layer.file_size(file));
        if offset >= end {
            return Some(Ok(()));
        }
        let chunks = self.layer.chunks_for(file, offset..end);
        if !chunks.clone().all(|i| self.cache.is_kept(i)) {
            return None;
        }
        self.noticed_change(file);
        if !self.check_present(chunks.clone()) {
            return None;
        }
        let start = out.len();
        out.resize(start + (end - offset) as usize, 0);
        match self.copy_out(file, chunks, offset, &mut out[start..]) {
            Ok(true) => {
                self.note_read(file, offset..end);
                Some(Ok(()))
            }
            Ok(false) => {
                out.truncate(start);
                None
            }
            Err(e) => {
                out.truncate(start);
                Some(Err(e))
            }
        }
    }
}

/// The engine fetches for its layer's codec through its blobs, counted and under its deadline.
impl Fetch for Engine {
    fn blob(&self, range: Range<u64>, ask: Ask) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Fetch::blob(&self.sources, range, ask)
    }

    fn windows(&self, range: Range<u64>, ask: Ask) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Fetch::windows(&self.sources, range, ask)
    }
}

/// Whether chunk bytes `next` follow `prev` in the blob, so one request fetches both: they
/// touch, or (spans of a gzip index) share the byte where one block ends and the next begins.
fn adjacent(prev: &Range<u64>, next: &Range<u64>) -> bool {
    next.start <= prev.end && prev.end <= next.start + 1 && prev.start < next.start
}

#[cfg(test)]
mod tests;
