//! The descriptors of a mount server's FUSE connections, handed to the daemon that keeps them
//! for a successor ([`crate::serve::connection`]), and the end of a server as the daemon
//! learns it.
//!
//! Each serving server listens on `<root>/fds/<key>.sock` (0600, root's directory). A caller
//! gets one message: a [`pb::FuseConnections`] describing each mount's connection, with a
//! descriptor of each (`SCM_RIGHTS`). The server then holds the stream until it ends: it
//! writes [`BYE`] when it stops after unmounting, and the stream closes unwritten when it dies
//! (a crash, a kill, the OOM killer). The daemon reads that at once, without asking.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;

use crate::api::vmdisk::v1 as pb;
use crate::error::{Error, ErrorKind, Result};
use crate::serve::connection::{Connection, Offer, Role};
use crate::serve::Serving;

/// What a server writes to its keepers when it stops after unmounting.
const BYE: &[u8] = b"bye";

/// Most connections one server has (its layer and its ready-disk directory).
pub const MAX_CONNECTIONS: usize = 2;

/// Largest description a keeper reads.
const MAX_MESSAGE: usize = 4096;

/// How long a stopping server spends saying goodbye to its keepers.
const BYE_DEADLINE: Duration = Duration::from_secs(1);

/// How long a keeper waits for a server's connections.
const COLLECT_DEADLINE: Duration = Duration::from_secs(2);

/// The description of `connection` in `role`, its descriptor numbered `fd`.
pub fn describe(role: Role, connection: &Connection, fd: u32) -> pb::FuseConnection {
    let mut message = pb::FuseConnection {
        fd,
        abi_major: connection.offer.major,
        abi_minor: connection.offer.minor,
        capabilities: connection.offer.capabilities,
        max_readahead: connection.offer.max_readahead,
        ..Default::default()
    };
    message.set_role(match role {
        Role::Layer => pb::ConnectionRole::Layer,
        Role::ReadyDisk => pb::ConnectionRole::ReadyDisk,
    });
    message
}

/// The role and offer `message` describes (its descriptor is the caller's to find).
pub fn described(message: &pb::FuseConnection) -> (Role, Offer) {
    let role = match message.role() {
        pb::ConnectionRole::Layer => Role::Layer,
        pb::ConnectionRole::ReadyDisk => Role::ReadyDisk,
    };
    (
        role,
        Offer {
            major: message.abi_major,
            minor: message.abi_minor,
            capabilities: message.capabilities,
            max_readahead: message.max_readahead,
        },
    )
}

/// A server's connection socket, until [`Offering::bye`].
pub struct Offering {
    task: tokio::task::JoinHandle<()>,
    ending: tokio::sync::watch::Sender<bool>,
    path: std::path::PathBuf,
}

impl Offering {
    /// Listens on `path` and hands each caller `serving`'s connections.
    pub fn start(path: &Path, serving: Arc<Serving>) -> Result<Offering> {
        let listener = crate::api::unix::bind(path, 0o600)?;
        let (ending, mut ended) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut held = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else { break };
                        let (serving, ended) = (Arc::clone(&serving), ended.clone());
                        held.spawn(async move {
                            if let Err(e) = hand(stream, &serving, ended).await {
                                tracing::warn!(error = %e.chain(), "handing the FUSE connections to a keeper failed");
                            }
                        });
                        // Streams of keepers that went are forgotten.
                        while held.try_join_next().is_some() {}
                    }
                    _ = async { ended.wait_for(|e| *e).await.map(|_| ()) } => break,
                }
            }
            // Each held stream says goodbye (briefly: a keeper that does not read is not
            // waited for).
            let _ = tokio::time::timeout(BYE_DEADLINE, async {
                while held.join_next().await.is_some() {}
            })
            .await;
        });
        Ok(Offering {
            task,
            ending,
            path: path.to_path_buf(),
        })
    }

    /// Tells every keeper this server stopped on purpose (its mounts are gone), and stops
    /// listening.
    pub async fn bye(self) {
        let _ = self.ending.send(true);
        let _ = self.task.await;
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Sends one keeper the connections, then holds its stream until it goes or the server ends.
async fn hand(
    mut stream: UnixStream,
    serving: &Serving,
    mut ended: tokio::sync::watch::Receiver<bool>,
) -> Result<()> {
    let connections = serving.connections()?;
    let message = pb::FuseConnections {
        connections: connections
            .iter()
            .enumerate()
            .map(|(n, (role, c))| describe(*role, c, n as u32))
            .collect(),
        generation: serving.generation(),
    };
    let bytes = prost::Message::encode_to_vec(&message);
    let fds: Vec<RawFd> = connections.iter().map(|(_, c)| c.fd.as_raw_fd()).collect();
    let io = |e: std::io::Error| Error::io("sending FUSE connections", e);
    loop {
        stream.writable().await.map_err(io)?;
        let sent = stream.try_io(Interest::WRITABLE, || {
            sendmsg::<()>(
                stream.as_raw_fd(),
                &[IoSlice::new(&bytes)],
                &[ControlMessage::ScmRights(&fds)],
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .map_err(std::io::Error::from)
        });
        match sent {
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(io(e)),
        }
    }
    drop(connections);
    let mut byte = [0u8; 1];
    tokio::select! {
        // The keeper went (a daemon replaced, or one that asked again).
        _ = stream.read(&mut byte) => {}
        _ = async { ended.wait_for(|e| *e).await.map(|_| ()) } => {
            let _ = stream.write_all(BYE).await;
        }
    }
    Ok(())
}

/// A server's connections, and the stream that tells how it ends ([`ended`]).
pub struct Kept {
    pub connections: Vec<(Role, Connection)>,
    /// How many servers served them before the one they came from.
    pub generation: u32,
    pub watch: UnixStream,
}

/// Takes descriptors of the connections of the server listening at `path`.
pub async fn collect(path: &Path) -> Result<Kept> {
    let failed = |why: String| {
        Error::new(
            ErrorKind::Io,
            format!(
                "collecting the FUSE connections at {}: {why}",
                path.display()
            ),
        )
    };
    tokio::time::timeout(COLLECT_DEADLINE, async {
        // A root of any length (`crate::api::unix`).
        let stream = crate::api::unix::connect(path)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let (bytes, fds) = loop {
            stream.readable().await.map_err(|e| failed(e.to_string()))?;
            match stream.try_io(Interest::READABLE, || receive(&stream)) {
                Ok(received) => break received,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(failed(e.to_string())),
            }
        };
        let message: pb::FuseConnections = prost::Message::decode(bytes.as_slice())
            .map_err(|e| failed(format!("a malformed description: {e}")))?;
        if message.connections.len() != fds.len() || fds.is_empty() {
            return Err(failed(format!(
                "{} descriptions for {} descriptors",
                message.connections.len(),
                fds.len()
            )));
        }
        let mut fds: Vec<Option<OwnedFd>> = fds.into_iter().map(Some).collect();
        let mut connections = Vec::with_capacity(fds.len());
        for c in &message.connections {
            let fd = fds
                .get_mut(c.fd as usize)
                .and_then(Option::take)
                .ok_or_else(|| failed(format!("descriptor {} named twice or not sent", c.fd)))?;
            Connection::check_device(&fd)?;
            let (role, offer) = described(c);
            connections.push((role, Connection { fd, offer }));
        }
        Ok(Kept {
            connections,
            generation: message.generation,
            watch: stream,
        })
    })
    .await
    .map_err(|_| failed(format!("no answer within {COLLECT_DEADLINE:?}")))?
}

/// One message of at most [`MAX_MESSAGE`] bytes and at most [`MAX_CONNECTIONS`] descriptors.
fn receive(stream: &UnixStream) -> std::io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut buffer = vec![0u8; MAX_MESSAGE];
    let mut space = nix::cmsg_space!([RawFd; MAX_CONNECTIONS]);
    let mut iov = [IoSliceMut::new(&mut buffer)];
    let msg = recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(received) = cmsg {
            // SAFETY: the kernel just installed these descriptors in this process for this
            // message; nothing else knows or owns them.
            #[allow(unsafe_code)]
            fds.extend(
                received
                    .into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    let (len, truncated) = (
        msg.bytes,
        msg.flags
            .intersects(MsgFlags::MSG_CTRUNC | MsgFlags::MSG_TRUNC),
    );
    if truncated {
        return Err(std::io::Error::other(
            "more descriptors or bytes than a server sends",
        ));
    }
    buffer.truncate(len);
    Ok((buffer, fds))
}

/// How a server ended, as its keeper learns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// It stopped after unmounting: nothing to take over.
    Stopped,
    /// It died with its mounts up: a successor takes them over.
    Died,
}

/// Waits until the server `watch` was collected from ends.
pub async fn ended(mut watch: UnixStream) -> Ending {
    let mut said = [0u8; 3];
    match watch.read(&mut said).await {
        Ok(n) if n > 0 => Ending::Stopped,
        _ => Ending::Died,
    }
}
