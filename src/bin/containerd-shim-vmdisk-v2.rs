//! `containerd-shim-vmdisk-v2`: hands a VM runtime a ready disk, then becomes the delegate
//! runtime's shim. All logic lives in the library (`vmdisk::shim`).

use std::os::unix::process::CommandExt;

fn main() -> std::process::ExitCode {
    let mut argv = std::env::args();
    let argv0 = argv.next().unwrap_or_default();
    let args: Vec<String> = argv.collect();
    // `-v` as containerd's own shims answer it; `-h` without reading any configuration.
    if matches!(args.as_slice(), [flag] if flag == "-v" || flag == "--version") {
        println!(
            "containerd-shim-vmdisk-v2:\n  Version: {}",
            env!("CARGO_PKG_VERSION")
        );
        return std::process::ExitCode::SUCCESS;
    }
    if matches!(args.as_slice(), [flag] if flag == "-h" || flag == "--help") {
        print!("{}", vmdisk::shim::HELP);
        return std::process::ExitCode::SUCCESS;
    }
    let config = std::env::var_os("VMDISK_SHIM_CONFIG")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| vmdisk::shim::DEFAULT_CONFIG.into());
    let bundle = std::env::current_dir().unwrap_or_default();
    let mut delegate = None;
    // containerd reads stdout for the address: logs go to stderr, and only at warn.
    let code = vmdisk::cli::main_with("containerd-shim-vmdisk-v2", "warn", || async {
        delegate = Some(vmdisk::shim::prepare(&argv0, &args, &bundle, &config).await?);
        Ok(())
    });
    let Some(delegate) = delegate else {
        return code;
    };
    // Become the delegate: same arguments, environment and working directory (the bundle).
    let err = std::process::Command::new(&delegate).args(&args).exec();
    eprintln!("containerd-shim-vmdisk-v2: cannot run the delegate {delegate}: {err}");
    std::process::ExitCode::FAILURE
}
