//! Mount servers outside the daemon's pod: each server moves itself into a cgroup of its own
//! choosing (`server_cgroup`) in every cgroup hierarchy of the node before it serves, so that
//! replacing the DaemonSet's pod — an update, a crash, an OOM kill: the runtime kills every
//! process of the pod's cgroup — leaves the FUSE sessions of running VMs served. The new
//! daemon adopts the servers as a restarted one does ([`crate::snapshotter::servers::supervisor`]).
//!
//! It needs what a privileged pod in the node's PID namespace has (`hostPID: true`): the
//! servers are not in a PID namespace that ends with the pod, and CAP_SYS_ADMIN to enter the
//! node's cgroup namespace (cgroup v2 pods have one of their own) and mount its hierarchies.
//! The Debian package's daemon needs none of it (its unit keeps servers with `KillMode=process`).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Moves this process into cgroup `target` (a path from each hierarchy's root, e.g.
/// `/vmdisk-servers`) in every hierarchy it belongs to, leaving the pod's. Call it before the
/// process starts threads. Returns the hierarchies moved (`cgroup2`, or v1 controller lists).
pub fn leave_pod(target: &str) -> Result<Vec<String>> {
    enter_nodes_cgroup_namespace()?;
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| Error::io("reading /proc/self/cgroup", e))?;
    // Every hierarchy is tried: one that cannot be joined leaves the others joined.
    let (mut moved, mut failed) = (Vec::new(), Vec::new());
    for line in own.lines().take(64) {
        let mut parts = line.splitn(3, ':');
        let controllers = match (parts.next(), parts.next()) {
            (Some(_), Some(controllers)) => controllers,
            _ => continue,
        };
        let hierarchy = match controllers {
            "" => Hierarchy::V2,
            named => Hierarchy::V1(named.to_string()),
        };
        match move_in(&hierarchy, target) {
            Ok(()) => moved.push(hierarchy.name()),
            Err(e) => failed.push(format!("{}: {}", hierarchy.name(), e.chain())),
        }
    }
    match failed.is_empty() {
        true => Ok(moved),
        false => Err(Error::io(
            format!(
                "joining cgroup {target} (joined in {})",
                if moved.is_empty() {
                    "none".to_string()
                } else {
                    moved.join(" ")
                }
            ),
            std::io::Error::other(failed.join("; ")),
        )),
    }
}

#[derive(Debug)]
enum Hierarchy {
    V2,
    /// A v1 hierarchy by its controllers (`cpu,cpuacct`, `name=systemd`).
    V1(String),
}

impl Hierarchy {
    fn name(&self) -> String {
        match self {
            Hierarchy::V2 => "cgroup2".into(),
            Hierarchy::V1(controllers) => controllers.clone(),
        }
    }
}

/// Enters the cgroup namespace of the node's first process if it is not this one's (a pod's
/// own, on cgroup v2): the hierarchies are then mounted from the node's root.
fn enter_nodes_cgroup_namespace() -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let ns = |pid: &str| std::fs::metadata(format!("/proc/{pid}/ns/cgroup")).map(|m| m.ino());
    match (ns("1"), ns("self")) {
        (Ok(node), Ok(own)) if node != own => {
            let file = std::fs::File::open("/proc/1/ns/cgroup")
                .map_err(|e| Error::io("opening the node's cgroup namespace", e))?;
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWCGROUP)
                .map_err(|e| Error::io("entering the node's cgroup namespace", e.into()))
        }
        _ => Ok(()),
    }
}

/// Mounts `hierarchy` at a private directory, makes `target` in it and moves this process
/// there, then unmounts it.
fn move_in(hierarchy: &Hierarchy, target: &str) -> Result<()> {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    let dir = tempfile::Builder::new()
        .prefix("vmdisk-cgroup-")
        .tempdir()
        .map_err(|e| Error::io("making a directory to mount a cgroup hierarchy at", e))?;
    let (fstype, data) = match hierarchy {
        Hierarchy::V2 => ("cgroup2", None),
        Hierarchy::V1(controllers) => ("cgroup", Some(v1_options(controllers))),
    };
    mount(
        Some("none"),
        dir.path(),
        Some(fstype),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        data.as_deref(),
    )
    .map_err(|e| Error::io(format!("mounting the {fstype} hierarchy"), e.into()))?;
    let moved = join(dir.path(), target);
    let _ = umount2(dir.path(), MntFlags::MNT_DETACH);
    moved
}

/// The mount options of a v1 hierarchy with `controllers` (`name=systemd` needs `none`).
fn v1_options(controllers: &str) -> String {
    match controllers.starts_with("name=") {
        true => format!("none,{controllers}"),
        false => controllers.to_string(),
    }
}

/// Makes cgroup `target` under the hierarchy mounted at `root` and moves this process into it.
fn join(root: &Path, target: &str) -> Result<()> {
    let cgroup: PathBuf = root.join(target.trim_start_matches('/'));
    std::fs::create_dir_all(&cgroup)
        .map_err(|e| Error::io(format!("making cgroup {target}"), e))?;
    // A new cpuset cgroup has no CPUs or memory nodes until given its parent's.
    for knob in ["cpuset.cpus", "cpuset.mems"] {
        let own = cgroup.join(knob);
        let empty = std::fs::read_to_string(&own).is_ok_and(|v| v.trim().is_empty());
        if empty {
            if let Ok(parent) = std::fs::read_to_string(root.join(knob)) {
                let _ = std::fs::write(&own, parent.trim());
            }
        }
    }
    std::fs::write(cgroup.join("cgroup.procs"), "0")
        .map_err(|e| Error::io(format!("moving into cgroup {target}"), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_v1_hierarchies_mount_with_none() {
        assert_eq!(v1_options("name=systemd"), "none,name=systemd");
        assert_eq!(v1_options("cpu,cpuacct"), "cpu,cpuacct");
    }
}
