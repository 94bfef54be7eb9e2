//! The daemon's control plane ahead of its disks' reads.
//!
//! The daemon answers containerd (Prepare), kubelet's probes, `vmdisk ls`/`stats` and metric
//! scrapes; its mount servers — processes of their own — serve the disks' reads and can keep
//! every CPU busy. The daemon's threads run `control_priority` nice levels (5 by default)
//! above the level it was started at and its servers at that level (Linux keeps a nice level
//! per thread, and a thread starts at its creator's; a server is told its level and takes it
//! before its threads start), so a loaded node still answers its control calls promptly while
//! the reads keep the share they had. Raising a priority needs `CAP_SYS_NICE` (root, a privileged pod); without
//! it everything runs at the start level.

use rustix::process::{getpriority_process, setpriority_process, Pid};

/// Raises every thread of this process `boost` levels (those it starts later start there);
/// the level its servers are to run at (the one it was started at), or `None` if it did not
/// raise them. Blocking (reads `/proc/self/task`).
pub fn raise(boost: u8) -> Option<i32> {
    let base = getpriority_process(None).ok()?;
    let level = (base - i32::from(boost)).max(-20);
    if level == base {
        return None;
    }
    let tids: Vec<i32> = std::fs::read_dir("/proc/self/task")
        .ok()?
        .flatten()
        .filter_map(|t| t.file_name().to_str()?.parse().ok())
        .collect();
    for &tid in &tids {
        if let Err(e) = setpriority_process(Pid::from_raw(tid), level) {
            tracing::info!(error = %e, "the daemon cannot run its control plane ahead of its mount servers (needs CAP_SYS_NICE); both run at one priority");
            for &tid in &tids {
                let _ = setpriority_process(Pid::from_raw(tid), base);
            }
            return None;
        }
    }
    tracing::debug!(
        nice = level,
        servers = base,
        "control plane priority raised"
    );
    Some(base)
}

/// Sets the calling thread's nice level (a mount server's, before its threads start: they
/// take it from it).
pub fn lower_to(level: i32) -> std::io::Result<()> {
    setpriority_process(None, level).map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_keeps_the_level_it_set_and_hands_it_on() {
        // A thread of its own: levels are per thread, and lowering needs no privilege.
        std::thread::spawn(|| {
            let start = getpriority_process(None).unwrap();
            let lower = (start + 1).min(19);
            lower_to(lower).unwrap();
            assert_eq!(getpriority_process(None).unwrap(), lower);
            let child = std::thread::spawn(|| getpriority_process(None).unwrap())
                .join()
                .unwrap();
            assert_eq!(child, lower, "a thread starts at its creator's level");
        })
        .join()
        .unwrap();
    }
}
