//! The layer model, below the engine: a lazily read layer as the tree its TOC or index
//! describes, its files' content as one flat table of chunks (each a verifiable piece of the
//! blob), what kind of layer it is and what identifies it ([`record`]), and the [`Codec`] of
//! its kind, which turns the blob's bytes into verified content ([`codec`] has one per kind
//! and opens layers: [`codec::open`]).
//!
//! Nothing here fetches on its own: the engine fetches what a codec asks for ([`Fetch`]),
//! resolution (`crate::resolve`) finds the record and the TOC, and both meet in a [`Layer`].

pub mod codec;
mod record;
#[cfg(test)]
pub(crate) mod testing;

use std::ops::Range;

use futures_util::future::BoxFuture;

pub use record::{IndexSource, LayerId, LayerKind, LayerMeta};

use crate::error::{Error, ErrorKind, Result};
use crate::format::tree::{Chunk, Node, NodeKind};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;

/// A regular file of the layer and its place in the chunk table.
#[derive(Clone, Debug)]
pub struct FileChunks {
    /// Index into [`Layer::nodes`].
    pub node: usize,
    /// Its chunks are `chunks[first..first + count]`.
    pub first: usize,
    pub count: usize,
}

/// Where a layer's record and TOC came from when it was opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolved {
    /// Resolved from the registry now.
    Online,
    /// From the cache's last resolution (the registry could not be reached), or a cached layer
    /// opened to share its chunks.
    Offline,
}

/// A layer and its chunk table.
#[derive(Debug)]
pub struct Layer {
    /// Where chunks are fetched from (registry and repository; the object is the blob).
    pub reference: Reference,
    pub meta: LayerMeta,
    pub nodes: Vec<Node>,
    /// Regular files with content, in TOC order; "file number" n is `files[n]`.
    pub files: Vec<FileChunks>,
    /// Every chunk of every file, file after file ([`Layer::chunk`] gives its file).
    pub chunks: Vec<Chunk>,
    /// The file number of the disk (under `disk/` or `image/`, or the annotated path).
    pub disk: usize,
    pub resolved: Resolved,
    codec: Box<dyn Codec>,
}

/// The files and chunk table a codec built from a TOC or index.
pub(crate) struct Table {
    pub nodes: Vec<Node>,
    pub files: Vec<FileChunks>,
    pub chunks: Vec<Chunk>,
}

impl Table {
    /// The table of validated `nodes` whose regular files carry their chunks: every chunk must
    /// carry a digest, so each can be verified on its own.
    pub fn of_nodes(mut nodes: Vec<Node>) -> Result<Self> {
        let mut files = Vec::new();
        let mut chunks: Vec<Chunk> = Vec::new();
        for (i, node) in nodes.iter_mut().enumerate() {
            if node.kind == NodeKind::Regular && node.size > 0 {
                if !node.verifiable() {
                    return Err(Error::unsupported(format!("{}: some chunks have no digest and cannot be verified; republish with `vmdisk convert`", node.path)));
                }
                files.push(FileChunks {
                    node: i,
                    first: chunks.len(),
                    count: node.chunks.len(),
                });
                // The flat table is the one copy of the chunks from here on (a disk layer's
                // one file hands over its table without a copy).
                if chunks.is_empty() {
                    chunks = std::mem::take(&mut node.chunks);
                } else {
                    chunks.append(&mut node.chunks);
                }
            }
        }
        Ok(Table {
            nodes,
            files,
            chunks,
        })
    }
}

impl Layer {
    /// The layer `meta` records with the chunk table and codec of its kind ([`codec::open`]);
    /// its disk is the file under `disk/` or `image/`, or the one the record names.
    pub(crate) fn new(
        reference: Reference,
        meta: LayerMeta,
        table: Table,
        codec: Box<dyn Codec>,
        resolved: Resolved,
    ) -> Result<Self> {
        let Table {
            nodes,
            files,
            chunks,
        } = table;
        let disk = files
            .iter()
            .position(|f| {
                crate::format::layout::is_disk_path(&nodes[f.node].path, meta.disk_path.as_deref())
            })
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::NotFound,
                    "the layer has no regular file under /disk/ or /image/",
                )
            })?;
        Ok(Layer {
            reference,
            meta,
            nodes,
            files,
            chunks,
            disk,
            resolved,
            codec,
        })
    }

    /// How the layer's bytes decode.
    pub fn codec(&self) -> &dyn Codec {
        self.codec.as_ref()
    }

    /// Chunk `idx` and the file number it belongs to.
    pub fn chunk(&self, idx: usize) -> (usize, &Chunk) {
        let file = self.files.partition_point(|f| f.first + f.count <= idx);
        (file, &self.chunks[idx])
    }

    /// The chunks of file `file`, as global indices.
    pub fn chunks_of(&self, file: usize) -> Range<usize> {
        let f = &self.files[file];
        f.first..f.first + f.count
    }

    /// The chunks of file `file` that overlap `range` (file offsets), as global indices.
    pub fn chunks_for(&self, file: usize, range: Range<u64>) -> Range<usize> {
        let f = &self.files[file];
        let slice = &self.chunks[f.first..f.first + f.count];
        if range.is_empty() {
            return f.first..f.first;
        }
        let start = slice.partition_point(|c| c.offset + c.size <= range.start);
        let end = slice.partition_point(|c| c.offset < range.end);
        f.first + start..f.first + end
    }

    /// Size of regular file `file`.
    pub fn file_size(&self, file: usize) -> u64 {
        self.nodes[self.files[file].node].size
    }

    /// The path of regular file `file` in the layer.
    pub fn file_path(&self, file: usize) -> &str {
        &self.nodes[self.files[file].node].path
    }

    /// The path of the disk in the layer (`disk/…`, `image/…` or the annotated one).
    pub fn disk_path(&self) -> &str {
        self.file_path(self.disk)
    }

    /// The file number of node `node`, if it is a regular file with content.
    pub fn file_of_node(&self, node: usize) -> Option<usize> {
        // Files are in node order.
        self.files.binary_search_by_key(&node, |f| f.node).ok()
    }

    /// The layer's identity.
    pub fn id(&self) -> LayerId {
        self.meta.id()
    }

    /// The layer's cache key ([`LayerId::key`]).
    pub fn key(&self) -> Digest {
        self.meta.id().key()
    }
}

/// Bytes of a layer's blob fetched before its structure check asked for them: next to its TOC
/// while it was resolved (the blob's head and the bytes just before the TOC, where the tar
/// headers and the end of the archive of a one-file layer sit), or by the snapshotter while
/// the layer's mount server started (the ranges the check reads, [`Codec::structure_ranges`]).
/// The structure check, which must read them before anything is served, reads them through
/// [`Held::before`] and costs no round trip of its own; nothing else does. They are
/// unverified, as every region between chunks is until the check has read them. At most
/// [`Held::MAX_BYTES`] are kept.
#[derive(Clone, Debug, Default)]
pub struct Held {
    /// (first byte's offset in the blob, the bytes)
    pieces: Vec<(u64, bytes::Bytes)>,
}

impl Held {
    /// Most bytes held: room for an eStargz file's last chunk member (read whole, for the
    /// padding and what follows it) of a 4 MiB chunk that does not compress.
    pub const MAX_BYTES: usize = 8 << 20;

    /// Adds `bytes` fetched from blob offset `at`, unless that would hold more than
    /// [`Held::MAX_BYTES`].
    pub fn add(&mut self, at: u64, bytes: bytes::Bytes) {
        if !bytes.is_empty() && self.len() + bytes.len() <= Self::MAX_BYTES {
            self.pieces.push((at, bytes));
        }
    }

    /// Adds the pieces of `other`, as [`Held::add`] does.
    pub fn join(&mut self, other: Held) {
        for (at, bytes) in other.pieces {
            self.add(at, bytes);
        }
    }

    /// The bytes held.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(|(_, b)| b.len()).sum()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// The pieces: (first byte's offset in the blob, the bytes).
    pub fn pieces(&self) -> impl Iterator<Item = (u64, &bytes::Bytes)> {
        self.pieces.iter().map(|(at, bytes)| (*at, bytes))
    }

    /// The bytes of `range` when one piece holds all of them.
    pub fn get(&self, range: &Range<u64>) -> Option<bytes::Bytes> {
        self.pieces.iter().find_map(|(at, bytes)| {
            let start = range.start.checked_sub(*at)?;
            let end = range.end.checked_sub(*at)?;
            (start <= end && end <= bytes.len() as u64)
                .then(|| bytes.slice(start as usize..end as usize))
        })
    }

    /// `fetch`, answering from these bytes the blob ranges they hold whole, except those asked
    /// of the registry itself ([`Ask::Registry`]: they failed once).
    pub fn before<'a>(&'a self, fetch: &'a dyn Fetch) -> impl Fetch + 'a {
        HeldFirst { held: self, fetch }
    }
}

/// [`Held::before`].
struct HeldFirst<'a> {
    held: &'a Held,
    fetch: &'a dyn Fetch,
}

impl Fetch for HeldFirst<'_> {
    fn blob(&self, range: Range<u64>, ask: Ask) -> BoxFuture<'_, Result<bytes::Bytes>> {
        match (ask, self.held.get(&range)) {
            (Ask::AnyEndpoint, Some(bytes)) => Box::pin(std::future::ready(Ok(bytes))),
            _ => self.fetch.blob(range, ask),
        }
    }

    fn windows(&self, range: Range<u64>, ask: Ask) -> BoxFuture<'_, Result<bytes::Bytes>> {
        self.fetch.windows(range, ask)
    }
}

pub use crate::registry::Ask;

/// Where a codec's bytes come from: the layer's blob and, for a gzip layer read through a
/// seekable index, the index's windows blob. Answers are exactly the bytes asked for (a short
/// one is an error). The engine implements it with its counters and deadlines.
pub trait Fetch: Sync {
    /// Bytes `range` of the layer's blob.
    fn blob(&self, range: Range<u64>, ask: Ask) -> BoxFuture<'_, Result<bytes::Bytes>>;
    /// Bytes `range` of the windows blob.
    fn windows(&self, range: Range<u64>, ask: Ask) -> BoxFuture<'_, Result<bytes::Bytes>>;
}

/// What a layer's uncompressed stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// A tar archive whose entries the TOC or index lists.
    Tar,
    /// A disk artifact's disk file: no entries, the whole stream is the disk.
    DiskFile,
}

/// How much of the layer's stream the integrity checks rebuild.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extent {
    /// What the check before anything is served needs: the tar headers and what places the
    /// chunks (up to the TOC, for a layer that carries one).
    Structure,
    /// All of it, once the layer is complete.
    Whole,
}

/// A piece of the layer's stream, in stream order.
pub enum Piece {
    /// Decoded bytes between chunks: tar headers, padding, the end of the archive.
    Region(Vec<u8>),
    /// Chunk `idx` (its content is in the cache, or skipped when only the structure is read).
    Chunk(usize),
}

/// How often bytes that fail to decode or verify are fetched before the failure counts (the
/// tries after the first ask the registry itself): a link that cuts or flips bytes now and
/// then never fails a check, bytes that are wrong at the source always do.
pub const VERIFY_TRIES: u32 = 3;

/// Runs `attempt` (a fetch and its check) through the one retry policy
/// ([`RetryPolicy::checked`]): bytes that fail their check (`Corrupt`) are fetched again at
/// once, [`VERIFY_TRIES`] tries in all, the first where `ask` says and the others from the
/// registry itself; any other failure ends it (the fetch below retried it already).
///
/// [`RetryPolicy::checked`]: crate::retry::RetryPolicy::checked
pub(crate) async fn fetch_checked<T, F, Fut>(what: &str, ask: Ask, attempt: F) -> Result<T>
where
    F: Fn(Ask) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let asking = crate::registry::AskUntilChecksFail::new(ask);
    let (asking, attempt) = (&asking, &attempt);
    checked_tries(what, VERIFY_TRIES, || async move {
        asking.noted(attempt(asking.ask()).await)
    })
    .await
}

/// [`fetch_checked`] for bytes whose first try (fetched with others, as part of a run) failed
/// its check: the rest of the [`VERIFY_TRIES`], each from the registry itself.
pub(crate) async fn fetch_checked_again<T, F, Fut>(what: &str, attempt: F) -> Result<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    checked_tries(what, VERIFY_TRIES - 1, attempt).await
}

async fn checked_tries<T, F, Fut>(what: &str, tries: u32, attempt: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    crate::retry::RetryPolicy::checked(tries)
        .run_when(what, attempt, |e| e.kind() == ErrorKind::Corrupt)
        .await
}

/// Most compressed bytes of one region between chunks (the last one holds the TOC, whose
/// compressed size is bounded at 64 MiB, and the tar-split).
pub const MAX_REGION_BYTES: u64 = 160 << 20;
/// Most decoded bytes of all regions between chunks together: tar headers, padding and the end
/// of the archive need a few KiB per entry.
pub const MAX_REGION_DECODED: u64 = 64 << 20;
/// A chunk's verified content, as a codec hands it over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoded<'a> {
    Bytes(&'a [u8]),
    /// A chunk the TOC marks as zeros, checked to be exactly that without being held.
    Zeros,
}

/// Hands a chunk's verified content, or why it failed verification, to whoever keeps it.
pub type Store<'s> = dyn FnMut(usize, Result<Decoded<'_>>) -> Result<()> + 's;

/// The decoding of one kind of layer.
pub trait Codec: Send + Sync + std::fmt::Debug {
    /// What the layer's stream is.
    fn stream(&self) -> StreamKind {
        StreamKind::Tar
    }

    /// The bytes of the windows blob chunk `idx` decodes from when it does not follow the
    /// chunk before it in one fetch; `None` when it needs none.
    fn window(&self, _idx: usize) -> Option<Range<u64>> {
        None
    }

    /// The window of chunk `idx` from its frame ([`Codec::window`]).
    fn decode_window(&self, idx: usize, _frame: &[u8]) -> Result<Vec<u8>> {
        Err(Error::corrupt(format!("chunk {idx} has no window")))
    }

    /// Decodes the blob bytes `bytes` fetched for `run` (chunks of one file, adjacent in the
    /// blob; `bytes` starts where the first one does) and hands each chunk's verified content,
    /// or why it failed verification, to `store`. `window` is the first chunk's window
    /// ([`Codec::window`], decoded; empty when it needs none), `None` if it could not be had.
    fn decode_run(
        &self,
        layer: &Layer,
        run: &[usize],
        bytes: &[u8],
        window: Option<&[u8]>,
        store: &mut Store<'_>,
    ) -> Result<()>;

    /// The pieces of `extent` of the layer's stream: every chunk, and the regions between
    /// them fetched through `fetch` (asking `ask`) and decoded as an ordinary decoder would.
    fn pieces<'a>(
        &'a self,
        layer: &'a Layer,
        extent: Extent,
        fetch: &'a dyn Fetch,
        ask: Ask,
    ) -> BoxFuture<'a, Result<Vec<Piece>>>;

    /// The blob ranges [`Codec::pieces`] of [`Extent::Structure`] fetches, for a caller that
    /// fetches them ahead and holds them for the check ([`Held`]); none when the check reads
    /// through the codec's own fetch units (a seekable index's spans and windows).
    fn structure_ranges(&self, _layer: &Layer) -> Result<Vec<Range<u64>>> {
        Ok(Vec::new())
    }

    /// A second blob the codec reads besides the layer's (a seekable index's windows blob).
    fn windows_blob(&self) -> Option<crate::oci::digest::Digest> {
        None
    }

    /// A tar entry the stream ends with that the TOC does not list (eStargz's TOC).
    fn trailing_entry(&self) -> Option<&'static str> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_bytes_answer_only_ranges_one_piece_holds_whole() {
        let mut held = Held::default();
        held.add(100, bytes::Bytes::from_static(b"abcdef"));
        held.add(0, bytes::Bytes::from(vec![7; 10]));
        assert_eq!(held.get(&(101..104)).as_deref(), Some(&b"bcd"[..]));
        assert_eq!(held.get(&(100..106)).as_deref(), Some(&b"abcdef"[..]));
        assert_eq!(held.get(&(2..4)).as_deref(), Some(&[7, 7][..]));
        for outside in [99..101, 104..107, 8..12, 10..100, 200..201] {
            assert_eq!(held.get(&outside), None, "{outside:?}");
        }
        // Bounded: a piece that would hold more than the bound is not kept.
        held.add(1000, bytes::Bytes::from(vec![0; Held::MAX_BYTES]));
        assert_eq!(held.get(&(1000..1001)), None);
    }
}
