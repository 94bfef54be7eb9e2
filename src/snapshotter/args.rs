//! `vmdisk-snapshotter`'s command line, in the library so its manual page is generated from
//! it (`vmdisk generate-man`).

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::oci::digest::Digest;

/// containerd proxy snapshotter that serves VM-disk layers lazily.
///
/// Serves containerd's snapshots API (a proxy plugin) on `address`, every ordinary layer as
/// containerd's overlayfs would and VM-disk layers as remote snapshots: mounted through FUSE,
/// fetched by HTTP Range and verified chunk by chunk into a persistent cache. It also serves
/// vmdisk's management API (the `vmdisk` node commands, the runtime shim) and, when
/// configured, kubelet's CRI image service. Settings: /etc/vmdisk/snapshotter.toml (every key
/// with its default in /usr/share/doc/vmdisk). See /usr/share/doc/vmdisk/snapshotter.md.
#[derive(Parser, Debug)]
#[command(name = "vmdisk-snapshotter", version)]
pub struct Args {
    /// TOML configuration (config/vmdisk-snapshotter.toml documents every field).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// State directory (overrides `root`).
    #[arg(long, global = true, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// Snapshots API socket (overrides `address`).
    #[arg(long, value_name = "SOCK")]
    pub address: Option<PathBuf>,
    /// Log level or tracing filter (overrides `log_level`).
    #[arg(long, global = true, value_name = "LEVEL")]
    pub log_level: Option<String>,
    #[command(subcommand)]
    pub command: Option<Internal>,
}

#[derive(Subcommand, Debug)]
pub enum Internal {
    /// Internal: serve one remote layer's FUSE mount (started by the daemon).
    #[command(hide = true)]
    ServeLayer {
        /// The layer's key (its paths under the root are named by it). What to serve — the
        /// daemon's plan —, its TLS roots and the registry credentials (kubelet's) are read
        /// from stdin, never from arguments (readable in /proc).
        #[arg(long)]
        layer: Digest,
        /// The nice level to run at, below the daemon's ([`super::daemon::priority`]).
        #[arg(long, allow_hyphen_values = true)]
        nice: Option<i32>,
    },
}
