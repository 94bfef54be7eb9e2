//! Layer and disk formats: what we write and what we read from registries.
//!
//! - [`zstd_chunked`]: the lazily loadable layer layout (containers/storage's zstd:chunked),
//!   its TOC, the writer used by `vmdisk push` and the reader used by everything that fetches.
//! - [`tarsplit`]: the tar-split metadata containers/storage uses to rebuild the tar stream.
//! - [`disk`]: recognising VM disk images by content, validating qcow2, unpacking OVA.
//! - [`qcow2`]: the qcow2 header and cluster tables.

pub mod disk;
pub mod qcow2;
pub mod tarsplit;
pub mod zstd_chunked;
