//! The `vmdisk` command line: argument parsing and output. Each subcommand is a thin call into
//! the library; errors come back as [`Error`] and become one line on stderr and exit code 1.

mod args;
mod disks;
pub mod manpages;
mod preheat;
mod publishing;
mod serving;

pub use publishing::pair_platforms;

use self::args::{Cli, Command, ContainerdConfigArgs, TraceCommand};

use clap::Parser;

use crate::error::{Error, Result};
use crate::oci::Platform;

/// The command line, or the end of the process: help and version as clap prints them; a
/// refused command line as one `NAME: error: …` line (what was wrong, in the words of the
/// value's own parser: a reference, a size, a format), exit status 2.
pub fn parse_or_exit(name: &str) -> Cli {
    use clap::error::ErrorKind as Kind;
    match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e)
            if matches!(
                e.kind(),
                Kind::DisplayHelp
                    | Kind::DisplayVersion
                    | Kind::DisplayHelpOnMissingArgumentOrSubcommand
            ) =>
        {
            e.exit()
        }
        Err(e) => {
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or_default();
            eprintln!(
                "{name}: error: {} (see `{name} --help`)",
                first.trim_start_matches("error: ")
            );
            std::process::exit(2)
        }
    }
}

/// The body of each binary's `main`: logs as [`crate::logging`] says (an unknown level is
/// refused), runs `body` on a multi-threaded runtime, and prints an error as one line,
/// `NAME: error: context: cause`.
pub fn main_with<F>(
    name: &str,
    directives: &str,
    body: impl FnOnce() -> F,
) -> std::process::ExitCode
where
    F: std::future::Future<Output = Result<()>>,
{
    if let Err(e) = crate::logging::init(directives) {
        eprintln!("{name}: error: {}", e.chain());
        return std::process::ExitCode::FAILURE;
    }
    crate::task::return_large_buffers();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{name}: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(body());
    // The runtime is left to end with the process, not shut down: a shut-down runtime drops
    // its tasks at their next poll, and one that was hashing or writing a chunk on its worker
    // (block_in_place) when the command finished would then panic at its next timer. Whatever
    // must be durable the command made so before it returned (the cache is flushed on
    // unmount).
    std::mem::forget(runtime);
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: error: {}", e.chain());
            std::process::ExitCode::FAILURE
        }
    }
}

/// `vmdisk containerd-config`.
async fn containerd_config(args: ContainerdConfigArgs) -> Result<()> {
    use crate::setup::{Release, Setup};
    let current = match std::fs::read_to_string(&args.config) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(Error::io(format!("reading {}", args.config.display()), e)),
    };
    let (release, version) = match &args.release {
        Some(r) => (Release::of_version(r)?, r.clone()),
        None => crate::setup::node_release(&args.containerd, &current).await?,
    };
    let setup = match args.only_handlers {
        true => Setup::Handlers,
        false => Setup::AllImages,
    };
    let platform = Platform::host().to_string();
    let daemon = crate::setup::Daemon {
        socket: &args.address,
        root: &args.root,
    };
    let merged = crate::setup::merge(&current, release, setup, daemon, &platform)
        .map_err(|e| e.context(args.config.display().to_string()))?;
    if args.dry_run {
        let path = args.config.display().to_string();
        print!(
            "{}",
            similar::TextDiff::from_lines(&current, &merged)
                .unified_diff()
                .header(&path, &path)
        );
        return Ok(());
    }
    if !args.write {
        print!("{merged}");
        return Ok(());
    }
    if merged == current {
        println!(
            "{} already sets containerd {version} up for vmdisk",
            args.config.display()
        );
        return Ok(());
    }
    let backup = crate::setup::write_config(&args.config, &merged)?;
    let kept = backup.map_or(String::new(), |b| {
        format!("; the original is kept as {}", b.display())
    });
    println!(
        "wrote {} for containerd {version} ({}){kept}; restart containerd to use it",
        args.config.display(),
        match setup {
            Setup::AllImages => "vmdisk is the snapshotter for every image",
            Setup::Handlers => "vmdisk for the VM runtime handlers",
        }
    );
    Ok(())
}

/// Runs a parsed command; what it prints goes to stdout.
pub async fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Push(args) => publishing::push(args).await,
        Command::Convert(args) => publishing::convert(args).await,
        Command::Index(args) => publishing::index(args).await,
        Command::Inspect(args) => publishing::inspect(args).await,
        Command::Mount(args) => serving::mount(args).await,
        Command::Trace(TraceCommand::Record(args)) => serving::trace_record(args).await,
        Command::Path(args) => disks::path(args).await,
        Command::Prefetch(args) => disks::prefetch(args).await,
        Command::Preheat(args) => preheat::preheat(args).await,
        Command::Rm(args) => disks::rm(args).await,
        Command::Gc(args) => disks::gc(args).await,
        Command::Stats(args) => disks::stats(args).await,
        Command::Ls(args) => disks::ls(args).await,
        Command::ContainerdConfig(args) => containerd_config(args).await,
        Command::GenerateMan { dir } => {
            for page in manpages::write_all(&dir)? {
                println!("{}", page.display());
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::args::*;
    use super::*;
    use crate::format::disk::DiskFormat;
    use crate::oci::Platform;

    #[test]
    fn every_argument_of_every_command_is_described() {
        use clap::CommandFactory;
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                if sub.get_about().is_none() {
                    missing.push(format!("{path} {} (the command)", sub.get_name()));
                }
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "vmdisk", &mut missing);
        assert!(missing.is_empty(), "undescribed: {missing:?}");
    }

    #[test]
    fn pairs_platforms_with_files() {
        let p = |v: &[&str]| {
            v.iter()
                .map(|x| Platform::parse(x).unwrap())
                .collect::<Vec<_>>()
        };
        let f = |v: &[&str]| v.iter().map(PathBuf::from).collect::<Vec<_>>();
        let one = pair_platforms(&[], &f(&["a.qcow2"])).unwrap();
        assert_eq!(one[0].0, Platform::host());
        let two = pair_platforms(&p(&["linux/amd64", "linux/arm64"]), &f(&["a", "b"])).unwrap();
        assert_eq!(two[1].0.architecture, "arm64");
        assert!(pair_platforms(&p(&["linux/amd64"]), &f(&["a", "b"])).is_err());
        assert!(pair_platforms(&p(&["linux/amd64", "linux/amd64"]), &f(&["a", "b"])).is_err());
    }

    #[test]
    fn parses_push_arguments() {
        let cli = Cli::try_parse_from([
            "vmdisk",
            "push",
            "--platform",
            "linux/amd64",
            "a.qcow2",
            "--platform",
            "linux/arm64",
            "b.qcow2",
            "--chunk-size",
            "1M",
            "--format",
            "raw",
            "r.example/vm:1",
        ])
        .unwrap();
        let Command::Push(p) = cli.command else {
            panic!("not push")
        };
        assert_eq!(p.platforms[1].architecture, "arm64");
        let (files, target) = p.operands().unwrap();
        assert_eq!(files, [PathBuf::from("a.qcow2"), PathBuf::from("b.qcow2")]);
        assert_eq!(target.to_string(), "r.example/vm:1");
        assert_eq!((p.chunk_size, p.format), (1 << 20, Some(DiskFormat::Raw)));
        // Each value is checked as it is parsed, naming what was wrong.
        let refused = |args: &[&str]| {
            let mut all = vec!["vmdisk", "push"];
            all.extend(args);
            Cli::try_parse_from(all).unwrap_err().to_string()
        };
        assert!(refused(&[]).contains("required"));
        let operands = |args: &[&str]| {
            let mut all = vec!["vmdisk", "push"];
            all.extend(args);
            let Command::Push(p) = Cli::try_parse_from(all).unwrap().command else {
                panic!("not push")
            };
            p.operands().unwrap_err().to_string()
        };
        assert!(operands(&["a.qcow2"]).contains("at least one disk file and an image reference"));
        assert!(operands(&["a.qcow2", "Not A Reference"]).contains("Not A Reference"));
        assert!(refused(&["--chunk-size", "100K", "a", "r.example/vm:1"]).contains("power of two"));
        assert!(refused(&["--format", "ova", "a", "r.example/vm:1"])
            .contains("detected and converted without it"));
        assert!(refused(&["--platform", "linux", "a", "r.example/vm:1"]).contains("linux"));
    }
}
