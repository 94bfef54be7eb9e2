//! Disk views: the seam between the FUSE layer and the engine. A view is a file's bytes as a
//! reader sees them — a file of a layer ([`file::LayerFile`]), or the raw view of a qcow2 over
//! any other view ([`qcow2::Qcow2View`]) — with what FUSE needs and nothing else: its size,
//! what can be answered from the cache at once, a read that fetches what is missing, and
//! read-ahead. FUSE maps inodes to views; a read of `disk.raw` goes FUSE → qcow2 view → layer
//! file → engine → source → registry, and a read of cached data answers on the FUSE thread
//! whichever view it is.

pub mod file;
pub mod qcow2;

use std::ops::Range;

use futures_util::future::BoxFuture;

use crate::error::Result;

/// A file's bytes as readers see them.
pub trait DiskView: Send + Sync {
    /// Its size in bytes.
    fn size(&self) -> u64;

    /// `len` bytes at `offset` (fewer at the end), if everything they need is cached; `None`
    /// if something must be fetched. Never blocks on the network.
    fn read_cached(&self, offset: u64, len: u64) -> Option<Result<Vec<u8>>>;

    /// [`DiskView::read_cached`] appending to `out` (as it was when `None`): a view that
    /// assembles a read from pieces of another copies each piece once.
    fn read_cached_into(&self, offset: u64, len: u64, out: &mut Vec<u8>) -> Option<Result<()>> {
        let bytes = self.read_cached(offset, len)?;
        Some(bytes.map(|b| out.extend_from_slice(&b)))
    }

    /// `len` bytes at `offset` (fewer at the end), fetching what is missing.
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Vec<u8>>>;

    /// Fetches what bytes `range` need, for a reader about to read them.
    fn prefetch(&self, range: Range<u64>) -> BoxFuture<'_, Result<()>>;

    /// The local file that holds exactly the view's bytes, once every one is cached and
    /// verified, for the kernel to read directly (FUSE passthrough); `None` for a view
    /// computed per read, or one not complete yet.
    fn backing_file(&self) -> Option<&std::fs::File> {
        None
    }

    /// Whether the view's local file is complete and unchanged but not yet checked again by
    /// this process (chunks cached by an earlier one): fit for passthrough once they are.
    fn backing_pending(&self) -> bool {
        false
    }
}

/// The length of a read of `len` bytes at `offset` of a view of `size` bytes.
pub(crate) fn clipped(offset: u64, len: u64, size: u64) -> u64 {
    len.min(size.saturating_sub(offset))
}
