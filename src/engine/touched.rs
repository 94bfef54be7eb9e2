//! What a boot trace being recorded holds: the chunks of the disk readers touched, in
//! first-touch order ([`super::trace`] records and replays it).

use std::ops::Range;

use parking_lot::Mutex;

/// The chunks of the disk file that readers touched, in first-touch order.
pub(super) struct Recorder {
    pub(super) seen: Vec<std::sync::atomic::AtomicU64>,
    /// Disk-file byte ranges, adjacent ones merged.
    pub(super) order: Mutex<Vec<Range<u64>>>,
}
