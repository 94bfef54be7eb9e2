//! A remote layer: an image reference resolved to the layer that holds a disk — zstd:chunked
//! or eStargz with its own TOC, an ordinary gzip or tar layer with the seekable index
//! published for it, or a disk artifact's disk file with its index — with its validated TOC
//! (or index) turned into a chunk index.
//!
//! Resolution prefers the registry (manifest, config, then the TOC by one Range request,
//! verified against the annotation) and records the outcome in the cache under the layer's
//! identity ([`disk_layer_id`]: what the manifest and config say, never the blob digest
//! alone); when the registry cannot be reached, the last recorded resolution and the cached TOC
//! are used, so a node can re-mount what it has without network.

use std::ops::Range;
use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::cache::{CacheRoot, IndexSource, LayerId, LayerMeta, RefRecord};
use crate::digest::Digest;
use crate::engine::{Engine, EngineOptions};
use crate::error::{Error, ErrorKind, Result};
use crate::format::seekable::{self, Compression, Expected, Layout, SeekIndex};
use crate::format::zstd_chunked::{self, Chunk, Node, NodeKind, TocLocation};
use crate::format::{artifact, estargz};
use crate::oci::{self, Descriptor, ManifestKind, Platform};
use crate::reference::Reference;
use crate::registry::Registry;
use crate::task::blocking;

/// Where a layer's bytes come from: ranges of one blob. The registry in production
/// ([`RegistrySource`]); an in-memory blob in the engine's unit tests.
pub trait BlobSource: Send + Sync {
    /// The bytes of `range`; the length is checked by the source, the content by the engine.
    fn fetch(&self, range: Range<u64>) -> BoxFuture<'_, Result<bytes::Bytes>>;
    /// The same for bytes that failed verification once: from the registry itself, not a
    /// mirror.
    fn refetch(&self, range: Range<u64>) -> BoxFuture<'_, Result<bytes::Bytes>> {
        self.fetch(range)
    }
    /// Requests, failures and bytes per registry endpoint, if the source has endpoints.
    fn endpoint_counters(&self) -> Vec<(String, crate::registry::health::EndpointCounters)> {
        Vec::new()
    }
}

/// Where a layer's bytes come from: its blob, and for a gzip layer read through a seekable
/// index, the index's windows blob.
pub struct Sources {
    pub blob: Box<dyn BlobSource>,
    pub windows: Option<Box<dyn BlobSource>>,
}

/// A layer blob in a registry, read with HTTP Range requests: the engine's source in
/// production.
pub struct RegistrySource {
    client: Arc<dyn Registry>,
    reference: Reference,
    blob: Digest,
}

impl BlobSource for RegistrySource {
    fn fetch(&self, range: Range<u64>) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Box::pin(
            self.client
                .get_blob_range(&self.reference, &self.blob, range),
        )
    }

    fn refetch(&self, range: Range<u64>) -> BoxFuture<'_, Result<bytes::Bytes>> {
        Box::pin(
            self.client
                .get_blob_range_from_registry(&self.reference, &self.blob, range),
        )
    }

    fn endpoint_counters(&self) -> Vec<(String, crate::registry::health::EndpointCounters)> {
        self.client.endpoint_counters()
    }
}

/// The one composition of a lazily loaded layer, for `vmdisk mount` and the mount servers:
/// resolves `reference` to its disk layer and starts an engine over its cache and its blob in
/// the registry.
pub async fn open_engine(
    client: Arc<dyn Registry>,
    cache: &CacheRoot,
    reference: &Reference,
    opts: EngineOptions,
) -> Result<Arc<Engine>> {
    let layer = resolve(client.as_ref(), cache, reference).await?;
    // A gzip layer's windows blob sits beside its index.
    let windows = match layer.spans.as_ref().and_then(|spans| spans.index.windows) {
        Some(windows) => Some(Box::new(RegistrySource {
            client: Arc::clone(&client),
            reference: source_repository(&layer.meta)?,
            blob: windows.digest,
        }) as Box<dyn BlobSource>),
        None => None,
    };
    let blob = Box::new(RegistrySource {
        client,
        reference: layer.reference.clone(),
        blob: layer.meta.layer_digest,
    });
    Engine::start(layer, cache, Sources { blob, windows }, opts).await
}

/// A regular file of the layer and its place in the chunk table.
#[derive(Clone, Debug)]
pub struct FileChunks {
    /// Index into [`RemoteLayer::nodes`].
    pub node: usize,
    /// Its chunks are `chunks[first..first + count]`.
    pub first: usize,
    pub count: usize,
}

/// A resolved layer and its chunk table.
#[derive(Debug)]
pub struct RemoteLayer {
    /// Where chunks are fetched from (registry and repository; the object is the blob).
    pub reference: Reference,
    pub meta: LayerMeta,
    pub nodes: Vec<Node>,
    /// Regular files with content, in TOC order; "file number" n is `files[n]`.
    pub files: Vec<FileChunks>,
    /// Every chunk of every file, file after file ([`RemoteLayer::chunk`] gives its file).
    pub chunks: Vec<Chunk>,
    /// The file number of the disk (under `disk/` or `image/`, or the annotated path).
    pub disk: usize,
    /// Whether this came from the registry (false: offline, from the cache).
    pub online: bool,
    /// For an ordinary layer read through a seekable index: the index and where each chunk
    /// is in it (`None` for zstd:chunked).
    pub spans: Option<Spans>,
}

/// An indexed layer's chunks in its index: chunk `i` is the part of span `span_of[i]` that
/// belongs to its file.
#[derive(Debug)]
pub struct Spans {
    pub index: SeekIndex,
    span_of: Vec<u32>,
    /// Where each file's content starts in the uncompressed stream.
    file_at: Vec<u64>,
}

impl Spans {
    /// Where file `file`'s content starts in the uncompressed tar stream.
    pub fn file_at(&self, file: usize) -> u64 {
        self.file_at[file]
    }

    /// The span chunk `idx` is part of.
    pub fn span_of(&self, idx: usize) -> usize {
        self.span_of[idx] as usize
    }
}

impl RemoteLayer {
    /// The chunk index of a cached layer (for dedup lookups), without resolving anything.
    pub fn index(reference: Reference, meta: LayerMeta, toc_bytes: &[u8]) -> Result<Self> {
        Self::build(reference, meta, toc_bytes, false)
    }

    fn build(
        reference: Reference,
        meta: LayerMeta,
        toc_bytes: &[u8],
        online: bool,
    ) -> Result<Self> {
        if meta.index.is_some() {
            return Self::build_indexed(reference, meta, toc_bytes, online);
        }
        let mut nodes = if meta.estargz {
            meta.toc_digest.verify(toc_bytes, "eStargz TOC")?;
            estargz::nodes(toc_bytes, meta.toc_offset)?
        } else {
            zstd_chunked::read_toc(toc_bytes, &toc_location(&meta))?
        };
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
        let disk = disk_file(&nodes, &files, &meta)?;
        Ok(RemoteLayer {
            reference,
            meta,
            nodes,
            files,
            chunks,
            disk,
            online,
            spans: None,
        })
    }

    /// The chunk table of an ordinary layer from its seekable index (`index_bytes`, pinned by
    /// `meta.toc_digest`): every regular file is cut where the spans are; a chunk is the part
    /// of one span inside one file, fetched as the whole span's compressed bytes. A chunk that
    /// is a whole span carries the span's digest (so identical spans of other layers dedup);
    /// a part of one has none, and is verified through its span. A disk file's layer (a disk
    /// artifact's) is one file at the path its record names, each span one chunk.
    fn build_indexed(
        reference: Reference,
        meta: LayerMeta,
        index_bytes: &[u8],
        online: bool,
    ) -> Result<Self> {
        let expected = expected_of(&meta).expect("build_indexed is for indexed layers");
        let index = SeekIndex::decode(index_bytes, &expected)?;
        let entries: std::borrow::Cow<'_, [seekable::Entry]> = match index.layout {
            Layout::Tar => (&index.entries[..]).into(),
            Layout::File => {
                let path = meta.disk_path.as_deref().ok_or_else(|| {
                    Error::corrupt("the record of a disk file's layer names no path for it")
                })?;
                file_entries(path, index.stream_size).into()
            }
        };
        let mut nodes = Vec::with_capacity(entries.len());
        let (mut files, mut chunks, mut span_of, mut file_at) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for entry in entries.iter() {
            let kind = match entry.kind.as_str() {
                "dir" => NodeKind::Dir,
                "reg" => NodeKind::Regular,
                "symlink" => NodeKind::Symlink,
                "hardlink" => NodeKind::Hardlink,
                _ => NodeKind::Other,
            };
            let link = match kind {
                NodeKind::Hardlink => zstd_chunked::clean_path(&entry.link_name)?,
                _ => entry.link_name.clone(),
            };
            if kind == NodeKind::Regular && entry.size > 0 {
                let first = chunks.len();
                let file = entry.offset..entry.offset + entry.size;
                for s in index.spans_for(file.clone()) {
                    let span = &index.spans[s];
                    let (start, end) =
                        (span.offset.max(file.start), index.span_end(s).min(file.end));
                    let whole = (start, end) == (span.offset, index.span_end(s));
                    chunks.push(Chunk {
                        offset: start - file.start,
                        size: end - start,
                        compressed: span.input..span.input_end,
                        digest: whole.then_some(span.digest),
                        zeros: false,
                    });
                    span_of.push(s as u32);
                }
                files.push(FileChunks {
                    node: nodes.len(),
                    first,
                    count: chunks.len() - first,
                });
                file_at.push(entry.offset);
            }
            nodes.push(Node {
                kind,
                path: zstd_chunked::clean_path(&entry.name)?,
                link,
                mode: entry.mode,
                uid: entry.uid,
                gid: entry.gid,
                size: if kind == NodeKind::Regular {
                    entry.size
                } else {
                    0
                },
                mod_time: time::OffsetDateTime::from_unix_timestamp(entry.mtime as i64)
                    .ok()
                    .and_then(|t| {
                        t.format(&time::format_description::well_known::Rfc3339)
                            .ok()
                    }),
                digest: None,
                chunks: Vec::new(),
            });
        }
        let disk = disk_file(&nodes, &files, &meta)?;
        Ok(RemoteLayer {
            reference,
            meta,
            nodes,
            files,
            chunks,
            disk,
            online,
            spans: Some(Spans {
                index,
                span_of,
                file_at,
            }),
        })
    }

    /// The verified content of chunk `idx` of a layer with a TOC (zstd:chunked, eStargz) from
    /// its compressed bytes: with [`RemoteLayer::decode_span`], the one way registry bytes
    /// become chunk content.
    pub fn decode(&self, idx: usize, compressed: &[u8]) -> Result<Vec<u8>> {
        let (_, chunk) = self.chunk(idx);
        if self.spans.is_some() {
            return Err(Error::corrupt(format!(
                "chunk {idx} of an indexed layer is decoded with its span's window"
            )));
        }
        if self.meta.estargz {
            return estargz::decode_chunk(compressed, chunk, self.last_of_file(idx));
        }
        crate::format::layout::decode_chunk(compressed, chunk)
    }

    /// The verified bytes of the span chunk `idx` of an indexed layer is part of, from the
    /// span's compressed bytes and its window ([`SeekIndex::window_range`]); the chunk is
    /// [`RemoteLayer::chunk_in_span`] of them, the next span's window their end.
    pub fn decode_span(&self, idx: usize, compressed: &[u8], window: &[u8]) -> Result<Vec<u8>> {
        let spans = self
            .spans
            .as_ref()
            .ok_or_else(|| Error::corrupt(format!("chunk {idx} is not in a span")))?;
        spans
            .index
            .decode_span(spans.span_of(idx), compressed, window)
    }

    /// Chunk `idx`'s part of the decoded bytes of its span.
    pub fn chunk_in_span<'a>(&self, idx: usize, span: &'a [u8]) -> &'a [u8] {
        let (file, chunk) = self.chunk(idx);
        let spans = self.spans.as_ref().expect("a chunk in a span");
        let s = spans.span_of(idx);
        let start = (spans.file_at(file) + chunk.offset - spans.index.spans[s].offset) as usize;
        &span[start..start + chunk.size as usize]
    }

    /// When chunk `idx` is the last of its file, the file's tar padding (which an eStargz
    /// layer keeps in that chunk's member).
    pub fn last_of_file(&self, idx: usize) -> Option<u64> {
        let (file, chunk) = self.chunk(idx);
        let size = self.file_size(file);
        (chunk.offset + chunk.size == size).then(|| estargz::padding(size))
    }

    /// Chunk `idx` and the file number it belongs to.
    pub fn chunk(&self, idx: usize) -> (usize, &Chunk) {
        let file = self.files.partition_point(|f| f.first + f.count <= idx);
        (file, &self.chunks[idx])
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

    /// The file number of node `node`, if it is a regular file with content.
    pub fn file_of_node(&self, node: usize) -> Option<usize> {
        // Files are in node order.
        self.files.binary_search_by_key(&node, |f| f.node).ok()
    }

    /// The layer's identity (and, through [`LayerId::key`], its cache key).
    pub fn id(&self) -> LayerId {
        self.meta.id()
    }

    /// Whether the layer is a disk file (a disk artifact's), not a tar.
    pub fn is_disk_file(&self) -> bool {
        self.spans
            .as_ref()
            .is_some_and(|s| s.index.layout == Layout::File)
    }
}

/// The file number of the disk: under `disk/` or `image/`, or the annotated path.
fn disk_file(nodes: &[Node], files: &[FileChunks], meta: &LayerMeta) -> Result<usize> {
    files
        .iter()
        .position(|f| {
            crate::format::layout::is_disk_path(&nodes[f.node].path, meta.disk_path.as_deref())
        })
        .ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                "the layer has no regular file under /disk/ or /image/",
            )
        })
}

/// The lazy view of a disk artifact's layer, as a containerDisk holds its disk: the
/// directories above `path` (0755) and the disk file (0644), owned by 107:107 (KubeVirt's
/// qemu), the file's content the whole stream.
fn file_entries(path: &str, size: u64) -> Vec<seekable::Entry> {
    let entry = |kind: &str, name: String, mode: u32, size: u64| seekable::Entry {
        kind: kind.into(),
        name,
        link_name: String::new(),
        mode,
        uid: 107,
        gid: 107,
        mtime: 0,
        size,
        offset: 0,
    };
    let parts: Vec<&str> = path.split('/').collect();
    let mut entries: Vec<_> = (1..parts.len())
        .map(|n| entry("dir", parts[..n].join("/"), 0o755, 0))
        .collect();
    entries.push(entry("reg", path.to_string(), 0o644, size));
    entries
}

/// Picks the disk layer of a manifest: the topmost layer with a TOC, zstd:chunked or eStargz.
pub fn disk_layer(m: &oci::Manifest) -> Option<&Descriptor> {
    m.layers
        .iter()
        .rev()
        .find(|l| match oci::layer_compression(&l.media_type) {
            Some(oci::LayerCompression::Zstd) => TocLocation::from_annotations(&l.annotations)
                .ok()
                .flatten()
                .is_some(),
            Some(oci::LayerCompression::Gzip) => estargz_toc_digest(l).is_some(),
            _ => false,
        })
}

/// The TOC digest an eStargz layer's annotation pins, if it is one.
fn estargz_toc_digest(layer: &Descriptor) -> Option<Digest> {
    layer.annotations.get(estargz::ANN_TOC_DIGEST)?.parse().ok()
}

/// Where a zstd:chunked layer's TOC is, as its record says.
fn toc_location(meta: &LayerMeta) -> TocLocation {
    TocLocation {
        offset: meta.toc_offset,
        length: meta.toc_length,
        uncompressed_length: meta.toc_uncompressed_length,
        checksum: meta.toc_digest,
    }
}

/// The manifest or index `reference` names, and its digest: when `reference` is by digest
/// and `cache` keeps that blob, from there (re-verified, no round trip); otherwise from the
/// registry, and then kept.
pub(crate) async fn manifest_of(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    reference: &Reference,
) -> Result<(ManifestKind, Digest)> {
    if let (Some(cache), Some(digest)) = (cache, reference.digest) {
        let c = cache.clone();
        let kept = blocking(move || Ok(c.load_blob(&digest, oci::MAX_MANIFEST_SIZE))).await?;
        if let Some(manifest) = kept.and_then(|bytes| oci::parse_manifest(&bytes, None).ok()) {
            return Ok((manifest, digest));
        }
    }
    let fetched = client.get_manifest(reference).await?;
    keep(cache, fetched.digest, fetched.bytes).await;
    Ok((fetched.manifest, fetched.digest))
}

/// Keeps verified bytes in the cache's blob store; a failure only costs a round trip later.
async fn keep(cache: Option<&CacheRoot>, digest: Digest, bytes: Vec<u8>) {
    let Some(cache) = cache.cloned() else { return };
    if let Err(e) = blocking(move || cache.save_blob(&digest, &bytes)).await {
        tracing::debug!(%digest, error = %e.chain(), "keeping a fetched blob failed");
    }
}

/// The image manifest of `reference` for the host's platform (through an index if there is
/// one), with its digest and platform. Manifests kept in `cache` save their round trips.
pub async fn platform_manifest(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    reference: &Reference,
) -> Result<(oci::Manifest, Digest, Platform)> {
    match manifest_of(client, cache, reference).await? {
        (ManifestKind::Image(m), digest) => Ok((m, digest, Platform::host())),
        (ManifestKind::Index(index), _) => {
            let host = Platform::host();
            let desc = index
                .manifests
                .iter()
                .find(|d| {
                    d.platform
                        .as_ref()
                        .is_some_and(|p| p.os == host.os && p.architecture == host.architecture)
                })
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::NotFound,
                        format!("{reference} has no image for {host}"),
                    )
                })?;
            match manifest_of(client, cache, &reference.with_digest(desc.digest)).await? {
                (ManifestKind::Image(m), _) => Ok((m, desc.digest, host)),
                (ManifestKind::Index(_), _) => {
                    Err(Error::unsupported(format!("{reference}: nested index")))
                }
            }
        }
    }
}

/// The disk layer of image manifest `manifest_digest` (`manifest`) of `reference`, and what
/// the cache records about it (its identity: [`LayerMeta::id`]): a zstd:chunked or eStargz
/// layer with its TOC, else an ordinary layer with a seekable index published for the image.
/// The config
/// (fetched by its digest) supplies the diff_id the layer claims.
pub async fn disk_layer_id(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    reference: &Reference,
    manifest: &oci::Manifest,
    manifest_digest: Digest,
) -> Result<(Descriptor, LayerMeta)> {
    let Some(layer) = disk_layer(manifest) else {
        // TOC annotations that are there but refused say why, not "no lazy layer".
        if let Some(e) = manifest
            .layers
            .iter()
            .rev()
            .find_map(|l| TocLocation::from_annotations(&l.annotations).err())
        {
            return Err(e.context(reference));
        }
        let (layer, meta, index) =
            seekable_layer_id(client, cache, reference, manifest, manifest_digest).await?;
        keep_layer(cache, &meta, index).await;
        return Ok((layer, meta));
    };
    if let Some(toc_digest) = estargz_toc_digest(layer) {
        return estargz_layer_id(client, cache, reference, manifest, layer, toc_digest).await;
    }
    let loc = TocLocation::from_annotations(&layer.annotations)?
        .expect("disk_layer checked the TOC annotations");
    loc.check_within(layer.size)?;
    let disk_path = disk_path_of(layer)?;
    let digest = manifest.config.digest;
    let kept = match cache.cloned() {
        Some(c) => blocking(move || Ok(c.load_blob(&digest, oci::MAX_CONFIG_SIZE))).await?,
        None => None,
    };
    let (config, toc) = match kept {
        Some(config) => (config, None),
        None => {
            let fetch_config = async {
                client
                    .get_blob(reference, &manifest.config, oci::MAX_CONFIG_SIZE)
                    .await
                    .map_err(|e| e.context(format!("fetching the image config of {reference}")))
            };
            // The TOC is what the layer's server needs next: with a cache to keep it in, it
            // is fetched alongside the config rather than a round trip later. (A failure
            // here is not this call's: the server fetches it again and says why.)
            let (config, toc) = match cache {
                Some(_) => {
                    let mut config = std::pin::pin!(fetch_config);
                    let mut toc = std::pin::pin!(fetch_toc(client, reference, &layer.digest, &loc));
                    let (config, toc) = tokio::select! {
                        c = &mut config => {
                            // Waited for at most TOC_GRACE more: a slow TOC never holds up
                            // the decision (the server then fetches it under its deadlines).
                            let toc = match c {
                                Ok(_) => tokio::time::timeout(TOC_GRACE, &mut toc).await.ok(),
                                Err(_) => None,
                            };
                            (c, toc)
                        }
                        t = &mut toc => (config.await, Some(t)),
                    };
                    (config?, toc.and_then(|t| t.ok()))
                }
                None => (fetch_config.await?, None),
            };
            keep(cache, digest, config.clone()).await;
            (config, toc)
        }
    };
    let position = manifest
        .layers
        .iter()
        .rposition(|l| std::ptr::eq(l, layer))
        .expect("disk_layer returns one of the manifest's layers");
    let id = LayerId {
        layer: layer.digest,
        size: layer.size,
        toc: loc.checksum,
        toc_offset: loc.offset,
        diff_id: diff_id_of(&config, manifest, position, reference)?,
        disk_path,
        indexed: false,
        estargz: false,
    };
    let meta = layer_meta(reference, &loc, &id);
    if let Some(toc) = toc {
        keep_layer(cache, &meta, toc).await;
    }
    Ok((layer.clone(), meta))
}

/// Keeps a layer's record and its TOC (or index) in `cache` for the mount server, unless there
/// already; a failure only costs the server a fetch.
async fn keep_layer(cache: Option<&CacheRoot>, meta: &LayerMeta, toc: Vec<u8>) {
    let Some(cache) = cache.cloned() else { return };
    let meta = meta.clone();
    let kept = blocking(move || {
        if !cache.has_layer_meta(&meta.id().key()) {
            cache.save_layer_meta(&meta, &toc)?;
        }
        Ok(())
    });
    if let Err(e) = kept.await {
        tracing::debug!(error = %e.chain(), "keeping a fetched TOC or index failed");
    }
}

/// The disk's path in `layer`, when its annotation names one.
fn disk_path_of(layer: &Descriptor) -> Result<Option<String>> {
    layer
        .annotations
        .get(crate::format::layout::ANN_PATH)
        .map(|p| zstd_chunked::clean_path(p))
        .transpose()
        .map_err(|e| {
            e.context(format!(
                "the {} annotation",
                crate::format::layout::ANN_PATH
            ))
        })
}

/// The eStargz disk layer `layer` of `manifest` and its record: its footer and TOC fetched
/// (the TOC checked against `toc_digest`) and kept in `cache` with the record.
async fn estargz_layer_id(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    reference: &Reference,
    manifest: &oci::Manifest,
    layer: &Descriptor,
    toc_digest: Digest,
) -> Result<(Descriptor, LayerMeta)> {
    let position = manifest
        .layers
        .iter()
        .rposition(|l| std::ptr::eq(l, layer))
        .expect("disk_layer returns one of the manifest's layers");
    let config = image_config(client, cache, reference, manifest).await?;
    let (toc_offset, json) =
        fetch_estargz_toc(client, reference, layer.digest, layer.size, toc_digest)
            .await
            .map_err(|e| e.context(format!("layer {} of {reference}", layer.digest)))?;
    let meta = LayerMeta {
        reference: reference.to_string(),
        layer_digest: layer.digest,
        layer_size: layer.size,
        toc_offset,
        toc_length: json.len() as u64,
        toc_uncompressed_length: 0,
        toc_digest,
        disk_path: disk_path_of(layer)?,
        diff_id: diff_id_of(&config, manifest, position, reference)?,
        index: None,
        estargz: true,
    };
    keep_layer(cache, &meta, json).await;
    Ok((layer.clone(), meta))
}

/// An eStargz layer's TOC offset (from its footer) and TOC JSON (checked against `digest`).
pub(crate) async fn fetch_estargz_toc(
    client: &dyn Registry,
    reference: &Reference,
    layer: Digest,
    size: u64,
    digest: Digest,
) -> Result<(u64, Vec<u8>)> {
    if size < estargz::FOOTER_SIZE {
        return Err(Error::corrupt(
            "the layer is too short for an eStargz footer",
        ));
    }
    let footer_at = size - estargz::FOOTER_SIZE;
    // Footer and TOC member are fetched and checked again if what came does not hold up (cut,
    // flipped): the TOC's digest is pinned, so only the published TOC passes.
    client
        .retry_policy()
        .run(&format!("the eStargz TOC of layer {layer}"), || async {
            let footer = client
                .get_blob_range(reference, &layer, footer_at..size)
                .await?;
            let offset = estargz::toc_offset(&footer, size)?;
            if footer_at - offset > estargz::MAX_TOC_MEMBER {
                return Err(Error::corrupt(format!(
                    "the eStargz footer puts a {}-byte TOC member before it, more than the {} accepted",
                    footer_at - offset,
                    estargz::MAX_TOC_MEMBER
                )));
            }
            let member = client
                .get_blob_range(reference, &layer, offset..footer_at)
                .await?;
            let json = blocking(move || estargz::toc_json(&member, &digest)).await?;
            Ok((offset, json))
        })
        .await
}

/// The diff_id the image config (`config`, verified JSON bytes) claims for layer `position`.
pub(crate) fn diff_id_of(
    config: &[u8],
    manifest: &oci::Manifest,
    position: usize,
    reference: &Reference,
) -> Result<Digest> {
    let config: oci::ImageConfig = serde_json::from_slice(config).map_err(|e| {
        Error::corrupt(format!("the image config of {reference} is not valid: {e}"))
    })?;
    if config.rootfs.diff_ids.len() != manifest.layers.len() {
        return Err(Error::corrupt(format!(
            "the image config of {reference} lists {} diff_ids for {} layers",
            config.rootfs.diff_ids.len(),
            manifest.layers.len()
        )));
    }
    Ok(config.rootfs.diff_ids[position])
}

/// The layer of an ordinary image that may hold its disk: the topmost gzip or uncompressed tar
/// layer, its position and compression.
pub fn indexable_layer(m: &oci::Manifest) -> Option<(usize, &Descriptor, Compression)> {
    m.layers.iter().enumerate().rev().find_map(|(i, l)| {
        match oci::layer_compression(&l.media_type)? {
            oci::LayerCompression::Gzip => Some((i, l, Compression::Gzip)),
            oci::LayerCompression::None => Some((i, l, Compression::None)),
            oci::LayerCompression::Zstd => None,
        }
    })
}

/// The layer of an image with no TOC of its own, or of a disk artifact, that a seekable index
/// must describe, and what it must say about it.
pub struct IndexTarget<'m> {
    pub layer: &'m Descriptor,
    pub expected: Expected,
    /// Where a disk artifact's disk appears in the view (part of its identity).
    pub disk_path: Option<String>,
}

/// What a seekable index of `manifest` must describe: an image's topmost gzip or uncompressed
/// tar layer with the diff_id its config claims, or a disk artifact's disk file with the digest
/// the artifact pins for it. The one place both `vmdisk index` and the readers ask.
pub async fn index_target<'m>(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    reference: &Reference,
    manifest: &'m oci::Manifest,
) -> Result<IndexTarget<'m>> {
    if artifact::is_artifact(manifest) {
        let disk = artifact::disk_file(manifest).map_err(|e| {
            e.context(format!(
                "{reference} is an OCI artifact ({})",
                manifest
                    .artifact_type
                    .as_deref()
                    .unwrap_or(&manifest.config.media_type)
            ))
        })?;
        return Ok(IndexTarget {
            layer: disk.layer,
            expected: Expected {
                layer: disk.layer.digest,
                layer_size: disk.layer.size,
                compression: None,
                diff_id: disk.digest,
                layout: Layout::File,
            },
            disk_path: Some(disk.path),
        });
    }
    let Some((position, layer, compression)) = indexable_layer(manifest) else {
        return Err(Error::unsupported(format!("{reference} has no zstd:chunked layer and no gzip or uncompressed tar layer a seekable index could describe; republish it with `vmdisk convert`")));
    };
    let config = image_config(client, cache, reference, manifest).await?;
    Ok(IndexTarget {
        layer,
        expected: Expected {
            layer: layer.digest,
            layer_size: layer.size,
            compression: Some(compression),
            diff_id: Some(diff_id_of(&config, manifest, position, reference)?),
            layout: Layout::Tar,
        },
        disk_path: None,
    })
}

/// The disk layer of an image or disk artifact with no TOC of its own, its record and the
/// bytes of the seekable index published for it. A disk artifact's identity is the
/// artifact's: the layer, the index, the disk's path in the view and the digest the artifact
/// pins for the disk (else the index's, checked once complete).
async fn seekable_layer_id(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    reference: &Reference,
    manifest: &oci::Manifest,
    manifest_digest: Digest,
) -> Result<(Descriptor, LayerMeta, Vec<u8>)> {
    let target = index_target(client, cache, reference, manifest).await?;
    let found = find_index(
        client,
        cache,
        reference,
        manifest_digest,
        &target.expected,
        target.disk_path.as_deref(),
    )
    .await?;
    let (meta, bytes) = indexed_meta(reference, target.layer, found, target.disk_path);
    Ok((target.layer.clone(), meta, bytes))
}

/// The seekable index the disk layer of `manifest` (an image with no TOC, or a disk
/// artifact) is read through, found as the daemon finds it, with its record: what `inspect`
/// reports.
pub async fn seekable_layer(
    client: &dyn Registry,
    reference: &Reference,
    manifest: &oci::Manifest,
    manifest_digest: Digest,
) -> Result<(LayerMeta, SeekIndex)> {
    let (_, meta, bytes) =
        seekable_layer_id(client, None, reference, manifest, manifest_digest).await?;
    let expected = expected_of(&meta).expect("an indexed layer's record names its index");
    let index = blocking(move || SeekIndex::decode(&bytes, &expected)).await?;
    Ok((meta, index))
}

/// The repository the index of the layer `meta` records was found in.
fn source_repository(meta: &LayerMeta) -> Result<Reference> {
    meta.index
        .as_ref()
        .ok_or_else(|| Error::corrupt("the layer's record names no seekable index"))?
        .repository
        .parse()
}

/// What the index of the layer `meta` records must describe, if it is read through one.
fn expected_of(meta: &LayerMeta) -> Option<Expected> {
    let source = meta.index.as_ref()?;
    Some(Expected {
        layer: meta.layer_digest,
        layer_size: meta.layer_size,
        compression: Some(source.compression),
        diff_id: Some(meta.diff_id),
        layout: source.layout,
    })
}

/// Bytes `range` of the uncompressed stream of the layer `meta` reads through `index`, from
/// its spans fetched from the registry (the first one's window from the windows blob) and
/// each checked against its digest.
pub async fn read_stream(
    client: &dyn Registry,
    meta: &LayerMeta,
    index: &SeekIndex,
    range: Range<u64>,
) -> Result<Vec<u8>> {
    let reference: Reference = meta.reference.parse()?;
    let mut out = Vec::with_capacity((range.end - range.start) as usize);
    let mut previous: Option<Vec<u8>> = None;
    for s in index.spans_for(range.clone()) {
        let span = &index.spans[s];
        let chained = previous
            .as_deref()
            .and_then(|p| index.window_after(s, p))
            .map(<[u8]>::to_vec);
        let what = format!("span {s} of layer {}", meta.layer_digest);
        let data = client
            .retry_policy()
            .run(&what, || async {
                let input = client
                    .get_blob_range(&reference, &meta.layer_digest, span.input..span.input_end)
                    .await?;
                let window = match (chained.clone(), index.window_range(s), index.windows) {
                    (Some(w), _, _) => w,
                    (None, Some(frame), Some(windows)) => {
                        let repo = source_repository(meta)?;
                        let frame = client.get_blob_range(&repo, &windows.digest, frame).await?;
                        index.decode_window(s, &frame)?
                    }
                    _ => Vec::new(),
                };
                crate::task::off_the_runtime(|| index.decode_span(s, &input, &window))
            })
            .await?;
        let from = (range.start.max(span.offset) - span.offset) as usize;
        let to = (range.end.min(index.span_end(s)) - span.offset) as usize;
        out.extend_from_slice(&data[from..to]);
        previous = Some(data);
    }
    Ok(out)
}

/// The record of `layer` read through the index `found`, and the index's bytes.
fn indexed_meta(
    reference: &Reference,
    layer: &Descriptor,
    found: FoundIndex,
    disk_path: Option<String>,
) -> (LayerMeta, Vec<u8>) {
    let meta = LayerMeta {
        reference: reference.to_string(),
        layer_digest: layer.digest,
        layer_size: layer.size,
        toc_offset: 0,
        toc_length: found.bytes.len() as u64,
        toc_uncompressed_length: 0,
        toc_digest: found.digest,
        disk_path,
        diff_id: found.diff_id,
        index: Some(IndexSource {
            repository: found.repository.to_string(),
            compression: found.compression,
            layout: found.layout,
        }),
        estargz: false,
    };
    (meta, found.bytes)
}

/// The image config of `manifest`: kept in `cache`, else fetched (by digest) and kept.
pub(crate) async fn image_config(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    reference: &Reference,
    manifest: &oci::Manifest,
) -> Result<Vec<u8>> {
    let digest = manifest.config.digest;
    if let Some(c) = cache.cloned() {
        if let Some(config) =
            blocking(move || Ok(c.load_blob(&digest, oci::MAX_CONFIG_SIZE))).await?
        {
            return Ok(config);
        }
    }
    let config = client
        .get_blob(reference, &manifest.config, oci::MAX_CONFIG_SIZE)
        .await
        .map_err(|e| e.context(format!("fetching the image config of {reference}")))?;
    keep(cache, digest, config.clone()).await;
    Ok(config)
}

/// A seekable index found for a layer: where, its blob digest and bytes (checked), and what
/// it says the layer is.
struct FoundIndex {
    repository: Reference,
    digest: Digest,
    bytes: Vec<u8>,
    compression: Compression,
    layout: Layout,
    /// The uncompressed stream's digest (equal to the pinned one, when something pins it).
    diff_id: Digest,
}

/// Most index artifacts tried per repository (newest first).
const MAX_INDEX_CANDIDATES: usize = 4;

/// The seekable index of layer `expected` of image manifest `manifest_digest`: among its
/// referrers in the image's repository, then in each configured index repository, the
/// newest whose manifest names that subject and whose index validates against the layer.
/// `disk_path` is where a disk artifact's disk appears (part of its identity). NotFound
/// (saying what was tried) when there is none.
async fn find_index(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    reference: &Reference,
    manifest_digest: Digest,
    expected: &Expected,
    disk_path: Option<&str>,
) -> Result<FoundIndex> {
    let own = Reference {
        tag: None,
        digest: None,
        ..reference.clone()
    };
    let mut refused = Vec::new();
    for repo in std::iter::once(&own).chain(client.index_repositories()) {
        let candidates = client
            .referrers(repo, &manifest_digest, seekable::ARTIFACT_TYPE)
            .await
            .map_err(|e| e.context(format!("looking up seekable indexes in {repo}")))?;
        for desc in candidates.iter().rev().take(MAX_INDEX_CANDIDATES) {
            let found = index_from(
                client,
                cache,
                repo,
                desc,
                manifest_digest,
                expected,
                disk_path,
            );
            match found.await {
                Ok(found) => return Ok(found),
                Err(e) if e.kind() == ErrorKind::Network => return Err(e),
                Err(e) => {
                    tracing::warn!(repository = %repo, index = %desc.digest, error = %e.chain(), "refusing a seekable index");
                    refused.push(format!("{repo}@{}: {}", desc.digest, e.chain()));
                }
            }
        }
    }
    let searched = std::iter::once(&own)
        .chain(client.index_repositories())
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    Err(Error::new(
        ErrorKind::NotFound,
        if refused.is_empty() {
            format!("{reference} has no lazily loadable layer: no seekable index for its layer {} (searched {searched}); publish one with `vmdisk index`, or republish the image with `vmdisk convert`", expected.layer)
        } else {
            format!(
                "no usable seekable index for layer {} of {reference}: {}",
                expected.layer,
                refused.join("; ")
            )
        },
    ))
}

/// The index artifact `desc` in `repo`, if it is one for `subject` and `expected`; its blob
/// from `cache` when a layer read through it is kept there (the daemon found it first).
async fn index_from(
    client: &dyn Registry,
    cache: Option<&CacheRoot>,
    repo: &Reference,
    desc: &Descriptor,
    subject: Digest,
    expected: &Expected,
    disk_path: Option<&str>,
) -> Result<FoundIndex> {
    let fetched = client.get_manifest(&repo.with_digest(desc.digest)).await?;
    let ManifestKind::Image(m) = fetched.manifest else {
        return Err(Error::corrupt(
            "the referrer is an index, not an artifact manifest",
        ));
    };
    if m.artifact_type.as_deref() != Some(seekable::ARTIFACT_TYPE) {
        return Err(Error::corrupt(format!(
            "the artifact's type is {:?}, not {}",
            m.artifact_type,
            seekable::ARTIFACT_TYPE
        )));
    }
    match &m.subject {
        Some(s) if s.digest == subject => {}
        other => {
            return Err(Error::corrupt(format!(
                "the artifact refers to {}, not image manifest {subject}",
                other
                    .as_ref()
                    .map_or("nothing".into(), |s| s.digest.to_string())
            )))
        }
    }
    if m.annotations
        .get(seekable::ANN_LAYER)
        .is_some_and(|l| *l != expected.layer.to_string())
    {
        return Err(Error::corrupt(format!(
            "the artifact indexes layer {}, not {}",
            m.annotations[seekable::ANN_LAYER],
            expected.layer
        )));
    }
    let (blob, windows) = match m.layers.as_slice() {
        [blob] => (blob, None),
        [blob, windows] => (blob, Some(windows)),
        _ => {
            return Err(Error::corrupt(
                "the artifact has not one or two blobs (the index and its windows)",
            ))
        }
    };
    if blob.media_type != seekable::MEDIA_TYPE
        || windows.is_some_and(|w| w.media_type != seekable::WINDOWS_MEDIA_TYPE)
    {
        return Err(Error::corrupt(format!(
            "the artifact's blobs are {}, not {} and {}",
            m.layers
                .iter()
                .map(|l| l.media_type.as_str())
                .collect::<Vec<_>>()
                .join(" and "),
            seekable::MEDIA_TYPE,
            seekable::WINDOWS_MEDIA_TYPE
        )));
    }
    // The windows blob the index names must be the one the artifact holds (so the registry
    // keeps it).
    let windows = windows.map(|w| seekable::Windows {
        digest: w.digest,
        size: w.size,
    });
    // A layer read through this index before is kept under its identity, which needs the
    // digest of the stream: known here when the manifest pins it.
    if let (Some(cache), Some(diff_id)) = (cache.cloned(), expected.diff_id) {
        let key = LayerId {
            layer: expected.layer,
            size: expected.layer_size,
            toc: blob.digest,
            toc_offset: 0,
            diff_id,
            disk_path: disk_path.map(str::to_string),
            indexed: true,
            estargz: false,
        }
        .key();
        // Kept only after it was checked, and re-checked against its digest here.
        if let Some((meta, bytes)) = blocking(move || Ok(cache.load_layer_meta(&key))).await? {
            if let Some(source) = meta.index {
                return Ok(FoundIndex {
                    repository: repo.clone(),
                    digest: blob.digest,
                    bytes,
                    compression: source.compression,
                    layout: source.layout,
                    diff_id: meta.diff_id,
                });
            }
        }
    }
    let bytes = client
        .get_blob(repo, blob, seekable::MAX_INDEX_BYTES)
        .await?;
    let expected = *expected;
    let (bytes, index) = blocking(move || {
        let index = SeekIndex::decode(&bytes, &expected)?;
        if index.layout == Layout::Tar && index.disk_entry().is_none() {
            return Err(Error::unsupported(
                "the indexed layer has no regular file under /disk/ or /image/",
            ));
        }
        if index.windows != windows {
            return Err(Error::corrupt(format!(
                "the index names the windows blob {:?}, the artifact holds {windows:?}",
                index.windows
            )));
        }
        Ok((bytes, index))
    })
    .await?;
    Ok(FoundIndex {
        repository: repo.clone(),
        digest: blob.digest,
        bytes,
        compression: index.compression,
        layout: index.layout,
        diff_id: index.diff_id,
    })
}

/// How long identifying a layer waits for its TOC once the config is there.
const TOC_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// What the cache records about the layer `id` resolved from `reference`.
fn layer_meta(reference: &Reference, loc: &TocLocation, id: &LayerId) -> LayerMeta {
    LayerMeta {
        reference: reference.to_string(),
        layer_digest: id.layer,
        layer_size: id.size,
        toc_offset: loc.offset,
        toc_length: loc.length,
        toc_uncompressed_length: loc.uncompressed_length,
        toc_digest: id.toc,
        disk_path: id.disk_path.clone(),
        diff_id: id.diff_id,
        index: None,
        estargz: false,
    }
}

/// The TOC (or seekable index) `meta` pins, verified against its digest.
async fn fetch_toc_of(client: &dyn Registry, meta: &LayerMeta) -> Result<Vec<u8>> {
    match &meta.index {
        Some(source) => {
            let repo: Reference = source.repository.parse()?;
            let desc = Descriptor {
                media_type: seekable::MEDIA_TYPE.into(),
                digest: meta.toc_digest,
                size: meta.toc_length,
                ..Descriptor::of(seekable::MEDIA_TYPE, b"")
            };
            client
                .get_blob(&repo, &desc, seekable::MAX_INDEX_BYTES)
                .await
        }
        None if meta.estargz => {
            let reference: Reference = meta.reference.parse()?;
            let (offset, json) = fetch_estargz_toc(
                client,
                &reference,
                meta.layer_digest,
                meta.layer_size,
                meta.toc_digest,
            )
            .await?;
            if offset != meta.toc_offset {
                return Err(Error::corrupt(format!(
                    "the eStargz footer of layer {} now puts the TOC at {offset}, not {}",
                    meta.layer_digest, meta.toc_offset
                )));
            }
            Ok(json)
        }
        None => {
            let reference: Reference = meta.reference.parse()?;
            fetch_toc(client, &reference, &meta.layer_digest, &toc_location(meta)).await
        }
    }
}

/// The TOC that `loc` places in blob `layer`, verified against its pinned checksum.
async fn fetch_toc(
    client: &dyn Registry,
    reference: &Reference,
    layer: &Digest,
    loc: &TocLocation,
) -> Result<Vec<u8>> {
    client
        .retry_policy()
        .run(
            &format!("the zstd:chunked TOC of layer {layer}"),
            || async {
                let toc = client
                    .get_blob_range(reference, layer, loc.range())
                    .await?
                    .to_vec();
                loc.checksum.verify(&toc, "zstd:chunked TOC")?;
                Ok(toc)
            },
        )
        .await
}

async fn resolve_online(
    client: &dyn Registry,
    cache: &CacheRoot,
    reference: &Reference,
) -> Result<RemoteLayer> {
    let (manifest, manifest_digest, platform) =
        platform_manifest(client, Some(cache), reference).await?;
    let (_, meta) =
        disk_layer_id(client, Some(cache), reference, &manifest, manifest_digest).await?;
    let key = meta.id().key();
    let c = cache.clone();
    // Usually there already: kept by this call's `disk_layer_id` or the snapshotter's.
    let cached = blocking(move || Ok(c.load_layer_meta(&key).map(|(_, toc)| toc))).await?;
    let (toc, fetched) = match cached {
        Some(toc) => (toc, false),
        None => (fetch_toc_of(client, &meta).await?, true),
    };
    // A kept TOC matches its pinned checksum but is parsed and validated on every load:
    // parsing grows with the chunk count (tens of ms per 8 GiB), so off the async workers.
    let (cache, reference) = (cache.clone(), reference.clone());
    blocking(move || {
        let remote = RemoteLayer::build(reference.clone(), meta, &toc, true)?;
        if fetched {
            cache.save_layer_meta(&remote.meta, &toc)?;
        }
        cache.save_ref(&RefRecord {
            reference: reference.to_string(),
            manifest_digest,
            layer_key: key,
            platform: platform.to_string(),
        })?;
        Ok(remote)
    })
    .await
}

/// Resolves `reference` to its disk layer: from the registry, or from the cache when the
/// registry is unreachable and this reference was resolved before.
pub async fn resolve(
    client: &dyn Registry,
    cache: &CacheRoot,
    reference: &Reference,
) -> Result<RemoteLayer> {
    match resolve_online(client, cache, reference).await {
        Ok(layer) => Ok(layer),
        Err(e) if e.kind() == ErrorKind::Network => {
            let (cache, reference) = (cache.clone(), reference.clone());
            blocking(move || {
                let record = cache.load_ref(&reference.to_string()).ok_or(e)?;
                let (meta, toc) = cache.load_layer_meta(&record.layer_key).ok_or_else(|| {
                    Error::new(
                        ErrorKind::Network,
                        format!(
                            "{reference}: the registry is unreachable and the cache has no TOC for it"
                        ),
                    )
                })?;
                tracing::warn!(%reference, layer = %meta.layer_digest, "registry unreachable; using the cached resolution");
                RemoteLayer::build(reference, meta, &toc, false)
            })
            .await
        }
        Err(e) => Err(e),
    }
}
