//! `vmdisk-snapshotter`: the containerd proxy snapshotter daemon. All logic lives in the
//! library (`vmdisk::snapshotter`).

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use vmdisk::snapshotter::config::Config;

/// containerd proxy snapshotter that serves VM-disk layers lazily.
#[derive(Parser, Debug)]
#[command(name = "vmdisk-snapshotter", version, about)]
struct Args {
    /// TOML configuration (config/vmdisk-snapshotter.toml documents every field).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// State directory (overrides `root`).
    #[arg(long, global = true, value_name = "DIR")]
    root: Option<PathBuf>,
    /// Snapshots API socket (overrides `address`).
    #[arg(long, value_name = "SOCK")]
    address: Option<PathBuf>,
    /// Log level or tracing filter (overrides `log_level`).
    #[arg(long, global = true, value_name = "LEVEL")]
    log_level: Option<String>,
    #[command(subcommand)]
    command: Option<Internal>,
}

#[derive(Subcommand, Debug)]
enum Internal {
    /// Internal: serve one remote layer's FUSE mount (started by the daemon).
    #[command(hide = true)]
    ServeLayer {
        #[arg(long)]
        reference: String,
        #[arg(long)]
        layer: String,
        /// A readable name for the ready-disk directory (the image reference pulled).
        #[arg(long)]
        alias: Option<String>,
        /// Read registry credentials (kubelet's) from stdin first.
        #[arg(long)]
        credentials_on_stdin: bool,
    },
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let mut config = match Config::load(args.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vmdisk-snapshotter: error: {}", e.chain());
            return std::process::ExitCode::FAILURE;
        }
    };
    if let Some(root) = args.root {
        config.root = root;
    }
    if let Some(address) = args.address {
        config.address = address;
    }
    if let Some(level) = args.log_level {
        config.log_level = level;
    }
    if let Err(e) = config.validate() {
        let source = args
            .config
            .as_ref()
            .map_or("the settings".to_string(), |p| p.display().to_string());
        eprintln!("vmdisk-snapshotter: error: {source}: {}", e.chain());
        return std::process::ExitCode::FAILURE;
    }
    // What the daemon and its mount servers create is private unless they say otherwise
    // (crate::dirs): no file of theirs is readable by other users.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    // h2 and tower log every connection at debug; keep them at warn unless asked.
    let directives = format!("{},h2=warn,tower=warn", config.log_level);
    vmdisk::cli::main_with("vmdisk-snapshotter", &directives, || async move {
        match args.command {
            None => vmdisk::snapshotter::daemon::run(config, args.config).await,
            Some(Internal::ServeLayer {
                reference,
                layer,
                alias,
                credentials_on_stdin,
            }) => {
                let layer = layer.parse()?;
                vmdisk::snapshotter::server::serve_layer(
                    &config,
                    &reference,
                    &layer,
                    alias.as_deref(),
                    credentials_on_stdin,
                )
                .await
            }
        }
    })
}
