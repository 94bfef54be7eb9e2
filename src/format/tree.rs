//! The tree every layer format yields: nodes (files, directories, links) with their metadata
//! and, for regular files, the chunks that hold their content; safe paths; the rules that keep
//! the lazy view identical to what tar extraction makes of a layer. Format-neutral: the TOC of
//! zstd:chunked and eStargz ([`super::toc`]), the seekable index and a disk artifact's file all
//! become these.

use std::collections::HashMap;
use std::ops::Range;

use crate::error::{Error, Result};
use crate::oci::digest::Digest;

/// One chunk of a regular file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Offset of the chunk in the file.
    pub offset: u64,
    /// Uncompressed length.
    pub size: u64,
    /// The chunk's zstd frame(s) in the blob.
    pub compressed: Range<u64>,
    /// sha256 of the uncompressed content; `None` only if the TOC gives none.
    pub digest: Option<Digest>,
    /// Marked all zeros by the writer: fetched and verified like any chunk (the mark is a
    /// claim), then kept as a hole in the cache instead of written.
    pub zeros: bool,
}

/// The kind of a tree entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    Dir,
    Regular,
    Symlink,
    Hardlink,
    Other,
}

/// A validated TOC entry: a safe relative path, its metadata and, for regular files, chunks
/// that cover the file exactly and lie inside the blob.
#[derive(Clone, Debug)]
pub struct Node {
    pub kind: NodeKind,
    /// Relative path without `.` or `..` components, e.g. `disk/disk.qcow2`.
    pub path: String,
    pub link: String,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub mod_time: Option<String>,
    pub digest: Option<Digest>,
    pub chunks: Vec<Chunk>,
}

impl Node {
    /// Whether every chunk has a digest, so each can be verified on its own.
    pub fn verifiable(&self) -> bool {
        self.chunks.iter().all(|c| c.digest.is_some())
    }
}

/// Makes a TOC or tar name into a safe relative path, or says why it is not one.
pub fn clean_path(name: &str) -> Result<String> {
    let bad = |why: &str| Error::corrupt(format!("path {name:?} in the layer is unsafe: {why}"));
    if name.len() > 4096 || name.contains('\0') {
        return Err(bad("too long or contains NUL"));
    }
    let mut parts = Vec::new();
    for part in name.split('/') {
        match part {
            "" | "." => continue,
            ".." => return Err(bad("contains '..'")),
            p if p.len() > 255 => return Err(bad("a component is longer than 255 bytes")),
            p => parts.push(p),
        }
    }
    if parts.is_empty() {
        return Err(bad("names the layer root"));
    }
    Ok(parts.join("/"))
}

/// What a path is while a TOC is validated: listed by an entry, or only implied as the
/// directory of other entries.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Seen {
    Implied,
    Listed(NodeKind),
}

/// Records `path` (of `kind`) and its ancestors, refusing what tar extraction would resolve
/// differently from the lazy view: a path listed twice (tar keeps the last entry), a
/// directory that is also listed as a file, an entry under a file. Linear in the TOC: the
/// walk up stops at the first ancestor already known as a directory.
pub(super) fn place(seen: &mut HashMap<String, Seen>, path: &str, kind: NodeKind) -> Result<()> {
    let refused = |why: String| Error::corrupt(format!("TOC: {path}: {why}"));
    match seen.get(path) {
        Some(Seen::Listed(_)) => {
            return Err(refused(
                "listed twice (tar extraction keeps the last entry, so the layer is ambiguous)"
                    .into(),
            ))
        }
        Some(Seen::Implied) if kind != NodeKind::Dir => {
            return Err(refused(format!(
                "listed as a {kind:?} but other entries lie under it"
            )))
        }
        _ => {}
    }
    seen.insert(path.to_string(), Seen::Listed(kind));
    let mut dir = path;
    while let Some(slash) = dir.rfind('/') {
        dir = &dir[..slash];
        match seen.get(dir) {
            Some(Seen::Implied | Seen::Listed(NodeKind::Dir)) => break,
            Some(Seen::Listed(other)) => {
                return Err(refused(format!("lies under {dir}, which is a {other:?}")))
            }
            None => {
                seen.insert(dir.to_string(), Seen::Implied);
            }
        }
    }
    Ok(())
}
