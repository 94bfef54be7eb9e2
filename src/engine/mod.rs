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
//!   the same way (the mark is only a claim) and kept as holes. Once the layer is complete, [`integrity`] checks the whole tar stream
//!   against the config's diff_id and the TOC; a layer that fails serves nothing more.
//! - **Faults.** Network errors and truncated answers are retried with backoff until a
//!   deadline, which bounds every attempt too (a registry that trickles bytes cannot hold a
//!   read past it); then the read fails.
//! - **Dedup.** A chunk whose digest is already cached under another layer is copied locally.
//! - **Beyond readers** ([`trace`], [`hydrate`]): boot traces recorded and replayed, and the
//!   whole layer fetched in the background while readers rest.
//!
//! What a chunk's bytes are and how they decode is the layer's codec's business
//! ([`crate::layer::codec`]): the engine asks it and never what kind the layer is. The engine
//! is async (tokio); the disk views (`crate::view`) call it for FUSE, which answers cached
//! reads on its own threads and misses from a task, so a missing chunk never blocks reads of
//! cached data.

mod hydrate;
pub mod integrity;
pub mod readahead;
pub mod source;
pub mod stats;
mod trace;

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;

use self::source::{BlobSource, Sources};
use self::stats::Stats;
use crate::cache::layer::Kept;
use crate::cache::memory::MemoryBudget;
use crate::cache::{CacheRoot, Integrity, LayerCache};
use crate::digest::Digest;
use crate::error::{Error, ErrorKind, Result};
use crate::layer::{Ask, Fetch, Layer, Resolved};
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

/// How long a chunk whose fetch failed fails again at once ([`Engine::recently_failed`]).
const FAILED_RECENTLY: Duration = Duration::from_secs(1);

/// Whose fetch it is: a reader's, or hydration's, which has slots of its own and, in the
/// background, waits while readers fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Priority {
    Demand,
    Hydration,
}

/// How long readers must have needed nothing from the registry before background hydration
/// fetches its next batch (and after the layer was opened before it starts).
const READERS_REST: Duration = Duration::from_secs(5);

/// How long hydration waits before each batch while the cache's disk is full.
const HYDRATE_WHEN_FULL: Duration = Duration::from_secs(5);

/// Where a chunk with a given digest can be copied from.
/// What a pass over the cache ([`Engine::check_cache`]) found.
#[derive(Debug, Default)]
pub struct CacheCheck {
    /// Present chunks it checked (those not checked in this process before).
    pub checked: usize,
    /// The chunks among them whose bytes were not what was verified: now missing, to be
    /// fetched again ([`Engine::repair`]).
    pub damaged: Vec<usize>,
    /// Whether every present chunk is now checked (none left for a later pass).
    pub complete: bool,
}

struct DedupSource {
    path: PathBuf,
    offset: u64,
    size: u64,
}

/// The answer of a blob range's fetch others wait for (unset until it came).
type SharedFetch = watch::Sender<Option<bytes::Bytes>>;

/// A lazily loaded layer: its chunk index, its cache and the fetch machinery.
pub struct Engine {
    pub layer: Layer,
    pub cache: LayerCache,
    pub stats: Stats,
    sources: Sources,
    inflight: Mutex<HashMap<usize, watch::Sender<Option<bool>>>>,
    /// Chunks whose fetch failed, when and why ([`Engine::recently_failed`]).
    failed: Mutex<HashMap<usize, (Instant, ErrorKind, String)>>,
    /// Blob ranges being fetched, by range: whoever asks for the same bytes meanwhile waits
    /// for that answer instead of asking again ([`Engine::fetch_range`]).
    shared_fetches: Mutex<HashMap<(u64, u64), SharedFetch>>,
    /// Requests in flight for readers (demand) and for hydration, apart: a read never waits
    /// for a slot hydration holds.
    fetch_slots: Semaphore,
    hydrate_slots: Semaphore,
    /// When a reader last had to fetch ([`Engine::wait_until_readers_rest`]).
    last_demand: Mutex<Instant>,
    /// Chunks of other cached layers by digest; built after the mount is ready
    /// ([`Engine::index_other_layers`]), empty until then.
    dedup: std::sync::OnceLock<HashMap<Digest, DedupSource>>,
    /// What the check of the complete layer found, once it did (unset: pending); a failure
    /// stops every read. Set once, read lock-free on every read.
    integrity: std::sync::OnceLock<Integrity>,
    /// Held while that check runs, so it runs once however many ask.
    checking: tokio::sync::Mutex<()>,
    /// Records which chunks of the disk are read, once started ([`Engine::start_recording`]).
    recorder: std::sync::OnceLock<trace::Recorder>,
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

fn build_dedup(cache: &CacheRoot, own: &Digest) -> HashMap<Digest, DedupSource> {
    let mut map = HashMap::new();
    for digest in cache.layers().into_iter().filter(|d| d != own) {
        // A layer found to differ from its config shares nothing.
        if matches!(cache.load_integrity(&digest), Some(Integrity::Failed(_))) {
            continue;
        }
        let Some((meta, toc)) = cache.load_layer_meta(&digest) else {
            continue;
        };
        let reference = meta.reference.clone();
        let Ok(layer) = crate::layer::codec::open(reference, meta, &toc, Resolved::Offline) else {
            continue;
        };
        let dir = cache.layer_dir(&digest);
        let Some(bits) = crate::cache::layer::durable_bits(&dir, layer.chunks.len()) else {
            continue;
        };
        for idx in 0..layer.chunks.len() {
            let (file, chunk) = layer.chunk(idx);
            if bits[idx / 8] & (1 << (idx % 8)) == 0 {
                continue;
            }
            if let Some(d) = chunk.digest {
                map.entry(d).or_insert(DedupSource {
                    path: crate::cache::data_file(&dir, file),
                    offset: chunk.offset,
                    size: chunk.size,
                });
            }
        }
    }
    map
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
        Arc::new(Engine {
            layer,
            cache,
            stats: Stats::default(),
            sources,
            inflight: Mutex::new(HashMap::new()),
            failed: Mutex::new(HashMap::new()),
            shared_fetches: Mutex::new(HashMap::new()),
            fetch_slots: Semaphore::new(opts.max_concurrent_fetches.max(1)),
            hydrate_slots: Semaphore::new(opts.max_concurrent_fetches.max(1)),
            last_demand: Mutex::new(Instant::now()),
            dedup: std::sync::OnceLock::new(),
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
        let index = build_dedup(cache, &self.layer.key());
        tracing::info!(
            sources = index.len(),
            "indexed chunks of other cached layers"
        );
        let _ = self.dedup.set(index);
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
        }
        let runs = self.runs(&claimed);
        let fetches = runs.into_iter().map(|run| async move {
            let claim = Claim {
                engine: self,
                chunks: run.clone(),
            };
            let result = self.fetch_run(&run, priority).await;
            if let Err(e) = &result {
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
            if !self.copy_from_dedup(idx) {
                need.push(idx);
            }
        }
        let mut start = 0;
        while start < need.len() {
            let mut end = start + 1;
            while end < need.len() && need[end] == need[end - 1] + 1 {
                end += 1;
            }
            self.fetch_verified(&need[start..end]).await?;
            start = end;
        }
        Ok(())
    }

    fn copy_from_dedup(&self, idx: usize) -> bool {
        let (file, chunk) = self.layer.chunk(idx);
        let Some(source) = chunk.digest.and_then(|d| self.dedup.get()?.get(&d)) else {
            return false;
        };
        if source.size != chunk.size {
            return false;
        }
        let mut data = vec![0u8; chunk.size as usize];
        let read = std::fs::File::open(&source.path)
            .and_then(|f| std::os::unix::fs::FileExt::read_exact_at(&f, &mut data, source.offset));
        // Verify anyway: the other layer's bytes are ours, but cheap to check.
        if read.is_err()
            || chunk
                .digest
                .is_some_and(|d| d.verify(&data, "dedup copy").is_err())
        {
            return false;
        }
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
    async fn fetch_verified(&self, run: &[usize]) -> Result<()> {
        let codec = self.layer.codec();
        let range = self.run_range(run);
        let (bytes, window) = tokio::join!(
            self.fetch_range(range, Ask::AnyEndpoint),
            self.fetch_window(run[0], Ask::AnyEndpoint)
        );
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

    fn store(&self, idx: usize, data: &[u8]) -> Result<()> {
        let (file, chunk) = self.layer.chunk(idx);
        // Only chunks the TOC marks as zeros are scanned (the mark is a claim; the digest
        // already held).
        if chunk.zeros && data.iter().all(|&b| b == 0) {
            // The data file's hole already reads as these bytes.
            self.cache.mark_hole(idx, file);
        } else {
            self.keep(idx, file, chunk.offset, data)?;
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

    /// The engine's counters now, with whether the cache's disk is full.
    pub fn counters(&self) -> stats::StatsSnapshot {
        stats::StatsSnapshot {
            cache_full: u64::from(self.cache.full()),
            memory_held: self.cache.memory_held(),
            ..self.stats.snapshot()
        }
    }

    /// The digest present chunk `idx`'s cached bytes must have: its own, or the one kept when
    /// it was stored.
    fn cached_digest(&self, idx: usize) -> Option<Digest> {
        self.layer.chunks[idx]
            .digest
            .or_else(|| self.cache.sum(idx))
    }

    /// Checks present chunk `idx`'s bytes in the cache against the digest they were verified
    /// with (blocking: reads and hashes the chunk). A chunk that differs is forgotten, so it is
    /// fetched again, and counted and logged; whether it was sound.
    pub fn check_cached(&self, idx: usize) -> bool {
        let (file, chunk) = self.layer.chunk(idx);
        let mut data = vec![0u8; chunk.size as usize];
        let read = self.cache.read_at(file, &mut data, chunk.offset);
        let why = match (read, self.cached_digest(idx)) {
            (Err(e), _) => e.chain(),
            (Ok(()), None) => "no digest was kept for it".to_string(),
            (Ok(()), Some(digest)) => match Digest::of(&data) {
                got if got == digest => {
                    self.cache.mark_checked(idx);
                    return true;
                }
                got => format!("its bytes hash to {got}, not {digest}"),
            },
        };
        // Counted and logged once however many readers found it at the same time.
        if self.cache.forget(idx) {
            Stats::add(&self.stats.cache_damaged, 1);
            tracing::warn!(layer = %self.layer.meta.layer_digest, chunk = idx, file = %self.layer.file_path(file), offset = chunk.offset, cache = %self.cache.dir().display(), reason = %why, "a cached chunk is not what was verified (a damaged or changed cache file); fetching it again");
        }
        false
    }

    /// Checks every present chunk of `chunks` not checked in this process
    /// ([`Engine::check_cached`]); whether all were sound (damaged ones are now missing).
    fn check_present(&self, chunks: Range<usize>) -> bool {
        let mut sound = true;
        for idx in chunks {
            if self.cache.is_present(idx) && !self.cache.is_checked(idx) {
                sound &= self.check_cached(idx);
            }
        }
        sound
    }

    /// Checks the present chunks not checked in this process: what makes a complete file fit
    /// for passthrough ([`Engine::passthrough_file`]). Blocking. First, at once, the chunks of
    /// data files someone else changed (an incident: readers holding them with passthrough
    /// read them); then, with `bulk_rate` (bytes/s, 0 for no pace) — the caller holds the
    /// node's turn ([`crate::cache::CacheRoot::verify_turn`]) — every other one, paced and in
    /// the idle I/O class: chunks cached before this process started, re-verified after a
    /// restart without slowing the guests that boot from the same disk meanwhile (their reads
    /// check what they touch first). Without it, those wait for a later pass.
    ///
    /// It goes from the end of each file backwards: a reader reading from the start meets it
    /// in the middle instead of checking the same chunks beside it.
    pub fn check_cache(&self, bulk_rate: Option<u64>) -> CacheCheck {
        let mut found = CacheCheck::default();
        let mut rest = Vec::new();
        for file in 0..self.layer.files.len() {
            self.noticed_change(file);
            match self.cache.take_changed(file) {
                true => self.check_file(file, None, &mut found),
                false => rest.push(file),
            }
        }
        if let Some(rate) = bulk_rate {
            let mut pace = hydrate::Pace::new(rate);
            crate::task::at_idle_io(|| {
                for file in rest {
                    self.check_file(file, Some(&mut pace), &mut found);
                }
            });
        }
        found.complete = self.cache.all_checked();
        found
    }

    /// [`Engine::check_cache`] of the unchecked present chunks of file `file`, at `pace`.
    fn check_file(
        &self,
        file: usize,
        mut pace: Option<&mut hydrate::Pace>,
        found: &mut CacheCheck,
    ) {
        for idx in self.layer.chunks_of(file).rev() {
            if !self.cache.is_present(idx) || self.cache.is_checked(idx) {
                continue;
            }
            if let Some(pace) = pace.as_deref_mut() {
                let at = pace.start(self.layer.chunks[idx].size);
                std::thread::sleep(at.saturating_duration_since(tokio::time::Instant::now()));
                // A reader may have checked it meanwhile.
                if !self.cache.is_present(idx) || self.cache.is_checked(idx) {
                    continue;
                }
            }
            found.checked += 1;
            if !self.check_cached(idx) {
                found.damaged.push(idx);
            }
        }
    }

    /// Whether data file `file` was changed by someone else since this process last wrote or
    /// checked it ([`LayerCache::changed_since_checked`]: one `fstat`), logged when it was: its
    /// chunks are then checked again before they are served or the file goes to passthrough.
    /// Asked wherever cached bytes are about to be trusted (a read through the daemon, an
    /// open, the background check), so a change is noticed when it matters.
    fn noticed_change(&self, file: usize) -> bool {
        let changed = self
            .cache
            .changed_since_checked(file, self.layer.chunks_of(file));
        if changed {
            tracing::warn!(layer = %self.layer.meta.layer_digest, file = %self.layer.file_path(file), cache = %self.cache.dir().display(), "the cache's data file was changed by someone else; its chunks are checked again before they are served");
        }
        changed
    }

    /// Fetches chunks found damaged in the cache again, so their verified bytes are written
    /// back where the kernel reads them: into the data file that readers holding a
    /// passthrough open read without asking the daemon.
    pub async fn repair(&self, damaged: &[usize]) {
        for &idx in damaged {
            if let Err(e) = self.ensure(idx..idx + 1).await {
                tracing::warn!(layer = %self.layer.meta.layer_digest, chunk = idx, error = %e.chain(), "a damaged cached chunk could not be fetched again; it is fetched when next read");
            }
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

    /// One Range request of the layer's blob, which must answer exactly the bytes asked for,
    /// retried on network errors until the deadline; `ask`: whom (the registry itself, for
    /// bytes that failed verification once).
    /// Concurrent asks of any endpoint for the same bytes share one request (a gzip layer's
    /// first span is wanted by the structure check, for the tar header, and by the disk's
    /// head at once); a waiter whose sharer failed or was dropped asks on its own.
    async fn fetch_range(&self, range: Range<u64>, ask: Ask) -> Result<bytes::Bytes> {
        if ask != Ask::AnyEndpoint {
            return self.fetch_range_alone(range, ask).await;
        }
        let key = (range.start, range.end);
        let waiting = {
            let mut shared = self.shared_fetches.lock();
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
            return self.fetch_range_alone(range, ask).await;
        }
        // Dropped with the fetch (cancelled or failed): the entry goes, waiters see the sender
        // gone and ask on their own.
        struct Sharing<'a>(&'a Engine, (u64, u64));
        impl Drop for Sharing<'_> {
            fn drop(&mut self) {
                self.0.shared_fetches.lock().remove(&self.1);
            }
        }
        let sharing = Sharing(self, key);
        let result = self.fetch_range_alone(range, ask).await;
        if let Ok(bytes) = &result {
            if let Some(tx) = self.shared_fetches.lock().get(&key) {
                tx.send_replace(Some(bytes.clone()));
            }
        }
        drop(sharing);
        result
    }

    /// [`Engine::fetch_range`] without sharing.
    async fn fetch_range_alone(&self, range: Range<u64>, ask: Ask) -> Result<bytes::Bytes> {
        let what = format!("layer {}", self.layer.meta.layer_digest);
        self.fetch_from(self.sources.blob.as_ref(), &what, range, ask)
            .await
    }

    /// [`Engine::fetch_range`] of `source`, `what` its blob (for errors), under the retry
    /// policy with the engine's fetch deadline: a read waits at most that long, body included,
    /// so a registry that trickles bytes cannot hold it.
    async fn fetch_from(
        &self,
        blob: &dyn BlobSource,
        what: &str,
        range: Range<u64>,
        ask: Ask,
    ) -> Result<bytes::Bytes> {
        let policy = crate::retry::RetryPolicy {
            attempts: u32::MAX,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(2),
            deadline: self.opts.fetch_deadline,
        };
        let what = format!("fetching bytes {}..{} of {what}", range.start, range.end);
        policy
            .run(&what, || async {
                let started = Instant::now();
                Stats::add(&self.stats.fetch_requests, 1);
                match blob.fetch(range.clone(), ask).await {
                    Ok(bytes) => {
                        Stats::add(&self.stats.bytes_fetched, bytes.len() as u64);
                        Stats::add(
                            &self.stats.fetch_micros,
                            started.elapsed().as_micros() as u64,
                        );
                        Ok(bytes)
                    }
                    Err(e) => {
                        Stats::add(&self.stats.fetch_errors, 1);
                        Err(e.context(what.as_str()))
                    }
                }
            })
            .await
    }

    /// Reads `size` bytes of file `file` at `offset` (short at the end of the file),
    /// fetching what is missing: a reader's read (recorded when recording).
    pub async fn read(&self, file: usize, offset: u64, size: u64) -> Result<Vec<u8>> {
        let end = (offset + size).min(self.layer.file_size(file));
        self.note_read(file, offset..end);
        self.read_unrecorded(file, offset, size).await
    }

    /// [`Engine::read`] for reads of our own (qcow2 metadata), which are not a boot's. One
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

/// The engine fetches for its layer's codec: the blob and the windows blob, counted and under
/// its deadline.
impl Fetch for Engine {
    fn blob(&self, range: Range<u64>, ask: Ask) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Box::pin(self.fetch_range(range, ask))
    }

    fn windows(&self, range: Range<u64>, ask: Ask) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Box::pin(async move {
            let source = self.sources.windows()?;
            let what = "the index's windows blob";
            self.fetch_from(source, what, range, ask).await
        })
    }
}

/// Whether chunk bytes `next` follow `prev` in the blob, so one request fetches both: they
/// touch, or (spans of a gzip index) share the byte where one block ends and the next begins.
fn adjacent(prev: &Range<u64>, next: &Range<u64>) -> bool {
    next.start <= prev.end && prev.end <= next.start + 1 && prev.start < next.start
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::toc::Toc;
    use crate::format::zstd_chunked::{decode_chunk, decode_toc, TocLocation};
    use crate::layer::{Held, IndexSource, LayerKind, LayerMeta};

    /// A blob in memory that records requests and can fail or corrupt the next answers.
    #[derive(Default)]
    struct FakeBlob {
        blob: Vec<u8>,
        calls: Mutex<Vec<Range<u64>>>,
        failures: Mutex<u32>,
        corruptions: Mutex<u32>,
        /// How long each answer takes.
        delay: Mutex<Duration>,
    }

    impl BlobSource for Arc<FakeBlob> {
        fn fetch(
            &self,
            range: Range<u64>,
            _ask: Ask,
        ) -> futures_util::future::BoxFuture<'_, Result<bytes::Bytes>> {
            self.calls.lock().push(range.clone());
            let fail = std::mem::replace(&mut *self.failures.lock(), 0);
            if fail > 0 {
                *self.failures.lock() = fail - 1;
                return Box::pin(async {
                    Err(Error::new(ErrorKind::Network, "injected network failure"))
                });
            }
            let mut bytes = self.blob[range.start as usize..range.end as usize].to_vec();
            let mut corrupt = self.corruptions.lock();
            if *corrupt > 0 {
                *corrupt -= 1;
                let mid = bytes.len() / 2;
                bytes[mid] ^= 0x40;
            }
            let delay = *self.delay.lock();
            Box::pin(async move {
                tokio::time::sleep(delay).await;
                Ok(bytes::Bytes::from(bytes))
            })
        }
    }

    const CHUNK: usize = 4096;

    /// Content of `chunks` chunks; chunk 3 (if there is one) is all zeros.
    fn content(chunks: usize) -> Vec<u8> {
        let mut v: Vec<u8> = (0..chunks * CHUNK)
            .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
            .collect();
        if chunks > 3 {
            v[3 * CHUNK..4 * CHUNK].fill(0);
        }
        v
    }

    fn engine(data: &[u8], opts: EngineOptions) -> (Arc<Engine>, Arc<FakeBlob>, tempfile::TempDir) {
        let (blob, summary) = honest(data);
        engine_of_blob(blob, &summary, opts)
    }

    /// An engine over `blob`, a layer `summary` describes.
    fn engine_of_blob(
        blob: Vec<u8>,
        summary: &crate::format::zstd_chunked::LayerSummary,
        opts: EngineOptions,
    ) -> (Arc<Engine>, Arc<FakeBlob>, tempfile::TempDir) {
        let (meta, toc) = crate::layer::testing::zstd_chunked_meta(summary, &blob);
        engine_of_layer(blob, meta, &toc, opts)
    }

    /// An engine over `blob`, the layer `meta` and `toc` (its TOC or index) describe.
    fn engine_of_layer(
        blob: Vec<u8>,
        meta: LayerMeta,
        toc: &[u8],
        opts: EngineOptions,
    ) -> (Arc<Engine>, Arc<FakeBlob>, tempfile::TempDir) {
        let (engine, source, _, dir) = engine_of_sources(blob, None, meta, toc, opts);
        (engine, source, dir)
    }

    /// [`engine_of_layer`] with a windows blob; its source too.
    fn engine_of_sources(
        blob: Vec<u8>,
        windows: Option<Vec<u8>>,
        meta: LayerMeta,
        toc: &[u8],
        opts: EngineOptions,
    ) -> (Arc<Engine>, Arc<FakeBlob>, Arc<FakeBlob>, tempfile::TempDir) {
        let layer = crate::layer::codec::open(meta.reference.clone(), meta, toc, Resolved::Offline)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let sizes: Vec<u64> = (0..layer.files.len()).map(|f| layer.file_size(f)).collect();
        let cache = LayerCache::open(dir.path(), &sizes, layer.chunks.len()).unwrap();
        let source = Arc::new(FakeBlob {
            blob,
            ..FakeBlob::default()
        });
        let windows_source = Arc::new(FakeBlob {
            blob: windows.clone().unwrap_or_default(),
            ..FakeBlob::default()
        });
        let sources = Sources {
            blob: Box::new(Arc::clone(&source)),
            windows: windows.map(|_| Box::new(Arc::clone(&windows_source)) as Box<dyn BlobSource>),
        };
        let engine = Engine::with_source(layer, cache, sources, opts);
        (engine, source, windows_source, dir)
    }

    /// An engine over an ordinary layer `blob` (of tar stream `tar`) read through `index` and
    /// its `windows`; the sources of both.
    fn engine_of_indexed(
        blob: Vec<u8>,
        windows: Vec<u8>,
        tar: &[u8],
        index: &crate::format::seekable::SeekIndex,
    ) -> (Arc<Engine>, Arc<FakeBlob>, Arc<FakeBlob>, tempfile::TempDir) {
        engine_of_indexed_at(blob, windows, tar, index, None)
    }

    /// The same, with the disk at `disk_path` (a disk artifact's layer).
    fn engine_of_indexed_at(
        blob: Vec<u8>,
        windows: Vec<u8>,
        tar: &[u8],
        index: &crate::format::seekable::SeekIndex,
        disk_path: Option<&str>,
    ) -> (Arc<Engine>, Arc<FakeBlob>, Arc<FakeBlob>, tempfile::TempDir) {
        let bytes = index.encode().unwrap();
        let meta = LayerMeta {
            reference: "127.0.0.1:1/test/t:1".parse().unwrap(),
            layer_digest: Digest::of(&blob),
            layer_size: blob.len() as u64,
            toc_offset: 0,
            toc_length: bytes.len() as u64,
            toc_uncompressed_length: 0,
            toc_digest: Digest::of(&bytes),
            disk_path: disk_path.map(str::to_string),
            diff_id: Digest::of(tar),
            kind: LayerKind::Indexed(IndexSource {
                repository: "127.0.0.1:1/test/t".into(),
                compression: index.compression,
                layout: index.layout,
            }),
        };
        let windows = index.windows.map(|_| windows);
        engine_of_sources(blob, windows, meta, &bytes, EngineOptions::default())
    }

    /// Where the disk's content starts in the tar stream `index` describes.
    fn disk_at(index: &crate::format::seekable::SeekIndex) -> u64 {
        index.disk_entry().unwrap().offset
    }

    /// A gzip containerDisk layer (a small file before the disk, one after) and its index.
    struct GzipLayer {
        data: Vec<u8>,
        tar: Vec<u8>,
        blob: Vec<u8>,
        index: crate::format::seekable::SeekIndex,
        windows: Vec<u8>,
    }

    fn gzip_layer(span: u64) -> GzipLayer {
        use crate::format::seekable::{testing, Compression, Expected, Layout};
        let data = testing::disk(3 << 20);
        let tar = testing::tar_of(&[
            ("etc/README", b"hello".to_vec()),
            ("disk/d.raw", data.clone()),
            ("image/zz", vec![7; 3000]),
        ]);
        let blob = testing::gzip(&tar, 6);
        let exp = Expected {
            layer: Digest::of(&blob),
            layer_size: blob.len() as u64,
            compression: Some(Compression::Gzip),
            diff_id: Some(Digest::of(&tar)),
            layout: Layout::Tar,
        };
        let (index, windows) = testing::index_of(&blob, &exp, span);
        GzipLayer {
            data,
            tar,
            blob,
            index,
            windows,
        }
    }

    /// A disk artifact's layer, the gzip-compressed disk file itself, read through its index
    /// as `disk/d.raw`; checked whole against the disk's digest once complete, and a lie
    /// caught there.
    #[tokio::test]
    async fn concurrent_asks_for_the_same_bytes_share_one_request() {
        let data = content(8);
        let (engine, source, _dir) = engine(&data, EngineOptions::default());
        *source.delay.lock() = Duration::from_millis(50);
        let range = engine.layer.chunks[1].compressed.clone();
        let asked = || source.calls.lock().iter().filter(|r| **r == range).count();
        let (a, b) = tokio::join!(
            engine.fetch_range(range.clone(), Ask::AnyEndpoint),
            engine.fetch_range(range.clone(), Ask::AnyEndpoint)
        );
        assert_eq!(a.unwrap(), b.unwrap());
        assert_eq!(asked(), 1, "two concurrent asks, one request");
        // Nothing is kept once answered, and the registry itself is always asked on its own.
        engine
            .fetch_range(range.clone(), Ask::AnyEndpoint)
            .await
            .unwrap();
        let (a, b) = tokio::join!(
            engine.fetch_range(range.clone(), Ask::Registry),
            engine.fetch_range(range.clone(), Ask::AnyEndpoint)
        );
        assert_eq!(a.unwrap(), b.unwrap());
        assert_eq!(asked(), 4);
        // A sharer dropped before its answer came leaves its waiter to ask on its own.
        *source.delay.lock() = Duration::from_millis(300);
        let sharer = tokio::time::timeout(
            Duration::from_millis(50),
            engine.fetch_range(range.clone(), Ask::AnyEndpoint),
        );
        let waiter = async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            engine.fetch_range(range.clone(), Ask::AnyEndpoint).await
        };
        let (gone, answer) = tokio::join!(sharer, waiter);
        assert!(gone.is_err(), "the sharer was dropped");
        assert_eq!(answer.unwrap().len() as u64, range.end - range.start);
        assert_eq!(asked(), 6);
        assert!(engine.shared_fetches.lock().is_empty());
    }

    #[tokio::test]
    async fn a_disk_file_layer_reads_by_span_and_is_verified_once_complete() {
        use crate::format::seekable::testing;
        let data = testing::disk(3 << 20);
        let blob = testing::gzip(&data, 6);
        let (index, windows) = testing::index_of(&blob, &testing::file_expected(&blob), 64 << 10);
        let (engine, source, _, _dir) = engine_of_indexed_at(
            blob.clone(),
            windows.clone(),
            &data,
            &index,
            Some("disk/d.raw"),
        );
        let layer = &engine.layer;
        let paths: Vec<_> = layer.nodes.iter().map(|n| n.path.as_str()).collect();
        assert_eq!(paths, ["disk", "disk/d.raw"]);
        assert_eq!(layer.files.len(), 1);
        assert_eq!(layer.chunks.len(), index.spans.len());
        engine
            .check_structure(None, &Held::default())
            .await
            .unwrap();
        assert!(source.calls.lock().is_empty(), "nothing to check");
        assert_eq!(
            engine.read(0, 2 << 20, 4096).await.unwrap(),
            data[2 << 20..(2 << 20) + 4096]
        );
        let cache_dir = tempfile::tempdir().unwrap();
        let cache = CacheRoot::open(cache_dir.path()).unwrap();
        assert_eq!(read_all(&engine).await.unwrap(), data);
        assert_eq!(engine.check_integrity(&cache).await, Integrity::Verified);

        // An index that lies consistently about span 5 (a forged window, the digest of what
        // it decodes to): every read passes its span check, the complete disk does not.
        let forged = vec![b'x'; 32 << 10];
        let (mut lying, lying_windows) = testing::with_window(&index, &windows, 5, &forged);
        let s = &lying.spans[5];
        let lie = lying
            .decode_unverified(5, &blob[s.input as usize..s.input_end as usize], &forged)
            .unwrap();
        assert_ne!(lie, data[s.offset as usize..index.span_end(5) as usize]);
        lying.spans[5].digest = Digest::of(&lie);
        let (engine, _, _, _dir) =
            engine_of_indexed_at(blob, lying_windows, &data, &lying, Some("disk/d.raw"));
        engine.read(0, 0, engine.layer.file_size(0)).await.unwrap();
        let outcome = engine.check_integrity(&cache).await;
        assert!(
            matches!(&outcome, Integrity::Failed(why) if why.contains("the disk hashes to")),
            "{outcome:?}"
        );
    }

    /// Bytes fetched from `source` so far.
    fn fetched_bytes(source: &FakeBlob) -> u64 {
        source.calls.lock().iter().map(|r| r.end - r.start).sum()
    }

    #[tokio::test]
    async fn an_indexed_gzip_layer_reads_by_span_and_is_verified_once_complete() {
        let GzipLayer {
            data,
            tar,
            blob,
            index,
            windows,
        } = gzip_layer(64 << 10);
        let (engine, source, windows_source, _dir) =
            engine_of_indexed(blob.clone(), windows.clone(), &tar, &index);
        let disk = engine.layer.disk;
        assert_eq!(
            engine.layer.nodes[engine.layer.files[disk].node].path,
            "disk/d.raw"
        );
        engine
            .check_structure(None, &Held::default())
            .await
            .unwrap();
        let before = fetched_bytes(&source);
        assert_eq!(
            engine.read(disk, 1 << 20, 4096).await.unwrap(),
            data[1 << 20..(1 << 20) + 4096]
        );
        let fetched = fetched_bytes(&source) - before;
        assert!(
            fetched < blob.len() as u64 / 4,
            "a few spans, not the blob: {fetched} of {}",
            blob.len()
        );
        // Spans 4 to 6 read in one go: one request, one window (the others follow from the
        // spans before them).
        let (requests, window_requests) =
            (source.calls.lock().len(), windows_source.calls.lock().len());
        let file_at = disk_at(&index);
        let (from, to) = (index.spans[4].offset - file_at, index.span_end(6) - file_at);
        assert_eq!(
            engine.read(disk, from, to - from).await.unwrap(),
            data[from as usize..to as usize]
        );
        assert_eq!(source.calls.lock().len(), requests + 1);
        assert_eq!(window_requests + 1, windows_source.calls.lock().len());
        // Never more windows than requests of the layer, and not all of them.
        assert!(windows_source.calls.lock().len() <= source.calls.lock().len());
        assert!(fetched_bytes(&windows_source) < windows.len() as u64);
        let cache_dir = tempfile::tempdir().unwrap();
        let cache = CacheRoot::open(cache_dir.path()).unwrap();
        assert_eq!(engine.check_integrity(&cache).await, Integrity::Pending);
        for f in 0..engine.layer.files.len() {
            engine.read(f, 0, engine.layer.file_size(f)).await.unwrap();
        }
        assert_eq!(read_all(&engine).await.unwrap(), data);
        assert_eq!(engine.read(0, 0, 100).await.unwrap(), b"hello");
        assert_eq!(engine.check_integrity(&cache).await, Integrity::Verified);
    }

    #[tokio::test]
    async fn an_indexed_layer_never_serves_bytes_its_span_digest_does_not_match() {
        use crate::format::seekable::testing;
        let GzipLayer {
            data,
            tar,
            blob,
            index,
            windows,
        } = gzip_layer(64 << 10);
        // A wrong checkpoint: span 5's window is span 6's.
        let (index, windows) =
            testing::with_window(&index, &windows, 5, &testing::window(&index, &windows, 6));
        let (engine, source, windows_source, _dir) = engine_of_indexed(blob, windows, &tar, &index);
        let disk = engine.layer.disk;
        let at = index.spans[5].offset - disk_at(&index);
        let err = engine.read(disk, at, 10).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{}", err.chain());
        assert!(err.chain().contains("span 5"), "{}", err.chain());
        assert_eq!(
            engine.stats.snapshot().verify_failures,
            u64::from(crate::layer::VERIFY_TRIES),
            "checked, then refetched and checked until the tries ran out"
        );
        assert!(source.calls.lock().len() >= 3);
        assert!(
            windows_source.calls.lock().len() >= 3,
            "its window refetched too"
        );
        // The rest of the disk still reads.
        assert_eq!(engine.read(disk, 0, 4096).await.unwrap(), data[..4096]);
        // A window frame corrupted on the way once is fetched again and the span reads.
        *windows_source.corruptions.lock() = 1;
        let at = index.spans[9].offset - disk_at(&index);
        engine.read(disk, at, 10).await.unwrap();
    }

    #[tokio::test]
    async fn an_index_that_lies_consistently_is_caught_by_the_diff_id_once_complete() {
        use crate::format::seekable::testing;
        let GzipLayer {
            tar,
            blob,
            index,
            windows,
            ..
        } = gzip_layer(64 << 10);
        // Span 5 from a forged window, with the digest of what that decodes to: every span
        // check passes, the bytes differ.
        let forged = vec![b'x'; 32 << 10];
        let (mut index, windows) = testing::with_window(&index, &windows, 5, &forged);
        let s = &index.spans[5];
        let input = &blob[s.input as usize..s.input_end as usize];
        let lie = index.decode_unverified(5, input, &forged).unwrap();
        assert_ne!(lie, tar[s.offset as usize..index.span_end(5) as usize]);
        index.spans[5].digest = Digest::of(&lie);
        let (engine, _, _, _dir) = engine_of_indexed(blob, windows, &tar, &index);
        for f in 0..engine.layer.files.len() {
            engine.read(f, 0, engine.layer.file_size(f)).await.unwrap();
        }
        let cache_dir = tempfile::tempdir().unwrap();
        let cache = CacheRoot::open(cache_dir.path()).unwrap();
        let outcome = engine.check_integrity(&cache).await;
        assert!(
            matches!(&outcome, Integrity::Failed(why) if why.contains("hashes to")),
            "{outcome:?}"
        );
        assert_eq!(
            read_all(&engine).await.unwrap_err().kind(),
            ErrorKind::Corrupt
        );
    }

    #[tokio::test]
    async fn an_estargz_layer_reads_through_its_toc_and_is_verified_once_complete() {
        use crate::format::estargz;
        let data = content(5);
        let files = [
            ("disk/d.qcow2", data.clone()),
            ("etc/hostname", b"vm\n".to_vec()),
        ];
        let written = vmdisk_testing::estargz::layer(&files, CHUNK);
        let (blob, toc, diff_id): (_, Digest, Digest) = (
            written.blob,
            written.toc_digest.parse().unwrap(),
            written.diff_id.parse().unwrap(),
        );
        let size = blob.len() as u64;
        let offset = estargz::toc_offset(&blob[blob.len() - 51..], size).unwrap();
        let json = estargz::toc_json(&blob[offset as usize..blob.len() - 51], &toc).unwrap();
        let meta = LayerMeta {
            reference: "127.0.0.1:1/test/t:1".parse().unwrap(),
            layer_digest: Digest::of(&blob),
            layer_size: size,
            toc_offset: offset,
            toc_length: json.len() as u64,
            toc_uncompressed_length: 0,
            toc_digest: toc,
            disk_path: None,
            diff_id,
            kind: LayerKind::Estargz,
        };
        let (engine, _, _dir) = engine_of_layer(blob, meta, &json, EngineOptions::default());
        engine
            .check_structure(None, &Held::default())
            .await
            .unwrap();
        assert_eq!(
            engine.read(engine.layer.disk, 100, 10).await.unwrap(),
            data[100..110]
        );
        let cache_dir = tempfile::tempdir().unwrap();
        let cache = CacheRoot::open(cache_dir.path()).unwrap();
        for f in 0..engine.layer.files.len() {
            engine.read(f, 0, engine.layer.file_size(f)).await.unwrap();
        }
        assert_eq!(read_all(&engine).await.unwrap(), data);
        assert_eq!(engine.check_integrity(&cache).await, Integrity::Verified);
    }

    fn calls(source: &FakeBlob) -> usize {
        source.calls.lock().len()
    }

    #[tokio::test]
    async fn adjacent_missing_chunks_are_one_request_and_fetched_once() {
        let data = content(8);
        let (engine, source, _dir) = engine(&data, EngineOptions::default());
        let disk = engine.layer.disk;
        assert_eq!(
            engine.read(disk, 0, 3 * CHUNK as u64).await.unwrap(),
            data[..3 * CHUNK]
        );
        assert_eq!(
            calls(&source),
            1,
            "chunks 0..3 coalesced into one Range request"
        );
        assert_eq!(engine.read(disk, 100, 5000).await.unwrap(), data[100..5100]);
        assert_eq!(calls(&source), 1, "cached chunks are not fetched again");
        // Chunk 3 is marked zeros: verified like any chunk (a few bytes), kept as a hole.
        assert_eq!(
            engine
                .read(disk, 3 * CHUNK as u64, CHUNK as u64)
                .await
                .unwrap(),
            vec![0u8; CHUNK]
        );
        assert_eq!(calls(&source), 2);
        let zero_frame = source.calls.lock()[1].clone();
        assert!(zero_frame.end - zero_frame.start < 64, "{zero_frame:?}");
        // Reading past the end is short, not an error.
        assert_eq!(
            engine
                .read(disk, data.len() as u64 - 10, 100)
                .await
                .unwrap(),
            data[data.len() - 10..]
        );
    }

    #[tokio::test]
    async fn requests_are_bounded_in_size() {
        let data = content(8);
        let opts = EngineOptions {
            max_request_bytes: 1,
            ..EngineOptions::default()
        };
        let (engine, source, _dir) = engine(&data, opts);
        engine
            .read(engine.layer.disk, 0, data.len() as u64)
            .await
            .unwrap();
        assert_eq!(
            calls(&source),
            8,
            "one request per chunk when requests may not grow"
        );
    }

    /// A second engine over `engine`'s cache directory `dir` and blob: the layer opened again
    /// by a new process.
    fn reopened(engine: &Engine, dir: &std::path::Path, blob: &Arc<FakeBlob>) -> Arc<Engine> {
        engine.cache.flush().unwrap();
        let layer = &engine.layer;
        let sizes: Vec<u64> = (0..layer.files.len()).map(|f| layer.file_size(f)).collect();
        let cache = LayerCache::open(dir, &sizes, layer.chunks.len()).unwrap();
        let again = Layer::new(
            layer.reference.clone(),
            layer.meta.clone(),
            crate::layer::Table {
                nodes: layer.nodes.clone(),
                files: layer.files.clone(),
                chunks: layer.chunks.clone(),
            },
            Box::new(crate::layer::codec::zstd_chunked::ZstdChunked),
            Resolved::Offline,
        )
        .unwrap();
        let sources = Sources {
            blob: Box::new(Arc::clone(blob)),
            windows: None,
        };
        Engine::with_source(again, cache, sources, engine.opts.clone())
    }

    /// Flips a byte of the cache's data file of file 0 at `at`.
    fn damage(dir: &std::path::Path, at: u64) {
        damage_file(dir, 0, at)
    }

    /// Flips a byte of the cache's data file of file `file` at `at`.
    fn damage_file(dir: &std::path::Path, file: usize, at: u64) {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(crate::cache::data_file(dir, file))
            .unwrap();
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 1], at).unwrap();
    }

    #[tokio::test]
    async fn a_damaged_cached_chunk_is_fetched_again_never_served() {
        let data = content(4);
        let (engine, source, dir) = engine(&data, EngineOptions::default());
        let disk = engine.layer.disk;
        let len = data.len() as u64;
        engine.read(disk, 0, len).await.unwrap();
        // Written by this process from verified bytes: checked without reading them back.
        assert!((0..4).all(|i| engine.cache.is_checked(i)));
        damage(dir.path(), CHUNK as u64 + 10);
        // A new process life: cached chunks are checked before they are served, by either
        // read path, and a damaged one is fetched again.
        let engine = reopened(&engine, dir.path(), &source);
        let before = calls(&source);
        assert!(
            engine.read_cached(disk, 0, len).is_none(),
            "a cached read that found a damaged chunk is a miss"
        );
        assert_eq!(engine.stats.snapshot().cache_damaged, 1);
        assert!(!engine.cache.is_present(1) && engine.cache.is_present(0));
        assert_eq!(engine.read(disk, 0, len).await.unwrap(), data);
        assert_eq!(calls(&source) - before, 1, "the damaged chunk alone");
        assert_eq!(
            engine.read_cached(disk, 0, len).unwrap().unwrap(),
            data,
            "now all checked"
        );

        // The async read path finds it too.
        damage(dir.path(), 2 * CHUNK as u64);
        let engine = reopened(&engine, dir.path(), &source);
        assert_eq!(engine.read(disk, 0, len).await.unwrap(), data);
        assert_eq!(engine.stats.snapshot().cache_damaged, 1);
    }

    /// A chunk that is only part of a span carries no digest of its own: the one of its bytes
    /// is kept when the span is verified, and the chunk is checked against it.
    #[tokio::test]
    async fn a_chunk_without_a_digest_of_its_own_is_checked_against_the_one_kept() {
        let GzipLayer {
            data,
            tar,
            blob,
            index,
            windows,
        } = gzip_layer(64 << 10);
        let (engine, _source, _windows, dir) =
            engine_of_indexed(blob.clone(), windows.clone(), &tar, &index);
        let disk = engine.layer.disk;
        engine.read(disk, 0, data.len() as u64).await.unwrap();
        let partial: Vec<usize> = engine
            .layer
            .chunks_of(disk)
            .filter(|&i| engine.layer.chunks[i].digest.is_none())
            .collect();
        assert!(
            !partial.is_empty(),
            "the disk's first and last chunks are parts of spans"
        );
        for &idx in &partial {
            let chunk = &engine.layer.chunks[idx];
            let bytes = &data[chunk.offset as usize..(chunk.offset + chunk.size) as usize];
            assert_eq!(engine.cache.sum(idx), Some(Digest::of(bytes)));
            assert!(engine.check_cached(idx));
        }
        let idx = partial[0];
        damage_file(dir.path(), disk, engine.layer.chunks[idx].offset);
        assert!(!engine.check_cached(idx) && !engine.cache.is_present(idx));
    }

    #[tokio::test]
    async fn a_damaged_cache_with_the_registry_gone_answers_an_error_naming_it() {
        let data = content(2);
        let (engine, source, dir) = engine(
            &data,
            EngineOptions {
                fetch_deadline: Duration::from_millis(300),
                ..EngineOptions::default()
            },
        );
        let disk = engine.layer.disk;
        engine.read(disk, 0, data.len() as u64).await.unwrap();
        damage(dir.path(), 5);
        let engine = reopened(&engine, dir.path(), &source);
        *source.failures.lock() = u32::MAX;
        let e = engine.read(disk, 0, 100).await.unwrap_err();
        assert!(e.chain().contains("injected network failure"), "{e}");
        assert_eq!(engine.stats.snapshot().cache_damaged, 1);
        // The chunk that was sound is still served.
        assert_eq!(
            engine.read_cached(disk, CHUNK as u64, 10).unwrap().unwrap(),
            data[CHUNK..CHUNK + 10]
        );
    }

    /// A registry whose every answer fails its check, each answer slow: the read ends within
    /// the fetch deadline and one more try, however many fetches its retries would make (they
    /// nested: three fetches of nearly a deadline each).
    #[tokio::test(start_paused = true)]
    async fn a_read_from_a_registry_that_fails_every_check_ends_within_its_deadline() {
        let data = content(4);
        let opts = EngineOptions {
            fetch_deadline: Duration::from_secs(10),
            ..EngineOptions::default()
        };
        let (engine, source, _dir) = engine(&data, opts);
        *source.corruptions.lock() = u32::MAX;
        *source.delay.lock() = Duration::from_secs(9);
        let started = tokio::time::Instant::now();
        let e = engine.read(engine.layer.disk, 0, 100).await.unwrap_err();
        let took = started.elapsed();
        assert!(
            took <= Duration::from_secs(10) + READ_GRACE,
            "{took:?}: {}",
            e.chain()
        );
        assert!(
            source.calls.lock().len() >= 2,
            "fetched again after the failed check"
        );
        // The kernel's read of the same page right after fails at once.
        let again = tokio::time::Instant::now();
        engine.read(engine.layer.disk, 0, 100).await.unwrap_err();
        assert_eq!(again.elapsed(), Duration::ZERO);
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_complete_file_is_fit_for_passthrough_only_once_checked_and_unchanged() {
        let data = content(4);
        let (engine, source, dir) = engine(&data, EngineOptions::default());
        let disk = engine.layer.disk;
        engine.read(disk, 0, data.len() as u64).await.unwrap();
        let _ = engine.integrity.set(Integrity::Verified);
        assert!(engine.passthrough_file(disk).is_some());
        // Changed by someone else: not handed over until checked again.
        damage(dir.path(), 3);
        assert!(engine.passthrough_file(disk).is_none());
        assert_eq!(
            counts(engine.check_cache(Some(0))),
            (4, 1),
            "the changed file is checked again"
        );
        assert!(
            engine.passthrough_file(disk).is_none(),
            "a chunk is missing now"
        );
        engine.read(disk, 0, data.len() as u64).await.unwrap();
        assert!(engine.passthrough_file(disk).is_some());
        // Another process life: nothing is handed over before the check.
        let engine = reopened(&engine, dir.path(), &source);
        let _ = engine.integrity.set(Integrity::Verified);
        assert!(engine.passthrough_file(disk).is_none());
        assert_eq!(counts(engine.check_cache(Some(0))), (4, 0));
        assert!(engine.passthrough_file(disk).is_some());
        assert_eq!(
            counts(engine.check_cache(Some(0))),
            (0, 0),
            "nothing left to check"
        );
    }

    /// After a restart, the chunks cached before are read back at the verify rate (in the
    /// node's turn); without the turn a pass checks only data files someone changed.
    #[tokio::test(flavor = "multi_thread")]
    async fn chunks_cached_before_a_restart_are_checked_at_the_verify_rate_in_the_nodes_turn() {
        let data = content(8);
        let (engine, source, dir) = engine(&data, EngineOptions::default());
        let disk = engine.layer.disk;
        engine.read(disk, 0, data.len() as u64).await.unwrap();
        let engine = reopened(&engine, dir.path(), &source);
        // No turn: nothing changed, nothing checked.
        let found = engine.check_cache(None);
        assert_eq!((found.checked, found.complete), (0, false));
        // A file changed by someone else is checked at once, turn or not.
        damage(dir.path(), 1);
        let found = engine.check_cache(None);
        assert_eq!(counts_of(&found), (8, 1), "the changed file, at once");
        engine.repair(&found.damaged).await;

        let engine = reopened(&engine, dir.path(), &source);
        let rate = 8 * CHUNK as u64; // 8 chunks a second
        let started = std::time::Instant::now();
        let found = engine.check_cache(Some(rate));
        let took = started.elapsed();
        assert_eq!(counts_of(&found), (8, 0));
        assert!(found.complete);
        assert!(
            took >= Duration::from_millis(800),
            "8 chunks at 8 a second start over 0.875 s: {took:?}"
        );
    }

    fn counts_of(found: &CacheCheck) -> (usize, usize) {
        (found.checked, found.damaged.len())
    }

    fn counts(found: CacheCheck) -> (usize, usize) {
        counts_of(&found)
    }

    /// Bytes changed in a checked data file while it is served are noticed by the next read
    /// through the daemon (not only by the background pass): that read is answered with the
    /// verified bytes, and the repair writes them back where passthrough readers read.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_change_to_a_checked_data_file_is_noticed_by_the_next_read_and_repaired() {
        let data = content(4);
        let (engine, source, dir) = engine(&data, EngineOptions::default());
        let disk = engine.layer.disk;
        engine.read(disk, 0, data.len() as u64).await.unwrap();
        let fetched = source.calls.lock().len();
        damage(dir.path(), CHUNK as u64 + 9);
        assert!(
            engine.read_cached(disk, CHUNK as u64, 16).is_none(),
            "the changed chunk is not answered from the cache"
        );
        assert_eq!(
            engine.read(disk, CHUNK as u64, 16).await.unwrap(),
            data[CHUNK..CHUNK + 16]
        );
        assert_eq!(engine.stats.snapshot().cache_damaged, 1);
        assert!(source.calls.lock().len() > fetched, "fetched again");
        // Written back: the data file holds the verified bytes again.
        let mut back = vec![0u8; 16];
        engine.cache.read_at(disk, &mut back, CHUNK as u64).unwrap();
        assert_eq!(back, data[CHUNK..CHUNK + 16]);

        // Found by the background pass instead: repaired without a reader.
        damage(dir.path(), 2 * CHUNK as u64 + 1);
        let found = engine.check_cache(Some(0));
        assert_eq!(found.damaged, [2]);
        engine.repair(&found.damaged).await;
        engine
            .cache
            .read_at(disk, &mut back, 2 * CHUNK as u64)
            .unwrap();
        assert_eq!(back, data[2 * CHUNK..2 * CHUNK + 16]);
        assert!(engine.all_present(0..4));
    }

    #[tokio::test(start_paused = true)]
    async fn background_hydration_waits_while_readers_fetch_and_keeps_slots_of_its_own() {
        let data = content(64);
        let (engine, source, _dir) = engine(&data, EngineOptions::default());
        let disk = engine.layer.disk;
        let hydrating = Arc::clone(&engine);
        let hydration = tokio::spawn(async move { hydrating.hydrate(2, Some(1 << 40)).await });
        tokio::time::sleep(READERS_REST / 2).await;
        assert_eq!(calls(&source), 0, "nothing before the readers rested");
        engine.read(disk, 40 * CHUNK as u64, 10).await.unwrap();
        assert_eq!(calls(&source), 1);
        tokio::time::sleep(READERS_REST - Duration::from_millis(100)).await;
        assert_eq!(calls(&source), 1, "a reader fetched: hydration waits again");
        // Every hydration slot taken: a reader still fetches at once.
        let held: Vec<_> = (0..engine.opts.max_concurrent_fetches)
            .map(|_| engine.hydrate_slots.try_acquire().unwrap())
            .collect();
        engine.read(disk, 20 * CHUNK as u64, 10).await.unwrap();
        assert_eq!(calls(&source), 2);
        drop(held);
        hydration.await.unwrap().unwrap();
        assert!(engine.cache.complete());
        assert_eq!(engine.read(disk, 0, data.len() as u64).await.unwrap(), data);
    }

    #[tokio::test]
    async fn a_read_of_a_chunk_that_just_failed_fails_at_once() {
        let data = content(2);
        let deadline = Duration::from_millis(400);
        let (engine, source, _dir) = engine(
            &data,
            EngineOptions {
                fetch_deadline: deadline,
                ..EngineOptions::default()
            },
        );
        *source.failures.lock() = u32::MAX;
        let started = Instant::now();
        assert!(engine.read(engine.layer.disk, 0, 10).await.is_err());
        assert!(started.elapsed() >= deadline);
        let again = Instant::now();
        let e = engine.read(engine.layer.disk, 0, 10).await.unwrap_err();
        assert!(again.elapsed() < deadline / 4, "{:?}", again.elapsed());
        assert!(e.chain().contains("not asked again so soon"), "{e}");
        // Later it is asked again.
        tokio::time::sleep(FAILED_RECENTLY).await;
        *source.failures.lock() = 0;
        assert_eq!(
            engine.read(engine.layer.disk, 0, 10).await.unwrap(),
            data[..10]
        );
    }

    #[tokio::test]
    async fn a_corrupt_chunk_is_fetched_once_more() {
        let data = content(4);
        let (engine, source, _dir) = engine(&data, EngineOptions::default());
        *source.corruptions.lock() = 1;
        assert_eq!(
            engine
                .read(engine.layer.disk, 0, CHUNK as u64)
                .await
                .unwrap(),
            data[..CHUNK]
        );
        assert_eq!(engine.stats.snapshot().verify_failures, 1);
        assert_eq!(calls(&source), 2);
    }

    #[tokio::test]
    async fn persistent_corruption_fails_and_caches_nothing() {
        let data = content(4);
        let (engine, source, _dir) = engine(&data, EngineOptions::default());
        *source.corruptions.lock() = 100;
        let err = engine
            .read(engine.layer.disk, 0, CHUNK as u64)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{}", err.chain());
        assert!(err
            .chain()
            .contains("failed verification on each of 3 fetches"));
        assert!(
            !engine.cache.is_present(0),
            "unverified bytes are never cached"
        );
        assert_eq!(calls(&source), 3);
    }

    #[tokio::test]
    async fn network_errors_are_retried_until_the_deadline() {
        let data = content(4);
        let opts = EngineOptions {
            fetch_deadline: Duration::from_secs(1),
            ..EngineOptions::default()
        };
        let (engine, source, _dir) = engine(&data, opts);
        *source.failures.lock() = 2;
        assert_eq!(
            engine.read(engine.layer.disk, 0, 10).await.unwrap(),
            data[..10]
        );
        assert_eq!(calls(&source), 3);
        *source.failures.lock() = 1000;
        let err = engine
            .read(engine.layer.disk, CHUNK as u64, 10)
            .await
            .unwrap_err();
        // The deadline ends the tries and names the last failure.
        assert_eq!(err.kind(), ErrorKind::Timeout, "{}", err.chain());
        assert!(err.chain().contains("fetching bytes"), "{}", err.chain());
        assert!(!engine.cache.is_present(1));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_reads_of_the_same_chunks_fetch_each_once() {
        let data = content(16);
        let (engine, source, _dir) = engine(
            &data,
            EngineOptions {
                max_request_bytes: 1,
                ..EngineOptions::default()
            },
        );
        let disk = engine.layer.disk;
        let reads = (0..8).map(|i| {
            let engine = Arc::clone(&engine);
            tokio::spawn(
                async move { engine.read(disk, (i * 100) as u64, 12 * CHUNK as u64).await },
            )
        });
        for r in futures_util::future::join_all(reads).await {
            r.unwrap().unwrap();
        }
        // 13 chunks touched (0..13): 13 fetches, however many readers.
        assert_eq!(engine.stats.snapshot().chunks_fetched, 13);
        assert_eq!(calls(&source), 13);
    }

    /// A layer of one file `disk/d.raw` holding `data` in `CHUNK`-byte chunks.
    /// Bytes held from the TOC's fetch answer the structure check's first try; when they fail
    /// it (garbled on the way), the check asks the registry itself, never the held bytes again.
    #[tokio::test]
    async fn held_bytes_that_fail_the_structure_check_are_asked_of_the_registry() {
        let (blob, summary) = honest(&content(2));
        // `head` held as the blob's first bytes.
        let holding = |head: Vec<u8>| {
            let mut held = Held::default();
            held.add(0, head.into());
            held
        };
        let (engine, source, _dir) =
            engine_of_blob(blob.clone(), &summary, EngineOptions::default());
        let head_end = engine.layer.chunks.iter().map(|c| c.compressed.start).min();
        let head = blob[..head_end.unwrap() as usize].to_vec();
        // Held as fetched: the head is not asked for.
        engine
            .check_structure(None, &holding(head.clone()))
            .await
            .unwrap();
        let calls = source.calls.lock().clone();
        assert!(calls.iter().all(|r| r.start > 0), "{calls:?}");
        // Garbled: the check fails on them once, then reads the registry's.
        let mut garbled = head;
        let mid = garbled.len() / 2;
        garbled[mid] ^= 0x40;
        let (engine, source, _dir) =
            engine_of_blob(blob.clone(), &summary, EngineOptions::default());
        engine
            .check_structure(None, &holding(garbled))
            .await
            .unwrap();
        let calls = source.calls.lock().clone();
        assert!(calls.iter().any(|r| r.start == 0), "{calls:?}");
    }

    fn honest(data: &[u8]) -> (Vec<u8>, crate::format::zstd_chunked::LayerSummary) {
        let (summary, blob) = crate::format::zstd_chunked::testing::write_layer(data, CHUNK);
        (blob, summary)
    }

    fn toc_of(blob: &[u8], s: &crate::format::zstd_chunked::LayerSummary) -> Toc {
        let loc = s.toc_location;
        decode_toc(
            &blob[loc.range().start as usize..loc.range().end as usize],
            &loc,
        )
        .unwrap()
    }

    /// `prefix` (the tar data as crafted) followed by `toc` in a skippable frame, and a summary
    /// that pins that TOC and claims `diff_id`.
    fn with_toc(
        mut prefix: Vec<u8>,
        toc: &Toc,
        diff_id: Digest,
    ) -> (Vec<u8>, crate::format::zstd_chunked::LayerSummary) {
        let json = serde_json::to_vec(toc).unwrap();
        let compressed = zstd::bulk::compress(&json, 1).unwrap();
        prefix.extend_from_slice(&[0x50, 0x2a, 0x4d, 0x18]);
        prefix.extend_from_slice(&(compressed.len() as u32).to_le_bytes());
        let toc_location = TocLocation {
            offset: prefix.len() as u64,
            length: compressed.len() as u64,
            uncompressed_length: json.len() as u64,
            checksum: Digest::of(&compressed),
        };
        prefix.extend_from_slice(&compressed);
        let summary = crate::format::zstd_chunked::LayerSummary {
            digest: Digest::of(&prefix),
            size: prefix.len() as u64,
            diff_id,
            annotations: Default::default(),
            toc_location,
            chunks: 0,
            zero_chunks: 0,
        };
        (prefix, summary)
    }

    async fn read_all(engine: &Engine) -> Result<Vec<u8>> {
        engine
            .read(
                engine.layer.disk,
                0,
                engine.layer.file_size(engine.layer.disk),
            )
            .await
    }

    #[tokio::test]
    async fn an_honest_layer_passes_both_checks_and_is_verified_once_complete() {
        let data = content(6);
        let (blob, summary) = honest(&data);
        let (engine, _, _dir) = engine_of_blob(blob, &summary, EngineOptions::default());
        engine
            .check_structure(None, &Held::default())
            .await
            .unwrap();
        let cache_dir = tempfile::tempdir().unwrap();
        let cache = CacheRoot::open(cache_dir.path()).unwrap();
        assert_eq!(
            engine.check_integrity(&cache).await,
            Integrity::Pending,
            "not complete yet"
        );
        assert_eq!(read_all(&engine).await.unwrap(), data);
        assert_eq!(engine.check_integrity(&cache).await, Integrity::Verified);
        assert_eq!(read_all(&engine).await.unwrap(), data);
    }

    #[tokio::test]
    async fn a_layer_whose_diff_id_is_a_lie_fails_every_read_once_complete() {
        let data = content(4);
        let (blob, mut summary) = honest(&data);
        summary.diff_id = Digest::of(b"another layer");
        let (engine, _, _dir) = engine_of_blob(blob, &summary, EngineOptions::default());
        engine
            .check_structure(None, &Held::default())
            .await
            .unwrap();
        assert_eq!(read_all(&engine).await.unwrap(), data);
        let cache_dir = tempfile::tempdir().unwrap();
        let cache = CacheRoot::open(cache_dir.path()).unwrap();
        let outcome = engine.check_integrity(&cache).await;
        let Integrity::Failed(why) = &outcome else {
            panic!("{outcome:?}")
        };
        assert!(
            why.contains("hashes to") && why.contains(&summary.diff_id.to_string()),
            "{why}"
        );
        assert_eq!(engine.stats.snapshot().integrity_failures, 1);
        let err = read_all(&engine).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
        assert!(
            err.chain()
                .contains("differs from what its image config says"),
            "{}",
            err.chain()
        );
        assert!(engine
            .read_cached(engine.layer.disk, 0, 10)
            .unwrap()
            .is_err());
    }

    #[tokio::test]
    async fn a_toc_that_renames_a_file_is_refused_before_anything_is_served() {
        let data = content(3);
        let (blob, summary) = honest(&data);
        let mut toc = toc_of(&blob, &summary);
        for e in &mut toc.entries {
            e.name = e.name.replace("d.raw", "other.raw");
        }
        let data_end = (summary.toc_location.offset - 8) as usize;
        let (blob, summary) = with_toc(blob[..data_end].to_vec(), &toc, summary.diff_id);
        let (engine, source, _dir) = engine_of_blob(blob, &summary, EngineOptions::default());
        let err = engine
            .check_structure(None, &Held::default())
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
        assert!(
            err.chain()
                .contains("path disk/d.raw, the TOC says disk/other.raw"),
            "{}",
            err.chain()
        );
        // Only the regions between chunks were fetched: no chunk.
        for range in source.calls.lock().iter() {
            assert!(engine
                .layer
                .chunks
                .iter()
                .all(|c| c.compressed.start >= range.end || c.compressed.end <= range.start));
        }
    }

    /// A one-chunk layer whose chunk is replaced, in the TOC, by a frame of fake content put
    /// just before the real one: hidden in a skippable frame (which every ordinary decoder
    /// ignores), or in plain sight (then the real content sits where the TOC says padding is).
    fn fake_first_chunk(hidden: bool) -> (Arc<Engine>, tempfile::TempDir) {
        let data = content(1);
        let (blob, summary) = honest(&data);
        let mut toc = toc_of(&blob, &summary);
        let first = toc.entries.iter().position(|e| e.kind == "reg").unwrap();
        let start = toc.entries[first].offset as usize;
        let fake = vec![0x41u8; CHUNK];
        let frame = zstd::bulk::compress(&fake, 1).unwrap();
        let mut crafted = blob[..start].to_vec();
        if hidden {
            crafted.extend_from_slice(&[0x50, 0x2a, 0x4d, 0x18]);
            crafted.extend_from_slice(&(frame.len() as u32).to_le_bytes());
        }
        let fake_at = crafted.len() as i64;
        crafted.extend_from_slice(&frame);
        let fake_end = crafted.len() as i64;
        crafted.extend_from_slice(&blob[start..(summary.toc_location.offset - 8) as usize]);
        let reg = &mut toc.entries[first];
        reg.offset = fake_at;
        reg.end_offset = fake_end;
        reg.chunk_digest = Digest::of(&fake).to_string();
        reg.digest = reg.chunk_digest.clone();
        let (crafted, summary) = with_toc(crafted, &toc, summary.diff_id);
        let (engine, _, dir) = engine_of_blob(crafted, &summary, EngineOptions::default());
        (engine, dir)
    }

    #[tokio::test]
    async fn a_chunk_inside_a_skippable_frame_is_refused() {
        let (engine, _dir) = fake_first_chunk(true);
        let err = engine
            .check_structure(None, &Held::default())
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
        assert!(
            err.chain().contains("no whole zstd frame"),
            "{}",
            err.chain()
        );
    }

    #[tokio::test]
    async fn a_fake_chunk_followed_by_the_real_content_is_refused() {
        let (engine, _dir) = fake_first_chunk(false);
        let err = engine
            .check_structure(None, &Held::default())
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{}", err.chain());
        assert!(err.chain().contains("not a valid tar"), "{}", err.chain());
    }

    #[tokio::test]
    async fn a_chunk_range_with_a_skippable_frame_is_never_served() {
        let data = content(1);
        let (blob, summary) = honest(&data);
        let (engine, _, _dir) = engine_of_blob(blob, &summary, EngineOptions::default());
        let (_, chunk) = engine.layer.chunk(0);
        let mut frame = vec![0x50, 0x2a, 0x4d, 0x18, 4, 0, 0, 0, 1, 2, 3, 4];
        frame.extend(zstd::bulk::compress(&data, 1).unwrap());
        let err = decode_chunk(&frame, chunk).unwrap_err();
        assert!(err.chain().contains("skippable frame"), "{}", err.chain());
        let mut trailing = zstd::bulk::compress(&data, 1).unwrap();
        trailing.extend_from_slice(b"junk");
        assert!(decode_chunk(&trailing, chunk).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_registry_that_never_finishes_an_answer_fails_the_read_at_the_deadline() {
        struct Stalled;
        impl BlobSource for Stalled {
            fn fetch(
                &self,
                _range: Range<u64>,
                _ask: Ask,
            ) -> futures_util::future::BoxFuture<'_, Result<bytes::Bytes>> {
                Box::pin(std::future::pending())
            }
        }
        let data = content(2);
        let (blob, summary) = honest(&data);
        let (engine, _, _dir) = engine_of_blob(blob, &summary, EngineOptions::default());
        let engine = Arc::try_unwrap(engine).ok().unwrap();
        let engine = Engine::with_source(
            engine.layer,
            engine.cache,
            Sources {
                blob: Box::new(Stalled),
                windows: None,
            },
            EngineOptions {
                fetch_deadline: Duration::from_secs(5),
                ..EngineOptions::default()
            },
        );
        let started = tokio::time::Instant::now();
        let err = read_all(&engine).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Timeout);
        assert!(
            err.chain().contains("did not succeed within 5 s"),
            "{}",
            err.chain()
        );
        assert!(
            started.elapsed() <= Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
    }
}
