//! Publishing VM disks as lazily loadable containerDisks: `vmdisk push` and `vmdisk convert`.
//!
//! An image we publish is an ordinary OCI image with one zstd:chunked layer holding the disk
//! (`/disk/<name>`, uid/gid 107, mode 0644, as KubeVirt expects, or any `--path`). The layer
//! carries the TOC annotations and our `containerd.io/snapshot/vmdisk.*` annotations, which
//! containerd hands to snapshotters as labels. Blobs stream straight into the registry; the
//! tag is written last, so a failed push leaves nothing tagged.
//!
//! Here: `push` and the image it writes (config, manifest, tag or index), and `convert`'s walk
//! over the source's platforms. A source image's layers are searched in [`convert`], a disk
//! artifact's disk in [`from_artifact`]; the layer is built by [`pipeline`] and streamed into
//! the registry by [`upload`]; `vmdisk index` is [`index`].

mod conversion;
mod convert;
mod cuts;
mod from_artifact;
pub mod index;
pub mod pipeline;
pub mod republish;
mod upload;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;

use self::pipeline::{build_layer, BuiltLayer, ChunkingOptions, LayerContent};
use self::upload::{upload_streamed, with_restarts};
use crate::error::{Error, ErrorKind, Result, ResultExt};
use crate::format::disk::{self, DiskFormat};
use crate::format::layout::{
    layer_path, ANN_CHUNK_SIZE, ANN_DISK_DIGEST, ANN_DISK_SIZE, ANN_FORMAT, ANN_PATH, ANN_PREFIX,
    ANN_TOC_DIGEST, ANN_TOC_POSITION, ANN_VIRTUAL_SIZE, LABEL_PREFIX,
};
use crate::format::zstd_chunked::{EntryMeta, TocLocation};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::{self, Descriptor, ImageConfig, Manifest, Platform, RootFs};
use crate::registry::RegistryClient;

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
    /// Counts the bytes of the disk (push) or of the source layer (convert) read.
    pub progress: crate::progress::Progress,
}

impl PublishOptions {
    /// `--path` as a path in the layer, if given.
    fn placement(&self) -> Result<Option<String>> {
        self.path
            .as_deref()
            .map(|p| layer_path(Some(p), ""))
            .transpose()
    }
}

impl Default for PublishOptions {
    fn default() -> Self {
        PublishOptions {
            path: None,
            chunk_size: DEFAULT_CHUNK_SIZE,
            level: DEFAULT_LEVEL,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            format: None,
            progress: crate::progress::Progress::off(),
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
    opts.progress.set_total(size);
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
        let progress = opts.progress.clone();
        async move {
            let upload = match started {
                Some(upload) => upload,
                None => client.start_upload(target).await?,
            };
            upload_streamed(client, target, Some(upload), move |sink| {
                let reader = std::fs::File::open(&disk.path)
                    .map_err(|e| Error::io(format!("opening {}", disk.path.display()), e))?;
                // Read from the start (again, after a broken upload).
                progress.set(0);
                let reader = progress.reader(reader);
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

#[cfg(test)]
mod tests {
    use super::*;

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
