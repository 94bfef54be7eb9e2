//! `vmdisk`: the producer and operator CLI. All logic lives in the library (`vmdisk::cli`).

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = vmdisk::cli::Cli::parse();
    // fuser warns about its own second unmount attempt after ours; keep it at error unless asked.
    let directives = if cli.log_level.contains("fuser") {
        cli.log_level.clone()
    } else {
        format!("{},fuser=error", cli.log_level)
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&directives)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,fuser=error"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vmdisk: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(vmdisk::cli::run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vmdisk: error: {}", e.chain());
            std::process::ExitCode::FAILURE
        }
    }
}
