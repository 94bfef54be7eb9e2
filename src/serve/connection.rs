//! A mount's FUSE connection, kept apart from the process that serves it so that a successor
//! can take it over when that process dies.
//!
//! The kernel ends a FUSE connection when the last descriptor of its `/dev/fuse` file closes,
//! not when its server dies. The snapshotter keeps a descriptor of every mount's connection
//! ([`crate::snapshotter::servers::keeper`]); when a server dies, the requests it read and did
//! not answer stay queued on the connection and its readers wait. A successor started with
//! that descriptor ([`take_over`]) answers on the same connection — no new mount, the same
//! inodes, its own file handles beside the old ones — and asks the kernel to send again what
//! the dead one left unanswered (`FUSE_NOTIFY_RESEND`, Linux 6.9).
//!
//! Files opened with FUSE passthrough keep reading their backing file across the crash (the
//! kernel holds it). The kernel ties an inode to one registration of its backing file, so a
//! successor answers later opens of such a file with the registration the dead server made,
//! which it finds in the mount's record of them ([`Registrations`]); a new registration would
//! be refused while the old one is in use.
//!
//! Sessions serve a connection with several threads on one descriptor, never with cloned
//! ones: a cloned descriptor belongs to one process, and when it closes with that process the
//! kernel fails the requests read through it instead of keeping them for a successor.
//!
//! fuser starts every session with the connection's `FUSE_INIT` handshake, which the kernel
//! sends once per mount. A successor's session makes it against a stand-in — a socket that
//! carries the kernel's recorded offer ([`Offer`]) to the filesystem's `init`, so it decides as
//! the first server did (its answer goes nowhere: the kernel keeps the first server's) — then
//! the connection's descriptor is put in the stand-in's place before the session reads
//! anything else.

use std::os::fd::{AsFd, AsRawFd, IntoRawFd, OwnedFd};

use fuser::{BackgroundSession, Config, Session, SessionACL};
use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};

use crate::error::{Error, Result};

/// What the kernel offered at a connection's `FUSE_INIT`: the ABI version, its capability
/// flags and the largest read-ahead. Recorded by the first server's filesystem and replayed to
/// its successors'.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offer {
    pub major: u32,
    pub minor: u32,
    pub capabilities: u64,
    pub max_readahead: u32,
}

/// One mount's FUSE connection: a descriptor of its `/dev/fuse` file and the kernel's offer.
#[derive(Debug)]
pub struct Connection {
    pub fd: OwnedFd,
    pub offer: Offer,
}

impl Connection {
    /// Another descriptor of the same connection.
    pub fn try_clone(&self) -> Result<Connection> {
        Ok(Connection {
            fd: self
                .fd
                .try_clone()
                .map_err(|e| Error::io("duplicating a FUSE connection's descriptor", e))?,
            offer: self.offer,
        })
    }

    /// Checks that `fd` is a descriptor of `/dev/fuse` (character device 10:229), as a
    /// descriptor handed over by another process must be before it is served.
    pub fn check_device(fd: &impl AsFd) -> Result<()> {
        let stat = nix::sys::stat::fstat(fd.as_fd())
            .map_err(|e| Error::io("looking at a handed FUSE descriptor", e.into()))?;
        let is_char = stat.st_mode & libc::S_IFMT == libc::S_IFCHR;
        let (major, minor) = (libc::major(stat.st_rdev), libc::minor(stat.st_rdev));
        if !is_char || (major, minor) != (10, 229) {
            return Err(Error::invalid(format!(
                "a handed FUSE connection is not /dev/fuse (mode {:o}, device {major}:{minor})",
                stat.st_mode
            )));
        }
        Ok(())
    }
}

/// Which of a server's mounts a connection is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The layer's files.
    Layer,
    /// Its ready-disk directory.
    ReadyDisk,
}

impl Role {
    /// The file where `prefix`'s mount of this role records its passthrough registrations.
    pub fn registrations(self, prefix: &std::path::Path) -> std::path::PathBuf {
        let name = match self {
            Role::Layer => "layer",
            Role::ReadyDisk => "ready-disk",
        };
        let mut path = prefix.as_os_str().to_owned();
        path.push(format!(".{name}.passthrough"));
        path.into()
    }
}

/// The connections a successor takes over, and how many servers served them before it.
#[derive(Debug)]
pub struct Inherited {
    pub layer: Connection,
    pub ready_disk: Option<Connection>,
    pub generation: u32,
}

/// Most passthrough registrations a record holds (one per file of a mount).
const MAX_REGISTRATIONS: usize = 4096;

/// A mount's passthrough registrations (inode → backing id), recorded in a file (root's, beside
/// the connection's socket) as they are made, for a successor. A new mount starts a new record.
#[derive(Debug)]
pub struct Registrations {
    path: std::path::PathBuf,
    made: parking_lot::Mutex<std::collections::BTreeMap<u64, u32>>,
    /// Inodes registered by an earlier server whose files this one has not checked yet.
    unconfirmed: parking_lot::Mutex<std::collections::BTreeSet<u64>>,
}

impl Registrations {
    /// The record at `path` of a mount made now: none yet.
    pub fn new_mount(path: std::path::PathBuf) -> Self {
        let _ = std::fs::remove_file(&path);
        Registrations {
            path,
            made: Default::default(),
            unconfirmed: Default::default(),
        }
    }

    /// The record at `path` of a mount taken over: those the earlier servers made. An
    /// unreadable or malformed record is an empty one (later opens of such files then fail
    /// while earlier opens hold them, and the log says why).
    pub fn taken_over(path: std::path::PathBuf) -> Self {
        let made = crate::policy::read_bounded(&path, 64 << 10, "passthrough record")
            .and_then(|bytes| {
                serde_json::from_slice::<std::collections::BTreeMap<u64, u32>>(&bytes)
                    .map_err(|e| Error::invalid(format!("{}: {e}", path.display())))
            })
            .unwrap_or_else(|e| {
                tracing::warn!(why = %e.chain(), "no record of the passthrough registrations of the mount taken over");
                Default::default()
            });
        Registrations {
            path,
            unconfirmed: parking_lot::Mutex::new(made.keys().copied().collect()),
            made: parking_lot::Mutex::new(made),
        }
    }

    /// The registration of inode `ino` on this connection, if any.
    pub fn of(&self, ino: u64) -> Option<u32> {
        self.made.lock().get(&ino).copied()
    }

    /// The registration an earlier server made for inode `ino`, while this one has not checked
    /// the file yet ([`Registrations::confirmed`]).
    pub fn unconfirmed(&self, ino: u64) -> Option<u32> {
        self.unconfirmed
            .lock()
            .contains(&ino)
            .then(|| self.of(ino))
            .flatten()
    }

    /// This server checked inode `ino`'s file: it stands by its registration.
    pub fn confirmed(&self, ino: u64) {
        self.unconfirmed.lock().remove(&ino);
    }

    /// Records that inode `ino` is registered as `id` (written at once: a crash may follow).
    pub fn made(&self, ino: u64, id: u32) {
        let mut made = self.made.lock();
        if made.len() >= MAX_REGISTRATIONS && !made.contains_key(&ino) {
            return;
        }
        made.insert(ino, id);
        self.write(&made);
    }

    /// Forgets inode `ino`'s registration (closed: its number may name another file's next).
    pub fn closed(&self, ino: u64) {
        self.unconfirmed.lock().remove(&ino);
        let mut made = self.made.lock();
        if made.remove(&ino).is_some() {
            self.write(&made);
        }
    }

    /// Replaces the record with `made` (called under its lock: records are written in order).
    fn write(&self, made: &std::collections::BTreeMap<u64, u32>) {
        let text = serde_json::to_string(made).expect("a map of numbers serialises");
        let tmp = self.path.with_extension("tmp");
        let written = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, &self.path));
        if let Err(e) = written {
            tracing::warn!(path = %self.path.display(), error = %e, "recording the passthrough registrations failed: a successor could not reopen those files");
        }
    }
}

/// The session settings of every mount: threads on one descriptor (see the module's note).
pub fn session_config(threads: usize) -> Config {
    let mut config = Config::default();
    config.acl = SessionACL::All;
    config.n_threads = Some(threads);
    config.clone_fd = false;
    config
}

/// `FUSE_INIT` (opcode 26) as the kernel sends it: a 40-byte `fuse_in_header` and a 64-byte
/// `fuse_init_in` carrying `offer`.
fn init_request(offer: &Offer) -> Vec<u8> {
    const FUSE_INIT: u32 = 26;
    const LEN: u32 = 40 + 64;
    let mut m = Vec::with_capacity(LEN as usize);
    m.extend_from_slice(&LEN.to_ne_bytes());
    m.extend_from_slice(&FUSE_INIT.to_ne_bytes());
    m.extend_from_slice(&1u64.to_ne_bytes()); // unique
    m.extend_from_slice(&0u64.to_ne_bytes()); // nodeid
    m.extend_from_slice(&[0; 12]); // uid, gid, pid
    m.extend_from_slice(&[0; 4]); // total_extlen, padding
    m.extend_from_slice(&offer.major.to_ne_bytes());
    m.extend_from_slice(&offer.minor.to_ne_bytes());
    m.extend_from_slice(&offer.max_readahead.to_ne_bytes());
    // FUSE_INIT_EXT: the flags go on in `flags2` (the kernel sets it since ABI 7.36; fuser
    // reports capabilities without it).
    const FUSE_INIT_EXT: u32 = 1 << 30;
    m.extend_from_slice(&(offer.capabilities as u32 | FUSE_INIT_EXT).to_ne_bytes());
    m.extend_from_slice(&((offer.capabilities >> 32) as u32).to_ne_bytes());
    m.extend_from_slice(&[0; 44]); // unused
    m
}

/// `FUSE_NOTIFY_RESEND` (code 7): a `fuse_out_header` with no request and no payload.
fn resend_notification() -> [u8; 16] {
    const FUSE_NOTIFY_RESEND: i32 = 7;
    let mut m = [0; 16];
    m[..4].copy_from_slice(&16u32.to_ne_bytes());
    m[4..8].copy_from_slice(&FUSE_NOTIFY_RESEND.to_ne_bytes());
    m
}

/// Serves `connection` — initialised by an earlier server of the same mount — with `fs` on
/// `threads` threads, and has the kernel send again the requests the earlier server read and
/// never answered.
pub fn take_over<FS: fuser::Filesystem + Send + 'static>(
    fs: FS,
    connection: &Connection,
    threads: usize,
) -> Result<BackgroundSession> {
    let io = |what: &str| {
        let what = what.to_string();
        move |e: nix::errno::Errno| {
            Error::io(format!("taking over a FUSE connection: {what}"), e.into())
        }
    };
    Connection::check_device(&connection.fd)?;
    let (standin, session_end) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(io("a stand-in socket"))?;
    nix::unistd::write(&standin, &init_request(&connection.offer))
        .map_err(io("the recorded offer"))?;
    let session = Session::from_fd(fs, session_end, SessionACL::All, session_config(threads))
        .map_err(|e| Error::io("taking over a FUSE connection: the handshake", e))?;
    // Its answer stays unread in the stand-in: the kernel has the first server's.
    let target = session.as_fd().as_raw_fd();
    // SAFETY: `target` is the descriptor the session owns, whose thread has not started; dup3
    // replaces what it refers to in one step and returns it, which stays the session's (its
    // ownership is given back with `into_raw_fd`, nothing closes it twice).
    #[allow(unsafe_code)]
    let replaced =
        unsafe { nix::unistd::dup3_raw(&connection.fd, target, nix::fcntl::OFlag::O_CLOEXEC) };
    replaced
        .map(IntoRawFd::into_raw_fd)
        .map_err(io("the descriptor swap"))?;
    drop(standin);
    let session = session
        .spawn()
        .map_err(|e| Error::io("taking over a FUSE connection: its threads", e))?;
    match nix::unistd::write(&connection.fd, &resend_notification()) {
        Ok(_) => {}
        // Before Linux 6.9: requests the dead server had read wait until their callers give up.
        Err(e) => {
            tracing::warn!(error = %e, "the kernel does not resend the requests the last server left unanswered (FUSE_NOTIFY_RESEND needs Linux 6.9)")
        }
    }
    Ok(session)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stand_in_init_carries_the_offer_where_the_kernel_puts_it() {
        let offer = Offer {
            major: 7,
            minor: 41,
            capabilities: (1 << 41) | 1,
            max_readahead: 131_072,
        };
        let m = init_request(&offer);
        assert_eq!(m.len(), 104);
        let word = |at: usize| u32::from_ne_bytes(m[at..at + 4].try_into().unwrap());
        assert_eq!((word(0), word(4)), (104, 26), "length and FUSE_INIT");
        assert_eq!((word(40), word(44), word(48)), (7, 41, 131_072));
        assert_eq!(
            (word(52), word(56)),
            ((1 << 30) | 1, 1 << 9),
            "flags, flags2"
        );
        let n = resend_notification();
        assert_eq!(
            (
                u32::from_ne_bytes(n[..4].try_into().unwrap()),
                i32::from_ne_bytes(n[4..8].try_into().unwrap())
            ),
            (16, 7)
        );
    }

    #[test]
    fn a_successor_finds_the_registrations_an_earlier_server_recorded_and_a_new_mount_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = Role::ReadyDisk.registrations(&dir.path().join("abc"));
        assert_eq!(path, dir.path().join("abc.ready-disk.passthrough"));
        let first = Registrations::new_mount(path.clone());
        first.made(2, 7);
        first.made(3, 9);
        first.made(4, 11);
        first.closed(3);
        let successor = Registrations::taken_over(path.clone());
        assert_eq!((successor.of(2), successor.of(3)), (Some(7), None));
        assert_eq!(
            successor.of(4),
            Some(11),
            "each registration written at once"
        );
        let fresh = Registrations::new_mount(path.clone());
        assert_eq!(fresh.of(2), None);
        assert_eq!(
            Registrations::taken_over(path.clone()).of(2),
            None,
            "a new mount's record starts empty"
        );
        std::fs::write(&path, "not a record").unwrap();
        assert_eq!(
            Registrations::taken_over(path).of(2),
            None,
            "a malformed record holds none"
        );
    }
}
