//! Checks that a layer's lazy view is what an ordinary pull extracts.
//!
//! Chunks are verified one by one against the TOC, but the TOC is the image author's word:
//! it could describe files the tar stream does not contain, place them elsewhere or name them
//! differently, and the blob digest and diff_id of a lazily read layer are never hashed whole.
//! The regions of the blob between chunks hold what the TOC leaves out (tar headers, padding,
//! the end of the archive, the TOC's own skippable frames); they are small, so they are
//! fetched and decoded frame by frame, as an ordinary decoder would, and joined with the
//! chunks into the layer's tar stream:
//! - **Before anything is served** ([`Engine::check_structure`]): the regions up to the TOC,
//!   with the chunks' content skipped, must parse as a tar whose entries are the TOC's, in
//!   order, with each file's content exactly where its chunks are. So a chunk is only served
//!   where the tar stream holds that file's bytes (a chunk pointing into a skippable frame, a
//!   renamed file, an extra file or duplicate name all fail here).
//! - **Once the layer is complete** ([`Engine::check_integrity`]): the whole stream, chunks
//!   from the cache, must hash to the diff_id the image config claims and parse the same way.
//!   This also covers what cannot be seen without every byte (the frames of chunks nobody
//!   read). A layer that fails is marked in the cache (`integrity`), counted, logged and shown
//!   by `vmdisk ls`, and every further read fails: the node never serves it again, nor shares
//!   its chunks with other layers.
//!
//! An eStargz layer's regions are gzip members (a file's padding rides in its last chunk's
//! member); an ordinary layer read through a seekable index has no regions of its own: the
//! stream between files is decoded from the spans that hold it, each checked against its
//! digest. A disk artifact's layer is no tar: its stream is the disk file, so it has no
//! structure to check, and once complete the file must hash to the digest the artifact pins
//! (else its index's).

use std::io::{Read, Seek, SeekFrom};
use std::sync::Arc;

use super::{Engine, Stats};
use crate::cache::{CacheRoot, Integrity};
use crate::error::{Error, ErrorKind, Result};
use crate::format::tree::{clean_path, NodeKind};
use crate::layer::Layer;
use crate::layer::{Ask, Extent, Held, Piece, StreamKind};
use crate::oci::digest::Hasher;
use crate::registry::AskUntilChecksFail;
use crate::task::blocking;

/// What a tar entry of the rebuilt stream says.
struct TarEntry {
    path: String,
    kind: NodeKind,
    size: u64,
    mode: u32,
    uid: u64,
    gid: u64,
    link: String,
    data_at: u64,
}

impl Engine {
    /// Checks, before the layer serves anything, that the tar stream's headers agree with the
    /// TOC and place every chunk where the tar holds that file's content (see the module
    /// docs). Fetches only the regions between chunks, up to the TOC, that `held` does not
    /// hold (bytes fetched with the TOC). Done once per layer key; the cache remembers it.
    pub async fn check_structure(
        self: &Arc<Self>,
        cache: Option<&CacheRoot>,
        held: &Held,
    ) -> Result<()> {
        if self.layer.codec().stream() == StreamKind::DiskFile {
            // No tar headers: the view is the one file the manifest names, the whole stream.
            return Ok(());
        }
        let key = self.layer.key();
        let cache = cache.cloned();
        let known = cache.clone();
        if blocking(move || Ok(known.is_some_and(|c| c.structure_checked(&key)))).await? {
            return Ok(());
        }
        // The regions between chunks carry no digest: bytes cut or flipped on the way fail the
        // check as a lie would, so a failed check is made again from the registry itself
        // before it counts.
        let asking = AskUntilChecksFail::default();
        let (asking, cache) = (&asking, &cache);
        self.check_policy()
            .run("the layer's structure check", || async move {
                let engine = Arc::clone(self);
                let cache = cache.clone();
                let checked = async {
                    let pieces = engine
                        .pieces(Extent::Structure, asking.ask(), held)
                        .await?;
                    blocking(move || {
                        let mut stream = RebuiltStream::new(&engine, pieces, false);
                        let entries = read_entries(&mut stream)?;
                        compare(&engine.layer, &entries, &stream.chunk_starts)?;
                        if let Some(cache) = cache {
                            if let Err(e) = cache.save_structure_checked(&key) {
                                tracing::warn!(error = %e.chain(), "recording the layer's structure check failed; it runs again next time");
                            }
                        }
                        Ok(())
                    })
                    .await
                };
                asking.noted(checked.await)
            })
            .await
            .map_err(|e| match e.kind() {
                ErrorKind::Corrupt => e.context(format!(
                    "layer {} does not hold what its TOC describes",
                    self.layer.meta.layer_digest
                )),
                _ => e.context(format!(
                    "the structure check of layer {} could not read the layer",
                    self.layer.meta.layer_digest
                )),
            })
    }

    /// Checks the layer once it is complete (see the module docs), records the outcome and,
    /// if the layer differs from its config, stops every further read. A layer that is not
    /// complete, or whose regions cannot be fetched now, stays pending.
    pub async fn check_integrity(self: &Arc<Self>, cache: &CacheRoot) -> Integrity {
        let _single = self.checking.lock().await;
        let current = self.integrity();
        if current != Integrity::Pending || !self.cache.complete() {
            return current;
        }
        // As for the structure check: a mismatch counts only once the regions fetched again
        // from the registry itself say the same.
        let asking = AskUntilChecksFail::default();
        let asking = &asking;
        let rebuilt = self
            .check_policy()
            .run("the layer's integrity check", || async move {
                asking.noted(self.rebuild_and_compare(asking.ask()).await)
            })
            .await;
        let outcome = match rebuilt {
            Ok(()) => Integrity::Verified,
            Err(e) if e.kind() == ErrorKind::Corrupt => Integrity::Failed(e.chain()),
            Err(e) => {
                tracing::warn!(layer = %self.layer.meta.layer_digest, error = %e.chain(), "the layer's integrity cannot be checked now; trying again later");
                return Integrity::Pending;
            }
        };
        match &outcome {
            Integrity::Failed(why) => {
                Stats::add(&self.stats.integrity_failures, 1);
                tracing::error!(layer = %self.layer.meta.layer_digest, reference = %self.layer.reference, reason = %why, "the complete layer differs from its image config; every further read fails");
            }
            _ => {
                tracing::info!(layer = %self.layer.meta.layer_digest, diff_id = %self.layer.meta.diff_id, "the complete layer matches its diff_id and TOC")
            }
        }
        // Only this check sets it, one at a time (`checking`), after it found it unset.
        let _ = self.integrity.set(outcome.clone());
        let (cache, key, record) = (cache.clone(), self.layer.key(), outcome.clone());
        if let Err(e) = blocking(move || cache.save_integrity(&key, &record)).await {
            tracing::warn!(error = %e.chain(), "recording the layer's integrity failed; it is checked again next time");
        }
        outcome
    }

    /// Rebuilds the whole stream (regions fetched, chunks from the cache) and compares it with
    /// the diff_id and the TOC, off the async workers.
    async fn rebuild_and_compare(self: &Arc<Self>, ask: Ask) -> Result<()> {
        let pieces = self.pieces(Extent::Whole, ask, &Held::default()).await?;
        let engine = Arc::clone(self);
        blocking(move || {
            let layer = &engine.layer;
            let mut stream = RebuiltStream::new(&engine, pieces, true);
            // A disk artifact's stream is the disk file: no tar entries to read or compare.
            let disk_file = layer.codec().stream() == StreamKind::DiskFile;
            let entries = match disk_file {
                true => Ok(Vec::new()),
                false => read_entries(&mut stream),
            };
            let rest = std::io::copy(&mut stream, &mut std::io::sink());
            // A failing cache read is a local fault, not a verdict on the layer.
            if let Some(e) = stream.cache_error.take() {
                return Err(e);
            }
            let entries = entries?;
            rest.map_err(|e| Error::io("reading the rebuilt layer", e))?;
            let digest = std::mem::take(&mut stream.hasher).finish();
            if digest != layer.meta.diff_id {
                return Err(Error::corrupt(match disk_file {
                    true => format!("the disk hashes to {digest}, not {}", layer.meta.diff_id),
                    false => format!(
                        "the layer's tar stream hashes to {digest}, its image config says {}",
                        layer.meta.diff_id
                    ),
                }));
            }
            if disk_file {
                return Ok(());
            }
            compare(layer, &entries, &stream.chunk_starts)
        })
        .await
    }

    /// The pieces of `extent` of the layer's stream, as its codec rebuilds them (`ask`: whom
    /// the regions between chunks are asked of, unless `held` holds them).
    async fn pieces(&self, extent: Extent, ask: Ask, held: &Held) -> Result<Vec<Piece>> {
        self.layer
            .codec()
            .pieces(&self.layer, extent, &held.before(self), ask)
            .await
    }

    /// How a check is made again ([`crate::retry::RetryPolicy::recheck`]: six tries, from the
    /// registry itself after the first, within the one fetch deadline). An answer that
    /// contradicts its request is not retried ([`crate::retry::transient`]).
    fn check_policy(&self) -> crate::retry::RetryPolicy {
        crate::retry::RetryPolicy::recheck(self.opts.fetch_deadline)
    }
}

/// Compares the tar entries with the TOC's nodes and the chunks' places in the stream with the
/// tar headers.
fn compare(layer: &Layer, entries: &[TarEntry], chunk_starts: &[u64]) -> Result<()> {
    // A stream may end with an entry the TOC does not list (eStargz: its TOC).
    let entries = match (entries.split_last(), layer.codec().trailing_entry()) {
        (Some((last, rest)), Some(trailing)) if last.path == trailing => rest,
        _ => entries,
    };
    if entries.len() != layer.nodes.len() {
        return Err(Error::corrupt(format!(
            "the tar stream holds {} entries, the TOC lists {}",
            entries.len(),
            layer.nodes.len()
        )));
    }
    for (n, (entry, node)) in entries.iter().zip(&layer.nodes).enumerate() {
        let differs = |what: &str, tar: String, toc: String| {
            Error::corrupt(format!(
                "tar entry {n} ({}) has {what} {tar}, the TOC says {toc}",
                entry.path
            ))
        };
        if entry.path != node.path {
            return Err(differs("path", entry.path.clone(), node.path.clone()));
        }
        if entry.kind != node.kind {
            return Err(differs(
                "type",
                format!("{:?}", entry.kind),
                format!("{:?}", node.kind),
            ));
        }
        if (entry.mode, entry.uid, entry.gid)
            != (node.mode, u64::from(node.uid), u64::from(node.gid))
        {
            return Err(differs(
                "mode/uid/gid",
                format!("{:o}/{}/{}", entry.mode, entry.uid, entry.gid),
                format!("{:o}/{}/{}", node.mode, node.uid, node.gid),
            ));
        }
        if matches!(node.kind, NodeKind::Symlink | NodeKind::Hardlink) && entry.link != node.link {
            return Err(differs(
                "link target",
                entry.link.clone(),
                node.link.clone(),
            ));
        }
        if node.kind != NodeKind::Regular {
            continue;
        }
        if entry.size != node.size {
            return Err(differs(
                "size",
                entry.size.to_string(),
                node.size.to_string(),
            ));
        }
        let Some(file) = layer.file_of_node(n) else {
            continue;
        };
        let f = &layer.files[file];
        let range = f.first..f.first + f.count;
        for (chunk, &start) in layer.chunks[range.clone()].iter().zip(&chunk_starts[range]) {
            let expected = entry.data_at + chunk.offset;
            if start != expected {
                return Err(Error::corrupt(format!(
                    "{}: the chunk at file offset {} lies at byte {start} of the tar stream, but the tar header puts it at {expected}",
                    node.path, chunk.offset
                )));
            }
        }
    }
    Ok(())
}

/// The entries of the rebuilt stream, as a tar reader sees them.
/// Unless the stream reads chunks, file contents are skipped, not read (they may not be
/// cached).
fn read_entries(stream: &mut RebuiltStream<'_>) -> Result<Vec<TarEntry>> {
    let corrupt = |e: std::io::Error| Error::corrupt(format!("the layer is not a valid tar: {e}"));
    let seek = !stream.read_chunks;
    let mut archive = tar::Archive::new(stream);
    let mut entries = Vec::new();
    let iter = if seek {
        archive.entries_with_seek()
    } else {
        archive.entries()
    };
    for entry in iter.map_err(corrupt)? {
        let entry = entry.map_err(corrupt)?;
        let header = entry.header();
        let kind = match header.entry_type() {
            tar::EntryType::Regular | tar::EntryType::Continuous => NodeKind::Regular,
            tar::EntryType::Directory => NodeKind::Dir,
            tar::EntryType::Symlink => NodeKind::Symlink,
            tar::EntryType::Link => NodeKind::Hardlink,
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => NodeKind::Other,
            tar::EntryType::XGlobalHeader => continue,
            other => {
                return Err(Error::corrupt(format!(
                "the layer's tar holds an entry of type {other:?}, which the TOC cannot describe"
            )))
            }
        };
        let name = String::from_utf8(entry.path_bytes().into_owned())
            .map_err(|_| Error::corrupt("a tar entry name is not UTF-8"))?;
        if kind == NodeKind::Dir && matches!(name.trim_end_matches('/'), "" | ".") {
            // The layer root: the lazy view's root is the mount's.
            continue;
        }
        let path = clean_path(&name)?;
        let link = match entry.link_name_bytes() {
            Some(l) => String::from_utf8(l.into_owned())
                .map_err(|_| Error::corrupt(format!("the link target of {path} is not UTF-8")))?,
            None => String::new(),
        };
        let link = if kind == NodeKind::Hardlink {
            clean_path(&link)?
        } else {
            link
        };
        let number = |v: std::io::Result<u64>| v.map_err(corrupt);
        entries.push(TarEntry {
            kind,
            size: if kind == NodeKind::Regular {
                entry.size()
            } else {
                0
            },
            mode: (number(header.mode().map(u64::from))? & 0o7777) as u32,
            uid: number(header.uid())?,
            gid: number(header.gid())?,
            link,
            data_at: entry.raw_file_position(),
            path,
        });
    }
    Ok(entries)
}

/// The rebuilt tar stream: decoded regions and cached chunks in blob order, hashed as read.
struct RebuiltStream<'a> {
    engine: &'a Engine,
    /// Whether chunks are read from the cache; if not, reading one is an error and only
    /// seeking passes it.
    read_chunks: bool,
    pieces: Vec<Piece>,
    /// The piece being read and the offset in it.
    at: usize,
    within: u64,
    /// Bytes read so far.
    position: u64,
    hasher: Hasher,
    /// Where each chunk starts in the stream.
    chunk_starts: Vec<u64>,
    /// A failed read of the cache, kept apart from what the tar reader makes of it.
    cache_error: Option<Error>,
}

impl<'a> RebuiltStream<'a> {
    fn new(engine: &'a Engine, pieces: Vec<Piece>, read_chunks: bool) -> Self {
        RebuiltStream {
            engine,
            read_chunks,
            pieces,
            at: 0,
            within: 0,
            position: 0,
            hasher: Hasher::new(),
            chunk_starts: vec![u64::MAX; engine.layer.chunks.len()],
            cache_error: None,
        }
    }

    /// The length of piece `i`.
    fn piece_len(&self, i: usize) -> u64 {
        match &self.pieces[i] {
            Piece::Region(bytes) => bytes.len() as u64,
            Piece::Chunk(idx) => self.engine.layer.chunks[*idx].size,
        }
    }

    /// Notes where a chunk starts when the stream enters it.
    fn entering(&mut self) {
        if let (0, Some(Piece::Chunk(idx))) = (self.within, self.pieces.get(self.at)) {
            self.chunk_starts[*idx] = self.position;
        }
    }
}

impl Seek for RebuiltStream<'_> {
    /// Forward relative seeks only (what a tar reader skipping file contents does); the
    /// skipped bytes are not hashed, so only the structure check seeks.
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        let SeekFrom::Current(mut left) = pos else {
            return Err(std::io::Error::other(
                "the rebuilt layer seeks forward only",
            ));
        };
        if left < 0 {
            return Err(std::io::Error::other(
                "the rebuilt layer seeks forward only",
            ));
        }
        while left > 0 && self.at < self.pieces.len() {
            self.entering();
            let step = (self.piece_len(self.at) - self.within).min(left as u64);
            self.within += step;
            self.position += step;
            left -= step as i64;
            if self.within == self.piece_len(self.at) {
                self.at += 1;
                self.within = 0;
            }
        }
        self.entering();
        Ok(self.position)
    }
}

impl Read for RebuiltStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let layer = &self.engine.layer;
        while let Some(piece) = self.pieces.get(self.at) {
            let n = match piece {
                Piece::Region(bytes) => {
                    let rest = &bytes[self.within as usize..];
                    let n = rest.len().min(buf.len());
                    buf[..n].copy_from_slice(&rest[..n]);
                    n
                }
                Piece::Chunk(idx) => {
                    let (file, chunk) = layer.chunk(*idx);
                    if self.within == 0 {
                        self.chunk_starts[*idx] = self.position;
                    }
                    if !self.read_chunks {
                        return Err(std::io::Error::other(
                            "a tar header region runs into file content",
                        ));
                    }
                    // A damaged cache is a local fault (the chunk is fetched again), never a
                    // verdict on the layer.
                    if self.within == 0
                        && !self.engine.cache.is_checked(*idx)
                        && !self.engine.check_cached(*idx)
                    {
                        let e = Error::new(
                            ErrorKind::Io,
                            format!("cached chunk {idx} was damaged; the check waits until it is fetched again (by a read or hydration)"),
                        );
                        let text = e.chain();
                        self.cache_error = Some(e);
                        return Err(std::io::Error::other(text));
                    }
                    let n = ((chunk.size - self.within) as usize).min(buf.len());
                    if let Err(e) =
                        self.engine
                            .cache
                            .read_at(file, &mut buf[..n], chunk.offset + self.within)
                    {
                        let text = e.chain();
                        self.cache_error = Some(e);
                        return Err(std::io::Error::other(text));
                    }
                    n
                }
            };
            if n == 0 {
                self.at += 1;
                self.within = 0;
                continue;
            }
            self.within += n as u64;
            self.position += n as u64;
            self.hasher.update(&buf[..n]);
            return Ok(n);
        }
        Ok(0)
    }
}
