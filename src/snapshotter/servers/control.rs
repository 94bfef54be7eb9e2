//! The control channel between the daemon and its mount servers: where a server's files and
//! socket are (`LayerPaths`), the client calls the daemon makes, each under a deadline, and the
//! translation of the engine's counters into the API's.
//!
//! Each server answers a small gRPC API (`proto/vmdisk/v1/layer.proto`) on its own unix socket:
//! status and counters, hydrate, stop, and its identity (layer key, pid, a random instance id),
//! which is how a restarted daemon adopts it. Nothing passes through files: the server's log is
//! for people, not for the daemon to parse.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::api::vmdisk::v1 as pb;
use crate::error::{Error, ErrorKind, Result};
use crate::layer::Held;
use crate::oci::digest::Digest;
use crate::registry::health;

pub use pb::{
    BlobBytes, Credentials, EndpointCounters, Handover, HydrationState, LayerCounters, LayerStatus,
    ReadyDirState, ServerState,
};

/// What a caller needs of a layer's server.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// The layer's files (a snapshot of a pull): nothing of the disk is read.
    Layer,
    /// Also its ready-disk directory (EnsureDisk: `vmdisk path`, the shim), which describing
    /// the disk reads the head of.
    ReadyDisk,
}

type Client = pb::layer_server_client::LayerServerClient<tonic::transport::Channel>;

/// How long a status or hydrate call may take: a server answers from memory.
pub const CALL_DEADLINE: Duration = Duration::from_secs(1);

/// Where a layer's server keeps its mount, its socket and its log on the host.
#[derive(Debug, Clone)]
pub struct LayerPaths {
    /// The layer's FUSE mount: `<root>/mounts/<key hex>`.
    pub mountpoint: PathBuf,
    /// The control socket: `<root>/control/<first 32 hex digits of the key>.sock` (a name that
    /// fits a socket address however long the root is, [`crate::api::unix`]; the server's
    /// identity is checked on every use, so a prefix suffices).
    pub control: PathBuf,
    /// The server's log: `<root>/servers/<key hex>.log`.
    pub log: PathBuf,
    /// Where the server hands out its FUSE connections ([`crate::snapshotter::servers::keeper`]):
    /// `<root>/fds/<first 32 hex digits of the key>.sock`.
    pub keeper: PathBuf,
}

impl LayerPaths {
    pub fn new(root: &Path, layer: &Digest) -> Self {
        let hex = layer.hex();
        LayerPaths {
            mountpoint: root.join("mounts").join(&hex),
            control: root.join("control").join(format!("{}.sock", &hex[..32])),
            log: root.join("servers").join(format!("{hex}.log")),
            keeper: root.join("fds").join(format!("{}.sock", &hex[..32])),
        }
    }

    /// Where the server's mounts record their passthrough registrations for a successor
    /// (`<root>/fds/<first 32 hex digits of the key>.<role>.passthrough`,
    /// [`crate::serve::connection::Registrations`]).
    pub fn passthrough_records(&self) -> PathBuf {
        self.keeper.with_extension("")
    }

    /// The directories servers need under `root`, root's only.
    pub fn prepare_root(root: &Path) -> Result<()> {
        for dir in ["mounts", "control", "fds", "servers"] {
            crate::dirs::private(&root.join(dir))?;
        }
        Ok(())
    }
}

/// Runs one call against the server at `socket`, connection included, within `deadline`.
async fn call<T, F>(
    socket: &Path,
    deadline: Duration,
    what: &str,
    f: impl FnOnce(Client) -> F,
) -> Result<T>
where
    F: std::future::Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
{
    let work = async {
        let channel = crate::api::unix::channel(socket).await?;
        f(Client::new(channel))
            .await
            .map(tonic::Response::into_inner)
            .map_err(Error::from)
    };
    tokio::time::timeout(deadline, work)
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::Timeout,
                format!(
                    "the mount server at {} did not answer {what} within {deadline:?}",
                    socket.display()
                ),
            )
        })?
        .map_err(|e| {
            e.context(format!(
                "{what} of the mount server at {}",
                socket.display()
            ))
        })
}

/// The status of the server at `socket`.
pub async fn status(socket: &Path) -> Result<LayerStatus> {
    call(socket, CALL_DEADLINE, "status", |mut c| async move {
        c.status(pb::LayerStatusRequest::default()).await
    })
    .await
}

/// The status of the server at `socket` once it is no longer starting, or after `wait`
/// (at most 1 s) if it still is.
pub async fn wait_started(socket: &Path, wait: Duration) -> Result<LayerStatus> {
    let wait_started_ms = wait.as_millis().min(1000) as u32;
    call(socket, CALL_DEADLINE + wait, "status", |mut c| async move {
        c.status(pb::LayerStatusRequest { wait_started_ms }).await
    })
    .await
}

/// Asks the server at `socket` to mount its ready-disk directory (describing the disk first,
/// which may fetch its head: within `deadline`). A server from before the call existed answers
/// `Unimplemented`: it mounted the directory when it started.
pub async fn mount_ready_dir(socket: &Path, deadline: Duration) -> Result<()> {
    call(
        socket,
        deadline,
        "mount the ready-disk directory",
        |mut c| async move {
            match c.mount_ready_dir(pb::MountReadyDirRequest {}).await {
                Err(s) if s.code() == tonic::Code::Unimplemented => {
                    Ok(tonic::Response::new(pb::MountReadyDirResponse::default()))
                }
                answer => answer,
            }
        },
    )
    .await
    .map(|_| ())
}

/// Asks the server at `socket` to fetch its whole disk; whether a new hydration started.
pub async fn hydrate(socket: &Path) -> Result<bool> {
    call(socket, CALL_DEADLINE, "hydrate", |mut c| async move {
        c.hydrate(pb::HydrateRequest {}).await
    })
    .await
    .map(|r| r.started)
}

/// Asks the server at `socket` to unmount and exit; its final counters. Fails with
/// `FailedPrecondition` while the mount is busy. Unmounting waits for the FUSE session to end,
/// hence the longer deadline.
pub async fn stop(socket: &Path) -> Result<LayerCounters> {
    call(
        socket,
        Duration::from_secs(10),
        "stop",
        |mut c| async move { c.stop(pb::StopRequest {}).await },
    )
    .await
    .map(|r| r.counters.unwrap_or_default())
}

impl std::fmt::Debug for pb::Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Credentials({}/{}, user {}, <redacted>, {} s)",
            self.registry, self.repository, self.username, self.ttl_seconds
        )
    }
}

/// Hands the server at `socket` credentials of a pull of its image that succeeded.
pub async fn set_credentials(socket: &Path, credentials: Credentials) -> Result<()> {
    call(
        socket,
        CALL_DEADLINE,
        "set credentials",
        |mut c| async move { c.set_credentials(credentials).await },
    )
    .await
    .map(|_| ())
}

/// The message that hands a server `grant`.
pub fn credentials_message(grant: &crate::registry::granted::Grant) -> pb::Credentials {
    let ttl = grant
        .expires
        .saturating_duration_since(tokio::time::Instant::now());
    pb::Credentials {
        registry: grant.registry.clone(),
        repository: grant.repository.clone(),
        username: grant.credential.username.clone(),
        secret: grant.credential.secret.clone(),
        ttl_seconds: ttl.as_secs(),
    }
}

/// Most bytes of a handover a server reads (a system's TLS roots are a few hundred KiB).
pub const MAX_HANDOVER: u64 = 8 << 20;

/// The daemon's side of a new server's stdin (`serve-layer --handover`): writes `handover` at
/// once and, while the server reads it, awaits `ahead` (the blob bytes fetched for the server
/// meanwhile), then writes those as a [`BlobBytes`], each message length-delimited, and closes
/// it by dropping it.
pub async fn hand_over(
    mut stdin: impl tokio::io::AsyncWrite + Unpin,
    handover: &Handover,
    ahead: impl std::future::Future<Output = Held>,
) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt as _;
    let first = prost::Message::encode_length_delimited_to_vec(handover);
    let (written, held) = tokio::join!(stdin.write_all(&first), ahead);
    written?;
    let pieces = held
        .pieces()
        .map(|(offset, bytes)| pb::BlobPiece {
            offset,
            bytes: bytes.to_vec(),
        })
        .collect();
    let second = prost::Message::encode_length_delimited_to_vec(&BlobBytes { pieces });
    stdin.write_all(&second).await?;
    stdin.flush().await
}

/// Reads the [`Handover`] that starts a server's stdin ([`hand_over`]).
pub async fn read_handover(stdin: &mut (impl tokio::io::AsyncRead + Unpin)) -> Result<Handover> {
    read_delimited(stdin, MAX_HANDOVER)
        .await?
        .ok_or_else(|| Error::invalid("the daemon closed stdin without a handover"))
}

/// Reads the [`BlobBytes`] that follow the handover on a server's stdin ([`hand_over`]), as
/// [`Held`] bytes (at most [`Held::MAX_BYTES`]; none if the daemon sent none).
pub async fn read_blob_bytes(stdin: &mut (impl tokio::io::AsyncRead + Unpin)) -> Result<Held> {
    let frame = Held::MAX_BYTES as u64 + (64 << 10);
    let message: Option<BlobBytes> = read_delimited(stdin, frame).await?;
    let mut held = Held::default();
    for piece in message.map(|m| m.pieces).unwrap_or_default() {
        held.add(piece.offset, piece.bytes.into());
    }
    Ok(held)
}

/// One length-delimited message of at most `max` bytes from `input`; `None` at its end.
async fn read_delimited<M: prost::Message + Default>(
    input: &mut (impl tokio::io::AsyncRead + Unpin),
    max: u64,
) -> Result<Option<M>> {
    use tokio::io::AsyncReadExt as _;
    let malformed = |why: String| {
        Error::invalid(format!(
            "the daemon's handover on stdin is malformed: {why}"
        ))
    };
    let reading = |e| Error::io("reading the daemon's handover from stdin", e);
    // The length: a varint of at most 10 bytes, the last without the high bit.
    let mut varint = Vec::with_capacity(10);
    loop {
        let mut byte = [0u8];
        if input.read(&mut byte).await.map_err(reading)? == 0 {
            return match varint.is_empty() {
                true => Ok(None),
                false => Err(malformed("it ends within a length".into())),
            };
        }
        varint.push(byte[0]);
        if byte[0] & 0x80 == 0 {
            break;
        }
        if varint.len() == 10 {
            return Err(malformed("a length longer than 10 bytes".into()));
        }
    }
    let len = prost::decode_length_delimiter(varint.as_slice())
        .map_err(|e| malformed(e.to_string()))? as u64;
    if len > max {
        return Err(malformed(format!(
            "a message of {len} bytes, more than the {max} accepted"
        )));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    input
        .take(len)
        .read_to_end(&mut bytes)
        .await
        .map_err(reading)?;
    if bytes.len() as u64 != len {
        return Err(malformed(format!(
            "it ends after {} of a message's {len} bytes",
            bytes.len()
        )));
    }
    M::decode(bytes.as_slice())
        .map(Some)
        .map_err(|e| malformed(e.to_string()))
}

/// The grant a [`pb::Credentials`] message carries.
pub fn grant_of(message: pb::Credentials) -> crate::registry::granted::Grant {
    crate::registry::granted::Grant::new(
        &message.registry,
        &message.repository,
        crate::registry::auth::Credential {
            username: message.username,
            secret: message.secret,
        },
        Duration::from_secs(message.ttl_seconds),
    )
}

/// A server's counters: its engine's, and per registry endpoint.
pub fn layer_counters(engine: &crate::engine::Engine) -> LayerCounters {
    LayerCounters {
        endpoints: engine
            .endpoint_counters()
            .into_iter()
            .map(|(endpoint, c)| EndpointCounters {
                endpoint,
                ..EndpointCounters::from(&c)
            })
            .collect(),
        ..engine.counters().into()
    }
}

/// An endpoint's counters as the control protocol carries them (without the endpoint).
impl From<&health::EndpointCounters> for EndpointCounters {
    fn from(c: &health::EndpointCounters) -> Self {
        EndpointCounters {
            endpoint: String::new(),
            requests: c.requests,
            failures: c.failures,
            bytes: c.bytes,
        }
    }
}

/// An endpoint's counters as a server reported them.
impl From<&EndpointCounters> for health::EndpointCounters {
    fn from(c: &EndpointCounters) -> Self {
        health::EndpointCounters {
            requests: c.requests,
            failures: c.failures,
            bytes: c.bytes,
        }
    }
}

/// How `vmdisk ls` and `prefetch --wait` show a server's hydration: `idle`, `running`, `done`
/// or `failed: <why>`.
pub fn hydration_text(status: &LayerStatus) -> String {
    match status.hydration() {
        HydrationState::Running => "running".into(),
        HydrationState::Done => "done".into(),
        HydrationState::Failed => format!("failed: {}", status.hydration_error),
        HydrationState::Idle | HydrationState::Unspecified => "idle".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_handover_is_followed_by_the_blob_bytes_fetched_meanwhile() {
        let (daemon, mut server) = tokio::io::duplex(64);
        let handover = Handover {
            credentials: Vec::new(),
            tls_roots: vec![vec![7; 1000]],
            ..Default::default()
        };
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        // The bytes come only once the handover was read: the handover does not wait for them.
        let ahead = async move {
            released.await.unwrap();
            let mut held = Held::default();
            held.add(5, bytes::Bytes::from_static(b"tail"));
            held
        };
        let writer = tokio::spawn(async move { hand_over(daemon, &handover, ahead).await });
        let read = read_handover(&mut server).await.unwrap();
        assert_eq!(read.tls_roots, vec![vec![7; 1000]]);
        release.send(()).unwrap();
        let held = read_blob_bytes(&mut server).await.unwrap();
        assert_eq!(held.get(&(6..8)).as_deref(), Some(&b"ai"[..]));
        writer.await.unwrap().unwrap();
        // Then stdin is closed: nothing more, and no error.
        assert!(read_blob_bytes(&mut server).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_handover_longer_than_allowed_or_cut_short_is_refused() {
        let mut long = Vec::new();
        prost::encode_length_delimiter((MAX_HANDOVER + 1) as usize, &mut long).unwrap();
        let e = read_handover(&mut long.as_slice()).await.unwrap_err();
        assert!(e.to_string().contains("more than"), "{e}");
        let mut cut = Vec::new();
        prost::encode_length_delimiter(100, &mut cut).unwrap();
        cut.extend_from_slice(&[1; 10]);
        let e = read_handover(&mut cut.as_slice()).await.unwrap_err();
        assert!(e.to_string().contains("ends after 10"), "{e}");
        let e = read_handover(&mut &b""[..]).await.unwrap_err();
        assert!(e.to_string().contains("without a handover"), "{e}");
    }
}
