//! The `vmdisk` command line: argument parsing and output. Each subcommand is a thin call into
//! the library; errors come back as [`Error`] and become one line on stderr and exit code 1.

pub mod manpages;

use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand};

use crate::api::vmdisk::v1::{DiskRequest, GcRequest, ListDisksRequest, StatusRequest};
use crate::digest::Digest;
use crate::error::{Error, ErrorKind, Result};
use crate::format::disk::DiskFormat;
use crate::oci::{Descriptor, Platform};
use crate::publish::{self, PublishOptions};
use crate::ready::Handed;
use crate::reference::Reference;
use crate::registry::{RegistryClient, RegistryConfig};
use crate::serve::{Hydrate, ServeOptions};

/// VM disks from container registries, loaded lazily.
#[derive(Parser, Debug)]
#[command(name = "vmdisk", version)]
pub struct Cli {
    /// Log level (error, warn, info, debug, trace) or a tracing filter.
    #[arg(long, global = true, default_value = "warn", env = "VMDISK_LOG")]
    pub log_level: String,
    #[command(subcommand)]
    pub command: Command,
}

/// How to reach registries (the commands that talk to them).
#[derive(Args, Debug, Clone)]
pub struct RegistryArgs {
    /// Speak plain HTTP to the registry (loopback registries always may).
    #[arg(long)]
    pub plain_http: bool,
    /// containerd hosts.toml directory for mirrors (certs.d layout).
    #[arg(long, value_name = "DIR", env = "VMDISK_HOSTS_DIR")]
    pub hosts_dir: Option<PathBuf>,
    /// Docker config file with credentials (default: REGISTRY_AUTH_FILE, $DOCKER_CONFIG, ~/.docker).
    #[arg(long, value_name = "FILE")]
    pub auth_file: Option<PathBuf>,
    /// A repository to look for seekable indexes in after the image's own (`index --to`);
    /// repeatable.
    #[arg(long = "index-repository", value_name = "REPO")]
    pub index_repositories: Vec<String>,
    /// Seconds a fetch from a registry (its tries and waits included) may take before the
    /// command fails naming what did not answer.
    #[arg(long, default_value_t = 60, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,
}

impl RegistryArgs {
    /// A client configured from these flags.
    pub fn client(&self) -> Result<RegistryClient> {
        RegistryClient::new(self.config()?)
    }

    /// The client settings these flags make.
    pub fn config(&self) -> Result<RegistryConfig> {
        Ok(RegistryConfig {
            plain_http: self.plain_http,
            hosts_dir: self.hosts_dir.clone(),
            auth_files: self.auth_file.clone().map(|f| vec![f]),
            index_repositories: self
                .index_repositories
                .iter()
                .map(|r| repository(r, "--index-repository"))
                .collect::<Result<_>>()?,
            retry: crate::retry::RetryPolicy {
                deadline: std::time::Duration::from_secs(self.timeout),
                ..Default::default()
            },
            ..RegistryConfig::default()
        })
    }
}

/// A signature policy the command enforces (beside the daemon's, for `path`).
#[derive(Args, Debug, Clone, Default)]
pub struct PolicyArgs {
    /// A containers-policy.json (as /etc/containers/policy.json): the image, and the seekable
    /// index it is read through, must satisfy it before anything of the disk is read.
    #[arg(long, value_name = "FILE")]
    pub policy: Option<PathBuf>,
}

impl PolicyArgs {
    /// The verifier of `--policy` (none: everything is accepted).
    pub fn verifier(&self) -> Result<crate::policy::Verifier> {
        match &self.policy {
            Some(path) => crate::policy::Verifier::load(&crate::policy::PolicyFiles {
                policy: path.clone(),
                ..Default::default()
            })
            .map_err(|e| e.context("--policy")),
            None => Ok(crate::policy::Verifier::none()),
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Publish VM disks (qcow2, raw; vmdk, vhdx, ova converted) as a lazily loadable containerDisk.
    Push(PushArgs),
    /// Republish an existing containerDisk, peer-pod image or disk artifact in the lazy layout.
    Convert(ConvertArgs),
    /// Show an image's layers, disks and whether they can be loaded lazily.
    Inspect(InspectArgs),
    /// Make an ordinary (gzip or uncompressed) disk image, or a disk artifact, lazily loadable
    /// without republishing it: read its disk layer once and publish a seekable index that
    /// refers to the image.
    Index(IndexArgs),
    /// Mount an image's disk layer read-only, fetching chunks as they are read (foreground).
    Mount(MountArgs),
    /// List the disks vmdisk-snapshotter serves lazily on this node.
    Ls(LsArgs),
    /// Make an image's disk ready on this node (manifest, TOC and the disk's head) and print
    /// its path.
    Path(PathArgs),
    /// Make an image's disk ready and fetch all of it in the background.
    Prefetch(PrefetchArgs),
    /// Forget a disk made ready by `path` or `prefetch` (its mount stops when unused).
    Rm(RefArgs),
    /// Stop unused mounts and evict unused cached layers down to the cache size.
    Gc(GcArgs),
    /// The daemon's version and counters.
    Stats(ManageArgs),
    /// Boot traces: what a boot reads, fetched first at every cold start.
    #[command(subcommand)]
    Trace(TraceCommand),
    /// Set this node's containerd up for vmdisk: merge the snippet for its release into its
    /// configuration file, keeping every other setting.
    ContainerdConfig(ContainerdConfigArgs),
    /// Write the manual pages (man1, man8) under DIR (for packaging).
    #[command(hide = true)]
    GenerateMan {
        /// Where the man1 and man8 directories go.
        dir: PathBuf,
    },
}

#[derive(Args, Debug)]
pub struct ContainerdConfigArgs {
    /// containerd's configuration file (created if missing).
    #[arg(
        long,
        default_value = "/etc/containerd/config.toml",
        value_name = "FILE"
    )]
    pub config: PathBuf,
    /// containerd's socket, asked for its version (if no containerd answers there: `containerd
    /// --version` on PATH, then the configuration file's `version`).
    #[arg(
        long,
        default_value = "/run/containerd/containerd.sock",
        value_name = "SOCK"
    )]
    pub containerd: PathBuf,
    /// containerd's release (1.6, 1.7 or 2), instead of asking containerd.
    #[arg(long, value_name = "RELEASE")]
    pub release: Option<String>,
    /// vmdisk for the VM runtime handlers only (kubevirt, vmdisk, vmdisk-peerpods; their pods
    /// need the io.containerd.cri.runtime-handler annotation), as the DaemonSet installs it;
    /// by default vmdisk is the snapshotter for every image.
    #[arg(long)]
    pub only_handlers: bool,
    /// vmdisk-snapshotter's snapshots socket.
    #[arg(
        long,
        default_value = "/run/vmdisk/snapshotter.sock",
        value_name = "SOCK"
    )]
    pub address: PathBuf,
    /// Write the file (the original kept once as FILE.vmdisk-backup); by default the merged
    /// configuration is printed.
    #[arg(long, conflicts_with = "dry_run")]
    pub write: bool,
    /// Print what writing would change, as a unified diff (nothing when nothing would).
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Subcommand, Debug)]
pub enum TraceCommand {
    /// Mount REF, run a boot against it and record which chunks of the disk it reads, in
    /// order; write the trace to a file and/or publish it beside the image.
    Record(TraceRecordArgs),
}

#[derive(Args, Debug)]
pub struct TraceRecordArgs {
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// Cache directory.
    #[arg(long, default_value = crate::cache::DEFAULT_ROOT)]
    pub cache: PathBuf,
    /// Write the trace (JSON, docs/format.md) to this file.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Publish the trace beside the image: an OCI artifact referring to its manifest.
    #[arg(long)]
    pub push: bool,
    /// An image reference (tag or digest).
    pub reference: String,
    /// The boot to record, run with VMDISK_DISK set to the mounted disk file (e.g. qemu with
    /// `-drive file=$VMDISK_DISK,format=qcow2,readonly=on`).
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// How to reach vmdisk-snapshotter.
#[derive(Args, Debug, Clone)]
pub struct ManageArgs {
    /// The daemon's management socket.
    #[arg(
        long,
        default_value = "/run/vmdisk/manage.sock",
        value_name = "SOCK",
        env = "VMDISK_MANAGE"
    )]
    pub manage: PathBuf,
    /// Seconds a call to the daemon may take before the command fails saying it did not
    /// answer.
    #[arg(long, default_value_t = 60, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    #[command(flatten)]
    pub daemon: ManageArgs,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct RefArgs {
    #[command(flatten)]
    pub daemon: ManageArgs,
    /// The reference the disk was made ready by (as `vmdisk ls` shows it).
    pub reference: String,
}

#[derive(Args, Debug)]
pub struct PathArgs {
    #[command(flatten)]
    pub daemon: ManageArgs,
    /// Print the raw view (`disk.raw`: what Kata boots) instead of the disk as published.
    #[arg(long)]
    pub raw: bool,
    /// Print the disk's libvirt volume (`<ready_dir>/volumes/<name>`, for a `dir` pool there):
    /// the qcow2 as published, or with `--raw` (or for a raw disk) the raw view. Its file name
    /// is the volume name a peer-pod config map names (`LIBVIRT_VOL_NAME`).
    #[arg(long)]
    pub volume: bool,
    /// Ask as a pod of this Kubernetes namespace does (the shim): the disk only if that
    /// namespace may pull the image (docs/threat-model.md). Default: the node's own credentials.
    #[arg(long, value_name = "NS")]
    pub namespace: Option<String>,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// An image reference (tag or digest).
    pub reference: String,
}

#[derive(Args, Debug)]
pub struct PrefetchArgs {
    #[command(flatten)]
    pub daemon: ManageArgs,
    /// Wait until the whole disk is cached and checked.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up after this many seconds (the hydration goes on).
    #[arg(long, value_name = "SECONDS", default_value_t = 3600)]
    pub wait_timeout: u64,
    /// Ask as a pod of this Kubernetes namespace does (see `vmdisk path --namespace`).
    #[arg(long, value_name = "NS")]
    pub namespace: Option<String>,
    /// An image reference (tag or digest).
    pub reference: String,
}

#[derive(Args, Debug)]
pub struct GcArgs {
    #[command(flatten)]
    pub daemon: ManageArgs,
    /// Evict down to this size (e.g. 20G; 0 evicts every cached layer no mount uses) instead
    /// of the configured cache.size.
    #[arg(long, value_name = "SIZE")]
    pub limit: Option<String>,
}

#[derive(Args, Debug)]
pub struct MountArgs {
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// Cache directory.
    #[arg(long, default_value = crate::cache::DEFAULT_ROOT)]
    pub cache: PathBuf,
    /// Whether to fetch the whole disk in the background.
    #[arg(long, value_enum, default_value = "off")]
    pub hydrate: Hydrate,
    /// Bandwidth limit of background hydration, in MB/s of disk data.
    #[arg(long, default_value_t = 50, value_name = "MB/S")]
    pub hydrate_rate: u64,
    /// Evict cached layers that are not mounted, least recently used first, until the cache
    /// holds at most this much (e.g. 20G).
    #[arg(long, value_name = "SIZE")]
    pub cache_size: Option<String>,
    /// Seconds a read keeps retrying a failing fetch before it fails with EIO.
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    pub fetch_timeout: u64,
    /// Never hand complete files to the kernel with FUSE passthrough.
    #[arg(long)]
    pub no_passthrough: bool,
    /// Print the counters as JSON on unmount.
    #[arg(long)]
    pub stats: bool,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// An image reference (tag or digest).
    pub reference: String,
    /// An existing directory to mount the image's disk layer on.
    pub dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct PushArgs {
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// Platform of the following disk file (repeat with one file each for a multi-arch image).
    #[arg(long = "platform", value_name = "OS/ARCH")]
    pub platforms: Vec<String>,
    /// Path of the disk inside the image (default /disk/<file name>; /image/podvm.qcow2 for peer pods).
    #[arg(long, value_name = "PATH")]
    pub path: Option<String>,
    /// Chunk size, a power of two from 64K to 16M.
    #[arg(long, default_value = "256K")]
    pub chunk_size: String,
    /// Disk format, skipping detection (for raw disks without partition table or filesystem).
    #[arg(long, value_parser = ["raw", "qcow2"])]
    pub format: Option<String>,
    /// Disk files, then the image reference to push to.
    #[arg(required = true, num_args = 1.., value_name = "FILE... REF")]
    pub args: Vec<String>,
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// Path of the disk in the source image (default: the regular file under /disk/ or
    /// /image/). For a disk artifact, where its disk goes (default /disk/<its name>;
    /// /image/podvm.qcow2 for peer pods).
    #[arg(long, value_name = "PATH")]
    pub path: Option<String>,
    /// Platform of a source that names none (a disk artifact with an empty config, such as the
    /// peer-pod images pushed with oras); default: this machine's.
    #[arg(long, value_name = "OS/ARCH")]
    pub platform: Option<String>,
    /// Chunk size, a power of two from 64K to 16M.
    #[arg(long, default_value = "256K")]
    pub chunk_size: String,
    /// The image to convert (a containerDisk, a peer-pod image, a disk artifact).
    pub source: String,
    /// Where to push the converted image (another tag or repository than the source's).
    pub target: String,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// An image reference (tag or digest).
    pub reference: String,
}

/// `text` as a repository, for flag `flag`.
fn repository(text: &str, flag: &str) -> Result<Reference> {
    crate::reference::parse_repository(text).map_err(|e| e.context(flag))
}

#[derive(Args, Debug)]
pub struct IndexArgs {
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// Publish the index into this repository (`registry/repository`) instead of the image's:
    /// for images one cannot push beside. List it in the daemon's
    /// `[registry] index_repositories`.
    #[arg(long, value_name = "REPO")]
    pub to: Option<String>,
    /// Uncompressed bytes between checkpoints: smaller spans fetch less per cold read and make
    /// a larger index (power of two, 64K to 16M). The default had the lowest total time of a
    /// boot, random reads and a full read over a 20 ms link (integration/bench-spans.sh).
    #[arg(long, default_value = "256K", value_name = "SIZE")]
    pub span: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// The image (or disk artifact) to index, left as it is.
    pub reference: String,
}

fn publish_options(
    path: Option<String>,
    chunk_size: &str,
    format: Option<&str>,
) -> Result<PublishOptions> {
    let chunk_size =
        crate::format::layout::check_chunk_size(crate::units::parse_size(chunk_size)?)?;
    let format = format.map(str::parse::<DiskFormat>).transpose()?;
    Ok(PublishOptions {
        path,
        chunk_size,
        format,
        ..PublishOptions::default()
    })
}

/// Pairs `--platform` values with files in order; one file without `--platform` is the host's.
pub fn pair_platforms(platforms: &[String], files: &[String]) -> Result<Vec<(Platform, PathBuf)>> {
    if platforms.is_empty() && files.len() == 1 {
        return Ok(vec![(Platform::host(), PathBuf::from(&files[0]))]);
    }
    if platforms.len() != files.len() {
        return Err(Error::invalid(format!(
            "{} --platform flags for {} disk files: give one --platform before each file (e.g. --platform linux/amd64 a.qcow2 --platform linux/arm64 b.qcow2 REF)",
            platforms.len(),
            files.len()
        )));
    }
    let pairs: Vec<(Platform, PathBuf)> = platforms
        .iter()
        .zip(files)
        .map(|(p, f)| Ok((Platform::parse(p)?, PathBuf::from(f))))
        .collect::<Result<_>>()?;
    for (i, (p, _)) in pairs.iter().enumerate() {
        if pairs[..i].iter().any(|(q, _)| q == p) {
            return Err(Error::invalid(format!("platform {p} is given twice")));
        }
    }
    Ok(pairs)
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
    let snippet = crate::setup::snippet(release, setup)?;
    let platform = Platform::host().to_string();
    let merged = crate::setup::merge(&current, snippet, &args.address, &platform)
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
        Command::Push(args) => {
            if args.args.len() < 2 {
                return Err(Error::invalid("push needs at least one disk file and an image reference: vmdisk push FILE REF"));
            }
            let (files, target) = args.args.split_at(args.args.len() - 1);
            let target: Reference = target[0].parse()?;
            publish::check_target(&target)?;
            let pairs = pair_platforms(&args.platforms, files)?;
            let opts = publish_options(args.path, &args.chunk_size, args.format.as_deref())?;
            let client = args.registry.client()?;
            let mut images = Vec::new();
            for (platform, file) in pairs {
                let (published, bytes) =
                    publish::push_disk(&client, &target, file.clone(), &platform, &opts).await?;
                println!(
                    "pushed {} ({}) as /{} {} virtual {} bytes: layer {} ({} bytes, {} chunks, {} zero)",
                    file.display(),
                    platform,
                    published.disk.path,
                    published.disk.format.name(),
                    published.disk.virtual_size,
                    published.layer.digest,
                    published.layer.size,
                    published.chunks,
                    published.zero_chunks
                );
                images.push((published, bytes));
            }
            let digest: Digest = publish::tag_images(&client, &target, &images).await?;
            let pinned = target.with_digest(digest);
            eprintln!("to sign it: cosign sign --key KEY {pinned} (or notation sign {pinned})");
            println!("{digest}");
        }
        Command::Convert(args) => {
            let source: Reference = args.source.parse()?;
            let target: Reference = args.target.parse()?;
            let tag = |r: &Reference| r.tag.clone().unwrap_or_else(|| "latest".into());
            if target.registry == source.registry
                && target.repository == source.repository
                && source.digest.is_none()
                && tag(&target) == tag(&source)
            {
                return Err(Error::invalid(format!(
                    "convert would overwrite {source}, the image it reads; name another tag or repository"
                )));
            }
            let opts = publish_options(args.path, &args.chunk_size, None)?;
            let platform = match &args.platform {
                Some(p) => Platform::parse(p)?,
                None => Platform::host(),
            };
            let client = args.registry.client()?;
            let digest = publish::convert(&client, &source, &target, &opts, &platform).await?;
            let pinned = target.with_digest(digest);
            eprintln!(
                "the converted image is new content: signatures of {source} do not cover it; sign it: cosign sign --key KEY {pinned} (or notation sign {pinned})"
            );
            println!("{digest}");
        }
        Command::Mount(args) => mount(args).await?,
        Command::Trace(TraceCommand::Record(args)) => trace_record(args).await?,
        Command::Ls(args) => ls(args).await?,
        Command::Path(args) => {
            let request = DiskRequest {
                reference: checked_reference(&args).await?,
                namespace: args.namespace.clone().unwrap_or_default(),
            };
            let disk = manage(
                &args.daemon,
                |mut c| async move { c.ensure_disk(request).await },
            )
            .await?;
            if args.volume {
                println!(
                    "{}",
                    volume_path(&disk, &args.reference, handed(args.raw))?.display()
                );
            } else if args.raw {
                let raw = crate::ready::raw_view_path(Path::new(&disk.ready_dir))?;
                println!("{}", raw.display());
            } else {
                println!("{}", ready_path(&disk, Handed::AsPublished));
            }
        }
        Command::Prefetch(args) => {
            let request = DiskRequest {
                reference: args.reference.clone(),
                namespace: args.namespace.clone().unwrap_or_default(),
            };
            let mut disk = manage(&args.daemon, |mut c| async move {
                c.prefetch_disk(request).await
            })
            .await?;
            if args.wait {
                disk = wait_hydrated(&args, disk).await?;
            }
            println!(
                "{}: {} of {} chunks cached{}",
                ready_path(&disk, Handed::AsPublished),
                disk.chunks_cached,
                disk.chunks,
                if args.wait {
                    ""
                } else {
                    "; fetching the rest in the background"
                }
            );
        }
        Command::Rm(args) => {
            let r = manage(&args.daemon, |mut c| async move {
                c.remove_disk(DiskRequest {
                    reference: args.reference,
                    namespace: String::new(),
                })
                .await
            })
            .await?;
            if !r.unmounted {
                println!("kept mounted: containers still use the layer");
            }
        }
        Command::Gc(args) => {
            let limit_bytes = match &args.limit {
                Some(l) => Some(crate::units::parse_size(l)? as u64),
                None => None,
            };
            let r = manage(&args.daemon, |mut c| async move {
                c.gc(GcRequest { limit_bytes }).await
            })
            .await?;
            println!(
                "freed {} bytes; stopped {} unused mounts",
                r.freed_bytes, r.stopped_mounts
            );
        }
        Command::ContainerdConfig(args) => containerd_config(args).await?,
        Command::GenerateMan { dir } => {
            for page in manpages::write_all(&dir)? {
                println!("{}", page.display());
            }
        }
        Command::Stats(args) => {
            let r = manage(
                &args,
                |mut c| async move { c.status(StatusRequest {}).await },
            )
            .await?;
            let json = serde_json::json!({
                "version": r.version, "snapshots": r.snapshots, "remote_layers": r.remote_layers,
                "decisions": r.decisions.into_iter().collect::<std::collections::BTreeMap<_, _>>(),
            });
            println!("{}", serde_json::to_string_pretty(&json).expect("JSON"));
        }
        Command::Index(args) => {
            let reference: Reference = args.reference.parse()?;
            let to = args
                .to
                .as_deref()
                .map(|t| repository(t, "--to"))
                .transpose()?;
            let span = crate::units::parse_size(&args.span)? as u64;
            let client = args.registry.client()?;
            let r = crate::publish::index::index(&client, &reference, to.as_ref(), span).await?;
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&r).expect("report serialises")
                );
            } else {
                println!(
                    "indexed {} ({:?}, {} bytes; {} of tar stream, disk {}) in {:.1} s: {} spans of {}, index {} bytes ({:.2}% of the stream)\npublished {} in {} (subject {})",
                    r.layer,
                    r.compression,
                    r.layer_size,
                    r.stream_size,
                    r.disk,
                    r.seconds,
                    r.spans,
                    r.span_size,
                    r.index_size,
                    100.0 * r.index_size as f64 / r.stream_size.max(1) as f64,
                    r.artifact,
                    r.repository,
                    r.manifest
                );
                // The image is unchanged (its signatures stay valid); the index is new, and a
                // policy that requires signatures in its repository requires it signed.
                println!(
                    "to sign the index: cosign sign --key KEY {}@{} (or notation sign)",
                    r.repository, r.artifact
                );
            }
        }
        Command::Inspect(args) => {
            let reference: Reference = args.reference.parse()?;
            let client = args.registry.client()?;
            let trust = args.policy.verifier()?;
            let report = crate::inspect::inspect(&client, &trust, &reference).await?;
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&report).expect("report serialises")
                );
            } else {
                print!("{}", crate::inspect::render_text(&report));
            }
        }
    }
    Ok(())
}

/// The reference `vmdisk path` asks the daemon for: as given, or with `--policy` pinned to the
/// manifest digest the policy accepted (checked here with this user's registry credentials,
/// the node's hosts.toml and the command's deadline), so the disk printed is the one checked.
async fn checked_reference(args: &PathArgs) -> Result<String> {
    let trust = args.policy.verifier()?;
    if !trust.is_set() {
        return Ok(args.reference.clone());
    }
    let reference: Reference = args.reference.parse()?;
    let hosts = std::env::var_os("VMDISK_HOSTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/etc/containerd/certs.d"));
    let client = RegistryClient::new(RegistryConfig {
        hosts_dir: Some(hosts).filter(|d| d.is_dir()),
        retry: crate::retry::RetryPolicy {
            deadline: std::time::Duration::from_secs(args.daemon.timeout),
            ..Default::default()
        },
        ..RegistryConfig::default()
    })?;
    let (_, digest, _) = crate::resolve::platform_manifest(&client, None, &reference).await?;
    trust.check_image(&client, None, &reference, digest).await?;
    Ok(reference.with_digest(digest).to_string())
}

/// `prefetch --wait`: polls the daemon until every chunk of `disk` is cached and the complete
/// layer was checked; fails if the hydration or the check fails, the mount stops, or
/// `--wait-timeout` passes.
async fn wait_hydrated(
    args: &PrefetchArgs,
    mut disk: crate::api::vmdisk::v1::Disk,
) -> Result<crate::api::vmdisk::v1::Disk> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(args.wait_timeout);
    loop {
        if disk.integrity.starts_with("failed") {
            return Err(Error::corrupt(format!(
                "{}: the layer differs from its image config and serves nothing: {}",
                args.reference, disk.integrity
            )));
        }
        if let Some(why) = disk.hydration.strip_prefix("failed: ") {
            return Err(Error::new(
                crate::error::ErrorKind::Network,
                format!(
                    "{}: fetching the disk stopped at {} of {} chunks: {why}; run `vmdisk prefetch` again to resume",
                    args.reference, disk.chunks_cached, disk.chunks
                ),
            ));
        }
        if disk.chunks_cached >= disk.chunks && disk.integrity != "pending" {
            return Ok(disk);
        }
        if !disk.serving {
            return Err(Error::new(
                crate::error::ErrorKind::Io,
                format!(
                    "the mount of {} stopped while prefetching (server {})",
                    args.reference, disk.server_state
                ),
            ));
        }
        if std::time::Instant::now() >= deadline {
            return Err(Error::new(
                crate::error::ErrorKind::Timeout,
                format!(
                    "{}: {} of {} chunks cached after --wait-timeout {}s; the fetch goes on in the background",
                    args.reference, disk.chunks_cached, disk.chunks, args.wait_timeout
                ),
            ));
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let layer = disk.layer_key.clone();
        disk = list_disks(&args.daemon)
            .await?
            .into_iter()
            .find(|d| d.layer_key == layer)
            .ok_or_else(|| Error::not_found(format!("{} is no longer served", args.reference)))?;
    }
}

type ManageClient = crate::api::vmdisk::v1::manage_client::ManageClient<tonic::transport::Channel>;

/// One management call; a gRPC error becomes our error with the daemon's message.
async fn manage<T, F>(args: &ManageArgs, call: impl FnOnce(ManageClient) -> F) -> Result<T>
where
    F: std::future::Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
{
    let deadline = std::time::Duration::from_secs(args.timeout);
    let work = async {
        let channel = crate::api::unix::channel(&args.manage).await.map_err(|e| {
            match e.source_io_kind() {
                Some(std::io::ErrorKind::PermissionDenied) => Error::new(
                    crate::error::ErrorKind::Auth,
                    format!(
                        "{} is root's: run this command as root",
                        args.manage.display()
                    ),
                ),
                _ => e,
            }
        })?;
        call(ManageClient::new(channel))
            .await
            .map(tonic::Response::into_inner)
            .map_err(Error::from)
    };
    tokio::time::timeout(deadline, work).await.map_err(|_| {
        Error::new(
            crate::error::ErrorKind::Timeout,
            format!(
                "vmdisk-snapshotter did not answer on {} within {} s (--timeout)",
                args.manage.display(),
                deadline.as_secs()
            ),
        )
    })?
}

async fn list_disks(args: &ManageArgs) -> Result<Vec<crate::api::vmdisk::v1::Disk>> {
    let r = manage(args, |mut c| async move {
        c.list_disks(ListDisksRequest {}).await
    })
    .await?;
    Ok(r.disks)
}

/// What `vmdisk path --raw` asks for.
fn handed(raw: bool) -> Handed {
    match raw {
        true => Handed::Raw,
        false => Handed::AsPublished,
    }
}

/// The libvirt volume of `reference`'s disk (`vmdisk path --volume`): the qcow2 as published
/// (or the raw disk, when it is raw), or the raw view.
fn volume_path(
    disk: &crate::api::vmdisk::v1::Disk,
    reference: &str,
    handed: Handed,
) -> Result<PathBuf> {
    let ready_dir = Path::new(&disk.ready_dir);
    let volumes = ready_dir
        .parent()
        .unwrap_or(ready_dir)
        .join(crate::ready::VOLUMES_DIR);
    let names = match handed {
        Handed::Raw => vec![crate::ready::volume_name(reference, DiskFormat::Raw)],
        Handed::AsPublished => vec![
            crate::ready::volume_name(reference, DiskFormat::Qcow2),
            crate::ready::volume_name(reference, DiskFormat::Raw),
        ],
    };
    names
        .iter()
        .map(|n| volumes.join(n))
        .find(|p| p.symlink_metadata().is_ok())
        .ok_or_else(|| {
            Error::not_found(format!(
                "no libvirt volume {} in {}: a disk's volumes are named after the reference its mount server was started for (`vmdisk ls` shows it)",
                names.join(" or "),
                volumes.display()
            ))
        })
}

/// The path `vmdisk path` prints: the disk as published, or its raw view.
fn ready_path(disk: &crate::api::vmdisk::v1::Disk, handed: Handed) -> String {
    let dir = Path::new(&disk.ready_dir);
    let path = match handed {
        Handed::Raw => dir.join(crate::ready::RAW_NAME),
        Handed::AsPublished => crate::ready::published_path(dir, &disk.disk_path),
    };
    path.display().to_string()
}

/// `vmdisk ls`: the daemon's remote disks, one line each (or JSON).
async fn ls(args: LsArgs) -> Result<()> {
    let disks = list_disks(&args.daemon).await?;
    if args.json {
        let rows: Vec<serde_json::Value> = disks
            .iter()
            .map(|d| {
                serde_json::json!({
                    "reference": d.reference, "layer": d.layer_digest, "layer_key": d.layer_key,
                    "integrity": d.integrity,
                    "path": ready_path(d, Handed::AsPublished), "raw": ready_path(d, Handed::Raw),
                    "disk_size": d.disk_size, "last_used": d.last_used,
                    "chunks": d.chunks, "chunks_cached": d.chunks_cached,
                    "registry_bytes": d.registry_bytes, "snapshots": d.snapshots,
                    "serving": d.serving, "server_pid": d.server_pid,
                    "server": d.server_state, "hydration": d.hydration,
                    "cache_full": d.cache_full,
                    "registry_needed_since": d.registry_needed_since,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows).expect("JSON"));
        return Ok(());
    }
    println!("IMAGE\tDISK SIZE\tCACHED\tFETCHED\tLAST USED\tIN USE BY\tINTEGRITY\tPATH");
    for d in disks {
        let pct = if d.chunks == 0 {
            100.0
        } else {
            d.chunks_cached as f64 * 100.0 / d.chunks as f64
        };
        let when = |secs: i64| {
            time::OffsetDateTime::from_unix_timestamp(secs)
                .ok()
                .filter(|_| secs > 0)
                .and_then(|t| {
                    t.format(&time::format_description::well_known::Rfc3339)
                        .ok()
                })
        };
        let last_used = when(d.last_used).unwrap_or_else(|| "-".into());
        let needs = when(d.registry_needed_since)
            .map(|t| format!(" (needs the registry since {t}; hydration {})", d.hydration))
            .unwrap_or_default();
        let users = if d.snapshots.is_empty() {
            "-".to_string()
        } else {
            d.snapshots.join(",")
        };
        println!(
            "{}\t{}\t{pct:.1}%\t{}\t{last_used}\t{users}\t{}\t{}{}{needs}",
            d.reference,
            d.disk_size,
            d.registry_bytes,
            d.integrity,
            ready_path(&d, Handed::AsPublished),
            match (d.serving, d.cache_full) {
                (false, _) => format!(" (server {})", d.server_state),
                (true, true) => " (cache_full: answered from memory)".to_string(),
                (true, false) => String::new(),
            }
        );
    }
    Ok(())
}

/// `vmdisk mount`: serves the disk layer at `dir` until SIGINT or SIGTERM.
async fn mount(args: MountArgs) -> Result<()> {
    let registry = &args.registry;
    use crate::engine::EngineOptions;
    let reference: Reference = args.reference.parse()?;
    // Checked before anything is fetched or created (a missing one is made).
    if args.dir.exists() && !args.dir.is_dir() {
        return Err(Error::invalid(format!(
            "the mount point {} is not a directory",
            args.dir.display()
        )));
    }
    let cache_size = args
        .cache_size
        .as_deref()
        .map(crate::units::parse_size)
        .transpose()
        .map_err(|e| e.context("--cache-size"))?;
    let trust = args.policy.verifier()?;
    let cache = crate::cache::CacheRoot::open(&args.cache)?;
    // What this node learns about its mirrors is kept with its cache.
    let client = std::sync::Arc::new(RegistryClient::new(RegistryConfig {
        notes: Some(args.cache.join(crate::registry::MIRROR_NOTES)),
        ..registry.config()?
    })?);
    let opts = EngineOptions {
        fetch_deadline: std::time::Duration::from_secs(args.fetch_timeout),
        ..EngineOptions::default()
    };
    // Resolution and the checks before anything is served end within --timeout, whatever
    // retries happen inside.
    let opening = crate::serve::open_engine(
        client,
        &cache,
        &trust,
        crate::resolve::Wanted::image(&reference),
        opts,
        crate::serve::Warm::Nothing,
        std::future::ready(crate::layer::Held::default()),
    );
    let engine = tokio::time::timeout(std::time::Duration::from_secs(registry.timeout), opening)
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::Timeout,
                format!(
                    "{reference} could not be resolved and checked within {} s (--timeout)",
                    registry.timeout
                ),
            )
        })??;
    // Evict only now: the layer being mounted holds its lock and cannot be chosen.
    if let Some(limit) = cache_size {
        let freed = cache.evict(limit as u64)?;
        tracing::info!(freed, "cache eviction done");
    }
    let serving = crate::serve::start(
        std::sync::Arc::clone(&engine),
        &cache,
        &args.dir,
        &ServeOptions {
            hydrate: args.hydrate,
            hydrate_rate: args.hydrate_rate,
            passthrough: !args.no_passthrough,
            announce: true,
            ready: None,
        },
    )
    .await?;
    println!(
        "ready: {} at {} ({} of {} chunks cached)",
        reference,
        serving.disk_path().display(),
        engine.cache.present_count(),
        engine.layer.chunks.len()
    );
    serving.serve_until_signalled().await?;
    let stats = serving.finish().await?;
    if args.stats {
        println!(
            "{}",
            serde_json::to_string(&stats).expect("stats serialise")
        );
    }
    Ok(())
}

/// `vmdisk trace record`: mounts the image in a scratch directory (no passthrough, so every
/// read reaches the engine), runs the command, and keeps what it read.
async fn trace_record(args: TraceRecordArgs) -> Result<()> {
    let registry = &args.registry;
    use crate::trace::BootTrace;
    if args.output.is_none() && !args.push {
        return Err(Error::invalid(
            "a recorded trace goes nowhere: give --output FILE, --push, or both",
        ));
    }
    let reference: Reference = args.reference.parse()?;
    let client = std::sync::Arc::new(registry.client()?);
    let cache = crate::cache::CacheRoot::open(&args.cache)?;
    let engine = crate::serve::open_engine(
        std::sync::Arc::clone(&client) as _,
        &cache,
        &crate::policy::Verifier::none(),
        crate::resolve::Wanted::image(&reference),
        Default::default(),
        crate::serve::Warm::Nothing,
        std::future::ready(crate::layer::Held::default()),
    )
    .await?;
    engine.start_recording();
    let dir = std::env::temp_dir().join(format!("vmdisk-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let serving = crate::serve::start(
        std::sync::Arc::clone(&engine),
        &cache,
        &dir,
        &ServeOptions {
            hydrate: Hydrate::Off,
            hydrate_rate: 0,
            passthrough: false,
            announce: false,
            ready: None,
        },
    )
    .await?;
    let status = tokio::process::Command::new(&args.command[0])
        .args(&args.command[1..])
        .env("VMDISK_DISK", serving.disk_path())
        .status()
        .await;
    // Ending the session waits for the unmount; a mount still in use is left to the kernel,
    // which breaks it when this process exits.
    serving.unmount().map_err(|e| {
        e.context(format!(
            "{} left the disk in use; no trace kept",
            args.command[0]
        ))
    })?;
    serving.finish().await?;
    let _ = std::fs::remove_dir(&dir);
    let status = status.map_err(|e| Error::io(format!("running {}", args.command[0]), e))?;
    if !status.success() {
        return Err(Error::invalid(format!(
            "{} exited with {status}: no trace kept (record a boot that succeeds)",
            args.command[0]
        )));
    }
    let trace = BootTrace::of(&engine, engine.recorded());
    let bytes: u64 = trace.ranges.iter().map(|[_, len]| len).sum();
    if let Some(output) = &args.output {
        std::fs::write(output, trace.to_json())
            .map_err(|e| Error::io(format!("writing {}", output.display()), e))?;
    }
    println!(
        "recorded {} ranges, {bytes} bytes of the {}-byte disk /{}",
        trace.ranges.len(),
        engine.layer.file_size(engine.layer.disk),
        trace.disk
    );
    if args.push {
        let (_, manifest, _) =
            crate::resolve::platform_manifest(client.as_ref(), None, &reference).await?;
        let fetched = client
            .get_manifest(&reference.with_digest(manifest))
            .await?;
        let subject = Descriptor {
            media_type: fetched.media_type,
            digest: fetched.digest,
            size: fetched.bytes.len() as u64,
            annotations: Default::default(),
            platform: None,
            artifact_type: None,
        };
        let digest = crate::trace::publish(&client, &reference, subject, &trace).await?;
        println!("published as {digest} (refers to {manifest})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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

    use super::*;

    #[test]
    fn pairs_platforms_with_files() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let one = pair_platforms(&[], &s(&["a.qcow2"])).unwrap();
        assert_eq!(one[0].0, Platform::host());
        let two = pair_platforms(&s(&["linux/amd64", "linux/arm64"]), &s(&["a", "b"])).unwrap();
        assert_eq!(two[1].0.architecture, "arm64");
        assert!(pair_platforms(&s(&["linux/amd64"]), &s(&["a", "b"])).is_err());
        assert!(pair_platforms(&s(&["linux/amd64", "linux/amd64"]), &s(&["a", "b"])).is_err());
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
            "r:1",
        ])
        .unwrap();
        let Command::Push(p) = cli.command else {
            panic!("not push")
        };
        assert_eq!(p.platforms, ["linux/amd64", "linux/arm64"]);
        assert_eq!(p.args, ["a.qcow2", "b.qcow2", "r:1"]);
        assert!(Cli::try_parse_from(["vmdisk", "push"]).is_err());
    }
}
