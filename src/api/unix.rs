//! Unix sockets at paths of any length, and the gRPC channels over them.
//!
//! A socket address holds at most [`MAX_SOCKET_PATH`] bytes, but the daemon's root (and so its
//! mount servers' control sockets) may be nested deep: containerd's snapshotter suite and k3s
//! give roots far longer than that. A longer path is bound and connected through the
//! directory's file descriptor (`/proc/self/fd/<fd>/<name>`), which the kernel resolves like
//! the path itself: the socket lives where its path says, with that directory's permissions.
//! Only the socket's own name must fit.

use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};

/// The longest path a socket address holds (`sun_path` less its terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// A path for the socket address naming `path`: itself when short enough, else through its
/// directory's descriptor, which stays open as long as this does.
struct SocketPath {
    path: PathBuf,
    _dir: Option<std::fs::File>,
}

impl SocketPath {
    fn new(path: &Path) -> std::io::Result<Self> {
        if path.as_os_str().len() <= MAX_SOCKET_PATH {
            return Ok(SocketPath {
                path: path.to_path_buf(),
                _dir: None,
            });
        }
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a socket path needs a directory and a name",
            ));
        };
        let dir = std::fs::File::open(if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        })?;
        let short = Path::new(&format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name);
        if short.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the socket's file name is too long for a socket address",
            ));
        }
        Ok(SocketPath {
            path: short,
            _dir: Some(dir),
        })
    }
}

/// Connects to the unix socket at `path`, whatever its length.
pub async fn connect(path: &Path) -> std::io::Result<tokio::net::UnixStream> {
    let at = SocketPath::new(path)?;
    tokio::net::UnixStream::connect(&at.path).await
}

/// Whether something accepts connections at `path`.
fn in_use(path: &Path) -> bool {
    SocketPath::new(path)
        .and_then(|at| std::os::unix::net::UnixStream::connect(&at.path))
        .is_ok()
}

/// Binds a unix socket at `path` (of any length) with `mode`, replacing a stale socket file;
/// creates its directory if missing (passable, not listable: the socket's mode decides who
/// may connect).
pub fn bind(path: &Path, mode: u32) -> Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        crate::dirs::passage(dir)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if in_use(path) {
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!(
                        "{} is in use by a running process; is another vmdisk-snapshotter running?",
                        path.display()
                    ),
                ));
            }
            std::fs::remove_file(path).map_err(|e| {
                Error::io(format!("removing the stale socket {}", path.display()), e)
            })?;
        }
        Ok(_) => {
            return Err(Error::invalid(format!(
                "{} exists and is not a socket; choose another address",
                path.display()
            )))
        }
        Err(_) => {}
    }
    let listener = SocketPath::new(path)
        .and_then(|at| tokio::net::UnixListener::bind(&at.path))
        .map_err(|e| Error::io(format!("listening on {}", path.display()), e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io(format!("chmod {}", path.display()), e))?;
    Ok(listener)
}

fn connector(
    path: PathBuf,
) -> impl tower::Service<
    tonic::transport::Uri,
    Response = hyper_util::rt::TokioIo<tokio::net::UnixStream>,
    Error = std::io::Error,
    Future = impl Send,
> + Clone {
    tower::service_fn(move |_: tonic::transport::Uri| {
        let path = path.clone();
        async move { Ok(hyper_util::rt::TokioIo::new(connect(&path).await?)) }
    })
}

/// A gRPC channel to a unix socket (tonic speaks HTTP/2 over it; the URI is a placeholder).
pub async fn channel(path: impl Into<PathBuf>) -> Result<tonic::transport::Channel> {
    let path = path.into();
    let shown = path.display().to_string();
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(connector(path))
        .await
        .map_err(|e| {
            Error::new(
                ErrorKind::Network,
                format!("connecting to {shown}; is vmdisk-snapshotter running?"),
            )
            .with_source(e)
        })
}

/// A gRPC channel to the unix socket `path` that connects on first use (and again after the
/// peer restarts), with a 5 s connect deadline.
pub fn lazy_channel(path: &Path) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_timeout(std::time::Duration::from_secs(5))
        .connect_with_connector_lazy(connector(path.to_path_buf()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sockets_bind_and_connect_at_paths_longer_than_an_address_holds() {
        let dir = tempfile::tempdir().unwrap();
        let deep = dir.path().join("a".repeat(100)).join("b".repeat(100));
        let path = deep.join("control.sock");
        assert!(path.as_os_str().len() > MAX_SOCKET_PATH);
        let listener = bind(&path, 0o600).unwrap();
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(
            meta.file_type().is_socket(),
            "the socket is where its path says"
        );
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let accepted = tokio::spawn(async move { listener.accept().await.map(|_| ()) });
        connect(&path).await.unwrap();
        accepted.await.unwrap().unwrap();
        // A second daemon on the same path is refused while the first listens.
        let listener = bind(&dir.path().join("x.sock"), 0o600).unwrap();
        assert_eq!(
            bind(&dir.path().join("x.sock"), 0o600).unwrap_err().kind(),
            ErrorKind::AlreadyExists
        );
        drop(listener);
        // Gone: the stale file is replaced.
        bind(&dir.path().join("x.sock"), 0o600).unwrap();
    }
}
