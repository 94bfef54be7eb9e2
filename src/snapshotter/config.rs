//! The daemon's configuration: a TOML file whose every field has a working default
//! (`config/vmdisk-snapshotter.toml` is those defaults, commented). Unknown fields are refused,
//! so a typo is an error at start, not a silently ignored setting.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::registry::RegistryConfig;
use crate::serve::Hydrate;

/// The whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Metadata, snapshot directories, mount points and (by default) the cache.
    pub root: PathBuf,
    /// The containerd snapshots API socket (mode 0660).
    pub address: PathBuf,
    /// The management API socket (mode 0600).
    pub manage_address: PathBuf,
    /// tracing filter: error, warn, info, debug, trace, or directives.
    pub log_level: String,
    /// Ready-disk directories: `<ready_dir>/<manifest digest hex>/` with the disk as
    /// published, `disk.raw` and `metadata.json`; `<ready_dir>/by-name/<image>` links to them.
    pub ready_dir: PathBuf,
    /// The group the VMs' hypervisor runs in (a name or a numeric gid): it alone, with root,
    /// may read the ready disks. Everything else the daemon keeps is root's only.
    pub vmm_group: String,
    /// Nice levels the daemon's threads run above its mount servers ([`super::daemon::priority`]):
    /// the control plane answers ahead of the disks' reads. 0: one priority.
    pub control_priority: u8,
    /// The cgroup (a path from each hierarchy's root, e.g. `/vmdisk-servers`) every mount
    /// server moves into before it serves, leaving the daemon's: set in a pod (the DaemonSet),
    /// so that replacing the pod leaves running VMs' disks served ([`super::mount_server::cgroup`]). Empty:
    /// servers stay in the daemon's cgroup (the Debian package's unit keeps them alive).
    pub server_cgroup: String,
    /// Seconds a mount server serves with no daemon asking after it (a running daemon asks
    /// every second) before it stops by itself, as soon as no one has its disk open: what is
    /// left of an uninstalled DaemonSet or package ends. A disk in use keeps its server until it
    /// is closed. Longer than a daemon's replacement takes (its pod's image pull, a crash
    /// loop's back-off). 0: never.
    pub orphan_grace: u64,
    pub cache: CacheConfig,
    pub registry: RegistrySettings,
    pub metrics: MetricsConfig,
    pub cri: super::prepare::cri::CriConfig,
    pub containerd: ContainerdConfig,
    /// Signature policies every image (and seekable index) must satisfy before it is served
    /// ([`crate::policy`]); none by default.
    pub signatures: crate::policy::PolicyFiles,
}

/// The containerd this daemon serves.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ContainerdConfig {
    /// containerd's `root`. Its CRI plugin reports `<root>/io.containerd.snapshotter.v1.<plugin>`
    /// as the image filesystem of a proxy snapshotter and kubelet stats that path: the daemon
    /// links it to its own root. Skipped when the directory does not exist. Its content store
    /// holds the manifest and config of an image being pulled ([`super::prepare::classify::ContentStore`]).
    pub root: PathBuf,
    /// The name of the proxy plugin in containerd's configuration (`[proxy_plugins.<name>]`).
    pub plugin: String,
}

impl Default for ContainerdConfig {
    fn default() -> Self {
        ContainerdConfig {
            root: PathBuf::from("/var/lib/containerd"),
            plugin: "vmdisk".into(),
        }
    }
}

/// The block cache.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Cache directory; empty means `<root>/cache`.
    pub dir: PathBuf,
    /// Upper bound (e.g. "50G"); layers of mounted disks are never evicted. Empty: no bound.
    pub size: String,
    /// What a mounted disk fetches beyond what is read.
    pub hydrate: Hydrate,
    /// Bandwidth limit of background hydration, MB/s.
    pub hydrate_rate: u64,
    /// Hand complete files to the kernel with FUSE passthrough.
    pub passthrough: bool,
    /// How fast cached chunks are read back and checked after a restart, MB/s: one layer of
    /// the node at a time, in the idle I/O class; 0: as fast as the disk goes.
    pub verify_rate: u64,
    /// The node's budget (e.g. "256M") for verified chunks held in memory while the cache's
    /// disk has no room for them, all layers together ([`crate::cache::memory`]).
    pub memory_budget: String,
    /// Fetch the chunks of a boot trace published beside the image first when a layer that is
    /// not complete is mounted (`vmdisk trace record --push`).
    pub boot_traces: bool,
}

/// How registries are reached.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistrySettings {
    /// containerd `hosts.toml` directory (mirrors, CAs, client certificates).
    pub hosts_dir: PathBuf,
    /// Docker config files with credentials; empty means the usual search path
    /// (REGISTRY_AUTH_FILE, $DOCKER_CONFIG, ~/.docker/config.json).
    pub auth_files: Vec<PathBuf>,
    /// Registries (`host[:port]`) spoken to over plain HTTP; loopback always may.
    pub plain_http_hosts: Vec<String>,
    /// Seconds a fetch (a read's chunks, a manifest, a TOC) keeps retrying before it fails
    /// (a read with EIO).
    pub fetch_timeout: u64,
    /// Seconds Prepare waits for a disk to be mounted before falling back to a normal pull.
    pub mount_timeout: u64,
    /// Repositories (`registry/repository`) searched for the seekable index of an ordinary
    /// disk image after the image's own (`vmdisk index --to`), in order.
    pub index_repositories: Vec<String>,
    /// Which images are searched for a seekable index: `data-images` (those that run no
    /// program: containerDisks, VM images) or `all-images`.
    pub index_search: super::prepare::classify::IndexSearch,
}

/// The Prometheus endpoint.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// "" (off), "unix:/path/to.sock", or a loopback "127.0.0.1:PORT".
    pub address: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            root: PathBuf::from("/var/lib/vmdisk-snapshotter"),
            address: PathBuf::from("/run/vmdisk/snapshotter.sock"),
            manage_address: PathBuf::from("/run/vmdisk/manage.sock"),
            log_level: "info".into(),
            ready_dir: PathBuf::from("/run/vmdisk/disks"),
            vmm_group: "kvm".into(),
            control_priority: 5,
            server_cgroup: String::new(),
            orphan_grace: 900,
            cache: CacheConfig::default(),
            registry: RegistrySettings::default(),
            metrics: MetricsConfig::default(),
            cri: super::prepare::cri::CriConfig::default(),
            containerd: ContainerdConfig::default(),
            signatures: crate::policy::PolicyFiles::default(),
        }
    }
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            dir: PathBuf::new(),
            size: String::new(),
            hydrate: Hydrate::Background,
            hydrate_rate: 50,
            passthrough: true,
            verify_rate: crate::serve::DEFAULT_VERIFY_RATE,
            memory_budget: "256M".into(),
            boot_traces: true,
        }
    }
}

impl Default for RegistrySettings {
    fn default() -> Self {
        RegistrySettings {
            hosts_dir: PathBuf::from("/etc/containerd/certs.d"),
            auth_files: Vec::new(),
            plain_http_hosts: Vec::new(),
            fetch_timeout: 30,
            mount_timeout: 60,
            index_repositories: Vec::new(),
            index_search: Default::default(),
        }
    }
}

/// The longest root or ready directory: PATH_MAX (4096) less room for what the daemon makes in
/// it.
const MAX_DIR_PATH: usize = 3584;

/// Where the metrics endpoint listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsAddress {
    Off,
    Unix(PathBuf),
    Tcp(std::net::SocketAddr),
}

impl Config {
    /// Reads `path`, or the defaults when there is none.
    pub fn load(path: Option<&Path>) -> Result<Config> {
        let Some(path) = path else {
            return Ok(Config::default());
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading the configuration {}", path.display()), e))?;
        let config: Config = toml::from_str(&text).map_err(|e| {
            Error::invalid(format!(
                "configuration {}: {}",
                path.display(),
                e.to_string().trim_end()
            ))
        })?;
        config.metrics_address()?;
        config.index_repositories().map_err(|e| {
            e.context(format!(
                "configuration {}: registry.index_repositories",
                path.display()
            ))
        })?;
        if !config.cache.size.is_empty() {
            crate::units::parse_size(&config.cache.size)
                .map_err(|e| e.context(format!("configuration {}: cache.size", path.display())))?;
        }
        config.memory_budget().map_err(|e| {
            e.context(format!(
                "configuration {}: cache.memory_budget",
                path.display()
            ))
        })?;
        Ok(config)
    }

    /// Checks what no field's type says: a known log level; absolute paths; sockets others
    /// dial (containerd, kubelet) short enough for a socket address; directories with room
    /// under PATH_MAX for what the daemon makes in them. Nothing is created before this passes.
    pub fn validate(&self) -> Result<()> {
        crate::logging::filter(&self.log_level).map_err(|e| e.context("log_level"))?;
        if self.control_priority > 20 {
            return Err(Error::invalid(format!(
                "control_priority {} is more than the 20 nice levels a thread can be raised by; use 0 to 20",
                self.control_priority
            )));
        }
        let metrics = match self.metrics_address()? {
            MetricsAddress::Unix(p) => Some(p),
            _ => None,
        };
        let paths = [
            ("root", Some(&self.root)),
            ("address", Some(&self.address)),
            ("manage_address", Some(&self.manage_address)),
            ("ready_dir", Some(&self.ready_dir)),
            (
                "cache.dir",
                Some(&self.cache.dir).filter(|d| !d.as_os_str().is_empty()),
            ),
            ("registry.hosts_dir", Some(&self.registry.hosts_dir)),
            (
                "cri.image_service_address",
                Some(&self.cri.image_service_address).filter(|d| !d.as_os_str().is_empty()),
            ),
            ("cri.containerd_address", Some(&self.cri.containerd_address)),
            ("containerd.root", Some(&self.containerd.root)),
            ("metrics.address", metrics.as_ref()),
        ];
        for (name, path) in paths {
            let Some(path) = path else { continue };
            if !path.is_absolute() {
                return Err(Error::invalid(format!(
                    "{name} {} is not an absolute path",
                    path.display()
                )));
            }
        }
        // Dialled by containerd and kubelet, which need it to fit a socket address.
        for (name, path) in [
            ("address", &self.address),
            ("cri.image_service_address", &self.cri.image_service_address),
        ] {
            if path.as_os_str().len() > crate::api::unix::MAX_SOCKET_PATH {
                return Err(Error::invalid(format!(
                    "{name} {} is longer than the {} bytes a socket address holds; containerd could not dial it",
                    path.display(),
                    crate::api::unix::MAX_SOCKET_PATH
                )));
            }
        }
        // Room for what is made below them (layer directories, link names of up to 200 bytes).
        for (name, path) in [("root", &self.root), ("ready_dir", &self.ready_dir)] {
            if path.as_os_str().len() > MAX_DIR_PATH {
                return Err(Error::invalid(format!(
                    "{name} is {} bytes long; at most {MAX_DIR_PATH} leave room under PATH_MAX for what the daemon makes in it",
                    path.as_os_str().len()
                )));
            }
        }
        for path in [&self.address, &self.manage_address] {
            if path.is_dir() {
                return Err(Error::invalid(format!(
                    "{} is a directory, not a socket path",
                    path.display()
                )));
            }
        }
        Ok(())
    }

    /// The cache directory.
    pub fn cache_dir(&self) -> PathBuf {
        if self.cache.dir.as_os_str().is_empty() {
            self.root.join("cache")
        } else {
            self.cache.dir.clone()
        }
    }

    /// The cache bound in bytes, if any.
    pub fn cache_limit(&self) -> Result<Option<u64>> {
        if self.cache.size.is_empty() {
            return Ok(None);
        }
        Ok(Some(crate::units::parse_size(&self.cache.size)? as u64))
    }

    /// The node's budget for verified chunks held in memory on a full disk, in bytes.
    pub fn memory_budget(&self) -> Result<u64> {
        Ok(crate::units::parse_size(&self.cache.memory_budget)? as u64)
    }

    /// The ledger through which the mount servers share that budget: beside the daemon's
    /// sockets (`/run/vmdisk`: tmpfs, never the cache's full disk).
    pub fn memory_ledger(&self) -> PathBuf {
        self.address
            .parent()
            .unwrap_or(Path::new("/run/vmdisk"))
            .join("memory-held")
    }

    /// The gid of `vmm_group`.
    pub fn vmm_gid(&self) -> Result<u32> {
        let group = self.vmm_group.trim();
        if let Ok(gid) = group.parse::<u32>() {
            return Ok(gid);
        }
        match nix::unistd::Group::from_name(group) {
            Ok(Some(g)) => Ok(g.gid.as_raw()),
            Ok(None) => Err(Error::invalid(format!(
                "vmm_group {group:?} is not a group on this node; set it to the group your hypervisor runs in (Debian's libvirt: kvm or libvirt-qemu; a numeric gid works too)"
            ))),
            Err(nix::errno::Errno::ENOENT) => Err(Error::invalid(format!(
                "vmm_group {group:?} cannot be looked up: there is no /etc/group here (a container image built FROM scratch); mount the host's /etc/group (the DaemonSet does) or set vmm_group to a numeric gid"
            ))),
            Err(e) => Err(Error::io(format!("looking up group {group:?}"), e.into())),
        }
    }

    /// The index repositories, parsed: each a repository, without tag or digest.
    pub fn index_repositories(&self) -> Result<Vec<crate::oci::reference::Reference>> {
        self.registry
            .index_repositories
            .iter()
            .map(|r| crate::oci::reference::parse_repository(r))
            .collect()
    }

    /// The registry client settings.
    pub fn registry_config(&self) -> RegistryConfig {
        RegistryConfig {
            // Checked when the configuration was loaded.
            index_repositories: self.index_repositories().unwrap_or_default(),
            plain_http_hosts: self.registry.plain_http_hosts.clone(),
            hosts_dir: Some(self.registry.hosts_dir.clone()).filter(|d| d.is_dir()),
            auth_files: Some(self.registry.auth_files.clone()).filter(|f| !f.is_empty()),
            retry: crate::retry::RetryPolicy::registry(std::time::Duration::from_secs(
                self.registry.fetch_timeout,
            )),
            ..RegistryConfig::default()
        }
    }

    /// The parsed metrics address; a TCP address must be loopback.
    pub fn metrics_address(&self) -> Result<MetricsAddress> {
        let a = self.metrics.address.trim();
        if a.is_empty() {
            return Ok(MetricsAddress::Off);
        }
        if let Some(path) = a.strip_prefix("unix:") {
            return Ok(MetricsAddress::Unix(PathBuf::from(path)));
        }
        let addr: std::net::SocketAddr = a.parse().map_err(|_| {
            Error::invalid(format!(
                "metrics.address {a:?} is neither unix:/path nor IP:PORT"
            ))
        })?;
        if !addr.ip().is_loopback() {
            return Err(Error::invalid(format!(
                "metrics.address {a:?} is not a loopback address; the endpoint is unauthenticated, expose it through a unix socket or a local proxy"
            )));
        }
        Ok(MetricsAddress::Tcp(addr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, text).unwrap();
        Config::load(Some(&path))
    }

    #[test]
    fn shipped_config_is_the_defaults() {
        let shipped = Config::load(Some(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/vmdisk-snapshotter.toml"
        ))))
        .unwrap();
        let d = Config::default();
        assert_eq!(format!("{shipped:?}"), format!("{d:?}"));
    }

    #[test]
    fn refuses_unknown_fields_and_bad_values() {
        let e = parse("roots = \"/x\"").unwrap_err();
        assert!(e.to_string().contains("unknown field"), "{e}");
        let e = parse("[metrics]\naddress = \"0.0.0.0:9100\"").unwrap_err();
        assert!(e.to_string().contains("loopback"), "{e}");
        let e = parse("[cache]\nsize = \"lots\"").unwrap_err();
        assert!(e.to_string().contains("cache.size"), "{e}");
        let e = parse("[registry]\nindex_repositories = [\"r.example/i:tag\"]").unwrap_err();
        assert!(e.to_string().contains("index_repositories"), "{e}");
        let c = parse("[registry]\nindex_repositories = [\"r.example/team/indexes\"]").unwrap();
        assert_eq!(
            c.registry.index_search,
            super::super::prepare::classify::IndexSearch::DataImages
        );
        let c2 = parse("[registry]\nindex_search = \"all-images\"").unwrap();
        assert_eq!(
            c2.registry.index_search,
            super::super::prepare::classify::IndexSearch::AllImages
        );
        assert!(parse("[registry]\nindex_search = \"some\"").is_err());
        assert_eq!(
            c.registry_config().index_repositories[0].repository,
            "team/indexes"
        );
        let c =
            parse("[metrics]\naddress = \"unix:/run/m.sock\"\n[cache]\nhydrate = \"background\"")
                .unwrap();
        assert_eq!(
            c.metrics_address().unwrap(),
            MetricsAddress::Unix(PathBuf::from("/run/m.sock"))
        );
        assert_eq!(c.cache.hydrate, Hydrate::Background);
    }
}
