//! vmdisk: VM disks from container registries, loaded lazily.
//!
//! The library holds everything; the binaries in `src/bin` only parse arguments and call in.
//! - [`registry`]: the OCI distribution client (endpoints, auth, retries, verified fetches).
//! - [`format`]: layer and disk formats (zstd:chunked, tar-split, qcow2, disk detection).
//! - [`publish`]: building and pushing lazily loadable images (`vmdisk push`, `convert`).
//! - [`inspect`]: reading any image and describing how lazily loadable it is.
//! - [`cache`]: the persistent block cache (data files, presence bitmaps, eviction).
//! - [`resolve`], [`layer`], [`engine`], [`view`], [`serve`]: a lazily loaded layer, from image
//!   to chunk index to FUSE mount ([`serve::fuse`]); [`serve::ready`]: the ready-disk directory
//!   handed to runtimes; [`trace`]: boot traces, recorded once and fetched first at every cold
//!   start.
//! - [`snapshotter`]: the containerd proxy snapshotter daemon; [`api`]: its gRPC definitions.
//! - [`oci`] ([`oci::reference`], [`oci::digest`]), [`error`], [`units`], [`task`],
//!   [`retry`]: the shared vocabulary.

pub mod api;
pub mod blob;
pub mod cache;
pub mod cli;
pub mod dirs;
pub mod engine;
pub mod error;
pub mod format;
pub mod inspect;
pub mod layer;
#[cfg(test)]
mod layering;
pub mod logging;
pub mod oci;
pub mod policy;
pub mod progress;
pub mod publish;
pub mod registry;
pub mod resolve;
pub mod retry;
pub mod serve;
pub mod setup;
pub mod shim;
pub mod snapshotter;
pub mod task;
pub mod trace;
pub mod units;
pub mod view;
