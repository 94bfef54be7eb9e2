//! Directories vmdisk makes on a node, and who may enter them.
//!
//! Node state (the daemon's root, the cache) is private to root: 0700. The ready disks are
//! shared with one group, the one the VMs' hypervisor runs in (`vmm_group`): 0750, owned by
//! root and that group. Directories made on the way to either (`/run/vmdisk` for
//! `/run/vmdisk/disks`) can be passed through but not listed: 0711, as containerd makes its
//! own. Modes are set explicitly, so they hold whatever umask, unit or DaemonSet started the
//! process, and an older installation's directories are corrected at the next start.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use crate::error::{Error, Result};

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io(format!("chmod {mode:o} {}", path.display()), e))
}

/// Creates `path`'s missing ancestors, each passable but not listable (0711).
fn ancestors(path: &Path) -> Result<()> {
    let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) else {
        return Ok(());
    };
    if parent.exists() {
        return Ok(());
    }
    ancestors(parent)?;
    match std::fs::create_dir(parent) {
        Ok(()) => set_mode(parent, 0o711),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(Error::io(format!("creating {}", parent.display()), e)),
    }
}

fn create(path: &Path) -> Result<()> {
    ancestors(path)?;
    match std::fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && path.is_dir() => Ok(()),
        Err(e) => Err(Error::io(format!("creating {}", path.display()), e)),
    }
}

/// Makes `path` a directory only root may enter (0700).
pub fn private(path: &Path) -> Result<()> {
    create(path)?;
    set_mode(path, 0o700)
}

/// Makes `path` a directory root and group `gid` may read (0750, owned by root:`gid`).
pub fn shared(path: &Path, gid: u32) -> Result<()> {
    create(path)?;
    std::os::unix::fs::chown(path, Some(0), Some(gid))
        .map_err(|e| Error::io(format!("chown root:{gid} {}", path.display()), e))?;
    set_mode(path, 0o750)
}

/// Makes `path` a directory anyone may pass through but not list (0711): the parent of sockets
/// whose own modes decide who may connect.
pub fn passage(path: &Path) -> Result<()> {
    if path.is_dir() {
        return Ok(());
    }
    create(path)?;
    set_mode(path, 0o711)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt as _;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn modes_are_set_whatever_the_umask_and_corrected_on_old_directories() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("var/lib/state");
        private(&state).unwrap();
        assert_eq!(mode(&state), 0o700);
        assert_eq!(mode(&dir.path().join("var/lib")), 0o711);
        // An older installation's world-readable directory is made private.
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
        private(&state).unwrap();
        assert_eq!(mode(&state), 0o700);
        let disks = dir.path().join("run/vmdisk/disks");
        shared(&disks, 108).unwrap();
        assert_eq!(mode(&disks), 0o750);
        assert_eq!(std::fs::metadata(&disks).unwrap().gid(), 108);
        assert_eq!(mode(&dir.path().join("run/vmdisk")), 0o711);
        // A passage that exists is left as it is (it may be the system's).
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        passage(dir.path()).unwrap();
        assert_eq!(mode(dir.path()), 0o755);
    }
}
