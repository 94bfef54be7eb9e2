//! Mount servers: one process per remote layer (`vmdisk-snapshotter serve-layer`), holding the
//! layer's FUSE connection at `<root>/mounts/<layer hex>`.
//!
//! Why processes: a FUSE mount dies with the process that serves it, and an overlay mount that
//! uses it as a lower directory keeps pointing at the dead connection. Serving each layer from
//! its own process, in its own process group, lets the daemon restart (upgrade, crash) while
//! containers keep reading: the new daemon adopts the running servers it finds
//! (`<root>/servers/<hex>/pid`, checked against `/proc` and the mount) and starts the missing
//! ones before it accepts calls. The systemd unit uses `KillMode=process` for the same reason.
//!
//! Each server writes its counters to `<root>/servers/<hex>/stats.json` every second and logs to
//! `serve.log` beside it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::AsyncBufReadExt;

use crate::digest::Digest;
use crate::error::{Error, ErrorKind, Result};

/// The FUSE superblock magic (`FUSE_SUPER_MAGIC`).
const FUSE_MAGIC: i64 = 0x6573_5546;

/// The line a server prints on stdout once its mount is up.
pub const READY_LINE: &str = "vmdisk-serve-layer: ready";

/// Where a layer lives on the host.
#[derive(Debug, Clone)]
pub struct LayerPaths {
    pub mountpoint: PathBuf,
    pub state: PathBuf,
}

impl LayerPaths {
    pub fn new(root: &Path, layer: &Digest) -> Self {
        LayerPaths {
            mountpoint: root.join("mounts").join(layer.hex()),
            state: root.join("servers").join(layer.hex()),
        }
    }

    pub fn pid_file(&self) -> PathBuf {
        self.state.join("pid")
    }

    pub fn stats_file(&self) -> PathBuf {
        self.state.join("stats.json")
    }

    /// Created by the daemon to ask the server to fetch the whole disk (`vmdisk prefetch`).
    pub fn hydrate_request(&self) -> PathBuf {
        self.state.join("hydrate")
    }

    pub fn log_file(&self) -> PathBuf {
        self.state.join("serve.log")
    }

    /// The server's status as last written.
    pub fn stats(&self) -> Option<crate::serve::LayerStatus> {
        let text = std::fs::read(self.stats_file()).ok()?;
        serde_json::from_slice(&text).ok()
    }
}

/// How to start servers.
#[derive(Debug, Clone)]
pub struct ServerCommand {
    /// The daemon's own executable.
    pub exe: PathBuf,
    pub config: Option<PathBuf>,
    pub root: PathBuf,
    /// Where servers mount ready-disk directories (`ready_dir` of the configuration).
    pub ready_dir: PathBuf,
    pub mount_timeout: Duration,
}

/// The running servers, by layer.
pub struct LayerServers {
    command: ServerCommand,
    running: tokio::sync::Mutex<HashMap<Digest, u32>>,
}

/// Whether `path` is a live FUSE mount (a dead one fails with ENOTCONN).
fn live_fuse_mount(path: &Path) -> bool {
    match nix::sys::statfs::statfs(path) {
        Ok(s) => s.filesystem_type().0 == FUSE_MAGIC && std::fs::metadata(path).is_ok(),
        Err(_) => false,
    }
}

fn process_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                !s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
            .unwrap_or(false)
}

/// The pid of a server for `paths` that is still serving, if any.
fn running_server(paths: &LayerPaths) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(paths.pid_file())
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let cmdline = String::from_utf8_lossy(&cmdline);
    let ours = cmdline.contains("serve-layer")
        && cmdline.contains(paths.mountpoint.file_name()?.to_str()?);
    (ours && process_alive(pid) && live_fuse_mount(&paths.mountpoint)).then_some(pid)
}

impl LayerServers {
    pub fn new(command: ServerCommand) -> Self {
        LayerServers {
            command,
            running: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    pub fn paths(&self, layer: &Digest) -> LayerPaths {
        LayerPaths::new(&self.command.root, layer)
    }

    /// The ready-disk directory of a layer resolved from `reference` (by digest).
    pub fn ready_dir(&self, reference: &str) -> Option<PathBuf> {
        let reference: crate::reference::Reference = reference.parse().ok()?;
        Some(self.command.ready_dir.join(reference.digest?.hex()))
    }

    /// The pid of `layer`'s server, if one is running.
    pub async fn pid(&self, layer: &Digest) -> Option<u32> {
        let running = self.running.lock().await;
        running
            .get(layer)
            .copied()
            .filter(|&pid| process_alive(pid) && live_fuse_mount(&self.paths(layer).mountpoint))
    }

    /// Makes sure `layer` (of `reference`) is mounted, adopting a running server or starting
    /// one; returns the mount point.
    pub async fn ensure(
        &self,
        reference: &str,
        layer: &Digest,
        alias: Option<&str>,
    ) -> Result<PathBuf> {
        let paths = self.paths(layer);
        let mut running = self.running.lock().await;
        if let Some(pid) = running_server(&paths) {
            if running.insert(*layer, pid).is_none() {
                tracing::info!(%layer, pid, "adopted the running mount server");
            }
            return Ok(paths.mountpoint);
        }
        running.remove(layer);
        // A mount left by a server that died answers ENOTCONN; detach it before mounting anew.
        if nix::sys::statfs::statfs(&paths.mountpoint).is_err()
            || std::fs::metadata(&paths.mountpoint).is_err()
        {
            let _ = nix::mount::umount2(&paths.mountpoint, nix::mount::MntFlags::MNT_DETACH);
        }
        for dir in [&paths.mountpoint, &paths.state] {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        }
        let pid = self.spawn(reference, layer, alias, &paths).await?;
        running.insert(*layer, pid);
        Ok(paths.mountpoint)
    }

    async fn spawn(
        &self,
        reference: &str,
        layer: &Digest,
        alias: Option<&str>,
        paths: &LayerPaths,
    ) -> Result<u32> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(paths.log_file())
            .map_err(|e| Error::io(format!("opening {}", paths.log_file().display()), e))?;
        let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
        let mut cmd = tokio::process::Command::new(&self.command.exe);
        cmd.arg("serve-layer");
        if let Some(config) = &self.command.config {
            cmd.arg("--config").arg(config);
        }
        cmd.arg("--root")
            .arg(&self.command.root)
            .arg("--reference")
            .arg(reference)
            .arg("--layer")
            .arg(layer.to_string());
        if let Some(alias) = alias {
            cmd.arg("--alias").arg(alias);
        }
        cmd.stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(log)
            // Its own process group: a signal to the daemon's group does not stop it.
            .process_group(0)
            .kill_on_drop(false);
        let mut child = cmd
            .spawn()
            .map_err(|e| Error::io(format!("starting {}", self.command.exe.display()), e))?;
        let pid = child.id().unwrap_or(0);
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(self.command.mount_timeout, async {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.starts_with(READY_LINE) {
                    return true;
                }
            }
            false
        })
        .await;
        if ready == Ok(true) {
            std::fs::write(paths.pid_file(), format!("{pid}\n"))
                .map_err(|e| Error::io(format!("writing {}", paths.pid_file().display()), e))?;
            tracing::info!(%layer, pid, mountpoint = %paths.mountpoint.display(), "mount server ready");
            // Reap it if it exits while this daemon lives; it keeps running if the daemon goes.
            tokio::spawn(async move {
                let _ = child.wait().await;
            });
            return Ok(pid);
        }
        let _ = child.start_kill();
        let _ = child.wait().await;
        let log = std::fs::read(paths.log_file()).unwrap_or_default();
        let tail = String::from_utf8_lossy(log.get(log_start as usize..).unwrap_or_default());
        let why = tail
            .lines()
            .rev()
            .find(|l| l.contains("error"))
            .unwrap_or("no message")
            .trim()
            .to_string();
        Err(Error::new(
            if ready.is_err() {
                ErrorKind::Network
            } else {
                ErrorKind::Io
            },
            format!(
                "mounting layer {layer} of {reference} {}: {why} (log: {})",
                if ready.is_err() {
                    "timed out"
                } else {
                    "failed"
                },
                paths.log_file().display()
            ),
        ))
    }

    /// Stops `layer`'s server (it unmounts) and waits up to 10 s for it to exit.
    pub async fn stop(&self, layer: &Digest) {
        let paths = self.paths(layer);
        let pid = self
            .running
            .lock()
            .await
            .remove(layer)
            .or_else(|| running_server(&paths));
        if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
            for _ in 0..100 {
                if !process_alive(pid as u32) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if process_alive(pid as u32) {
                tracing::warn!(%layer, pid, "mount server did not exit (its mount is busy); leaving it");
                return;
            }
        }
        let _ = nix::mount::umount2(&paths.mountpoint, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&paths.mountpoint);
        let _ = std::fs::remove_file(paths.pid_file());
        tracing::info!(%layer, "mount server stopped");
    }
}
