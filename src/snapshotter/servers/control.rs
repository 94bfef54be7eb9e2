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
use crate::oci::reference::{ImageName, Reference};
use crate::registry::granted::Grant;
use crate::registry::health;

pub use pb::{
    BlobBytes, Credentials, EndpointCounters, Handover, HydrationState, LayerCounters, LayerStatus,
    ReadyDirState, ServerState,
};

/// What a caller needs of a layer's server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// The layer's files (a snapshot of a pull): nothing of the disk is read.
    Layer,
    /// Also its ready-disk directory (EnsureDisk: `vmdisk path`, the shim), which describing
    /// the disk reads the head of.
    ReadyDisk,
}

/// Whether the daemon decided a layer just now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The daemon checked the image against the signature policy and resolved its disk layer
    /// just now, keeping the layer's record and TOC in the cache: its server opens the layer
    /// from there and asks the registry nothing of its image (a Prepare, EnsureDisk).
    DecidedNow,
    /// The daemon serves again a layer it recorded earlier (its start-up, a snapshot's chain,
    /// a disk the node holds): the server resolves the image and asks the policy itself.
    Recorded,
}

/// A layer the daemon decided to serve, and everything its server is handed to serve it
/// (judge, plan, serve: made where a Prepare or the management API decided the layer, kept by
/// the supervisor for successors, written to the server's stdin whole).
#[derive(Clone, Debug)]
pub struct LayerPlan {
    /// The disk layer's key ([`crate::layer::LayerId::key`]).
    pub key: Digest,
    /// The image, pinned by its platform manifest's digest.
    pub reference: Reference,
    /// The image as it was asked for: the ready-disk directory's readable name, and the name
    /// the signature policy judges.
    pub alias: Option<ImageName>,
    /// What its first caller needs.
    pub need: Need,
    /// Credentials of pulls of the image the server may fetch with.
    pub grants: Vec<Grant>,
    pub verdict: Verdict,
}

impl LayerPlan {
    /// The plan for serving again layer `key` of `reference` (`alias` the name it was asked
    /// by), which the daemon recorded earlier: no credentials of its own, the server resolves
    /// and checks the image itself.
    pub fn recorded(
        key: Digest,
        reference: &Reference,
        alias: Option<&ImageName>,
        need: Need,
    ) -> Self {
        LayerPlan {
            key,
            reference: reference.clone(),
            alias: alias.cloned(),
            need,
            grants: Vec::new(),
            verdict: Verdict::Recorded,
        }
    }

    /// The plan as the handover carries it (its grants go in the handover's credentials).
    pub fn message(&self) -> pb::LayerPlan {
        pb::LayerPlan {
            reference: self.reference.to_string(),
            key: self.key.to_string(),
            alias: self
                .alias
                .as_ref()
                .map(|a| a.as_str().to_string())
                .unwrap_or_default(),
            need: match self.need {
                Need::Layer => pb::LayerNeed::Files,
                Need::ReadyDisk => pb::LayerNeed::ReadyDisk,
            } as i32,
            decided_now: self.verdict == Verdict::DecidedNow,
        }
    }

    /// The plan a handover carries, with `grants`; an error names what is malformed (the
    /// reference must be pinned by digest).
    pub fn from_message(message: &pb::LayerPlan, grants: Vec<Grant>) -> Result<Self> {
        let reference: Reference = message
            .reference
            .parse()
            .map_err(|e: Error| e.context("the plan's reference"))?;
        if reference.digest.is_none() {
            return Err(Error::invalid(format!(
                "the plan's reference {reference} is not pinned by digest"
            )));
        }
        Ok(LayerPlan {
            key: message
                .key
                .parse()
                .map_err(|e: Error| e.context("the plan's layer key"))?,
            reference,
            alias: match message.alias.as_str() {
                "" => None,
                alias => Some(
                    alias
                        .parse()
                        .map_err(|e: Error| e.context("the plan's alias"))?,
                ),
            },
            need: match message.need() {
                pb::LayerNeed::Files => Need::Layer,
                pb::LayerNeed::ReadyDisk => Need::ReadyDisk,
            },
            grants,
            verdict: match message.decided_now {
                true => Verdict::DecidedNow,
                false => Verdict::Recorded,
            },
        })
    }
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

    /// The plan reaches the server as the daemon made it (its grants travel as the handover's
    /// credentials); a plan whose image is not pinned, or whose key is not a digest, is refused.
    #[test]
    fn a_plan_reaches_the_server_whole_and_a_malformed_one_is_refused() {
        let plan = LayerPlan {
            key: Digest::of(b"layer"),
            reference: format!("r.example/vm/disk@{}", Digest::of(b"manifest"))
                .parse()
                .unwrap(),
            alias: Some("r.example/vm/disk:1".parse().unwrap()),
            need: Need::ReadyDisk,
            grants: Vec::new(),
            verdict: Verdict::DecidedNow,
        };
        let back = LayerPlan::from_message(&plan.message(), Vec::new()).unwrap();
        assert_eq!(
            (
                back.key,
                back.reference,
                back.alias,
                back.need,
                back.verdict
            ),
            (
                plan.key,
                plan.reference.clone(),
                plan.alias.clone(),
                plan.need,
                plan.verdict
            )
        );
        let recorded = LayerPlan::recorded(plan.key, &plan.reference, None, Need::Layer);
        let back = LayerPlan::from_message(&recorded.message(), Vec::new()).unwrap();
        assert_eq!(
            (back.alias, back.need, back.verdict),
            (None, Need::Layer, Verdict::Recorded)
        );
        let mut tagged = plan.message();
        tagged.reference = "r.example/vm/disk:1".into();
        assert!(LayerPlan::from_message(&tagged, Vec::new()).is_err());
        let mut keyless = plan.message();
        keyless.key = "layer".into();
        assert!(LayerPlan::from_message(&keyless, Vec::new()).is_err());
    }

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
