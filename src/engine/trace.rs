//! Boot traces in the engine: which chunks of the disk readers touch, in first-touch order,
//! recorded while a boot runs, and those chunks fetched first at a later cold start
//! ([`crate::trace`] publishes and finds traces).

use std::ops::Range;

use parking_lot::Mutex;

use super::touched::Recorder;
use super::Engine;
use crate::error::Result;

impl Engine {
    /// Starts recording which chunks of the disk readers touch, in order (a boot trace).
    /// Reads through the kernel's page cache or FUSE passthrough never reach the engine: mount
    /// without passthrough to record.
    pub fn start_recording(&self) {
        let words = self.layer.chunks.len().div_ceil(64);
        let _ = self.recorder.set(Recorder {
            seen: (0..words)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
            order: Mutex::new(Vec::new()),
        });
    }

    /// What was recorded since [`Engine::start_recording`]: disk-file byte ranges of the
    /// touched chunks in first-touch order.
    pub fn recorded(&self) -> Vec<Range<u64>> {
        self.recorder
            .get()
            .map_or_else(Vec::new, |r| r.order.lock().clone())
    }

    /// Records a read of `range` of `file` if recording and `file` is the disk.
    pub(super) fn note_read(&self, file: usize, range: Range<u64>) {
        use std::sync::atomic::Ordering;
        let Some(recorder) = self.recorder.get().filter(|_| file == self.layer.disk) else {
            return;
        };
        for idx in self.layer.chunks_for(file, range) {
            let bit = 1u64 << (idx % 64);
            if recorder.seen[idx / 64].fetch_or(bit, Ordering::Relaxed) & bit != 0 {
                continue;
            }
            let chunk = &self.layer.chunks[idx];
            let span = chunk.offset..chunk.offset + chunk.size;
            let mut order = recorder.order.lock();
            match order.last_mut() {
                Some(last) if last.end == span.start => last.end = span.end,
                _ => order.push(span),
            }
        }
    }

    /// Fetches the chunks of the disk that `ranges` (disk-file byte ranges) cover, in that
    /// order, a few requests at a time so that readers' misses keep slots of their own; each
    /// chunk once, present ones skipped. Returns how many chunks the ranges cover.
    pub async fn replay(&self, ranges: &[Range<u64>]) -> Result<usize> {
        let in_flight = (self.opts.max_concurrent_fetches / 2).max(1);
        self.ensure_ranges(self.layer.disk, ranges, in_flight).await
    }
}
