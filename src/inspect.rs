//! `vmdisk inspect`: what an image holds and whether vmdisk can load it lazily.
//!
//! For a zstd:chunked layer the TOC is fetched with one Range request, verified against its
//! annotation and validated (paths, chunk coverage, ranges); a layer is lazily loadable only if
//! it has a disk under `disk/` or `image/` whose every data chunk has a digest. Third-party
//! images without our annotations get their format and virtual size from the disk's first
//! chunk, fetched and verified; eStargz layers are read the same way from their own TOC. Gzip
//! and uncompressed layers are lazily loadable when a seekable index was published for them;
//! otherwise they are reported as not lazily loadable, with the reason, and the disk is located by reading
//! the start of the layer stream only (informational, not verified: nothing is served from it).

use std::io::Read;

use serde::Serialize;

use crate::blob::Blob;
use crate::error::{Error, Result};
use crate::format::disk::{self, DiskFormat};
use crate::format::tree::NodeKind;
use crate::format::zstd_chunked::{self, TocLocation};
use crate::format::{artifact, seekable};
use crate::layer::LayerKind;
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::{
    self, Descriptor, ImageConfig, LayerCompression, Manifest, ManifestKind, Platform,
};
use crate::policy::Verifier;
use crate::registry::{Ask, Registry, RegistryClient};
use crate::resolve::{LayerForm, TocPin};

/// The whole report.
#[derive(Debug, Serialize)]
pub struct Report {
    pub reference: String,
    pub digest: String,
    pub media_type: String,
    pub platforms: Vec<PlatformReport>,
}

/// One platform's image.
#[derive(Debug, Serialize)]
pub struct PlatformReport {
    pub platform: String,
    pub manifest: String,
    pub layers: Vec<LayerReport>,
}

/// One layer.
#[derive(Debug, Clone, Serialize)]
pub struct LayerReport {
    pub digest: String,
    pub media_type: String,
    pub size: u64,
    /// `zstd:chunked`, `estargz`, `gzip`, `zstd`, `tar` or `unknown`.
    pub layout: String,
    pub lazy: bool,
    /// Why the layer is not lazily loadable (`null` when it is).
    pub reason: Option<String>,
    /// The disk found in the layer (`null` if none).
    pub disk: Option<DiskReport>,
    pub chunks: u64,
    pub zero_chunks: u64,
    /// Fraction of the disk's bytes in zero chunks.
    pub zero_fraction: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chunk_size: Option<ChunkSpread>,
    /// Compressed TOC size in bytes.
    pub toc_size: u64,
    pub toc_uncompressed_size: u64,
    /// Whether the layer carries vmdisk's own annotations.
    pub vmdisk_annotations: bool,
    /// The seekable index an ordinary layer is read through (`repository@digest (size)`).
    pub index: Option<String>,
}

/// The disk found in a layer.
#[derive(Debug, Clone, Serialize)]
pub struct DiskReport {
    pub path: String,
    pub format: String,
    pub virtual_size: u64,
    pub size: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// Chunk size statistics over the disk's data chunks.
#[derive(Debug, Clone, Serialize)]
pub struct ChunkSpread {
    pub min: u64,
    pub median: u64,
    pub max: u64,
}

impl LayerReport {
    fn new(desc: &Descriptor, layout: &str) -> Self {
        LayerReport {
            digest: desc.digest.to_string(),
            media_type: desc.media_type.clone(),
            size: desc.size,
            layout: layout.to_string(),
            lazy: false,
            reason: None,
            disk: None,
            chunks: 0,
            zero_chunks: 0,
            zero_fraction: 0.0,
            chunk_size: None,
            toc_size: 0,
            toc_uncompressed_size: 0,
            vmdisk_annotations: desc
                .annotations
                .keys()
                .any(|k| k.starts_with(crate::format::layout::ANN_PREFIX)),
            index: None,
        }
    }
}

/// Most layers of one image inspect looks at (Docker and containerd build at most 127).
pub const MAX_LAYERS: usize = 128;
/// Most platforms of an index inspect looks at.
pub const MAX_PLATFORMS: usize = 64;
/// Layers inspected at once.
const LAYER_CONCURRENCY: usize = 4;

/// Inspects every platform of `r` that `trust` accepts (nothing of a platform's layers is
/// read before).
pub async fn inspect(client: &RegistryClient, trust: &Verifier, r: &Reference) -> Result<Report> {
    let fetched = client.get_manifest(r).await?;
    let mut platforms = Vec::new();
    match &fetched.manifest {
        ManifestKind::Image(m) => {
            let config = client.get_blob(r, &m.config, oci::MAX_CONFIG_SIZE).await?;
            let platform = if artifact::is_artifact(m) {
                // An artifact's config is often empty: the platform is what it names, if any.
                oci::config_platform(&config).unwrap_or(Platform {
                    os: "unknown".into(),
                    architecture: "unknown".into(),
                    variant: None,
                })
            } else {
                let cfg: ImageConfig = serde_json::from_slice(&config)
                    .map_err(|e| Error::corrupt(format!("image config of {r}: {e}")))?;
                Platform {
                    os: cfg.os,
                    architecture: cfg.architecture,
                    variant: cfg.variant,
                }
            };
            platforms.push(
                inspect_image(client, trust, r, m, &platform, fetched.digest.to_string()).await?,
            );
        }
        ManifestKind::Index(index) => {
            if index.manifests.len() > MAX_PLATFORMS {
                return Err(Error::unsupported(format!(
                    "{r} lists {} manifests; inspect reads at most {MAX_PLATFORMS}",
                    index.manifests.len()
                )));
            }
            for desc in &index.manifests {
                let Some(platform) = desc.platform.clone() else {
                    continue;
                };
                let child = client.get_manifest(&r.with_digest(desc.digest)).await?;
                match child.manifest {
                    ManifestKind::Image(m) => platforms.push(
                        inspect_image(client, trust, r, &m, &platform, desc.digest.to_string())
                            .await?,
                    ),
                    ManifestKind::Index(_) => {
                        return Err(Error::unsupported(format!(
                            "{r}: nested index {}",
                            desc.digest
                        )))
                    }
                }
            }
        }
    }
    Ok(Report {
        reference: r.to_string(),
        digest: fetched.digest.to_string(),
        media_type: fetched.media_type,
        platforms,
    })
}

async fn inspect_image(
    client: &RegistryClient,
    trust: &Verifier,
    r: &Reference,
    m: &Manifest,
    platform: &Platform,
    digest: String,
) -> Result<PlatformReport> {
    use futures_util::StreamExt;
    trust.check_image(client, None, r, digest.parse()?).await?;
    if artifact::is_artifact(m) {
        return inspect_artifact(client, trust, r, m, platform, digest).await;
    }
    if m.layers.len() > MAX_LAYERS {
        return Err(Error::unsupported(format!(
            "{r}: the image has {} layers; inspect reads at most {MAX_LAYERS} (containerd and Docker build no more than 127)",
            m.layers.len()
        )));
    }
    // Each distinct layer once, a few at a time; repeats share the report.
    let mut unique: Vec<&Descriptor> = Vec::new();
    for desc in &m.layers {
        if !unique.iter().any(|d| d.digest == desc.digest) {
            unique.push(desc);
        }
    }
    let mut reports: Vec<LayerReport> =
        futures_util::stream::iter(unique.iter().map(|desc| async move {
            inspect_layer(client, r, desc)
                .await
                .map_err(|e| e.context(format!("layer {}", desc.digest)))
        }))
        .buffered(LAYER_CONCURRENCY)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    if crate::resolve::disk_layer(m).is_none() {
        if let Some((_, layer, _)) = crate::resolve::indexable_layer(m) {
            let at = unique
                .iter()
                .position(|d| d.digest == layer.digest)
                .expect("the layer is among the unique ones");
            seekable_index(client, trust, r, m, digest.parse()?, &mut reports[at]).await?;
        }
    }
    let layers = m
        .layers
        .iter()
        .map(|desc| {
            let at = unique
                .iter()
                .position(|d| d.digest == desc.digest)
                .expect("every layer is among the unique ones");
            reports[at].clone()
        })
        .collect();
    Ok(PlatformReport {
        platform: platform.to_string(),
        manifest: digest,
        layers,
    })
}

/// A disk artifact: which layer is its disk, and whether a seekable index makes it lazily
/// loadable; with one, the disk's format from its first bytes (fetched and checked through
/// the index).
async fn inspect_artifact(
    client: &RegistryClient,
    trust: &Verifier,
    r: &Reference,
    m: &Manifest,
    platform: &Platform,
    digest: String,
) -> Result<PlatformReport> {
    if m.layers.len() > MAX_LAYERS {
        return Err(Error::unsupported(format!(
            "{r}: the artifact has {} layers; inspect reads at most {MAX_LAYERS}",
            m.layers.len()
        )));
    }
    let source = artifact::disk_source(m).map(|l| l.position);
    let mut layers: Vec<LayerReport> = artifact::layers(m)
        .iter()
        .map(|l| {
            let layout = match l.payload {
                artifact::Payload::Disk => "disk file",
                artifact::Payload::Archive => "archive",
                _ => "file",
            };
            let mut rep = LayerReport::new(l.layer, layout);
            if Some(l.position) != source {
                rep.reason = Some("not the artifact's disk".into());
            }
            rep
        })
        .collect();
    let disk = match artifact::disk_file(m) {
        Ok(disk) => disk,
        Err(e) => {
            if let Some(at) = source {
                layers[at].reason = Some(e.chain());
            }
            return Ok(PlatformReport {
                platform: platform.to_string(),
                manifest: digest,
                layers,
            });
        }
    };
    let rep = &mut layers[disk.position];
    let manifest_digest: crate::oci::digest::Digest = digest.parse()?;
    let pinned = r.with_digest(manifest_digest);
    match crate::resolve::seekable_layer(client, trust, &pinned, m, manifest_digest).await {
        Ok((meta, index)) => {
            let source = meta.index_source().expect("read through an index");
            rep.layout = format!("disk file ({})", source.compression.name());
            rep.lazy = true;
            rep.index = Some(format!(
                "{}@{} ({} bytes)",
                source.repository, meta.toc_digest, meta.toc_length
            ));
            rep.chunks = index.spans.len() as u64;
            let head_end = seekable::build::HEAD_BYTES.min(index.stream_size);
            let head = read_stream(client, &meta, &index, 0..head_end).await?;
            let (format, virtual_size) = disk::identify(&head, index.stream_size)?;
            rep.disk = Some(DiskReport {
                path: disk.path,
                format: format.map_or("unknown", |f| f.name()).to_string(),
                virtual_size,
                size: index.stream_size,
                digest: disk.digest.map(|d| d.to_string()),
            });
        }
        Err(e) if e.kind() == crate::error::ErrorKind::Network => return Err(e),
        Err(e) => rep.reason = Some(e.chain()),
    }
    Ok(PlatformReport {
        platform: platform.to_string(),
        manifest: digest,
        layers,
    })
}

/// Bytes `range` of the uncompressed stream of the layer `meta` reads through `index`, from its
/// spans fetched from the registry, each checked against its digest.
async fn read_stream(
    client: &RegistryClient,
    meta: &crate::layer::LayerMeta,
    index: &seekable::SeekIndex,
    range: std::ops::Range<u64>,
) -> Result<Vec<u8>> {
    let source = meta
        .index_source()
        .ok_or_else(|| Error::corrupt("the layer's record names no seekable index"))?;
    let windows = index.windows.map(|w| (source.repository.clone(), w.digest));
    let client: std::sync::Arc<dyn crate::registry::Registry> = std::sync::Arc::new(client.clone());
    let reference = meta.reference.clone();
    let sources = crate::blob::Sources::in_registry(client, &reference, meta.layer_digest, windows);
    let ask = crate::layer::Ask::AnyEndpoint;
    crate::layer::codec::indexed::SpanReader::new(index, &sources, ask)
        .read(range)
        .await
}

/// Looks up the seekable index of `m`'s ordinary disk layer (reported in `rep`): with one, the
/// layer is lazily loadable through it.
async fn seekable_index(
    client: &RegistryClient,
    trust: &Verifier,
    r: &Reference,
    m: &Manifest,
    manifest_digest: crate::oci::digest::Digest,
    rep: &mut LayerReport,
) -> Result<()> {
    let pinned = r.with_digest(manifest_digest);
    match crate::resolve::disk_layer_id(client, None, trust, &pinned, m, manifest_digest, None)
        .await
    {
        Ok((_, meta)) => {
            let source = meta
                .index_source()
                .expect("an ordinary layer is read through its index");
            rep.lazy = true;
            rep.reason = None;
            rep.index = Some(format!(
                "{}@{} ({} bytes)",
                source.repository, meta.toc_digest, meta.toc_length
            ));
        }
        Err(e) if e.kind() == crate::error::ErrorKind::Network => return Err(e),
        Err(e) => {
            rep.reason = Some(format!(
                "{}; {}",
                rep.reason.take().unwrap_or_default(),
                e.chain()
            ))
        }
    }
    Ok(())
}

/// One layer, by what its descriptor says it is ([`crate::resolve::layer_form`]).
async fn inspect_layer(
    client: &RegistryClient,
    r: &Reference,
    desc: &Descriptor,
) -> Result<LayerReport> {
    let form = match crate::resolve::layer_form(desc) {
        Ok(form) => form,
        // A TOC annotation that is there but refused: the layer cannot be read lazily.
        Err(e) => {
            let mut rep = LayerReport::new(desc, "unknown");
            rep.reason = Some(format!("its TOC annotations are refused: {}", e.chain()));
            return Ok(rep);
        }
    };
    match form {
        LayerForm::Toc(TocPin::Frame(loc)) => inspect_chunked(client, r, desc, &loc).await,
        LayerForm::Toc(TocPin::Digest(toc)) => match inspect_estargz(client, r, desc, toc).await {
            Err(e) if e.kind() != crate::error::ErrorKind::Network => {
                let mut rep = LayerReport::new(desc, "estargz");
                rep.reason = Some(format!("eStargz layer that cannot be read: {}", e.chain()));
                Ok(rep)
            }
            other => other,
        },
        LayerForm::Plain(c) => {
            let layout = match c {
                LayerCompression::None => "tar",
                LayerCompression::Gzip => "gzip",
                LayerCompression::Zstd => "zstd",
            };
            let mut rep = LayerReport::new(desc, layout);
            rep.reason = Some(format!("{layout} layer without a chunk index: it can only be fetched whole; index it with `vmdisk index` or republish it with `vmdisk convert`"));
            rep.disk = peek_stream_disk(client, r, desc, c).await?;
            Ok(rep)
        }
        LayerForm::NotTar => {
            let mut rep = LayerReport::new(desc, "unknown");
            rep.reason = Some(format!("media type {} is not a tar layer", desc.media_type));
            Ok(rep)
        }
    }
}

async fn inspect_chunked(
    client: &RegistryClient,
    r: &Reference,
    desc: &Descriptor,
    loc: &TocLocation,
) -> Result<LayerReport> {
    let mut rep = LayerReport::new(desc, "zstd:chunked");
    rep.toc_size = loc.length;
    rep.toc_uncompressed_size = loc.uncompressed_length;
    loc.check_within(desc.size)?;
    let compressed = crate::resolve::fetch_toc(client, r, &desc.digest, loc).await?;
    let nodes = zstd_chunked::read_toc(&compressed, loc)?;
    inspect_nodes(client, r, desc, rep, &nodes, &LayerKind::ZstdChunked).await
}

/// An eStargz layer: its footer and TOC (checked against the digest `toc` its annotation pins)
/// read.
async fn inspect_estargz(
    client: &RegistryClient,
    r: &Reference,
    desc: &Descriptor,
    toc: Digest,
) -> Result<LayerReport> {
    let mut rep = LayerReport::new(desc, "estargz");
    let (offset, json) =
        crate::resolve::fetch_estargz_toc(client, r, desc.digest, desc.size, toc).await?;
    rep.toc_size = desc.size - crate::format::estargz::FOOTER_SIZE - offset;
    rep.toc_uncompressed_size = json.len() as u64;
    let nodes = crate::format::estargz::nodes(&json, offset)?;
    inspect_nodes(client, r, desc, rep, &nodes, &LayerKind::Estargz).await
}

/// What a layer's validated TOC `nodes` say about its disk; `kind`: how its first chunk is
/// decoded (by the layer's codec).
async fn inspect_nodes(
    client: &RegistryClient,
    r: &Reference,
    desc: &Descriptor,
    mut rep: LayerReport,
    nodes: &[crate::format::tree::Node],
    kind: &LayerKind,
) -> Result<LayerReport> {
    let wanted = desc
        .annotations
        .get(crate::format::layout::ANN_PATH)
        .cloned();
    let disk = nodes
        .iter()
        .filter(|n| n.kind == NodeKind::Regular && n.size > 0)
        .find(|n| crate::format::layout::is_disk_path(&n.path, wanted.as_deref()));
    let Some(disk) = disk else {
        rep.reason = Some("no regular file under /disk/ or /image/ in the TOC".into());
        return Ok(rep);
    };
    chunk_figures(&mut rep, disk);
    let (format, virtual_size) = match (
        desc.annotations.get(crate::format::layout::ANN_FORMAT),
        desc.annotations
            .get(crate::format::layout::ANN_VIRTUAL_SIZE),
    ) {
        (Some(f), Some(v)) => (
            f.clone(),
            v.parse::<u64>().map_err(|_| {
                Error::corrupt(format!(
                    "annotation {} is not a number",
                    crate::format::layout::ANN_VIRTUAL_SIZE
                ))
            })?,
        ),
        _ => {
            // Third-party image: read the disk's first chunk, verified, to learn its format.
            let first = &disk.chunks[0];
            let head = if first.zeros {
                vec![0u8; first.size as usize]
            } else {
                // Bytes that fail to decode or verify are fetched again from the registry.
                let blob = &Blob::in_registry(client as &dyn Registry, r, desc.digest);
                let what = format!("the first chunk of {}", disk.path);
                crate::layer::fetch_checked(&what, Ask::AnyEndpoint, |ask| async move {
                    let frame = blob.fetch(first.compressed.clone(), ask).await?;
                    crate::layer::codec::decode_chunk_alone(kind, first, disk.size, &frame)
                })
                .await
                .map_err(|e| e.context(format!("first chunk of {}", disk.path)))?
            };
            let (format, virtual_size) = disk::identify(&head, disk.size)?;
            (
                format.map_or("unknown", |f| f.name()).to_string(),
                virtual_size,
            )
        }
    };
    rep.disk = Some(DiskReport {
        path: disk.path.clone(),
        format: format.clone(),
        virtual_size,
        size: disk.size,
        digest: disk.digest.map(|d| d.to_string()),
    });
    rep.reason = if !disk.verifiable() {
        Some("some chunks have no chunkDigest, so they cannot be verified one by one".into())
    } else if !format
        .parse::<disk::DiskFormat>()
        .is_ok_and(|f| f.is_served())
    {
        Some(format!(
            "the file at {} is not a qcow2 or raw disk ({format})",
            disk.path
        ))
    } else {
        None
    };
    rep.lazy = rep.reason.is_none();
    Ok(rep)
}

/// How `disk`'s chunks are made: how many, how many (and what share) are zeros, the spread of
/// the others' sizes.
fn chunk_figures(rep: &mut LayerReport, disk: &crate::format::tree::Node) {
    rep.chunks = disk.chunks.len() as u64;
    rep.zero_chunks = disk.chunks.iter().filter(|c| c.zeros).count() as u64;
    let zero_bytes: u64 = disk.chunks.iter().filter(|c| c.zeros).map(|c| c.size).sum();
    rep.zero_fraction = zero_bytes as f64 / disk.size as f64;
    let mut sizes: Vec<u64> = disk
        .chunks
        .iter()
        .filter(|c| !c.zeros)
        .map(|c| c.size)
        .collect();
    sizes.sort_unstable();
    if !sizes.is_empty() {
        rep.chunk_size = Some(ChunkSpread {
            min: sizes[0],
            median: sizes[sizes.len() / 2],
            max: sizes[sizes.len() - 1],
        });
    }
}

/// Most bytes of other files skipped while looking for the disk in a stream.
const PEEK_LIMIT: u64 = 64 << 20;

async fn peek_stream_disk(
    client: &RegistryClient,
    r: &Reference,
    desc: &Descriptor,
    compression: LayerCompression,
) -> Result<Option<DiskReport>> {
    let blob = client.blob_reader(r, desc).await?;
    tokio::task::spawn_blocking(move || -> Result<Option<DiskReport>> {
        let decoder = crate::format::layer_decoder(compression, blob)?;
        let mut archive = tar::Archive::new(decoder);
        let mut skipped = 0u64;
        for entry in archive
            .entries()
            .map_err(|e| Error::io("reading the layer", e))?
        {
            let mut entry = entry.map_err(|e| Error::io("reading the layer", e))?;
            let Ok(path) = entry.path().map(|p| p.to_string_lossy().into_owned()) else {
                continue;
            };
            let Ok(path) = crate::format::tree::clean_path(&path) else {
                continue;
            };
            let size = entry.size();
            if entry.header().entry_type() == tar::EntryType::Regular
                && crate::format::layout::is_disk_path(&path, None)
            {
                let mut head = vec![0u8; size.min(66 * 1024) as usize];
                entry
                    .read_exact(&mut head)
                    .map_err(|e| Error::io("reading the disk header", e))?;
                // Informational only: an unreadable qcow2 header reports size 0, not an error.
                let (format, virtual_size) =
                    disk::identify(&head, size).unwrap_or((Some(DiskFormat::Qcow2), 0));
                let format = format.map_or("unknown", |f| f.name()).to_string();
                return Ok(Some(DiskReport {
                    path,
                    format,
                    virtual_size,
                    size,
                    digest: None,
                }));
            }
            skipped += size;
            if skipped > PEEK_LIMIT {
                return Ok(None);
            }
        }
        Ok(None)
    })
    .await
    .map_err(|e| Error::new(crate::error::ErrorKind::Io, "layer reader failed").with_source(e))?
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The report as text for people.
pub fn render_text(report: &Report) -> String {
    let mut out = format!(
        "{}\n  digest: {}\n  type:   {}\n",
        report.reference, report.digest, report.media_type
    );
    for p in &report.platforms {
        out.push_str(&format!(
            "platform {} (manifest {})\n",
            p.platform, p.manifest
        ));
        for l in &p.layers {
            out.push_str(&format!(
                "  layer {} {} {} ({})\n",
                l.digest,
                l.layout,
                human(l.size),
                l.media_type
            ));
            out.push_str(&format!(
                "    lazily loadable: {}{}\n",
                if l.lazy { "yes" } else { "no" },
                l.reason
                    .as_ref()
                    .map(|r| format!(" — {r}"))
                    .unwrap_or_default()
            ));
            if let Some(index) = &l.index {
                out.push_str(&format!("    seekable index: {index}\n"));
            }
            if let Some(d) = &l.disk {
                out.push_str(&format!(
                    "    disk: /{} {} virtual {} file {}\n",
                    d.path,
                    d.format,
                    human(d.virtual_size),
                    human(d.size)
                ));
                if l.layout.starts_with("disk file") {
                    out.push_str(&match &d.digest {
                        Some(digest) => format!("    disk digest: {digest} (pinned by the artifact)
"),
                        None => "    disk digest: not pinned by the artifact (checked against its index only)
".into(),
                    });
                }
            }
            if l.chunks > 0 && l.index.is_none() {
                let spread = l
                    .chunk_size
                    .as_ref()
                    .map(|s| {
                        format!(
                            ", size min/median/max {}/{}/{}",
                            human(s.min),
                            human(s.median),
                            human(s.max)
                        )
                    })
                    .unwrap_or_default();
                out.push_str(&format!(
                    "    chunks: {} ({} zero, {:.1}% of the disk){spread}\n",
                    l.chunks,
                    l.zero_chunks,
                    l.zero_fraction * 100.0
                ));
                out.push_str(&format!(
                    "    TOC: {} compressed, {} uncompressed\n",
                    human(l.toc_size),
                    human(l.toc_uncompressed_size)
                ));
            }
        }
    }
    out
}
