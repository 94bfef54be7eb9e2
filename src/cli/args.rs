//! The `vmdisk` command line's arguments (clap), and the small conversions each subcommand's
//! arguments make of themselves.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::error::{Error, Result};
use crate::format::disk::DiskFormat;
use crate::oci::reference::Reference;
use crate::oci::Platform;
use crate::registry::{RegistryClient, RegistryConfig};
use crate::serve::Hydrate;

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
            retry: crate::retry::RetryPolicy::registry(std::time::Duration::from_secs(
                self.timeout,
            )),
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
    /// Warm the registry's mirrors (a regional cache) with an image, no node mounting it: a
    /// rollout then starts warm.
    Preheat(PreheatArgs),
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
    /// containerd's release (1.6, 1.7, 2.1, 2.3, …), instead of asking containerd (a bare 2 is
    /// taken as 2.0-2.2: a file it creates is written in configuration version 3).
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
    /// vmdisk-snapshotter's root (its configuration's `root`), which containerd 1.7 reports to
    /// kubelet as the image filesystem.
    #[arg(
        long,
        default_value = "/var/lib/vmdisk-snapshotter",
        value_name = "DIR"
    )]
    pub root: PathBuf,
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
    pub reference: Reference,
    /// The boot to record, run with VMDISK_DISK set to the mounted disk file (e.g. qemu with
    /// `-drive file=$VMDISK_DISK,format=qcow2,readonly=on`).
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// How a long command shows its progress (on stderr: stdout keeps what scripts read).
#[derive(Args, Debug, Clone, Copy)]
pub struct ProgressArgs {
    /// Show no progress: by default a bar on a terminal, else a line every 5 s on stderr.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

impl ProgressArgs {
    /// How to show progress on this process's stderr.
    pub fn display(self) -> crate::progress::Display {
        crate::progress::Display::for_stderr(self.quiet)
    }
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
    #[command(flatten)]
    pub progress: ProgressArgs,
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
pub struct PreheatArgs {
    #[command(flatten)]
    pub registry: RegistryArgs,
    #[command(flatten)]
    pub progress: ProgressArgs,
    /// An image reference (tag or digest): its manifests, config and every layer's blob are
    /// read through the mirrors hosts.toml lists for its registry.
    pub reference: Reference,
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
    /// How fast chunks cached by an earlier mount are read back and checked in the
    /// background, MB/s (one layer of the cache at a time, idle I/O class); 0: no limit.
    #[arg(long, default_value_t = crate::serve::DEFAULT_VERIFY_RATE, value_name = "MB/S")]
    pub verify_rate: u64,
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
    pub reference: Reference,
    /// An existing directory to mount the image's disk layer on.
    pub dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct PushArgs {
    #[command(flatten)]
    pub registry: RegistryArgs,
    #[command(flatten)]
    pub progress: ProgressArgs,
    /// Platform of the following disk file (repeat with one file each for a multi-arch image).
    #[arg(long = "platform", value_name = "OS/ARCH", value_parser = Platform::parse)]
    pub platforms: Vec<Platform>,
    /// Path of the disk inside the image (default /disk/<file name>; /image/podvm.qcow2 for peer pods).
    #[arg(long, value_name = "PATH")]
    pub path: Option<String>,
    /// Chunk size, a power of two from 64K to 16M.
    #[arg(long, default_value = "256K", value_parser = chunk_size)]
    pub chunk_size: usize,
    /// Disk format, skipping detection (for raw disks without partition table or filesystem).
    #[arg(long, value_parser = served_format)]
    pub format: Option<DiskFormat>,
    /// Disk files, then the image reference to push to.
    #[arg(required = true, num_args = 1.., value_name = "FILE... REF")]
    pub args: Vec<String>,
}

impl PushArgs {
    /// The disk files and the reference the operands name. (One positional list, split here:
    /// `--platform` goes before each file, and clap ends a list of files at an option, so two
    /// positionals would take the second file for the reference.)
    pub fn operands(&self) -> Result<(Vec<PathBuf>, Reference)> {
        match self.args.split_last() {
            Some((target, files)) if !files.is_empty() => {
                Ok((files.iter().map(PathBuf::from).collect(), target.parse()?))
            }
            _ => Err(Error::invalid(
                "push needs at least one disk file and an image reference: vmdisk push FILE REF",
            )),
        }
    }
}

/// `--chunk-size`: a size (`256K`, `1M`) that is a power of two from 64K to 16M.
fn chunk_size(text: &str) -> Result<usize> {
    crate::format::layout::check_chunk_size(crate::units::parse_size(text)?)
}

/// `--format`: a format whose disks are published as they are.
fn served_format(text: &str) -> Result<DiskFormat> {
    let format: DiskFormat = text.parse()?;
    if !format.is_served() {
        return Err(Error::invalid(format!(
            "--format names raw or qcow2 (it skips detection); a disk in {format} is detected and converted without it"
        )));
    }
    Ok(format)
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    #[command(flatten)]
    pub registry: RegistryArgs,
    #[command(flatten)]
    pub progress: ProgressArgs,
    /// Path of the disk in the source image (default: the regular file under /disk/ or
    /// /image/). For a disk artifact, where its disk goes (default /disk/<its name>;
    /// /image/podvm.qcow2 for peer pods).
    #[arg(long, value_name = "PATH")]
    pub path: Option<String>,
    /// Platform of a source that names none (a disk artifact with an empty config, such as the
    /// peer-pod images pushed with oras); default: this machine's.
    #[arg(long, value_name = "OS/ARCH", value_parser = Platform::parse)]
    pub platform: Option<Platform>,
    /// Chunk size, a power of two from 64K to 16M.
    #[arg(long, default_value = "256K", value_parser = chunk_size)]
    pub chunk_size: usize,
    /// The image to convert (a containerDisk, a peer-pod image, a disk artifact).
    pub source: Reference,
    /// Where to push the converted image (another tag or repository than the source's).
    pub target: Reference,
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
    pub reference: Reference,
}

/// `text` as a repository, for flag `flag`.
pub(super) fn repository(text: &str, flag: &str) -> Result<Reference> {
    crate::oci::reference::parse_repository(text).map_err(|e| e.context(flag))
}

#[derive(Args, Debug)]
pub struct IndexArgs {
    #[command(flatten)]
    pub registry: RegistryArgs,
    #[command(flatten)]
    pub progress: ProgressArgs,
    /// Publish the index into this repository (`registry/repository`) instead of the image's:
    /// for images one cannot push beside. List it in the daemon's
    /// `[registry] index_repositories`.
    #[arg(long, value_name = "REPO")]
    pub to: Option<String>,
    /// Uncompressed bytes between checkpoints: smaller spans fetch less per cold read and make
    /// a larger index (power of two, 64K to 16M). The default had the lowest total time of a
    /// boot, random reads and a full read over a 20 ms link (integration/benches/spans.sh).
    #[arg(long, default_value = "256K", value_name = "SIZE")]
    pub span: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// The image (or disk artifact) to index, left as it is.
    pub reference: Reference,
}
