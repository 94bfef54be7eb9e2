//! Starting and stopping the daemon, and the `serve-layer` mount server it runs per layer.
//!
//! Start-up order matters to containerd: the store is opened and every remote snapshot's layer
//! is mounted (adopted or started) before the snapshots socket accepts calls, so containerd
//! never sees a remote snapshot whose directory is empty. A layer whose registry is
//! unreachable still mounts from the cached TOC; if even that fails, the daemon logs it and
//! keeps going (reads of that snapshot fail until the layer is mounted again by a later start).
//!
//! Stopping the daemon (SIGTERM, SIGINT) closes the sockets and leaves the mount servers
//! running, so containers keep reading across a restart.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::classify::Classifier;
use super::config::Config;
use super::grpc::{CallCounts, ManageService, SnapshotsService};
use super::layers::{LayerPaths, LayerServers, ServerCommand, READY_LINE};
use super::Snapshotter;
use crate::api::containerd::services::snapshots::v1::snapshots_server::SnapshotsServer;
use crate::api::vmdisk::v1::manage_server::ManageServer;
use crate::cache::CacheRoot;
use crate::digest::Digest;
use crate::engine::{Engine, EngineOptions};
use crate::error::{Error, ErrorKind, Result};
use crate::reference::Reference;
use crate::registry::RegistryClient;

/// The file name of an image reference in `by-name/` and `volumes/` (a libvirt volume name).
///
/// Injective, so two references never share a name and one never re-points another's links:
/// ASCII letters, digits, `.` and `-` stay as they are, `/` becomes `_`, `:` becomes `+`, and
/// every other byte (`_`, `+` and `%` included) becomes `%XX`. `registry.example/vm/fedora:39`
/// is `registry.example_vm_fedora+39`. A name that would be longer than 200 bytes keeps its
/// first 120 and ends in `%%` and the reference's sha256 (no short name contains `%%`).
pub fn alias_name(reference: &str) -> String {
    let mut name = String::with_capacity(reference.len());
    for b in reference.bytes() {
        match b {
            b'/' => name.push('_'),
            b':' => name.push('+'),
            b if b.is_ascii_alphanumeric() || b == b'.' || b == b'-' => name.push(b as char),
            b => name.push_str(&format!("%{b:02X}")),
        }
    }
    if name.starts_with('.') {
        // ".", ".." and hidden names are not file names to hand out.
        name = format!("%2E{}", &name[1..]);
    }
    if name.len() > 200 {
        let mut cut = 120;
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        name = format!(
            "{}%%{}",
            &name[..cut],
            Digest::of(reference.as_bytes()).hex()
        );
    }
    name
}

/// Binds a unix socket at `path` with `mode`, replacing a stale socket file.
pub fn bind_unix(path: &Path, mode: u32) -> Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!(
                        "{} is in use by a running process; is another vmdisk-snapshotter running?",
                        path.display()
                    ),
                ));
            }
            std::fs::remove_file(path).map_err(|e| {
                Error::io(format!("removing the stale socket {}", path.display()), e)
            })?;
        }
        Ok(_) => {
            return Err(Error::invalid(format!(
                "{} exists and is not a socket; choose another address",
                path.display()
            )))
        }
        Err(_) => {}
    }
    let listener = tokio::net::UnixListener::bind(path)
        .map_err(|e| Error::io(format!("listening on {}", path.display()), e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io(format!("chmod {}", path.display()), e))?;
    Ok(listener)
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(config: Config, config_path: Option<PathBuf>) -> Result<()> {
    std::fs::create_dir_all(&config.root)
        .map_err(|e| Error::io(format!("creating {}", config.root.display()), e))?;
    let client = Arc::new(RegistryClient::new(config.registry_config())?);
    let servers = LayerServers::new(ServerCommand {
        exe: std::env::current_exe()
            .map_err(|e| Error::io("finding the daemon's own executable", e))?,
        config: config_path,
        root: config.root.clone(),
        ready_dir: config.ready_dir.clone(),
        mount_timeout: Duration::from_secs(config.registry.mount_timeout),
    });
    let snapshotter = Arc::new(Snapshotter::open(
        &config.root,
        servers,
        Classifier::new(client),
        super::CacheSettings {
            dir: config.cache_dir(),
            limit: config.cache_limit()?,
        },
    )?);

    // Remote snapshots come back before containerd can ask for them.
    let me = Arc::clone(&snapshotter);
    let layers = super::blocking(move || me.remote_layers()).await?;
    for (layer, (remote, snapshots)) in &layers {
        match snapshotter
            .servers
            .ensure(&remote.reference, layer, remote.alias.as_deref())
            .await
        {
            Ok(mnt) => {
                tracing::info!(%layer, mountpoint = %mnt.display(), snapshots = snapshots.len(), "remote snapshot layer mounted")
            }
            Err(e) => {
                tracing::error!(%layer, error = %e.chain(), "cannot mount a remote snapshot's layer; reads of it fail until a restart mounts it")
            }
        }
    }
    if let Some(limit) = config.cache_limit()? {
        let cache = CacheRoot::open(&config.cache_dir())?;
        let freed = super::blocking(move || cache.evict(limit)).await?;
        tracing::info!(freed, limit, "cache eviction done");
    }

    let calls = Arc::new(CallCounts::new());
    let snapshots = bind_unix(&config.address, 0o660)?;
    let manage = bind_unix(&config.manage_address, 0o600)?;
    let metrics_task = {
        let address = config.metrics_address()?;
        let (s, c) = (Arc::clone(&snapshotter), Arc::clone(&calls));
        tokio::spawn(async move {
            if let Err(e) = super::metrics::serve(address, s, c).await {
                tracing::error!(error = %e.chain(), "metrics endpoint stopped");
            }
        })
    };
    let snapshots_svc = SnapshotsServer::new(SnapshotsService {
        snapshotter: Arc::clone(&snapshotter),
        calls: Arc::clone(&calls),
    });
    let manage_svc = ManageServer::new(ManageService {
        snapshotter: Arc::clone(&snapshotter),
    });
    tracing::info!(address = %config.address.display(), manage = %config.manage_address.display(), remote_layers = layers.len(), "vmdisk-snapshotter ready");
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
    metrics_task.abort();
    for path in [&config.address, &config.manage_address] {
        let _ = std::fs::remove_file(path);
    }
    tracing::info!("vmdisk-snapshotter stopped; mount servers keep serving");
    Ok(())
}

/// The `serve-layer` mount server: resolves `reference`, checks that its disk layer is
/// `layer`, mounts it at `<root>/mounts/<hex>`, prints [`READY_LINE`] and serves until
/// SIGTERM (refused while the mount is busy).
pub async fn serve_layer(
    config: &Config,
    reference: &str,
    layer: &Digest,
    alias: Option<&str>,
) -> Result<()> {
    let reference: Reference = reference.parse()?;
    let paths = LayerPaths::new(&config.root, layer);
    let client = Arc::new(RegistryClient::new(config.registry_config())?);
    let cache = CacheRoot::open(&config.cache_dir())?;
    let opts = EngineOptions {
        fetch_deadline: Duration::from_secs(config.registry.fetch_timeout),
        ..EngineOptions::default()
    };
    let engine = Engine::open(client, &cache, &reference, opts).await?;
    let key = engine.layer.id().key();
    if key != *layer {
        return Err(Error::corrupt(format!(
            "{reference} resolves to disk layer {} with key {key}, not {layer}; the image changed since the snapshot was made",
            engine.layer.meta.layer_digest
        )));
    }
    let digest = reference.digest.ok_or_else(|| {
        Error::invalid(format!(
            "{reference}: serve-layer needs a reference by digest"
        ))
    })?;
    let platform = cache
        .load_ref(&reference.to_string())
        .map(|r| r.platform)
        .unwrap_or_default();
    let ready = crate::serve::ReadyDir {
        dir: config.ready_dir.join(digest.hex()),
        alias: alias.map(|a| config.ready_dir.join("by-name").join(alias_name(a))),
        volumes: alias.map(|a| config.ready_dir.join("volumes").join(alias_name(a))),
        reference: reference.to_string(),
        platform,
    };
    let serving = crate::serve::start(
        Arc::clone(&engine),
        &cache,
        &paths.mountpoint,
        &crate::serve::ServeOptions {
            hydrate: config.cache.hydrate,
            hydrate_rate: config.cache.hydrate_rate,
            passthrough: config.cache.passthrough,
            stats_file: Some(paths.stats_file()),
            announce: false,
            ready: Some(ready),
            hydrate_request: Some(paths.hydrate_request()),
        },
    )
    .await?;
    crate::serve::write_stats(&paths.stats_file(), &engine)?;
    // The only line this process writes to stdout; the daemon may be gone later.
    println!("{READY_LINE} {}", serving.disk_path().display());
    tracing::info!(%reference, %layer, mountpoint = %paths.mountpoint.display(), "serving");
    serving.serve_until_signalled().await?;
    serving.finish().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::alias_name;

    #[test]
    fn alias_names_are_readable_and_injective() {
        assert_eq!(
            alias_name("registry.example/vm/fedora:39"),
            "registry.example_vm_fedora+39"
        );
        // These collided when `/` and `:` both became `_`.
        let colliding = [
            "a/b/c:1",
            "a/b_c:1",
            "a/b_c+1",
            "a/b%5Fc:1",
            "a_b/c:1",
            "a/b/c/1",
            "..",
            ".a",
            "%2Ea",
        ];
        let names: Vec<String> = colliding.iter().map(|r| alias_name(r)).collect();
        for (i, a) in names.iter().enumerate() {
            assert!(!a.contains('/') && a != "." && a != ".." && !a.starts_with('.'));
            for (j, b) in names.iter().enumerate() {
                assert!(
                    i == j || a != b,
                    "{} and {} share {a}",
                    colliding[i],
                    colliding[j]
                );
            }
        }
        // Long references keep a readable start and stay distinct.
        let long = |c: char| format!("r.example/{}:1", c.to_string().repeat(300));
        let (x, y) = (alias_name(&long('x')), alias_name(&long('y')));
        assert!(x.len() <= 200 && x.starts_with("r.example_xxx") && x.contains("%%"));
        assert_ne!(x, y);
        let same_prefix = |tag: &str| alias_name(&format!("r.example/{}:{tag}", "z".repeat(300)));
        assert_ne!(same_prefix("1"), same_prefix("2"));
    }
}
