//! `vmdisk`: the producer and operator CLI. All logic lives in the library (`vmdisk::cli`).

fn main() -> std::process::ExitCode {
    let cli = vmdisk::cli::parse_or_exit("vmdisk");
    let directives = cli.log_level.clone();
    vmdisk::cli::main_with("vmdisk", &directives, || vmdisk::cli::run(cli))
}
