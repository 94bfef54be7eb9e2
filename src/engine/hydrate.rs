//! Fetching beyond a reader's read: chunks named by ranges, in order (a trace's replay,
//! `vmdisk prefetch`), and the whole layer in the background while readers rest (hydration),
//! with fetch slots of its own.

use std::ops::Range;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::{Engine, Priority, HYDRATE_WHEN_FULL, READERS_REST};

/// Chunks in one batch of hydration (4 MiB of 256 KiB chunks).
const HYDRATE_BATCH: usize = 16;
use crate::error::Result;

/// The pace of background work at a byte rate (hydration's fetches, the re-verification of a
/// cache after a restart): when the next piece of work may start, given the bytes started
/// since the pace began. A rate of 0 sets no pace.
pub(super) struct Pace {
    rate: u64,
    since: Instant,
    bytes: u64,
}

impl Pace {
    pub(super) fn new(rate: u64) -> Self {
        Pace {
            rate,
            since: Instant::now(),
            bytes: 0,
        }
    }

    /// Begins anew from now (after a pause, which the work does not catch up on).
    pub(super) fn restart(&mut self) {
        *self = Pace::new(self.rate);
    }

    /// When work of `bytes` may start; counts them.
    pub(super) fn start(&mut self, bytes: u64) -> Instant {
        if self.rate == 0 {
            return Instant::now();
        }
        let at = self.since + Duration::from_secs_f64(self.bytes as f64 / self.rate as f64);
        self.bytes += bytes;
        at
    }
}

impl Engine {
    /// Fetches the chunks of file `file` that `ranges` (file byte ranges) cover, in that
    /// order, `in_flight` requests at a time; each chunk once, present ones skipped. Returns
    /// how many chunks the ranges cover.
    pub async fn ensure_ranges(
        &self,
        file: usize,
        ranges: &[Range<u64>],
        in_flight: usize,
    ) -> Result<usize> {
        use futures_util::StreamExt;
        let mut seen = std::collections::HashSet::new();
        let mut order: Vec<usize> = Vec::new();
        for range in ranges {
            order.extend(
                self.layer
                    .chunks_for(file, range.clone())
                    .filter(|&c| seen.insert(c)),
            );
        }
        // Runs of chunks adjacent in `order` and in the blob, one request each.
        let runs = self.request_runs(order.iter().copied());
        let mut fetches = futures_util::stream::iter(runs.into_iter().map(|r| self.ensure(r)))
            .buffered(in_flight.max(1));
        while let Some(result) = fetches.next().await {
            result?;
        }
        Ok(order.len())
    }

    /// Waits until no reader has had to fetch for [`READERS_REST`]: background hydration
    /// starts, and goes on, only while the readers (a booting guest) need nothing from the
    /// registry. Whether it waited.
    async fn wait_until_readers_rest(&self) -> bool {
        let mut waited = false;
        loop {
            let rested = self.last_demand.lock().elapsed();
            match READERS_REST.checked_sub(rested) {
                Some(left) if !left.is_zero() => {
                    waited = true;
                    tokio::time::sleep(left).await
                }
                _ => return waited,
            }
        }
    }

    /// Fetches the whole layer in order, `concurrency` batches at a time, with fetch slots of
    /// its own (a reader never waits for one hydration holds). With `bytes_per_second`
    /// (uncompressed): at most that, and only while readers rest
    /// ([`Engine::wait_until_readers_rest`]): background hydration.
    pub async fn hydrate(&self, concurrency: usize, bytes_per_second: Option<u64>) -> Result<()> {
        self.usable()?;
        use futures_util::StreamExt;
        // A batch is the unit hydration paces and runs `concurrency` of (what each request of it
        // covers is `Engine::joins_run`'s to say): a fixed count of chunks, so a batch of a
        // sparse disk's zero chunks is not gigabytes the pace must then wait for.
        let total = self.layer.chunks.len();
        let batches: Vec<Range<usize>> = (0..total)
            .step_by(HYDRATE_BATCH)
            .map(|s| s..(s + HYDRATE_BATCH).min(total))
            .collect();
        // The pace of a rate-limited hydration; a wait for the readers starts it anew (the
        // rest does not let it catch up).
        let pace = Mutex::new(Pace::new(bytes_per_second.unwrap_or(0)));
        let batch = |r: Range<usize>| {
            let bytes: u64 = self.layer.chunks[r.clone()].iter().map(|c| c.size).sum();
            let pace = &pace;
            async move {
                // A full disk keeps what it fetches in memory only: hydrate slowly until it
                // has room again (a batch a while is the probe).
                if self.cache.full() {
                    tokio::time::sleep(HYDRATE_WHEN_FULL).await;
                }
                if bytes_per_second.is_some() {
                    if self.wait_until_readers_rest().await {
                        pace.lock().restart();
                    }
                    let start_at = pace.lock().start(bytes);
                    tokio::time::sleep_until(start_at).await;
                }
                // A pull-through mirror filling the blob from the origin serves the fleet once
                // it holds it: wait for it rather than fetch the blob from the origin once per
                // node (bounded: `health::MAX_FILL_WAIT`). A batch whose ask showed the fill
                // (the registry is then not asked for it) waits and goes again.
                loop {
                    while let Some(until) = self.sources.blob.filling() {
                        tokio::time::sleep_until(until).await;
                    }
                    match self.ensure_as(r.clone(), Priority::Hydration).await {
                        Err(_) if self.sources.blob.filling().is_some() => continue,
                        done => return done,
                    }
                }
            }
        };
        // The first batch alone: where a mirror is a pull-through cache that lacks the blob,
        // its one ask starts the fill and the batches after it wait for that fill; batches
        // beside it would go to the origin while it asks (a mirror is asked for a blob it has
        // not served by one request at a time: `Health::first_ask`).
        let mut batches = batches.into_iter();
        if let Some(first) = batches.next() {
            batch(first).await?;
        }
        let mut stream =
            futures_util::stream::iter(batches.map(batch)).buffered(concurrency.max(1));
        while let Some(result) = stream.next().await {
            result?;
        }
        Ok(())
    }
}
