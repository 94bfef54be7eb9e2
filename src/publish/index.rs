//! `vmdisk index`: makes an ordinary (gzip or uncompressed) disk image, or a disk artifact,
//! lazily loadable without republishing it. Its disk layer is read once, streaming, and a
//! seekable index ([`crate::format::seekable`]) is published as an OCI 1.1 artifact whose
//! `subject` is the image's platform manifest: in the image's repository, or with `--to` in
//! another one (which the daemon's `[registry] index_repositories` then lists). The image is
//! not touched, so its digest and signatures stay valid.

use serde::Serialize;

use crate::error::{Error, Result};
use crate::format::disk::{self, DiskFormat};
use crate::format::seekable::{self, Layout};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::Descriptor;
use crate::registry::RegistryClient;
use crate::resolve;

/// What `vmdisk index` did.
#[derive(Debug, Serialize)]
pub struct IndexReport {
    /// The image manifest indexed (the artifact's subject).
    pub manifest: Digest,
    pub layer: Digest,
    pub layer_size: u64,
    pub compression: seekable::Compression,
    /// `tar` (an image layer) or `file` (a disk artifact's disk).
    pub layout: Layout,
    /// The uncompressed stream's size.
    pub stream_size: u64,
    pub disk: String,
    pub span_size: u64,
    pub spans: usize,
    /// The index blob's size, its windows blob's (gzip layers), and where the artifact went.
    pub index_size: u64,
    pub windows_size: u64,
    pub repository: String,
    pub artifact: Digest,
    pub seconds: f64,
}

/// The path of the disk in the indexed layer `layer` of `reference`: the one its artifact
/// record names (which must hold a qcow2 or raw disk), or the first regular file under
/// `disk/` or `image/` of its tar.
fn disk_of(
    built: &seekable::build::Built,
    disk_path: Option<String>,
    layer: &crate::oci::digest::Digest,
    reference: &Reference,
) -> Result<String> {
    Ok(match disk_path {
        Some(path) => {
            match disk::identify(&built.head, built.index.stream_size) {
                Ok((Some(DiskFormat::Qcow2 | DiskFormat::Raw), _)) => {}
                Ok((other, _)) => return Err(Error::unsupported(format!(
                    "layer {layer} of {reference} is not a qcow2 or raw disk ({}): nothing to index",
                    other.map_or("not recognised", |f| f.name())
                ))),
                Err(e) => return Err(e.context(format!("the disk in layer {layer} of {reference}"))),
            }
            path
        }
        None => built
            .index
            .disk_entry()
            .ok_or_else(|| {
                Error::unsupported(format!(
                    "layer {layer} of {reference} has no regular file under /disk/ or /image/: not a disk image"
                ))
            })?
            .name
            .clone(),
    })
}

/// Indexes `reference`'s disk layer with spans of `span_size` and publishes the index to
/// `to` (a repository), or beside the image. The disk layer is an image's topmost gzip or
/// uncompressed tar layer, or a disk artifact's disk file (whose compression its bytes tell).
pub async fn index(
    client: &RegistryClient,
    reference: &Reference,
    to: Option<&Reference>,
    span_size: u64,
    progress: &crate::progress::Progress,
) -> Result<IndexReport> {
    let started = std::time::Instant::now();
    let (manifest, manifest_digest, _) =
        resolve::platform_manifest(client, None, reference).await?;
    if resolve::disk_layer(&manifest).is_some() {
        return Err(Error::invalid(format!(
            "{reference} already has a lazily loadable zstd:chunked layer; it needs no index"
        )));
    }
    let target = resolve::index_target(client, None, reference, &manifest).await?;
    let (layer, expected, disk_path) = (target.layer, target.expected, target.disk_path);
    progress.set_total(layer.size);
    let blob = progress.reader(client.blob_reader(reference, layer).await?);
    // The windows (32 KiB a span) go to a file, not memory: a 50 GiB disk has 1.6 GiB of them.
    let windows_file = tempfile::NamedTempFile::new()
        .map_err(|e| Error::io("creating a temporary file for the windows (TMPDIR)", e))?;
    let windows_out = windows_file
        .reopen()
        .map_err(|e| Error::io("opening the windows file", e))?;
    let built = crate::task::blocking(move || {
        seekable::build::build(
            blob,
            &expected,
            span_size,
            std::io::BufWriter::with_capacity(1 << 20, windows_out),
        )
    })
    .await
    .map_err(|e| e.context(format!("indexing layer {} of {reference}", layer.digest)))?;
    let disk = disk_of(&built, disk_path, &layer.digest, reference)?;
    let built = built.index;
    let encoded = crate::task::blocking(move || Ok((built.encode()?, built))).await?;
    let (bytes, built) = encoded;
    let subject = client
        .get_manifest(&reference.with_digest(manifest_digest))
        .await?;
    let subject = Descriptor::of(&subject.media_type, &subject.bytes);
    let target = match to {
        Some(repo) => repo.clone(),
        None => Reference {
            tag: None,
            digest: None,
            ..reference.clone()
        },
    };
    let blob_desc = Descriptor::of(seekable::MEDIA_TYPE, &bytes);
    let index_size = bytes.len() as u64;
    let annotations = [(seekable::ANN_LAYER.to_string(), layer.digest.to_string())].into();
    let published = async {
        let mut layers = vec![blob_desc.clone()];
        if let Some(windows) = built.windows {
            client
                .push_blob_file(&target, &windows.digest, windows_file.path())
                .await?;
            layers.push(Descriptor {
                media_type: seekable::WINDOWS_MEDIA_TYPE.into(),
                digest: windows.digest,
                size: windows.size,
                ..Descriptor::of(seekable::WINDOWS_MEDIA_TYPE, b"")
            });
        }
        client
            .push_blob(&target, &blob_desc.digest, bytes.into())
            .await?;
        client
            .push_referrer(
                &target,
                subject,
                seekable::ARTIFACT_TYPE,
                layers,
                annotations,
            )
            .await
    };
    let artifact = published
        .await
        .map_err(|e| e.context(format!("publishing the index to {target}")))?;
    Ok(IndexReport {
        manifest: manifest_digest,
        layer: layer.digest,
        layer_size: layer.size,
        compression: built.compression,
        layout: built.layout,
        stream_size: built.stream_size,
        disk,
        span_size,
        spans: built.spans.len(),
        index_size,
        windows_size: built.windows.map_or(0, |w| w.size),
        repository: target.to_string(),
        artifact,
        seconds: started.elapsed().as_secs_f64(),
    })
}
