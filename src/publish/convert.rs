//! `vmdisk convert` of an image: the disk found in a source layer's tar (or an artifact's
//! archive, [`super::from_artifact`]) and republished in the lazy layout as it is read.

use super::conversion::Conversion;
use super::pipeline::{build_layer, BuiltLayer, ChunkingOptions, LayerContent};
use super::upload::{upload_streamed, with_restarts, SegmentSink};
use super::Published;
use super::{chunking, disk_entries, disk_facts_from_head, finish_disk, source_date};
use crate::error::{Error, ErrorKind, Result, ResultExt};
use crate::format::artifact;
use crate::format::layout::is_disk_path;
use crate::format::tree::clean_path;
use crate::oci::digest::Digest;
use crate::oci::{self, Descriptor, Manifest, Platform};
use crate::registry::BlobReader;

/// A source layer's blob as a conversion reads it, its bytes counted as done.
pub(super) type SourceBlob = crate::progress::Counted<BlobReader>;

/// Which file of a source tar is the disk, and where it goes.
#[derive(Clone, Debug)]
pub(super) enum Selection {
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
pub(super) type ConvertedLayer = (BuiltLayer, String, u64);

/// Looks for the disk in a source tar `stream` and, if it is there, republishes it. The caller
/// reads the source blob to its end afterwards, so its digest is checked before anything is
/// tagged.
pub(super) fn convert_tar(
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
pub(super) fn read_to_end(blob: &mut impl std::io::Read) -> Result<()> {
    std::io::copy(blob, &mut std::io::sink())
        .map(|_| ())
        .map_err(|e| Error::io("verifying the source layer", e))
}

/// Looks for the disk in one source image layer and, if it is there, republishes it.
fn convert_layer(
    blob: SourceBlob,
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
pub(super) async fn convert_image(
    job: &Conversion<'_>,
    manifest: &Manifest,
    platform: &Platform,
) -> Result<(Published, Vec<u8>)> {
    let (source, opts) = (job.source, job.opts);
    let wanted = opts.placement()?;
    let chunks = chunking(opts);
    for layer in manifest.layers.iter().rev() {
        let Some(compression) = oci::layer_compression(&layer.media_type) else {
            continue;
        };
        let wanted = wanted.clone();
        let found = republish_layer(job, layer, move |blob, sink| {
            convert_layer(blob, compression, wanted.clone(), chunks, sink)
        })
        .await?;
        if let Some(found) = found {
            return finish_converted(job, found, platform).await;
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

/// Reads source layer `layer` of `job` into `build` on a blocking thread, which streams what it
/// builds into a new blob of the target; started again whole after a broken request
/// ([`with_restarts`]).
pub(super) async fn republish_layer<T, F>(
    job: &Conversion<'_>,
    layer: &Descriptor,
    build: F,
) -> Result<T>
where
    T: Send + 'static,
    F: Fn(SourceBlob, SegmentSink) -> Result<(T, Option<Digest>, SegmentSink)>
        + Clone
        + Send
        + 'static,
{
    let (client, source, target) = (job.client, job.source, job.target);
    let progress = &job.opts.progress;
    progress.set_total(layer.size);
    with_restarts(client, || {
        let build = build.clone();
        async move {
            let blob = client.blob_reader(source, layer).await?;
            // Read from the start (again, after a broken upload).
            progress.set(0);
            let blob = progress.reader(blob);
            upload_streamed(client, target, None, move |sink| build(blob, sink)).await
        }
    })
    .await
    .context(format!("converting layer {} of {source}", layer.digest))
}

/// Config and manifest for a disk republished from `source`, once its format is known.
pub(super) async fn finish_converted(
    job: &Conversion<'_>,
    (built, path, size): ConvertedLayer,
    platform: &Platform,
) -> Result<(Published, Vec<u8>)> {
    let (client, source, target, opts) = (job.client, job.source, job.target, job.opts);
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
}
