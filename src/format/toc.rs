//! The TOC zstd:chunked and eStargz share (the CRFS schema of stargz, which containers/storage
//! kept): its entries, a streaming parser, and the validator that folds entries into the
//! format-neutral tree ([`super::tree`]) while it checks them.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::tree::{clean_path, place, Chunk, Node, NodeKind, Seen};
use crate::error::{Error, Result};
use crate::oci::digest::Digest;

/// Largest chunk (uncompressed) we accept from a third-party TOC.
pub const MAX_CHUNK_SIZE: u64 = 64 << 20;
/// Largest chunk marked zeros: such a chunk is checked a piece at a time and never held, so
/// its size bounds time (decoding that many zeros), not memory.
pub const MAX_ZEROS_CHUNK_SIZE: u64 = 256 << 20;
/// Most TOC entries, chunks included (a 256 GiB disk at 256 KiB chunks). Parsed entries take
/// about 330 bytes each, so this bounds the TOC's memory near 330 MiB whatever it claims.
pub const MAX_TOC_ENTRIES: usize = 1 << 20;
/// Most files, directories and links a TOC may list: a VM-disk layer has a handful.
pub const MAX_TOC_FILES: usize = 4096;
/// Most components in a path.
pub const MAX_PATH_DEPTH: usize = 64;

/// One TOC entry, field for field as containers/storage writes it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TocEntry {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub link_name: String,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mode: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub size: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub uid: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gid: i64,
    #[serde(default, rename = "modtime", skip_serializing_if = "Option::is_none")]
    pub mod_time: Option<String>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dev_major: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dev_minor: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xattrs: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub digest: String,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub offset: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub end_offset: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub chunk_size: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub chunk_offset: i64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub chunk_digest: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub chunk_type: String,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

/// Deserialises the TOC's entries, failing as soon as there are more than [`MAX_TOC_ENTRIES`]
/// (before they take the memory).
fn bounded_entries<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Vec<TocEntry>, D::Error> {
    struct Entries;
    impl<'de> serde::de::Visitor<'de> for Entries {
        type Value = Vec<TocEntry>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "at most {MAX_TOC_ENTRIES} TOC entries")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut entries = Vec::new();
            while let Some(entry) = seq.next_element()? {
                if entries.len() == MAX_TOC_ENTRIES {
                    return Err(serde::de::Error::custom(format!(
                        "more than {MAX_TOC_ENTRIES} entries"
                    )));
                }
                entries.push(entry);
            }
            Ok(entries)
        }
    }
    deserializer.deserialize_seq(Entries)
}

/// The TOC document.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Toc {
    pub version: u32,
    #[serde(deserialize_with = "bounded_entries")]
    pub entries: Vec<TocEntry>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tar_split_digest: Option<String>,
}

fn parse_opt_digest(s: &str, what: &str) -> Result<Option<Digest>> {
    if s.is_empty() {
        return Ok(None);
    }
    s.parse()
        .map(Some)
        .map_err(|e: Error| Error::corrupt(format!("{what}: {e}")))
}

impl Toc {
    /// Validates the whole document (see [`TocValidator`]); readers of a registry's TOC use
    /// [`super::zstd_chunked::read_toc`], which never holds the document.
    pub fn nodes(&self, data_end: u64) -> Result<Vec<Node>> {
        let mut validator = TocValidator::new(data_end);
        for entry in &self.entries {
            validator.entry(entry.clone())?;
        }
        validator.finish()
    }
}

/// Parses TOC JSON (`{"version":1,"entries":[…]}`) and validates it entry by entry
/// ([`TocValidator`]), to the end of the input: from a slice
/// (`serde_json::Deserializer::from_slice`) or a stream (`from_reader` over a `BufReader`).
pub fn parse_toc<'de, R: serde_json::de::Read<'de>>(
    mut de: serde_json::Deserializer<R>,
    data_end: u64,
) -> Result<Vec<Node>> {
    use serde::de::DeserializeSeed;
    let mut document = TocDocument {
        validator: TocValidator::new(data_end),
        failure: None,
        version: None,
    };
    let parsed = (&mut document).deserialize(&mut de).and_then(|()| de.end());
    if let Some(e) = document.failure {
        return Err(e);
    }
    parsed.map_err(|e| match e.classify() {
        serde_json::error::Category::Io => Error::corrupt(format!("decompressing it: {e}")),
        _ => Error::corrupt(format!("TOC is not valid JSON: {e}")),
    })?;
    match document.version {
        Some(1) => document.validator.finish(),
        Some(v) => Err(Error::unsupported(format!(
            "TOC version {v} is not supported (only 1)"
        ))),
        None => Err(Error::corrupt("TOC has no version")),
    }
}

/// The serde side of [`parse_toc`]: visits the document's keys and hands each entry to the
/// validator as soon as it is decoded. A validation error is kept in `failure` (serde's
/// errors carry only text) and stops the parse.
struct TocDocument {
    validator: TocValidator,
    failure: Option<Error>,
    version: Option<u32>,
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "camelCase")]
enum TocField {
    Version,
    Entries,
    #[serde(other)]
    Other,
}

impl<'de> serde::de::DeserializeSeed<'de> for &mut TocDocument {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for &mut TocDocument {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a TOC object with a version and entries")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<(), A::Error> {
        use serde::de::Error as _;
        let mut entries = false;
        while let Some(field) = map.next_key::<TocField>()? {
            match field {
                TocField::Version if self.version.is_some() => {
                    return Err(A::Error::duplicate_field("version"))
                }
                TocField::Version => {
                    let version: u32 = map.next_value()?;
                    if version != 1 {
                        self.failure = Some(Error::unsupported(format!(
                            "TOC version {version} is not supported (only 1)"
                        )));
                        return Err(A::Error::custom("unsupported version"));
                    }
                    self.version = Some(version);
                }
                TocField::Entries if entries => return Err(A::Error::duplicate_field("entries")),
                TocField::Entries => {
                    map.next_value_seed(TocEntries(&mut *self))?;
                    entries = true;
                }
                TocField::Other => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        if !entries {
            return Err(A::Error::missing_field("entries"));
        }
        Ok(())
    }
}

/// The `entries` array, folded into the validator one entry at a time.
struct TocEntries<'a>(&'a mut TocDocument);

impl<'de> serde::de::DeserializeSeed<'de> for TocEntries<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> serde::de::Visitor<'de> for TocEntries<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of TOC entries")
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<(), A::Error> {
        while let Some(entry) = seq.next_element::<TocEntry>()? {
            if let Err(e) = self.0.validator.entry(entry) {
                self.0.failure = Some(e);
                return Err(serde::de::Error::custom("invalid entry"));
            }
        }
        Ok(())
    }
}

/// Validates a TOC's entries in order against a blob whose data region ends at `data_end`:
/// safe, unique paths of bounded depth; hardlinks to earlier non-directories; chunk ranges
/// that cover each file exactly, follow each other without gaps and lie inside the data
/// region without overlapping; bounded counts and chunk sizes. It keeps only what the nodes
/// need: a file's last entry waits for the next one (which says where its frame ends).
pub struct TocValidator {
    data_end: u64,
    nodes: Vec<Node>,
    seen: HashMap<String, Seen>,
    entries: usize,
    open: Option<ReadingFile>,
}

/// The regular file whose chunk entries are being read.
struct ReadingFile {
    /// Its chunks so far are in `node.chunks`.
    node: Node,
    /// The name its chunk entries repeat, as the TOC spells it.
    name: String,
    /// Where its last frame ends in the blob (`endOffset` of its `reg` entry; 0 if not given).
    end: u64,
    /// Its latest entry, whose chunk is built once the next entry (or none) is known.
    pending: TocEntry,
}

impl TocValidator {
    pub fn new(data_end: u64) -> Self {
        TocValidator {
            data_end,
            nodes: Vec::new(),
            seen: HashMap::new(),
            entries: 0,
            open: None,
        }
    }

    /// Takes the next entry.
    pub fn entry(&mut self, e: TocEntry) -> Result<()> {
        if self.entries == MAX_TOC_ENTRIES {
            return Err(Error::corrupt(format!(
                "TOC lists more than {MAX_TOC_ENTRIES} entries"
            )));
        }
        self.entries += 1;
        let kind = match e.kind.as_str() {
            "chunk" => {
                return match &mut self.open {
                    Some(open) if open.name == e.name => open.push(e, self.data_end),
                    Some(open) => Err(Error::corrupt(format!(
                        "TOC: chunk entry for {:?} follows {:?}",
                        e.name, open.name
                    ))),
                    None => Err(Error::corrupt(format!(
                        "TOC: chunk entry for {:?} without a preceding reg entry",
                        e.name
                    ))),
                }
            }
            "dir" => NodeKind::Dir,
            "reg" => NodeKind::Regular,
            "symlink" => NodeKind::Symlink,
            "hardlink" => NodeKind::Hardlink,
            "char" | "block" | "fifo" => {
                return Err(Error::unsupported(format!(
                    "TOC lists {:?}, a {} entry: the lazy view serves no devices or fifos, so it would differ from the extracted layer",
                    e.name, e.kind
                )))
            }
            other => {
                return Err(Error::unsupported(format!(
                    "TOC entry type {other:?} for {:?}",
                    e.name
                )))
            }
        };
        self.close()?;
        if self.nodes.len() == MAX_TOC_FILES {
            return Err(Error::unsupported(format!(
                "TOC lists more than {MAX_TOC_FILES} files, directories and links; a VM-disk layer needs a handful"
            )));
        }
        let path = clean_path(&e.name)?;
        if path.split('/').count() > MAX_PATH_DEPTH {
            return Err(Error::unsupported(format!(
                "TOC: {path}: deeper than {MAX_PATH_DEPTH} directories"
            )));
        }
        place(&mut self.seen, &path, kind)?;
        let link = self.link_of(kind, &path, &e)?;
        let size = u64::try_from(e.size)
            .map_err(|_| Error::corrupt(format!("TOC: negative size for {path}")))?;
        let to_u32 = |v: i64, what: &str| {
            u32::try_from(v)
                .map_err(|_| Error::corrupt(format!("TOC: {what} {v} of {path} out of range")))
        };
        let node = Node {
            kind,
            link,
            mode: to_u32(e.mode & 0o7777, "mode")?,
            uid: to_u32(e.uid, "uid")?,
            gid: to_u32(e.gid, "gid")?,
            size: if kind == NodeKind::Regular { size } else { 0 },
            mod_time: e.mod_time.clone(),
            digest: parse_opt_digest(&e.digest, &format!("TOC digest of {path}"))?,
            chunks: Vec::new(),
            path,
        };
        if kind == NodeKind::Regular && size > 0 {
            let end = u64::try_from(e.end_offset)
                .map_err(|_| Error::corrupt(format!("TOC: {}: negative endOffset", node.path)))?;
            self.open = Some(ReadingFile {
                node,
                name: e.name.clone(),
                end,
                pending: e,
            });
        } else {
            self.nodes.push(node);
        }
        Ok(())
    }

    /// The target of a link entry `e` at `path`: a hardlink's must be an earlier file of the
    /// layer, a symlink's must be non-empty and free of NULs; other kinds keep what they say.
    fn link_of(&self, kind: NodeKind, path: &str, e: &TocEntry) -> Result<String> {
        Ok(match kind {
            NodeKind::Hardlink => {
                let target = clean_path(&e.link_name).map_err(|err| {
                    err.context(format!("TOC: hardlink {path} has an unusable target"))
                })?;
                match self.seen.get(&target) {
                    Some(Seen::Listed(k)) if *k != NodeKind::Dir && target != path => target,
                    _ => {
                        return Err(Error::corrupt(format!(
                            "TOC: hardlink {path} points at {target:?}, which is not an earlier file of the layer"
                        )))
                    }
                }
            }
            NodeKind::Symlink if e.link_name.is_empty() || e.link_name.contains('\0') => {
                return Err(Error::corrupt(format!(
                    "TOC: symlink {path} has an empty or NUL-containing target"
                )))
            }
            _ => e.link_name.clone(),
        })
    }

    fn close(&mut self) -> Result<()> {
        if let Some(open) = self.open.take() {
            self.nodes.push(open.finish(self.data_end)?);
        }
        Ok(())
    }

    /// The validated nodes, once every entry was taken.
    pub fn finish(mut self) -> Result<Vec<Node>> {
        self.close()?;
        // A file's frames follow each other exactly (checked as they came), so files overlap
        // in the blob exactly when their spans do.
        let mut spans: Vec<(Range<u64>, &str)> = self
            .nodes
            .iter()
            .filter_map(|n| {
                let (first, last) = (n.chunks.first()?, n.chunks.last()?);
                Some((first.compressed.start..last.compressed.end, n.path.as_str()))
            })
            .collect();
        spans.sort_unstable_by_key(|(r, _)| r.start);
        for pair in spans.windows(2) {
            let ((a, a_path), (b, b_path)) = (&pair[0], &pair[1]);
            if b.start < a.end {
                return Err(Error::corrupt(format!(
                    "TOC: chunks of {a_path} ({}..{}) and {b_path} ({}..{}) overlap in the layer",
                    a.start, a.end, b.start, b.end
                )));
            }
        }
        Ok(self.nodes)
    }
}

impl ReadingFile {
    /// Takes the file's next chunk entry, which completes the pending one.
    fn push(&mut self, next: TocEntry, data_end: u64) -> Result<()> {
        let pending = std::mem::replace(&mut self.pending, next);
        let chunk = self.chunk(&pending, Some(&self.pending), data_end)?;
        self.node.chunks.push(chunk);
        Ok(())
    }

    /// The node, with its last chunk, once no more chunk entries follow.
    fn finish(mut self, data_end: u64) -> Result<Node> {
        let pending = std::mem::take(&mut self.pending);
        let chunk = self.chunk(&pending, None, data_end)?;
        self.node.chunks.push(chunk);
        self.node.chunks.shrink_to_fit();
        let covered = chunk_end(&self.node.chunks);
        if covered != self.node.size {
            return Err(Error::corrupt(format!(
                "TOC: {}: chunks cover {covered} bytes of a {}-byte file",
                self.node.path, self.node.size
            )));
        }
        Ok(self.node)
    }

    /// The chunk entry `e` describes, given the entry that follows it in this file (if any).
    fn chunk(&self, e: &TocEntry, next: Option<&TocEntry>, data_end: u64) -> Result<Chunk> {
        let node = &self.node;
        let first = node.chunks.is_empty();
        let bad = |why: String| Error::corrupt(format!("TOC: {}: {why}", node.path));
        let offset_of =
            |v: i64, what: &str| u64::try_from(v).map_err(|_| bad(format!("negative {what}")));
        let chunk_offset = offset_of(e.chunk_offset, "chunkOffset")?;
        let start = offset_of(e.offset, "offset")?;
        let next_offset = match next {
            Some(next) => offset_of(next.chunk_offset, "chunkOffset")?,
            None => node.size,
        };
        let size = if e.chunk_size > 0 {
            e.chunk_size as u64
        } else {
            next_offset.saturating_sub(chunk_offset)
        };
        // A chunk's frame ends where the next chunk's starts; the last one at the file's end.
        let end = if !first && e.end_offset > 0 {
            e.end_offset as u64
        } else {
            match next {
                Some(next) => offset_of(next.offset, "offset")?,
                None => self.end,
            }
        };
        let expected_offset = chunk_end(&node.chunks);
        if chunk_offset != expected_offset {
            return Err(bad(format!("chunk at {chunk_offset} does not follow the previous one ending at {expected_offset}")));
        }
        let zeros = e.chunk_type == "zeros";
        let max = if zeros {
            MAX_ZEROS_CHUNK_SIZE
        } else {
            MAX_CHUNK_SIZE
        };
        if size == 0 || size > max {
            return Err(bad(format!(
                "chunk at {chunk_offset} has size {size}, outside 1..={max}"
            )));
        }
        if start >= end || end > data_end || end - start > size + (size >> 3) + 4096 {
            return Err(bad(format!("chunk at {chunk_offset} has compressed range {start}..{end} outside the layer data (ends at {data_end})")));
        }
        // Whatever lies between two chunks of a file would be part of its content in the tar
        // stream, so a file's frames must follow each other exactly.
        let follows = match next {
            Some(next) => u64::try_from(next.offset).ok(),
            None if self.end > 0 => Some(self.end),
            None => None,
        };
        if let Some(next_start) = follows.filter(|&s| s != end) {
            return Err(bad(format!("chunk at {chunk_offset} ends at {end} in the layer but the file's next bytes start at {next_start}: the frames of a file must follow each other")));
        }
        if !e.chunk_type.is_empty() && !zeros {
            return Err(Error::unsupported(format!(
                "TOC: {}: chunk type {:?}",
                node.path, e.chunk_type
            )));
        }
        let mut digest = parse_opt_digest(
            &e.chunk_digest,
            &format!("TOC chunk digest of {}", node.path),
        )?;
        if digest.is_none() && first && next.is_none() && size == node.size {
            digest = node.digest;
        }
        Ok(Chunk {
            offset: chunk_offset,
            size,
            compressed: start..end,
            digest,
            zeros,
        })
    }
}

/// Where the last of `chunks` ends in the file.
fn chunk_end(chunks: &[Chunk]) -> u64 {
    chunks.last().map_or(0, |c| c.offset + c.size)
}
