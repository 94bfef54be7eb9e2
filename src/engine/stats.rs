//! Counters of the lazy engine, each declared once, in the table below: the live [`Stats`], the
//! [`StatsSnapshot`] a mount prints (`--stats`), the control protocol's `LayerCounters` a
//! mount server reports to the daemon (both conversions), and the Prometheus counters the
//! daemon keeps of them ([`METRICS`], from which `/metrics` and `vmdisk stats` are made) are
//! all made from it. The protocol's message (`proto/vmdisk/v1/layer.proto`) names each field
//! too: a counter added here without it does not build. The gauges the engine fills in (after
//! `@gauges`) are declared in the same table.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::api::vmdisk::v1 as pb;

/// One counter the daemon keeps as a Prometheus counter: its metric name (without `_total`),
/// help, and where its value is in a server's counters.
pub type Metric = (&'static str, &'static str, fn(&StatsSnapshot) -> u64);

/// Declares the engine's counters (see the module docs): each a field, its doc and, if the
/// daemon keeps it, its metric name and help.
macro_rules! counters {
    ($(
        $(#[doc = $doc:literal])*
        $field:ident $(=> $metric:literal, $help:literal)?;
    )*
    @gauges $(
        $(#[doc = $gdoc:literal])*
        $gauge:ident;
    )*) => {
        /// Live counters (all monotonic).
        #[derive(Default, Debug)]
        pub struct Stats {
            $( $(#[doc = $doc])* pub $field: AtomicU64, )*
        }

        /// A point-in-time copy of [`Stats`], with the engine's gauges.
        #[derive(Debug, Serialize, Deserialize, Clone, Copy, Default, PartialEq, Eq)]
        #[serde(default)]
        pub struct StatsSnapshot {
            $( $(#[doc = $doc])* pub $field: u64, )*
            $( $(#[doc = $gdoc])* pub $gauge: u64, )*
        }

        impl Stats {
            /// The current values (the gauges 0).
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot {
                    $( $field: self.$field.load(Ordering::Relaxed), )*
                    $( $gauge: 0, )*
                }
            }
        }

        /// The counters the daemon keeps, summed over every mount server it ran.
        pub const METRICS: &[Metric] = &[
            $( $( ($metric, $help, |s: &StatsSnapshot| s.$field), )? )*
        ];

        /// A server's counters as the control protocol carries them (its endpoints apart).
        impl From<StatsSnapshot> for pb::LayerCounters {
            fn from(s: StatsSnapshot) -> Self {
                pb::LayerCounters {
                    $( $field: s.$field, )*
                    $( $gauge: s.$gauge, )*
                    endpoints: Vec::new(),
                }
            }
        }

        /// The counters a server reported.
        impl From<&pb::LayerCounters> for StatsSnapshot {
            fn from(c: &pb::LayerCounters) -> Self {
                StatsSnapshot {
                    $( $field: c.$field, )*
                    $( $gauge: c.$gauge, )*
                }
            }
        }
    };
}

counters! {
    /// FUSE read requests answered by the daemon (passthrough reads never arrive here).
    read_calls;
    /// Bytes returned to readers.
    bytes_served => "vmdisk_served_bytes",
        "Bytes returned to FUSE readers by the servers (passthrough reads excluded).";
    /// Reads whose chunks were all present.
    cache_hits => "vmdisk_cache_hits", "FUSE reads whose chunks were all in the cache.";
    /// Reads that had to wait for at least one chunk.
    cache_misses => "vmdisk_cache_misses",
        "FUSE reads that waited for at least one chunk to be fetched.";
    /// Compressed bytes received from the registry for chunks.
    bytes_fetched => "vmdisk_registry_bytes", "Compressed chunk bytes received from registries.";
    /// Range requests sent for chunks.
    fetch_requests => "vmdisk_registry_requests", "Range requests sent for chunks.";
    /// Chunks fetched and verified.
    chunks_fetched => "vmdisk_chunks_fetched", "Chunks fetched and verified.";
    /// Chunks copied from another cached layer with the same digest.
    chunks_deduplicated => "vmdisk_chunks_deduplicated",
        "Chunks copied from another cached layer instead of fetched.";
    /// Uncompressed bytes copied that way.
    bytes_deduplicated;
    /// Chunks that failed verification (each is refetched once).
    verify_failures => "vmdisk_verify_failures", "Chunks that failed digest verification.";
    /// Fetch attempts that failed (network, truncation).
    fetch_errors;
    /// Reads answered with EIO.
    read_errors => "vmdisk_read_errors", "FUSE reads answered with EIO.";
    /// Reads that waited past the fetch deadline for their chunks (then answered with EIO,
    /// counted in `read_errors` too).
    read_timeouts => "vmdisk_read_timeouts",
        "FUSE reads that waited past the fetch deadline ([registry] fetch_timeout) for their chunks, then answered with EIO.";
    /// Total time spent in chunk fetch requests, microseconds.
    fetch_micros;
    /// Files opened with FUSE passthrough.
    passthrough_opens;
    /// Checks of the complete layer that found it differs from its image config (then every
    /// read fails).
    integrity_failures => "vmdisk_integrity_failures",
        "Checks of a complete layer that found it differs from its image config.";
    /// Cached chunks whose bytes were not what was verified when read back (each is fetched
    /// again).
    cache_damaged => "vmdisk_cache_damaged",
        "Cached chunks that were not what was verified when read back (each fetched again).";
@gauges
    /// 1 while the cache's disk has no room for chunks (they are answered from memory), else
    /// 0: a gauge the engine fills in ([`crate::engine::Engine::counters`]), not kept in
    /// [`Stats`].
    cache_full;
    /// Bytes of verified chunks held in memory because the cache's disk had no room: a gauge
    /// the engine fills in, like `cache_full`.
    memory_held;
}

/// What the FUSE front end saw of a read or an open, counted by [`super::Engine::count`].
#[derive(Clone, Copy, Debug)]
pub enum Seen {
    /// A read asked.
    ReadCall,
    /// A read answered from what is cached, on the FUSE thread.
    CacheHit,
    /// A read that had to fetch.
    CacheMiss,
    /// A file opened with FUSE passthrough.
    PassthroughOpen,
    /// A read answered with this many bytes.
    Answered(u64),
    /// A read answered EIO; `timeout`: because it ran out of time.
    Failed { timeout: bool },
}

/// A layer's blob reads counted in its engine's counters.
impl crate::blob::FetchCounts for Stats {
    fn requested(&self) {
        Stats::add(&self.fetch_requests, 1);
    }

    fn fetched(&self, bytes: u64, took: std::time::Duration) {
        Stats::add(&self.bytes_fetched, bytes);
        Stats::add(&self.fetch_micros, took.as_micros() as u64);
    }

    fn failed(&self) {
        Stats::add(&self.fetch_errors, 1);
    }
}

impl Stats {
    /// Adds `n` to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}
