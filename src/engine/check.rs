//! The cache's chunks checked against what was verified: one chunk before it is trusted, the
//! files someone else changed, and every chunk once per process life in the background
//! (paced, at idle I/O priority); damaged chunks are fetched again.

use std::ops::Range;

use super::stats::Stats;
use super::{hydrate, Engine};
use crate::format::zstd_chunked::zeros_digest;
use crate::format::zstd_frames::all_zero;
use crate::oci::digest::Digest;

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

impl Engine {
    /// The digest present chunk `idx`'s cached bytes must have: its own, or the one kept when
    /// it was stored.
    pub(super) fn cached_digest(&self, idx: usize) -> Option<Digest> {
        self.layer.chunks[idx]
            .digest
            .or_else(|| self.cache.sum(idx))
    }

    /// Checks present chunk `idx`'s bytes in the cache against the digest they were verified
    /// with (blocking: reads and hashes the chunk). A chunk that differs is forgotten, so it is
    /// fetched again, and counted and logged; whether it was sound.
    pub fn check_cached(&self, idx: usize) -> bool {
        let (file, chunk) = self.layer.chunk(idx);
        if chunk.zeros {
            return self.check_cached_zeros(idx);
        }
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
        self.damaged(idx, &why);
        false
    }

    /// [`Engine::check_cached`] of a chunk marked zeros (up to 256 MiB): read a piece at a time
    /// and never held; sound when it reads as zeros and its digest is that of as many zeros.
    fn check_cached_zeros(&self, idx: usize) -> bool {
        let (file, chunk) = self.layer.chunk(idx);
        let mut piece = vec![0u8; (1 << 20).min(chunk.size as usize)];
        let mut at = 0;
        let why = loop {
            if at == chunk.size {
                if chunk.digest == Some(zeros_digest(chunk.size)) {
                    self.cache.mark_checked(idx);
                    return true;
                }
                break "its digest is not that of zeros".to_string();
            }
            let n = piece.len().min((chunk.size - at) as usize);
            if let Err(e) = self.cache.read_at(file, &mut piece[..n], chunk.offset + at) {
                break e.chain();
            }
            if !all_zero(&piece[..n]) {
                break format!("it is marked zeros but holds other bytes at {at}");
            }
            at += n as u64;
        };
        self.damaged(idx, &why);
        false
    }

    /// Forgets damaged chunk `idx`, which is then fetched again.
    fn damaged(&self, idx: usize, why: &str) {
        let (file, chunk) = self.layer.chunk(idx);
        // Counted and logged once however many readers found it at the same time.
        if self.cache.forget(idx) {
            Stats::add(&self.stats.cache_damaged, 1);
            tracing::warn!(layer = %self.layer.meta.layer_digest, chunk = idx, file = %self.layer.file_path(file), offset = chunk.offset, cache = %self.cache.dir().display(), reason = %why, "a cached chunk is not what was verified (a damaged or changed cache file); fetching it again");
        }
    }

    /// Checks every present chunk of `chunks` not checked in this process
    /// ([`Engine::check_cached`]); whether all were sound (damaged ones are now missing).
    pub(super) fn check_present(&self, chunks: Range<usize>) -> bool {
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
    pub(super) fn noticed_change(&self, file: usize) -> bool {
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
}
