//! The read-only FUSE filesystem that shows a lazily loaded layer: the TOC's tree with its
//! modes, owners, sizes and times, and file contents from the [`Engine`].
//!
//! Reads of cached data are answered on the FUSE thread; a read that needs a fetch is handed
//! to the async runtime and answered from there, so missing chunks never hold up cached reads.
//! The data is immutable, so attributes and entries carry long timeouts and the kernel page
//! cache is kept across opens. A file whose every chunk is present is opened with FUSE
//! passthrough (kernel ≥ 6.9): the kernel then reads the cache's data file directly.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use fuser::{
    BackingId, Config, Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyXattr, Request,
    SessionACL,
};

use crate::engine::stats::Stats;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::format::zstd_chunked::NodeKind;

/// Attribute and entry timeout: the content never changes while mounted.
const TTL: Duration = Duration::from_secs(24 * 3600);
const ROOT: u64 = 1;

struct Inode {
    attr: FileAttr,
    parent: u64,
    /// File number in the layer, for regular files with content.
    file: Option<usize>,
    link: OsString,
    children: Vec<(OsString, u64)>,
}

struct OpenFile {
    /// Where the last read ended, to detect sequential reading.
    next_offset: u64,
    /// Bytes read back to back so far; read-ahead starts past [`SEQUENTIAL_THRESHOLD`].
    sequential_bytes: u64,
}

/// A reader must read this much back to back before read-ahead starts: the kernel splits one
/// large read into several FUSE requests, which alone must not look like a stream.
const SEQUENTIAL_THRESHOLD: u64 = 1 << 20;

/// The filesystem of one mounted layer.
pub struct LayerFs {
    engine: Arc<Engine>,
    runtime: tokio::runtime::Handle,
    inodes: Vec<Inode>,
    open: Mutex<HashMap<u64, OpenFile>>,
    next_fh: AtomicU64,
    passthrough: AtomicBool,
    backing: Mutex<HashMap<usize, Arc<BackingId>>>,
}

fn mtime(text: Option<&str>) -> SystemTime {
    text.and_then(|t| {
        time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()
    })
    .and_then(|t| u64::try_from(t.unix_timestamp()).ok())
    .map_or(SystemTime::UNIX_EPOCH, |s| {
        SystemTime::UNIX_EPOCH + Duration::from_secs(s)
    })
}

fn attr(
    ino: u64,
    kind: FileType,
    size: u64,
    perm: u32,
    uid: u32,
    gid: u32,
    time: SystemTime,
) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: size.div_ceil(512),
        atime: time,
        mtime: time,
        ctime: time,
        crtime: time,
        kind,
        perm: (perm & 0o7777) as u16,
        nlink: if kind == FileType::Directory { 2 } else { 1 },
        uid,
        gid,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl LayerFs {
    /// Builds the tree from the layer's TOC.
    pub fn new(engine: Arc<Engine>, runtime: tokio::runtime::Handle, passthrough: bool) -> Self {
        let mut inodes = vec![
            Inode {
                attr: attr(0, FileType::Directory, 0, 0, 0, 0, SystemTime::UNIX_EPOCH),
                parent: 0,
                file: None,
                link: OsString::new(),
                children: Vec::new(),
            },
            Inode {
                attr: attr(
                    ROOT,
                    FileType::Directory,
                    0,
                    0o755,
                    0,
                    0,
                    SystemTime::UNIX_EPOCH,
                ),
                parent: ROOT,
                file: None,
                link: OsString::new(),
                children: Vec::new(),
            },
        ];
        let mut by_path: HashMap<String, u64> = HashMap::from([(String::new(), ROOT)]);
        let layer = &engine.layer;
        for (n, node) in layer.nodes.iter().enumerate() {
            // Parents first (the TOC may omit directory entries).
            let mut parent = ROOT;
            let parts: Vec<&str> = node.path.split('/').collect();
            for depth in 1..parts.len() {
                let dir = parts[..depth].join("/");
                parent = match by_path.get(&dir) {
                    Some(&ino) => ino,
                    None => {
                        let ino = inodes.len() as u64;
                        inodes.push(Inode {
                            attr: attr(
                                ino,
                                FileType::Directory,
                                0,
                                0o755,
                                0,
                                0,
                                SystemTime::UNIX_EPOCH,
                            ),
                            parent,
                            file: None,
                            link: OsString::new(),
                            children: Vec::new(),
                        });
                        inodes[parent as usize]
                            .children
                            .push((OsString::from(parts[depth - 1]), ino));
                        by_path.insert(dir, ino);
                        ino
                    }
                };
            }
            let name = OsString::from(parts[parts.len() - 1]);
            let time = mtime(node.mod_time.as_deref());
            if node.kind == NodeKind::Dir {
                if let Some(&ino) = by_path.get(&node.path) {
                    inodes[ino as usize].attr = attr(
                        ino,
                        FileType::Directory,
                        0,
                        node.mode,
                        node.uid,
                        node.gid,
                        time,
                    );
                    continue;
                }
            }
            if node.kind == NodeKind::Hardlink {
                if let Some(&target) = by_path
                    .get(&crate::format::zstd_chunked::clean_path(&node.link).unwrap_or_default())
                {
                    inodes[target as usize].attr.nlink += 1;
                    inodes[parent as usize].children.push((name, target));
                }
                continue;
            }
            let kind = match node.kind {
                NodeKind::Dir => FileType::Directory,
                NodeKind::Regular => FileType::RegularFile,
                NodeKind::Symlink => FileType::Symlink,
                NodeKind::Hardlink | NodeKind::Other => continue,
            };
            let ino = inodes.len() as u64;
            let size = if kind == FileType::Symlink {
                node.link.len() as u64
            } else {
                node.size
            };
            inodes.push(Inode {
                attr: attr(ino, kind, size, node.mode, node.uid, node.gid, time),
                parent,
                file: layer.file_of_node(n),
                link: OsString::from(&node.link),
                children: Vec::new(),
            });
            inodes[parent as usize].children.push((name, ino));
            by_path.insert(node.path.clone(), ino);
        }
        LayerFs {
            engine,
            runtime,
            inodes,
            open: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            passthrough: AtomicBool::new(passthrough),
            backing: Mutex::new(HashMap::new()),
        }
    }

    fn inode(&self, ino: INodeNo) -> Option<&Inode> {
        self.inodes.get(ino.0 as usize).filter(|_| ino.0 >= ROOT)
    }

    fn file_complete(&self, file: usize) -> bool {
        let f = &self.engine.layer.files[file];
        self.engine.all_present(f.first..f.first + f.count)
    }

    /// The passthrough backing id of `file` once every chunk of it is present, registered with
    /// the kernel on first use. Disables passthrough for the mount if the kernel refuses.
    fn backing(&self, file: usize, reply: &ReplyOpen) -> Option<Arc<BackingId>> {
        if !self.passthrough.load(Ordering::Relaxed) || !self.file_complete(file) {
            return None;
        }
        let mut backing = self.backing.lock().expect("backing lock");
        if let Some(id) = backing.get(&file) {
            return Some(Arc::clone(id));
        }
        match reply.open_backing(self.engine.cache.data_file(file)) {
            Ok(id) => {
                let id = Arc::new(id);
                backing.insert(file, Arc::clone(&id));
                Some(id)
            }
            Err(e) => {
                tracing::info!(error = %e, "FUSE passthrough unavailable (needs CAP_SYS_ADMIN and kernel support); serving reads from the daemon");
                self.passthrough.store(false, Ordering::Relaxed);
                None
            }
        }
    }
}

impl fuser::Filesystem for LayerFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_readahead(1 << 20);
        if self.passthrough.load(Ordering::Relaxed) {
            let ok = config.capabilities().contains(InitFlags::FUSE_PASSTHROUGH)
                && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(1).is_ok();
            if !ok {
                tracing::info!("the kernel does not offer FUSE passthrough; every read goes through the daemon");
                self.passthrough.store(false, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = self
            .inode(parent)
            .and_then(|p| p.children.iter().find(|(n, _)| n == name))
            .map(|(_, ino)| *ino);
        match found {
            Some(ino) => reply.entry(&TTL, &self.inodes[ino as usize].attr, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.inode(ino) {
            Some(i) => reply.attr(&TTL, &i.attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.inode(ino) {
            Some(i) if i.attr.kind == FileType::Symlink => {
                reply.data(std::os::unix::ffi::OsStrExt::as_bytes(i.link.as_os_str()))
            }
            Some(_) => reply.error(Errno::EINVAL),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let Some(inode) = self.inode(ino) else {
            return reply.error(Errno::ENOENT);
        };
        if flags.0 & libc_accmode() != 0 {
            return reply.error(Errno::EROFS);
        }
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.open.lock().expect("open lock").insert(
            fh,
            OpenFile {
                next_offset: 0,
                sequential_bytes: 0,
            },
        );
        if let Some(id) = inode.file.and_then(|file| self.backing(file, &reply)) {
            Stats::add(&self.engine.stats.passthrough_opens, 1);
            // The kernel accepts no caching flags with passthrough (it uses the backing file's).
            return reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id);
        }
        reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let stats = &self.engine.stats;
        Stats::add(&stats.read_calls, 1);
        let Some(file) = self.inode(ino).and_then(|i| i.file) else {
            return reply.data(&[]);
        };
        let sequential = {
            let mut open = self.open.lock().expect("open lock");
            match open.get_mut(&fh.0) {
                Some(state) => {
                    state.sequential_bytes = if state.next_offset == offset {
                        state.sequential_bytes + u64::from(size)
                    } else {
                        0
                    };
                    state.next_offset = offset + u64::from(size);
                    state.sequential_bytes >= SEQUENTIAL_THRESHOLD
                }
                None => false,
            }
        };
        if sequential {
            self.read_ahead(file, offset + u64::from(size));
        }
        if let Some(result) = self.engine.read_cached(file, offset, u64::from(size)) {
            Stats::add(&stats.cache_hits, 1);
            return answer(&self.engine, result, reply);
        }
        Stats::add(&stats.cache_misses, 1);
        let engine = Arc::clone(&self.engine);
        self.runtime.spawn(async move {
            let result = engine.read(file, offset, u64::from(size)).await;
            answer(&engine, result, reply);
        });
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, _name: &OsStr, _size: u32, reply: ReplyXattr) {
        // The TOC's xattrs are not exposed (containerDisks carry none).
        match self.inode(ino) {
            Some(_) => reply.error(Errno::ENODATA),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        match (self.inode(ino), size) {
            (None, _) => reply.error(Errno::ENOENT),
            (Some(_), 0) => reply.size(0),
            (Some(_), _) => reply.data(&[]),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.open.lock().expect("open lock").remove(&fh.0);
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.inode(ino) {
            Some(i) if i.attr.kind == FileType::Directory => {
                reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE)
            }
            Some(_) => reply.error(Errno::ENOTDIR),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let Some(dir) = self.inode(ino) else {
            return reply.error(Errno::ENOENT);
        };
        let mut entries: Vec<(u64, FileType, &OsStr)> = vec![
            (ino.0, FileType::Directory, OsStr::new(".")),
            (dir.parent, FileType::Directory, OsStr::new("..")),
        ];
        entries.extend(dir.children.iter().map(|(name, child)| {
            (
                *child,
                self.inodes[*child as usize].attr.kind,
                name.as_os_str(),
            )
        }));
        for (i, (child, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(child), (i + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let total: u64 = self.inodes.iter().map(|i| i.attr.size).sum();
        reply.statfs(
            total.div_ceil(4096),
            0,
            0,
            self.inodes.len() as u64,
            0,
            4096,
            255,
            4096,
        );
    }
}

impl LayerFs {
    /// Fetches the chunks after `from` in the background for a sequential reader.
    fn read_ahead(&self, file: usize, from: u64) {
        let layer = &self.engine.layer;
        let start = layer.chunks_for(file, from..from + 1).start;
        let f = &layer.files[file];
        let end = (start + self.engine.options().readahead_chunks).min(f.first + f.count);
        if start >= end || self.engine.all_present(start..end) {
            return;
        }
        let engine = Arc::clone(&self.engine);
        self.runtime.spawn(async move {
            if let Err(e) = engine.ensure(start..end).await {
                tracing::debug!(error = %e.chain(), "read-ahead failed");
            }
        });
    }
}

/// O_WRONLY | O_RDWR.
fn libc_accmode() -> i32 {
    0o3
}

fn answer(engine: &Engine, result: Result<Vec<u8>>, reply: ReplyData) {
    match result {
        Ok(data) => {
            Stats::add(&engine.stats.bytes_served, data.len() as u64);
            reply.data(&data);
        }
        Err(e) => {
            Stats::add(&engine.stats.read_errors, 1);
            tracing::error!(layer = %engine.layer.meta.layer_digest, error = %e.chain(), "read failed; answering EIO");
            reply.error(Errno::EIO);
        }
    }
}

/// Mounts `fs` read-only at `dir` with a multi-threaded session.
pub fn mount(fs: LayerFs, dir: &Path) -> Result<fuser::BackgroundSession> {
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::RO,
        MountOption::FSName("vmdisk".into()),
        MountOption::Subtype("vmdisk".into()),
        MountOption::DefaultPermissions,
        MountOption::NoDev,
        MountOption::NoSuid,
    ];
    config.acl = SessionACL::All;
    config.n_threads = Some(4);
    config.clone_fd = true;
    fuser::spawn_mount(fs, dir, &config)
        .map_err(|e| Error::io(format!("mounting FUSE at {}", dir.display()), e))
}
