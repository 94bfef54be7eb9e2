//! `vmdisk`: the producer and operator CLI. All logic lives in the library (`vmdisk::cli`).

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = vmdisk::cli::Cli::parse();
    let directives = cli.log_level.clone();
    vmdisk::cli::main_with("vmdisk", &directives, || vmdisk::cli::run(cli))
}
