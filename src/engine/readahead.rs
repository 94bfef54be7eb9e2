//! Deciding what to fetch ahead of a reader.
//!
//! Random readers get no read-ahead: a read fetches the chunks it touches and nothing else, so
//! scattered reads cost about what they read. A reader becomes a stream once it has read
//! [`STREAM_THRESHOLD`] bytes back to back; from then on the window ahead of it grows with
//! what it has read (as the kernel's own read-ahead ramps up), up to
//! [`EngineOptions::readahead_bytes`](super::EngineOptions::readahead_bytes), and is refilled
//! in large steps once half of it is consumed, so the engine can cut it into few large
//! requests that keep the link full.

use std::ops::Range;

/// Bytes a reader must read back to back before it counts as a stream: more than any single
/// read of a random reader (qemu and fio issue up to 1–2 MiB), which the kernel may split
/// into several FUSE requests.
pub const STREAM_THRESHOLD: u64 = 4 << 20;

/// How far from the stream's head a read may land and still continue it: the kernel sends
/// the pieces of one large read concurrently, so they may arrive out of order.
const SLACK: u64 = 1 << 20;

/// One reader of one file.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stream {
    /// Where the furthest read so far ended.
    head: u64,
    /// Bytes read back to back up to `head`.
    run: u64,
    /// Where the read-ahead asked for so far ends.
    ahead: u64,
}

impl Stream {
    /// Records a read of `len` bytes at `offset`; returns the bytes to fetch ahead of it, if
    /// any (at most `max_window` past the head, never what was asked for before).
    pub fn advance(&mut self, offset: u64, len: u64, max_window: u64) -> Option<Range<u64>> {
        let continues = self.run > 0 && offset <= self.head + SLACK && offset + SLACK >= self.head;
        let end = offset.saturating_add(len);
        if continues {
            self.run = self.run.saturating_add(len);
            self.head = self.head.max(end);
        } else {
            *self = Stream {
                head: end,
                run: len,
                ahead: 0,
            };
        }
        if self.run < STREAM_THRESHOLD || max_window == 0 {
            return None;
        }
        let window = self
            .run
            .clamp(STREAM_THRESHOLD, max_window.max(STREAM_THRESHOLD));
        // Refill once less than half the window is left ahead of the head.
        if self.ahead >= self.head.saturating_add(window / 2) {
            return None;
        }
        let start = self.ahead.max(self.head);
        self.ahead = self.head.saturating_add(window);
        Some(start..self.ahead)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Feeds reads of `size` at `offsets`; every read-ahead range asked for.
    fn feed(
        stream: &mut Stream,
        offsets: impl IntoIterator<Item = u64>,
        size: u64,
    ) -> Vec<Range<u64>> {
        offsets
            .into_iter()
            .filter_map(|o| stream.advance(o, size, 32 * MIB))
            .collect()
    }

    #[test]
    fn random_reads_get_no_read_ahead() {
        let mut s = Stream::default();
        // 1 MiB reads, each split into eight 128 KiB kernel requests, at scattered offsets.
        let mut offsets = Vec::new();
        for base in [700, 13, 1900, 402, 77, 1500, 1234, 88] {
            offsets.extend((0..8).map(|i| base * MIB + 3 * 4096 + i * 128 * 1024));
        }
        assert!(feed(&mut s, offsets, 128 * 1024).is_empty());
    }

    #[test]
    fn a_stream_ramps_up_to_the_window_and_asks_each_byte_once() {
        let mut s = Stream::default();
        let asked = feed(&mut s, (0..1024).map(|i| i * 128 * 1024), 128 * 1024);
        assert!(!asked.is_empty());
        // Nothing before the threshold, then windows that grow and never overlap.
        assert!(asked[0].start >= STREAM_THRESHOLD);
        for pair in asked.windows(2) {
            assert_eq!(pair[0].end, pair[1].start, "{asked:?}");
        }
        let first = asked[0].end - asked[0].start;
        let last = asked[asked.len() - 1].end - asked[asked.len() - 1].start;
        assert!(last > first, "the window grows: {asked:?}");
        // Never more than the window ahead of what was read (128 MiB).
        assert!(asked.last().unwrap().end <= 128 * MIB + 32 * MIB);
        // Once the window is full, refills come in steps of half of it.
        assert!(asked.len() < 20, "{} refills", asked.len());
    }

    #[test]
    fn out_of_order_pieces_of_one_stream_keep_it() {
        let mut s = Stream::default();
        let mut offsets: Vec<u64> = (0..64).map(|i| i * 128 * 1024).collect();
        for pair in offsets.chunks_mut(2) {
            pair.swap(0, 1);
        }
        assert!(!feed(&mut s, offsets, 128 * 1024).is_empty());
    }

    #[test]
    fn a_jump_starts_a_new_stream() {
        let mut s = Stream::default();
        assert!(!feed(&mut s, (0..64).map(|i| i * MIB), MIB).is_empty());
        assert_eq!(s.advance(900 * MIB, MIB, 32 * MIB), None);
        assert_eq!(s.run, MIB);
    }

    #[test]
    fn a_zero_window_turns_read_ahead_off() {
        let mut s = Stream::default();
        assert!((0..64).all(|i| s.advance(i * MIB, MIB, 0).is_none()));
    }
}
