//! Layer and disk formats: what we write and what we read from registries.
//!
//! - [`tree`]: what every layer format yields, format-neutral: nodes, chunks, safe paths.
//! - [`toc`]: the TOC zstd:chunked and eStargz share, its parser and its validator.
//! - [`zstd_chunked`]: the lazily loadable layer layout (containers/storage's zstd:chunked),
//!   where its TOC is, the writer used by `vmdisk push` and the reader used by everything
//!   that fetches.
//! - [`layout`]: the vmdisk image layout: annotations, where the disk is, the verified decode
//!   of a chunk.
//! - [`seekable`]: the seekable index `vmdisk index` publishes for ordinary gzip and
//!   uncompressed layers and disk files; [`seekable::zran`]: deflate at block boundaries, which builds and reads it.
//! - [`artifact`]: disk artifacts, OCI artifacts whose layer is the disk file itself: what
//!   makes a manifest one, which layer is the disk, where it appears.
//! - [`estargz`]: eStargz layers, read lazily from their own TOC.
//! - [`tarsplit`]: the tar-split metadata containers/storage uses to rebuild the tar stream.
//! - [`disk`]: recognising VM disk images by content, validating qcow2, unpacking OVA.
//! - [`qcow2`]: the qcow2 header and cluster tables; [`qcow2_raw`]: the raw view through them.

pub mod artifact;
pub mod disk;
pub mod estargz;
pub mod layout;
pub mod qcow2;
pub mod qcow2_raw;
pub mod seekable;
pub mod tarsplit;
pub mod toc;
pub mod tree;
pub mod zstd_chunked;
pub mod zstd_frames;

/// A reader of the uncompressed tar stream of a layer blob read from `blob`.
pub fn layer_decoder<'a>(
    compression: crate::oci::LayerCompression,
    blob: impl std::io::Read + 'a,
) -> crate::error::Result<Box<dyn std::io::Read + 'a>> {
    use crate::oci::LayerCompression;
    Ok(match compression {
        LayerCompression::None => Box::new(blob),
        LayerCompression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(blob)),
        LayerCompression::Zstd => Box::new(
            zstd::stream::read::Decoder::new(blob)
                .map_err(|e| crate::error::Error::io("starting the zstd decoder", e))?,
        ),
    })
}
