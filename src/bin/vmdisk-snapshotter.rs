//! `vmdisk-snapshotter`: the containerd proxy snapshotter daemon. All logic lives in the
//! library (`vmdisk::snapshotter`).

use clap::Parser;
use vmdisk::snapshotter::args::{Args, Internal};
use vmdisk::snapshotter::config::Config;

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
    // A mount server runs below the daemon that started it, from before its threads exist.
    if let Some(Internal::ServeLayer {
        nice: Some(level), ..
    }) = &args.command
    {
        if let Err(e) = vmdisk::snapshotter::daemon::priority::lower_to(*level) {
            eprintln!("vmdisk-snapshotter: cannot run at nice level {level}: {e}");
        }
    }
    // A mount server leaves the daemon's pod, when asked, from before its threads exist.
    if matches!(args.command, Some(Internal::ServeLayer { .. })) && !config.server_cgroup.is_empty()
    {
        match vmdisk::snapshotter::mount_server::cgroup::leave_pod(&config.server_cgroup) {
            Ok(moved) => eprintln!(
                "vmdisk-snapshotter: serving from cgroup {} ({})",
                config.server_cgroup,
                moved.join(" ")
            ),
            Err(e) => eprintln!(
                "vmdisk-snapshotter: warning: cannot leave the daemon's cgroup for {}: {}; this disk is served only as long as the daemon's pod lives",
                config.server_cgroup,
                e.chain()
            ),
        }
    }
    vmdisk::cli::main_with("vmdisk-snapshotter", &directives, || async move {
        match args.command {
            None => vmdisk::snapshotter::daemon::run(config, args.config).await,
            Some(Internal::ServeLayer { layer, nice: _ }) => {
                vmdisk::snapshotter::mount_server::serve_layer(&config, layer).await
            }
        }
    })
}
