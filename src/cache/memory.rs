//! The node's budget for verified chunks its caches had no room for.
//!
//! A chunk that its data file has no room for (a full disk) is kept in memory so the reads
//! waiting for it are answered ([`super::layer`]'s spill). One budget bounds what every layer
//! of the node holds that way together, whatever process serves it: each layer's mount server
//! notes what it holds in a small file of a *ledger* directory (the daemon's, on its run
//! directory: tmpfs, not the full disk) and may hold the budget less what the others noted.
//! Past it, a layer lets its oldest chunks go and a read of one fetches it again. One read
//! burst ([`READ_BURST`]) a layer may always hold, so the read that fetched a chunk is
//! answered even when others hold the whole budget: the node's bound is the budget and one
//! burst per layer answering from memory at that moment.
//!
//! The ledger is the node's and untrusted like the rest of its files: at most
//! [`MAX_LEDGER_ENTRIES`] entries of at most 32 bytes are read; an entry that does not parse
//! counts as nothing. A layer that holds anything writes its entry again each second
//! ([`MemoryBudget::renew`]); an entry older than [`STALE`] counts as nothing, so a server that
//! crashed (or exited without clearing it) holds no part of the budget for long.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

/// What a layer may always hold, whatever the others hold: a read burst and a sequential
/// reader's next requests.
pub const READ_BURST: u64 = 8 << 20;

/// The budget when none is configured: 256 MiB for the node.
pub const DEFAULT_BUDGET: u64 = 256 << 20;

/// Most ledger entries read (one per layer served on the node).
pub const MAX_LEDGER_ENTRIES: usize = 4096;

/// How old a ledger entry may be and still count: its layer renews it each second.
pub const STALE: std::time::Duration = std::time::Duration::from_secs(10);

/// The node's budget, as one layer sees it.
#[derive(Debug)]
pub struct MemoryBudget {
    bytes: u64,
    /// The ledger directory and this layer's entry in it; none for a process alone on its
    /// cache (`vmdisk mount`).
    ledger: Option<(PathBuf, String)>,
    /// What this layer holds now.
    held: AtomicU64,
}

impl MemoryBudget {
    /// A budget of `bytes` for this process alone.
    pub fn alone(bytes: u64) -> Self {
        MemoryBudget {
            bytes,
            ledger: None,
            held: AtomicU64::new(0),
        }
    }

    /// A budget of `bytes` shared through the ledger directory `dir`, where this layer's entry
    /// is `name` (its key: one server per layer). The entry is cleared now (an earlier server
    /// of the layer may have left one).
    pub fn shared(bytes: u64, dir: PathBuf, name: String) -> Self {
        let budget = MemoryBudget {
            bytes,
            ledger: Some((dir, name)),
            held: AtomicU64::new(0),
        };
        budget.note(0);
        budget
    }

    /// The budget for the node.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// What this layer holds now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }

    /// How much this layer may hold now: the budget less what the other layers noted, never
    /// less than [`READ_BURST`].
    pub fn room(&self) -> u64 {
        self.bytes.saturating_sub(self.others()).max(READ_BURST)
    }

    /// What the other layers of the ledger hold.
    fn others(&self) -> u64 {
        use std::io::Read;
        let Some((dir, me)) = &self.ledger else {
            return 0;
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return 0;
        };
        let mut total = 0u64;
        for entry in entries.flatten().take(MAX_LEDGER_ENTRIES) {
            let fresh = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|at| at.elapsed().map_or(true, |age| age < STALE));
            if !fresh || entry.file_name().to_str() == Some(me.as_str()) {
                continue;
            }
            let mut text = String::new();
            let read = std::fs::File::open(entry.path())
                .and_then(|f| f.take(32).read_to_string(&mut text));
            if read.is_ok() {
                total = total.saturating_add(text.trim().parse::<u64>().unwrap_or(0));
            }
        }
        total
    }

    /// Notes that this layer holds `held` bytes now (in the ledger, written aside and renamed;
    /// a failure to write it is logged once and leaves the last entry).
    pub fn note(&self, held: u64) {
        self.held.store(held, Ordering::Release);
        let Some((dir, me)) = &self.ledger else {
            return;
        };
        let path = dir.join(me);
        let tmp = dir.join(format!(".{me}.tmp"));
        let written = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&tmp, held.to_string()))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            tracing::warn!(ledger = %path.display(), error = %e, "noting the memory this layer holds for a full disk failed; the node's budget may be exceeded");
        }
    }
}

impl MemoryBudget {
    /// Writes this layer's entry again while it holds anything, so it stays counted
    /// ([`STALE`]); called each second.
    pub fn renew(&self) {
        let held = self.held();
        if held > 0 {
            self.note(held);
        }
    }
}

impl Drop for MemoryBudget {
    fn drop(&mut self) {
        if let Some((dir, me)) = &self.ledger {
            let _ = std::fs::remove_file(dir.join(me));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_share_one_budget_through_the_ledger_and_keep_a_read_burst() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = dir.path().join("ledger");
        let a = MemoryBudget::shared(64 << 20, ledger.clone(), "a".into());
        let b = MemoryBudget::shared(64 << 20, ledger.clone(), "b".into());
        assert_eq!((a.room(), b.room()), (64 << 20, 64 << 20));
        a.note(40 << 20);
        assert_eq!(b.room(), 24 << 20, "what a holds is b's no more");
        assert_eq!(
            a.room(),
            64 << 20,
            "its own holding is not counted against it"
        );
        b.note(24 << 20);
        assert_eq!(a.room(), 40 << 20);
        a.note(64 << 20);
        assert_eq!(b.room(), READ_BURST, "a read burst is always there");
        // Garbage in the ledger counts as nothing; a layer gone takes its entry with it.
        std::fs::write(ledger.join("junk"), "a lot").unwrap();
        drop(a);
        assert_eq!(b.room(), 64 << 20);
        // An entry nobody renewed for a while (its server crashed) counts as nothing.
        std::fs::write(ledger.join("crashed"), (32u64 << 20).to_string()).unwrap();
        assert_eq!(b.room(), 32 << 20);
        let old = std::time::SystemTime::now() - STALE - std::time::Duration::from_secs(1);
        std::fs::File::options()
            .write(true)
            .open(ledger.join("crashed"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert_eq!(b.room(), 64 << 20);
        assert_eq!(MemoryBudget::alone(1 << 20).room(), READ_BURST);
    }
}
