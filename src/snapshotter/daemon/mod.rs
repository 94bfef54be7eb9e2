//! Starting and stopping the daemon.
//!
//! Start-up order matters to containerd: the store is opened and every remote snapshot's layer
//! is mounted (adopted or started, all layers at once) before the snapshots socket accepts
//! calls, so containerd never sees a remote snapshot whose directory is empty. A layer whose registry is
//! unreachable still mounts from the cached TOC; if even that fails, the daemon logs it and
//! keeps going (reads of that snapshot fail until the layer is mounted again by a later start).
//!
//! While it runs, the servers' statuses are asked every second ([`COLLECT_EVERY`]) and kept, so
//! `vmdisk ls` and `/metrics` need not wait for a server busy serving reads (they show its last
//! answer after 50 ms), and their counters are taken in, so little is lost if a server dies.
//! Stopping the daemon (SIGTERM, SIGINT) closes the sockets,
//! keeps the counters and leaves the mount servers running, so containers keep reading across
//! a restart.

mod disks;
pub mod filter;
pub mod grpc;
pub mod metrics;
pub mod priority;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::api::containerd::services::snapshots::v1::snapshots_server::SnapshotsServer;
use crate::api::vmdisk::v1::manage_server::ManageServer;
use crate::cache::CacheRoot;
use crate::error::{Error, ErrorKind, Result};
use crate::registry::RegistryClient;
use crate::snapshotter::config::Config;
use crate::snapshotter::daemon::grpc::{ManageService, SnapshotsService};
use crate::snapshotter::prepare::classify::{Classifier, ContentStore};
use crate::snapshotter::servers::supervisor::{LayerServers, ServerCommand};
use crate::snapshotter::Snapshotter;

/// How often the daemon asks its mount servers their status (and takes in their counters).
pub const COLLECT_EVERY: Duration = Duration::from_secs(1);

/// containerd's CRI plugin reports `<containerd root>/io.containerd.snapshotter.v1.<plugin>` as
/// the image filesystem of every snapshotter, a proxy one included, and kubelet's eviction
/// manager stats that path (and fails when it does not exist). It is made a link to the
/// daemon's root, so it lies on the filesystem that holds vmdisk's snapshots and cache: what
/// the image filesystem stats count (each snapshot's `Usage`, a remote one's cached bytes
/// included) is stored there. A directory already at that path is replaced only if empty.
/// Whether the link is there: not while containerd's root does not exist yet (vmdisk started
/// first, [`keep_image_filesystem_linked`] makes it once containerd has).
pub fn link_image_filesystem(config: &Config) -> Result<bool> {
    let containerd = &config.containerd;
    if !containerd.root.is_dir() {
        return Ok(false);
    }
    if containerd.plugin.is_empty() || containerd.plugin.contains('/') {
        return Err(Error::invalid(format!(
            "containerd.plugin {:?} is not a plugin name",
            containerd.plugin
        )));
    }
    let link = containerd.root.join(format!(
        "io.containerd.snapshotter.v1.{}",
        containerd.plugin
    ));
    let target = std::path::absolute(&config.root)
        .map_err(|e| Error::io(format!("resolving {}", config.root.display()), e))?;
    match std::fs::symlink_metadata(&link) {
        Ok(m) if m.file_type().is_symlink() => {
            if std::fs::read_link(&link).ok().as_deref() == Some(target.as_path()) {
                return Ok(true);
            }
        }
        Ok(m) if m.is_dir() => {
            if std::fs::remove_dir(&link).is_err() {
                tracing::warn!(path = %link.display(), "containerd's image filesystem path for vmdisk is a directory with files in it; left as it is (kubelet's image filesystem stats count that directory, not vmdisk's root)");
                return Ok(true);
            }
        }
        Ok(_) => {
            return Err(Error::invalid(format!(
                "{} exists and is not a directory or a link; remove it so it can point at {}",
                link.display(),
                target.display()
            )))
        }
        Err(_) => {}
    }
    crate::serve::ready::replace_symlink(&link, &target)?;
    tracing::info!(link = %link.display(), target = %target.display(), "containerd's image filesystem for this snapshotter points at its root");
    Ok(true)
}

/// How often a daemon that started before containerd looks for containerd's root.
const LINK_AGAIN: Duration = Duration::from_secs(2);

/// Makes the image filesystem link now if containerd's root exists, else once it does (looked
/// for every [`LINK_AGAIN`] in the background): whichever of vmdisk and containerd starts
/// first, kubelet's image filesystem stats find vmdisk's root.
async fn keep_image_filesystem_linked(config: &Config) -> Result<()> {
    if link_image_filesystem(config)? {
        return Ok(());
    }
    tracing::info!(root = %config.containerd.root.display(), "no containerd root yet; the image filesystem link is made once containerd has made it");
    let config = config.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(LINK_AGAIN).await;
            let c = config.clone();
            match crate::snapshotter::blocking(move || link_image_filesystem(&c)).await {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %e.chain(), "linking containerd's image filesystem failed");
                    return;
                }
            }
        }
    });
    Ok(())
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(config: Config, config_path: Option<PathBuf>) -> Result<()> {
    let snapshotter = open(&config, config_path).await?;
    // Remote snapshots come back before containerd can ask for them.
    let remote_layers = snapshotter.mount_recorded().await?;
    if let Some(limit) = config.cache_limit()? {
        let dir = config.cache_dir();
        let freed =
            crate::snapshotter::blocking(move || CacheRoot::open(&dir)?.evict(limit)).await?;
        tracing::info!(freed, limit, "cache eviction done");
    }

    let snapshots = crate::api::unix::bind(&config.address, 0o660)?;
    let manage = crate::api::unix::bind(&config.manage_address, 0o600)?;
    let background = Background::spawn(&config, &snapshotter)?;
    tracing::info!(address = %config.address.display(), manage = %config.manage_address.display(), remote_layers, "vmdisk-snapshotter ready");
    // Under systemd (Type=notify): ready once the sockets are bound, so containerd, ordered
    // after this unit, finds them.
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
        tracing::warn!(error = %e, "telling systemd the daemon is ready failed");
    }
    serve(snapshots, manage, &snapshotter).await?;
    background.stop();
    if let Err(e) = collect(&snapshotter).await {
        tracing::warn!(error = %e.chain(), "keeping the counters failed");
    }
    for path in [
        &config.address,
        &config.manage_address,
        &config.cri.image_service_address,
    ] {
        if !path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(path);
        }
    }
    tracing::info!("vmdisk-snapshotter stopped; mount servers keep serving");
    Ok(())
}

/// The daemon's state directories made private, its registry client, servers, classifier and
/// store opened: the snapshotter, before anything is mounted or served.
async fn open(config: &Config, config_path: Option<PathBuf>) -> Result<Arc<Snapshotter>> {
    // Node state is root's alone; the ready disks root's and the VMM group's.
    crate::dirs::private(&config.root)?;
    crate::dirs::private(&config.cache_dir())?;
    crate::serve::ready::prepare_root(&config.ready_dir, config.vmm_gid()?)?;
    keep_image_filesystem_linked(config).await?;
    let client = Arc::new(RegistryClient::new(config.registry_config())?);
    // Which namespace's pulls granted what (the CRI proxy tells); memory only.
    let tenants = crate::snapshotter::prepare::tenants::Tenants::new(
        config.cri.verify_pulled_images,
        Duration::from_secs(config.cri.credentials_ttl),
    );
    let servers = LayerServers::new(ServerCommand {
        exe: std::env::current_exe()
            .map_err(|e| Error::io("finding the daemon's own executable", e))?,
        config: config_path,
        root: config.root.clone(),
        ready_dir: config.ready_dir.clone(),
        mount_timeout: Duration::from_secs(config.registry.mount_timeout),
        // Read once here, for the daemon's clients and every server it starts.
        tls_roots: crate::snapshotter::blocking(|| {
            Ok(crate::registry::roots::Roots::default().certificates())
        })
        .await?,
        // The daemon's threads ahead of the servers' reads, from before the first is started.
        nice: {
            let boost = config.control_priority;
            crate::snapshotter::blocking(move || {
                Ok(crate::snapshotter::daemon::priority::raise(boost))
            })
            .await?
        },
    });
    let (root, cache) = (
        config.root.clone(),
        crate::snapshotter::CacheSettings {
            dir: config.cache_dir(),
            limit: config.cache_limit()?,
            memory_budget: config.memory_budget()?,
        },
    );
    let signatures = config.signatures.clone();
    let containerd_root = config.containerd.root.clone();
    let index_search = config.registry.index_search;
    Ok(Arc::new(
        crate::snapshotter::blocking(move || {
            let trust = crate::policy::Verifier::load(&signatures)
                .map_err(|e| e.context("configuration [signatures]"))?;
            if trust.is_set() {
                tracing::info!(?trust, "signature policy in force");
            }
            // The classifier keeps the manifests and configs it verifies in the cache, where the
            // mount servers find them instead of fetching them again; those of an image
            // containerd is pulling it takes from containerd's content store.
            let kept = crate::cache::CacheRoot::open(&cache.dir)?;
            let classifier = Classifier::new(client, Some(kept), Arc::new(trust))
                .with_content_store(ContentStore::of_root(&containerd_root))
                .with_index_search(index_search);
            let pulls = crate::snapshotter::prepare::Pulls::new(classifier, tenants);
            Snapshotter::open(&root, Box::new(servers), pulls, cache)
        })
        .await?,
    ))
}

/// What the daemon runs beside its APIs: the metrics endpoint, the CRI image service (when
/// configured), the servers' counters collection each [`COLLECT_EVERY`] and the look for pods
/// whose containers will not use their lazy pulls ([`crate::snapshotter::prepare::pods`]).
struct Background {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Background {
    fn spawn(config: &Config, snapshotter: &Arc<Snapshotter>) -> Result<Self> {
        let metrics_task = {
            let address = config.metrics_address()?;
            let s = Arc::clone(snapshotter);
            tokio::spawn(async move {
                if let Err(e) = crate::snapshotter::daemon::metrics::serve(address, s).await {
                    tracing::error!(error = %e.chain(), "metrics endpoint stopped");
                }
            })
        };
        let cri_on = !config.cri.image_service_address.as_os_str().is_empty();
        let cri_task = cri_on.then(|| {
            let (cri, s) = (config.cri.clone(), Arc::clone(snapshotter));
            tokio::spawn(async move {
                if let Err(e) = crate::snapshotter::prepare::cri::serve(cri, s).await {
                    tracing::error!(error = %e.chain(), "the CRI image service stopped");
                }
            })
        });
        let collect_task = {
            let s = Arc::clone(snapshotter);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(COLLECT_EVERY).await;
                    if let Err(e) = collect(&s).await {
                        tracing::warn!(error = %e.chain(), "collecting the mount servers' counters failed");
                    }
                }
            })
        };
        // A server that dies with its mounts up is succeeded at once, on its connections.
        let revive_task = {
            let s = Arc::clone(snapshotter);
            tokio::spawn(async move {
                while let Some(layer) = s.servers.died().await {
                    tokio::spawn(Arc::clone(&s).revive(layer));
                }
            })
        };
        let pods_task = {
            let (containerd, pulled) = (
                config.cri.containerd_address.clone(),
                Arc::clone(&snapshotter.lazily_pulled),
            );
            tokio::spawn(async move {
                crate::snapshotter::prepare::pods::watch(&containerd, pulled).await
            })
        };
        Ok(Background {
            tasks: [
                Some(metrics_task),
                cri_task,
                Some(collect_task),
                Some(revive_task),
                Some(pods_task),
            ]
            .into_iter()
            .flatten()
            .collect(),
        })
    }

    fn stop(self) {
        for task in self.tasks {
            task.abort();
        }
    }
}

/// Serves the snapshots API on `snapshots` and the management API on `manage` until SIGINT or
/// SIGTERM.
async fn serve(
    snapshots: tokio::net::UnixListener,
    manage: tokio::net::UnixListener,
    snapshotter: &Arc<Snapshotter>,
) -> Result<()> {
    let snapshots_svc = SnapshotsServer::new(SnapshotsService {
        snapshotter: Arc::clone(snapshotter),
    });
    let manage_svc = ManageServer::new(ManageService {
        snapshotter: Arc::clone(snapshotter),
    });
    let shutdown = async {
        if let Err(e) = crate::serve::wait_for_signal().await {
            tracing::error!(error = %e.chain(), "signal handling failed");
        }
    };
    let (tx, rx) = tokio::sync::watch::channel(false);
    let manage_task = tokio::spawn(async move {
        let mut rx = rx;
        let _ = tonic::transport::Server::builder()
            .add_service(manage_svc)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(manage),
                async move {
                    let _ = rx.wait_for(|stop| *stop).await;
                },
            )
            .await;
    });
    tonic::transport::Server::builder()
        .add_service(snapshots_svc)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(snapshots),
            shutdown,
        )
        .await
        .map_err(|e| Error::new(ErrorKind::Io, "serving the snapshots API").with_source(e))?;
    let _ = tx.send(true);
    let _ = manage_task.await;
    Ok(())
}

/// Takes in every recorded layer's server counters and keeps the totals.
async fn collect(s: &Arc<Snapshotter>) -> Result<()> {
    let me = Arc::clone(s);
    let layers = crate::snapshotter::blocking(move || me.remote_layers()).await?;
    s.statuses(layers.into_keys(), crate::snapshotter::Freshness::Now)
        .await;
    s.save_counters().await
}
