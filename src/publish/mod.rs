//! Publishing VM disks as lazily loadable containerDisks: `vmdisk push` and `vmdisk convert`.
//!
//! An image we publish is an ordinary OCI image with one zstd:chunked layer holding the disk
//! (`/disk/<name>`, uid/gid 107, mode 0644, as KubeVirt expects, or any `--path`). The layer
//! carries the TOC annotations and our `containerd.io/snapshot/vmdisk.*` annotations, which
//! containerd hands to snapshotters as labels. Blobs stream straight into the registry; the
//! tag is written last, so a failed push leaves nothing tagged.

pub mod index;
pub mod pipeline;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;

use self::pipeline::{build_layer, BuiltLayer, ChunkingOptions, LayerContent};
use crate::error::{Error, ErrorKind, Result, ResultExt};
use crate::format::artifact;
use crate::format::disk::{self, DiskFormat};
use crate::format::layout::{
    is_disk_path, layer_path, ANN_CHUNK_SIZE, ANN_DISK_DIGEST, ANN_DISK_SIZE, ANN_FORMAT, ANN_PATH,
    ANN_PREFIX, ANN_TOC_DIGEST, ANN_TOC_POSITION, ANN_VIRTUAL_SIZE, LABEL_PREFIX,
};
use crate::format::tree::clean_path;
use crate::format::zstd_chunked::{EntryMeta, TocLocation};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::{self, Descriptor, ImageConfig, Manifest, ManifestKind, Platform, RootFs};
use crate::registry::{BlobUpload, RegistryClient, UPLOAD_SEGMENT};

/// Default chunk size: 256 KiB (see docs/format.md for the measurement behind it).
pub const DEFAULT_CHUNK_SIZE: usize = 256 << 10;
/// Default zstd level: fast, and disk images are mostly incompressible or zeros anyway.
pub const DEFAULT_LEVEL: i32 = 3;

/// How to publish.
#[derive(Clone, Debug)]
pub struct PublishOptions {
    /// Where the disk goes in the image, e.g. `/image/podvm.qcow2`; default `/disk/<name>`.
    pub path: Option<String>,
    pub chunk_size: usize,
    pub level: i32,
    pub threads: usize,
    /// Skip content detection (`--format`).
    pub format: Option<DiskFormat>,
}

impl Default for PublishOptions {
    fn default() -> Self {
        PublishOptions {
            path: None,
            chunk_size: DEFAULT_CHUNK_SIZE,
            level: DEFAULT_LEVEL,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            format: None,
        }
    }
}

/// The mtime to record: `SOURCE_DATE_EPOCH` if set (reproducible layers), else `fallback`.
fn source_date(fallback: u64) -> u64 {
    std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(fallback)
}

/// Facts about the disk, recorded in annotations and the config.
#[derive(Clone, Debug)]
pub struct DiskFacts {
    pub path: String,
    pub format: DiskFormat,
    pub virtual_size: u64,
    pub size: u64,
    pub digest: Digest,
}

/// One published platform image.
#[derive(Clone, Debug)]
pub struct Published {
    pub manifest: Descriptor,
    pub layer: Descriptor,
    pub disk: DiskFacts,
    pub chunks: u64,
    pub zero_chunks: u64,
}

/// A `Write` that cuts the stream into upload segments and hands them to the async uploader.
struct SegmentSink {
    tx: tokio::sync::mpsc::Sender<Bytes>,
    buf: Vec<u8>,
}

impl SegmentSink {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let seg = Bytes::from(std::mem::replace(
            &mut self.buf,
            Vec::with_capacity(UPLOAD_SEGMENT),
        ));
        self.tx
            .blocking_send(seg)
            .map_err(|_| std::io::Error::other("the upload stopped"))
    }
}

impl std::io::Write for SegmentSink {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let room = UPLOAD_SEGMENT - self.buf.len();
        let n = room.min(data.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == UPLOAD_SEGMENT {
            self.send()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `build` on a blocking thread, streaming what it writes into a new blob of `target`.
/// Unless `started` is given, the upload session opens with the first segment, so a build
/// that fails or finds nothing before writing leaves no trace in the registry. `build` reports the blob's digest, or
/// `None` if it wrote nothing; the result comes back once the registry has accepted the blob.
async fn upload_streamed<'c, T, F>(
    client: &'c RegistryClient,
    target: &Reference,
    started: Option<BlobUpload<'c>>,
    build: F,
) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(SegmentSink) -> Result<(T, Option<Digest>, SegmentSink)> + Send + 'static,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(1);
    let worker = tokio::task::spawn_blocking(move || -> Result<(T, Option<Digest>)> {
        let (value, digest, mut sink) = build(SegmentSink {
            tx,
            buf: Vec::with_capacity(UPLOAD_SEGMENT),
        })?;
        sink.send()
            .map_err(|e| Error::io("uploading the layer", e))?;
        Ok((value, digest))
    });
    let mut upload = started;
    while let Some(segment) = rx.recv().await {
        if upload.is_none() {
            upload = Some(client.start_upload(target).await?);
        }
        upload
            .as_mut()
            .expect("started above")
            .write(segment)
            .await?;
    }
    let (value, digest) = worker
        .await
        .map_err(|e| Error::new(ErrorKind::Io, "layer builder failed").with_source(e))??;
    match (upload, digest) {
        (Some(upload), Some(digest)) => upload.finish(&digest).await?,
        (_, None) => {}
        _ => {
            return Err(Error::new(
                ErrorKind::Io,
                "the layer builder's output and its digest disagree",
            ))
        }
    }
    Ok(value)
}

/// Runs `attempt` again when it fails with a network error, under the client's retry policy.
/// Used around whole layer uploads: registries such as distribution 2.8 cancel an upload whose
/// request broke part-way, and then only a new upload of the layer helps. A layer takes as
/// long as it takes: each request of it is bounded, the upload as a whole is not.
async fn with_restarts<T, Fut>(client: &RegistryClient, attempt: impl FnMut() -> Fut) -> Result<T>
where
    Fut: std::future::Future<Output = Result<T>>,
{
    client
        .retry_policy()
        .with_deadline(std::time::Duration::MAX)
        .run_when("uploading a layer", attempt, |e| {
            e.kind() == ErrorKind::Network
        })
        .await
}

/// The tar entries of the disk at `path`: the directories above it and the file, as a
/// containerDisk holds them ([`crate::format::layout::disk_view`]).
fn disk_entries(path: &str, mtime: u64) -> (Vec<EntryMeta>, EntryMeta) {
    let mut entries: Vec<EntryMeta> = crate::format::layout::disk_view(path)
        .map(|v| EntryMeta {
            path: v.path,
            mode: v.mode,
            uid: v.owner,
            gid: v.owner,
            mtime,
        })
        .collect();
    let file = entries.pop().expect("the view ends with the disk");
    (entries, file)
}

/// Format and virtual size from the first bytes of a disk.
fn disk_facts_from_head(head: &[u8], size: u64) -> Result<(DiskFormat, u64)> {
    match disk::identify(head, size)? {
        (Some(format @ (DiskFormat::Qcow2 | DiskFormat::Raw)), virtual_size) => Ok((format, virtual_size)),
        (Some(other), _) => Err(Error::unsupported(format!("the disk is in {} format; publish it with `vmdisk push`, which converts it", other.name()))),
        (None, _) => Err(Error::invalid("the file does not look like a VM disk (not qcow2, no partition table or filesystem signature)")),
    }
}

/// Writes config and manifest for a pushed layer; the manifest is stored by digest only.
async fn finish_image(
    client: &RegistryClient,
    target: &Reference,
    built: &BuiltLayer,
    disk: DiskFacts,
    platform: &Platform,
    chunk_size: usize,
) -> Result<(Published, Vec<u8>)> {
    let summary = &built.summary;
    let loc: TocLocation = summary.toc_location;
    let position = format!(
        "{}:{}:{}:1",
        loc.offset, loc.length, loc.uncompressed_length
    );
    let facts = [
        (ANN_FORMAT, disk.format.name().to_string()),
        (ANN_VIRTUAL_SIZE, disk.virtual_size.to_string()),
        (ANN_DISK_SIZE, disk.size.to_string()),
        (ANN_DISK_DIGEST, disk.digest.to_string()),
        (ANN_PATH, disk.path.clone()),
        (ANN_CHUNK_SIZE, chunk_size.to_string()),
        (ANN_TOC_DIGEST, loc.checksum.to_string()),
        (ANN_TOC_POSITION, position),
    ];
    let mut annotations = summary.annotations.clone();
    let mut labels = BTreeMap::new();
    for (key, value) in facts {
        // The config carries the same facts as labels: vmdisk.io/<name>.
        let name = key
            .strip_prefix(ANN_PREFIX)
            .expect("vmdisk annotation keys share the prefix");
        labels.insert(format!("{LABEL_PREFIX}{name}"), value.clone());
        annotations.insert(key.to_string(), value);
    }

    let config = ImageConfig {
        created: None,
        architecture: platform.architecture.clone(),
        os: platform.os.clone(),
        variant: platform.variant.clone(),
        config: oci::ContainerConfig { labels },
        rootfs: RootFs {
            kind: "layers".into(),
            diff_ids: vec![summary.diff_id],
        },
    };
    let config_bytes = serde_json::to_vec(&config).expect("config serialises");
    let config_desc = Descriptor::of(oci::OCI_CONFIG, &config_bytes);
    client
        .push_blob(target, &config_desc.digest, Bytes::from(config_bytes))
        .await
        .context("uploading the image config")?;

    let layer = Descriptor {
        media_type: oci::OCI_LAYER_ZSTD.into(),
        digest: summary.digest,
        size: summary.size,
        annotations,
        platform: None,
        artifact_type: None,
    };
    let manifest = Manifest {
        schema_version: 2,
        media_type: Some(oci::OCI_MANIFEST.into()),
        artifact_type: None,
        config: config_desc,
        layers: vec![layer.clone()],
        subject: None,
        annotations: BTreeMap::new(),
    };
    let bytes = serde_json::to_vec(&manifest).expect("manifest serialises");
    client
        .put_manifest(target, None, oci::OCI_MANIFEST, bytes.clone())
        .await
        .context("uploading the manifest")?;
    let mut desc = Descriptor::of(oci::OCI_MANIFEST, &bytes);
    desc.platform = Some(platform.clone());
    let published = Published {
        manifest: desc,
        layer,
        disk,
        chunks: summary.chunks,
        zero_chunks: summary.zero_chunks,
    };
    Ok((published, bytes))
}

fn chunking(opts: &PublishOptions) -> ChunkingOptions {
    ChunkingOptions {
        chunk_size: opts.chunk_size,
        level: opts.level,
        threads: opts.threads,
    }
}

/// Publishes one disk file as the image for `platform` (untagged; see [`tag_images`]).
pub async fn push_disk(
    client: &RegistryClient,
    target: &Reference,
    file: PathBuf,
    platform: &Platform,
    opts: &PublishOptions,
) -> Result<(Published, Vec<u8>)> {
    let forced = opts.format;
    let shown = file.display().to_string();
    // The input's mtime, also for disks converted from vmdk or an OVA.
    let modified = std::fs::metadata(&file).and_then(|m| m.modified()).ok();
    let mtime = source_date(
        modified
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs()),
    );
    let prepared = tokio::task::spawn_blocking(move || disk::prepare(&file, forced))
        .await
        .map_err(|e| Error::new(ErrorKind::Io, "disk preparation failed").with_source(e))??;
    let path = layer_path(opts.path.as_deref(), &prepared.file_name)?;
    let (format, virtual_size, size) = (prepared.format, prepared.virtual_size, prepared.size);
    let chunks = chunking(opts);
    let layer_file = path.clone();
    tracing::info!(disk = %shown, path = %path, format = format.name(), size, "publishing");
    let prepared = Arc::new(prepared);
    // Open the first upload before anything else: an unreachable registry or missing push
    // rights fail at once, before the disk is read and without whole-layer restarts.
    let mut first_upload = Some(
        client
            .start_upload(target)
            .await
            .context(format!("pushing {shown} to {target}"))?,
    );
    let built = with_restarts(client, || {
        let disk = Arc::clone(&prepared);
        let layer_file = layer_file.clone();
        let started = first_upload.take();
        async move {
            let upload = match started {
                Some(upload) => upload,
                None => client.start_upload(target).await?,
            };
            upload_streamed(client, target, Some(upload), move |sink| {
                let reader = std::fs::File::open(&disk.path)
                    .map_err(|e| Error::io(format!("opening {}", disk.path.display()), e))?;
                let (dirs, file) = disk_entries(&layer_file, mtime);
                let content = LayerContent {
                    dirs,
                    file,
                    size,
                    reader,
                };
                let (built, sink) = build_layer(content, chunks, sink)?;
                let digest = built.summary.digest;
                Ok((built, Some(digest), sink))
            })
            .await
        }
    })
    .await
    .context(format!("pushing {shown} to {target}"))?;
    finish_disk(
        client,
        target,
        &built,
        path,
        (format, virtual_size, size),
        platform,
        opts,
    )
    .await
}

/// Config and manifest for a layer built around the disk at `path` of the given format,
/// virtual size and size.
async fn finish_disk(
    client: &RegistryClient,
    target: &Reference,
    built: &BuiltLayer,
    path: String,
    (format, virtual_size, size): (DiskFormat, u64, u64),
    platform: &Platform,
    opts: &PublishOptions,
) -> Result<(Published, Vec<u8>)> {
    let disk = DiskFacts {
        path,
        format,
        virtual_size,
        size,
        digest: built.disk_digest,
    };
    finish_image(client, target, built, disk, platform, opts.chunk_size).await
}

/// Tags what was published: the manifest itself for one image, an index for several.
/// Returns the digest the tag points at.
pub async fn tag_images(
    client: &RegistryClient,
    target: &Reference,
    images: &[(Published, Vec<u8>)],
) -> Result<Digest> {
    let tag = target.tag.clone().unwrap_or_else(|| "latest".to_string());
    match images {
        [] => Err(Error::invalid("nothing to publish")),
        [(_, bytes)] => {
            client
                .put_manifest(target, Some(&tag), oci::OCI_MANIFEST, bytes.clone())
                .await
        }
        many => {
            let index = oci::Index {
                schema_version: 2,
                media_type: Some(oci::OCI_INDEX.into()),
                manifests: many.iter().map(|(p, _)| p.manifest.clone()).collect(),
                annotations: BTreeMap::new(),
            };
            let bytes = serde_json::to_vec(&index).expect("index serialises");
            client
                .put_manifest(target, Some(&tag), oci::OCI_INDEX, bytes)
                .await
        }
    }
}

/// Checks that a push target names a tag (or nothing, meaning `latest`), not a digest.
pub fn check_target(target: &Reference) -> Result<()> {
    if target.digest.is_some() {
        return Err(Error::invalid(format!(
            "push target {target} names a digest; give a tag instead"
        )));
    }
    Ok(())
}

/// Which file of a source tar is the disk, and where it goes.
#[derive(Clone, Debug)]
enum Selection {
    /// An image layer: the file at `wanted` (`--path`), else the first under `/disk/` or
    /// `/image/`; republished at the same path.
    Image { wanted: Option<String> },
    /// An archive in an artifact (the peer-pod `podvm.tar.xz`): the first file under `/disk/`
    /// or `/image/` or named like a disk (`*.qcow2`, `*.img`, `*.raw`); republished at `to`
    /// (`--path`), else at `/disk/<its name>`.
    Archive { to: Option<String> },
}

impl Selection {
    /// Where the disk at `path` (clean) goes, if it is the disk.
    fn target(&self, path: &str) -> Option<String> {
        match self {
            Selection::Image { wanted } => {
                is_disk_path(path, wanted.as_deref()).then(|| wanted.clone().unwrap_or(path.into()))
            }
            Selection::Archive { to } => {
                let name = path.rsplit('/').next().unwrap_or(path);
                (is_disk_path(path, None) || artifact::names_disk(name)).then(|| {
                    to.clone()
                        .unwrap_or_else(|| format!("{}{name}", crate::format::layout::DISK_DIRS[0]))
                })
            }
        }
    }
}

/// The disk found in a source layer and republished: the layer, its path and size.
type ConvertedLayer = (BuiltLayer, String, u64);

/// Looks for the disk in a source tar `stream` and, if it is there, republishes it. The caller
/// reads the source blob to its end afterwards, so its digest is checked before anything is
/// tagged.
fn convert_tar(
    stream: impl std::io::Read,
    selection: Selection,
    chunks: ChunkingOptions,
    sink: SegmentSink,
) -> Result<(Option<ConvertedLayer>, Option<Digest>, SegmentSink)> {
    let mut found = None;
    let mut sink = Some(sink);
    let mut archive = tar::Archive::new(stream);
    let entries = archive
        .entries()
        .map_err(|e| Error::io("reading the source layer", e))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| Error::io("reading the source layer", e))?;
        let raw_path = entry
            .path()
            .map_err(|e| Error::io("source layer entry name", e))?
            .to_string_lossy()
            .into_owned();
        let target = clean_path(&raw_path)
            .ok()
            .filter(|_| found.is_none())
            .filter(|_| entry.header().entry_type() == tar::EntryType::Regular)
            .and_then(|path| selection.target(&path));
        let Some(target_path) = target else {
            std::io::copy(&mut entry, &mut std::io::sink())
                .map_err(|e| Error::io("reading the source layer", e))?;
            continue;
        };
        let size = entry.size();
        let mtime = source_date(entry.header().mtime().unwrap_or(0));
        let (dirs, file) = disk_entries(&target_path, mtime);
        let content = LayerContent {
            dirs,
            file,
            size,
            reader: &mut entry,
        };
        let (built, s) = build_layer(content, chunks, sink.take().expect("one disk per layer"))?;
        sink = Some(s);
        found = Some((built, target_path, size));
    }
    let digest = found.as_ref().map(|(b, _, _)| b.summary.digest);
    Ok((found, digest, sink.expect("sink returned")))
}

/// Reads the rest of a source blob, so its reader checks its digest.
fn read_to_end(blob: &mut impl std::io::Read) -> Result<()> {
    std::io::copy(blob, &mut std::io::sink())
        .map(|_| ())
        .map_err(|e| Error::io("verifying the source layer", e))
}

/// Looks for the disk in one source image layer and, if it is there, republishes it.
fn convert_layer(
    blob: crate::registry::BlobReader,
    compression: oci::LayerCompression,
    wanted: Option<String>,
    chunks: ChunkingOptions,
    sink: SegmentSink,
) -> Result<(Option<ConvertedLayer>, Option<Digest>, SegmentSink)> {
    let mut blob = blob;
    let decoder = crate::format::layer_decoder(compression, &mut blob)?;
    let converted = convert_tar(decoder, Selection::Image { wanted }, chunks, sink)?;
    if converted.0.is_some() {
        read_to_end(&mut blob)?;
    }
    Ok(converted)
}

/// Republishes the disk of one source image (single platform) in the lazy layout.
async fn convert_image(
    client: &RegistryClient,
    source: &Reference,
    manifest: &Manifest,
    target: &Reference,
    platform: &Platform,
    opts: &PublishOptions,
) -> Result<(Published, Vec<u8>)> {
    let wanted = opts
        .path
        .as_deref()
        .map(|p| layer_path(Some(p), ""))
        .transpose()?;
    for layer in manifest.layers.iter().rev() {
        let Some(compression) = oci::layer_compression(&layer.media_type) else {
            continue;
        };
        let chunks = chunking(opts);
        let found = with_restarts(client, || {
            let wanted = wanted.clone();
            async move {
                let blob = client.blob_reader(source, layer).await?;
                upload_streamed(client, target, None, move |sink| {
                    convert_layer(blob, compression, wanted, chunks, sink)
                })
                .await
            }
        })
        .await
        .context(format!("converting layer {} of {source}", layer.digest))?;
        if let Some(found) = found {
            return finish_converted(client, source, target, found, platform, opts).await;
        }
    }
    let place = opts
        .path
        .clone()
        .unwrap_or_else(|| "/disk/ or /image/".into());
    Err(Error::new(
        ErrorKind::NotFound,
        format!(
            "{source} ({platform}) has no regular file under {place}; name the disk with --path"
        ),
    ))
}

/// Config and manifest for a disk republished from `source`, once its format is known.
async fn finish_converted(
    client: &RegistryClient,
    source: &Reference,
    target: &Reference,
    (built, path, size): ConvertedLayer,
    platform: &Platform,
    opts: &PublishOptions,
) -> Result<(Published, Vec<u8>)> {
    let (format, virtual_size) =
        disk_facts_from_head(&built.head, size).context(format!("{path} in {source}"))?;
    finish_disk(
        client,
        target,
        &built,
        path,
        (format, virtual_size, size),
        platform,
        opts,
    )
    .await
}

/// What reading a disk artifact's disk layer gave.
enum FromArtifact {
    /// A disk found in an archive, republished.
    Converted(Box<ConvertedLayer>),
    /// The layer is the disk file itself, decompressed into this file (its size goes into the
    /// tar header before its content, so it must be known first).
    Spooled(tempfile::TempPath),
    /// An archive without a disk.
    Missing,
}

/// Most bytes of a tar header block, which tells a tar from a disk.
const TAR_BLOCK: usize = 512;

/// Writes `stream` into `file`, leaving holes where whole 1 MiB blocks are zero (a raw disk is
/// mostly zeros).
fn spool(mut stream: impl std::io::Read, file: &mut std::fs::File) -> Result<u64> {
    use std::io::{Seek, SeekFrom, Write};
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let mut filled = 0;
        while filled < buf.len() {
            match stream.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("reading the artifact's disk", e)),
            }
        }
        if filled == 0 {
            break;
        }
        let write = if buf[..filled].iter().all(|&b| b == 0) {
            file.seek(SeekFrom::Current(filled as i64)).map(|_| ())
        } else {
            file.write_all(&buf[..filled])
        };
        write.map_err(|e| Error::io("writing the decompressed disk", e))?;
        size += filled as u64;
    }
    file.set_len(size)
        .map_err(|e| Error::io("writing the decompressed disk", e))?;
    Ok(size)
}

/// Reads the disk layer `blob` of a disk artifact: decompressed as its first bytes say; a tar
/// (the peer-pod `podvm.tar.xz`) is searched for the disk, which is republished as it is read,
/// anything else is the disk itself and is decompressed into a temporary file.
fn read_artifact_layer(
    blob: crate::registry::BlobReader,
    to: Option<String>,
    chunks: ChunkingOptions,
    sink: SegmentSink,
) -> Result<(FromArtifact, Option<Digest>, SegmentSink)> {
    use std::io::{BufRead, Read};
    let mut blob = std::io::BufReader::with_capacity(64 << 10, blob);
    let head = blob
        .fill_buf()
        .map_err(|e| Error::io("reading the artifact's layer", e))?;
    let mut stream = artifact::Codec::sniff(head).decoder(&mut blob)?;
    let mut first = Vec::with_capacity(TAR_BLOCK);
    (&mut stream)
        .take(TAR_BLOCK as u64)
        .read_to_end(&mut first)
        .map_err(|e| Error::io("reading the artifact's layer", e))?;
    let is_tar = first.len() == TAR_BLOCK && &first[257..262] == b"ustar";
    let stream = std::io::Cursor::new(first).chain(stream);
    if is_tar {
        let (found, digest, sink) = convert_tar(stream, Selection::Archive { to }, chunks, sink)?;
        if found.is_some() {
            read_to_end(&mut blob)?;
        }
        let found = found.map_or(FromArtifact::Missing, |f| {
            FromArtifact::Converted(Box::new(f))
        });
        return Ok((found, digest, sink));
    }
    let mut file = tempfile::NamedTempFile::new()
        .map_err(|e| Error::io("creating a temporary file for the disk (TMPDIR)", e))?;
    spool(stream, file.as_file_mut())?;
    read_to_end(&mut blob)?;
    Ok((FromArtifact::Spooled(file.into_temp_path()), None, sink))
}

/// Republishes the disk of disk artifact `manifest` (one platform): its disk file, compressed
/// with gzip, xz or zstd or not at all, or the disk in a tar archive it carries (the upstream
/// peer-pod images' `podvm.tar.xz`). The disk goes to `--path`, else `/disk/<its name>`.
async fn convert_artifact(
    client: &RegistryClient,
    source: &Reference,
    manifest: &Manifest,
    target: &Reference,
    platform: &Platform,
    opts: &PublishOptions,
) -> Result<(Published, Vec<u8>)> {
    let Some(layer) = artifact::disk_source(manifest) else {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!("{source} is an OCI artifact with no layer holding a disk (a *.qcow2, *.img or *.raw file, an archive such as *.tar.xz, or a disk media type)"),
        ));
    };
    let desc = layer.layer;
    let to = opts
        .path
        .as_deref()
        .map(|p| layer_path(Some(p), ""))
        .transpose()?;
    let chunks = chunking(opts);
    let read = with_restarts(client, || {
        let to = to.clone();
        async move {
            let blob = client.blob_reader(source, desc).await?;
            upload_streamed(client, target, None, move |sink| {
                read_artifact_layer(blob, to, chunks, sink)
            })
            .await
        }
    })
    .await
    .context(format!("converting layer {} of {source}", desc.digest))?;
    match read {
        FromArtifact::Converted(found) => {
            finish_converted(client, source, target, *found, platform, opts).await
        }
        FromArtifact::Spooled(file) => {
            let path = to.unwrap_or_else(|| {
                format!(
                    "{}{}",
                    crate::format::layout::DISK_DIRS[0],
                    artifact::file_name(&layer)
                )
            });
            let opts = PublishOptions {
                path: Some(format!("/{path}")),
                ..opts.clone()
            };
            push_disk(client, target, file.to_path_buf(), platform, &opts)
                .await
                .context(format!("the disk of {source}"))
        }
        FromArtifact::Missing => Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "the archive {} of {source} holds no file under /disk/ or /image/ or named *.qcow2, *.img or *.raw",
                desc.annotations
                    .get(artifact::ANN_TITLE)
                    .cloned()
                    .unwrap_or_else(|| desc.digest.to_string())
            ),
        )),
    }
}

/// Republishes one manifest of `source`: an image's disk layer, or a disk artifact's disk.
async fn convert_manifest(
    client: &RegistryClient,
    source: &Reference,
    manifest: &Manifest,
    target: &Reference,
    platform: &Platform,
    opts: &PublishOptions,
) -> Result<(Published, Vec<u8>)> {
    if artifact::is_artifact(manifest) {
        convert_artifact(client, source, manifest, target, platform, opts).await
    } else {
        convert_image(client, source, manifest, target, platform, opts).await
    }
}

/// `vmdisk convert`: republishes every platform of `source` at `target` in the lazy layout.
/// `platform` is the platform of a source that names none (a disk artifact with an empty
/// config).
pub async fn convert(
    client: &RegistryClient,
    source: &Reference,
    target: &Reference,
    opts: &PublishOptions,
    platform: &Platform,
) -> Result<Digest> {
    check_target(target)?;
    let fetched = client.get_manifest(source).await?;
    // Pre-flight: reach the target with push rights before any layer is streamed, so an
    // unreachable registry or refused credentials fail at once rather than after restarts.
    client
        .blob_exists(target, &Digest::of(b""))
        .await
        .context(format!("checking access to {target}"))?;
    let mut images = Vec::new();
    match fetched.manifest {
        ManifestKind::Image(m) => {
            let config = client
                .get_blob(source, &m.config, oci::MAX_CONFIG_SIZE)
                .await?;
            let named = if artifact::is_artifact(&m) {
                oci::config_platform(&config)
            } else {
                let cfg: ImageConfig = serde_json::from_slice(&config)
                    .map_err(|e| Error::corrupt(format!("image config of {source}: {e}")))?;
                Some(Platform {
                    os: cfg.os,
                    architecture: cfg.architecture,
                    variant: cfg.variant,
                })
            };
            let platform = named.unwrap_or_else(|| {
                tracing::warn!(%source, %platform, "the source names no platform; publishing it for the one given (--platform)");
                platform.clone()
            });
            images.push(convert_manifest(client, source, &m, target, &platform, opts).await?);
        }
        ManifestKind::Index(index) => {
            for desc in &index.manifests {
                let Some(platform) = desc.platform.clone().filter(|p| p.os != "unknown") else {
                    continue;
                };
                let child = client
                    .get_manifest(&source.with_digest(desc.digest))
                    .await?;
                let ManifestKind::Image(m) = child.manifest else {
                    return Err(Error::unsupported(format!(
                        "{source}: nested index {} is not supported",
                        desc.digest
                    )));
                };
                images.push(convert_manifest(client, source, &m, target, &platform, opts).await?);
            }
        }
    }
    tag_images(client, target, &images).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_archive_s_disk_is_chosen_by_name_and_placed_under_disk() {
        let archive = Selection::Archive { to: None };
        assert_eq!(
            archive.target("podvm-fedora-amd64.qcow2").as_deref(),
            Some("disk/podvm-fedora-amd64.qcow2")
        );
        // Nested names keep only the file name; anything not named like a disk is skipped.
        assert_eq!(
            archive.target("out/images/guest.img").as_deref(),
            Some("disk/guest.img")
        );
        assert_eq!(archive.target("README.md"), None);
        assert_eq!(archive.target("podvm.sha256"), None);
        let to = Selection::Archive {
            to: Some("image/podvm.qcow2".into()),
        };
        assert_eq!(
            to.target("podvm-x.qcow2").as_deref(),
            Some("image/podvm.qcow2")
        );
        // An image layer: only the disk directories, or the named path.
        let image = Selection::Image { wanted: None };
        assert_eq!(image.target("guest.qcow2"), None);
        assert_eq!(
            image.target("disk/guest.qcow2").as_deref(),
            Some("disk/guest.qcow2")
        );
        // Unsafe names never reach the selection: convert_tar cleans them first.
        assert!(clean_path("../../etc/x.qcow2").is_err());
    }

    #[test]
    fn parents_are_listed_outermost_first() {
        let (dirs, file) = disk_entries("a/b/c.qcow2", 5);
        assert_eq!(
            dirs.iter().map(|d| d.path.as_str()).collect::<Vec<_>>(),
            ["a", "a/b"]
        );
        assert_eq!(
            (file.path.as_str(), file.mode, file.uid, file.mtime),
            ("a/b/c.qcow2", 0o644, 107, 5)
        );
    }
}
