//! `vmdisk convert` of a disk artifact (one platform): its disk file, compressed or not, or
//! the disk in a tar archive it carries (the upstream peer-pod images' `podvm.tar.xz`).

use super::conversion::Conversion;
use super::convert::{
    convert_tar, finish_converted, read_to_end, republish_layer, ConvertedLayer, Selection,
};
use super::pipeline::ChunkingOptions;
use super::upload::SegmentSink;
use super::{chunking, push_disk, PublishOptions, Published};
use crate::error::{Error, ErrorKind, Result, ResultExt};
use crate::format::artifact;
use crate::oci::digest::Digest;
use crate::oci::{Manifest, Platform};

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
    blob: super::convert::SourceBlob,
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
pub(super) async fn convert_artifact(
    job: &Conversion<'_>,
    manifest: &Manifest,
    platform: &Platform,
) -> Result<(Published, Vec<u8>)> {
    let (client, source, target, opts) = (job.client, job.source, job.target, job.opts);
    let Some(layer) = artifact::disk_source(manifest) else {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!("{source} is an OCI artifact with no layer holding a disk (a *.qcow2, *.img or *.raw file, an archive such as *.tar.xz, or a disk media type)"),
        ));
    };
    let desc = layer.layer;
    let to = opts.placement()?;
    let chunks = chunking(opts);
    let placed = to.clone();
    let read = republish_layer(job, desc, move |blob, sink| {
        read_artifact_layer(blob, placed.clone(), chunks, sink)
    })
    .await?;
    match read {
        FromArtifact::Converted(found) => {
            finish_converted(job, *found, platform).await
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
