//! Counters of the lazy engine, kept in one place: the mount prints them (`--stats`), the
//! daemon will export them as Prometheus metrics under the same names.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// Live counters (all monotonic).
#[derive(Default, Debug)]
pub struct Stats {
    /// FUSE read requests answered by the daemon (passthrough reads never arrive here).
    pub read_calls: AtomicU64,
    /// Bytes returned to readers.
    pub bytes_served: AtomicU64,
    /// Reads whose chunks were all present.
    pub cache_hits: AtomicU64,
    /// Reads that had to wait for at least one chunk.
    pub cache_misses: AtomicU64,
    /// Compressed bytes received from the registry for chunks.
    pub bytes_fetched: AtomicU64,
    /// Range requests sent for chunks.
    pub fetch_requests: AtomicU64,
    /// Chunks fetched and verified.
    pub chunks_fetched: AtomicU64,
    /// Chunks copied from another cached layer with the same digest.
    pub chunks_deduplicated: AtomicU64,
    /// Uncompressed bytes copied that way.
    pub bytes_deduplicated: AtomicU64,
    /// Chunks that failed verification (each is refetched once).
    pub verify_failures: AtomicU64,
    /// Fetch attempts that failed (network, truncation).
    pub fetch_errors: AtomicU64,
    /// Reads answered with EIO.
    pub read_errors: AtomicU64,
    /// Total time spent in chunk fetch requests, microseconds.
    pub fetch_micros: AtomicU64,
    /// Files opened with FUSE passthrough.
    pub passthrough_opens: AtomicU64,
    /// Checks of the complete layer that found it differs from its image config (then every
    /// read fails).
    pub integrity_failures: AtomicU64,
    /// Cached chunks whose bytes were not what was verified when read back (each is fetched
    /// again).
    pub cache_damaged: AtomicU64,
}

/// A point-in-time copy of [`Stats`], for printing.
#[derive(Debug, Serialize, Deserialize, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub read_calls: u64,
    pub bytes_served: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub bytes_fetched: u64,
    pub fetch_requests: u64,
    pub chunks_fetched: u64,
    pub chunks_deduplicated: u64,
    pub bytes_deduplicated: u64,
    pub verify_failures: u64,
    pub fetch_errors: u64,
    pub read_errors: u64,
    pub fetch_micros: u64,
    pub passthrough_opens: u64,
    #[serde(default)]
    pub integrity_failures: u64,
    #[serde(default)]
    pub cache_damaged: u64,
    /// 1 while the cache's disk has no room for chunks (they are answered from memory), else
    /// 0: a gauge the engine fills in ([`crate::engine::Engine::counters`]), not kept here.
    #[serde(default)]
    pub cache_full: u64,
    /// Bytes of verified chunks held in memory because the cache's disk had no room: a gauge
    /// the engine fills in, like `cache_full`.
    #[serde(default)]
    pub memory_held: u64,
}

impl Stats {
    /// Adds `n` to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// The current values.
    pub fn snapshot(&self) -> StatsSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            read_calls: g(&self.read_calls),
            bytes_served: g(&self.bytes_served),
            cache_hits: g(&self.cache_hits),
            cache_misses: g(&self.cache_misses),
            bytes_fetched: g(&self.bytes_fetched),
            fetch_requests: g(&self.fetch_requests),
            chunks_fetched: g(&self.chunks_fetched),
            chunks_deduplicated: g(&self.chunks_deduplicated),
            bytes_deduplicated: g(&self.bytes_deduplicated),
            verify_failures: g(&self.verify_failures),
            fetch_errors: g(&self.fetch_errors),
            read_errors: g(&self.read_errors),
            fetch_micros: g(&self.fetch_micros),
            passthrough_opens: g(&self.passthrough_opens),
            integrity_failures: g(&self.integrity_failures),
            cache_damaged: g(&self.cache_damaged),
            cache_full: 0,
            memory_held: 0,
        }
    }
}
