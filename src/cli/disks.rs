//! The commands that ask the node's daemon over its management socket: `path`, `prefetch`,
//! `rm`, `gc`, `stats`, `ls`.

use std::path::{Path, PathBuf};

use crate::api::vmdisk::v1::{DiskRequest, GcRequest, ListDisksRequest, StatusRequest};
use crate::error::{Error, Result};
use crate::format::disk::DiskFormat;
use crate::oci::reference::Reference;
use crate::registry::{RegistryClient, RegistryConfig};
use crate::serve::ready::Handed;

use super::args::{GcArgs, LsArgs, ManageArgs, PathArgs, PrefetchArgs, RefArgs};

/// `vmdisk path`: the disk made ready by the daemon, as the runtime is handed it.
pub(super) async fn path(args: PathArgs) -> Result<()> {
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
        let raw = crate::serve::ready::raw_view_path(Path::new(&disk.ready_dir))?;
        println!("{}", raw.display());
    } else {
        println!("{}", ready_path(&disk, Handed::AsPublished));
    }
    Ok(())
}

/// `vmdisk prefetch`: the rest of the disk fetched in the background (or waited for).
pub(super) async fn prefetch(args: PrefetchArgs) -> Result<()> {
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
    Ok(())
}

/// `vmdisk rm`: the disk no longer served (kept mounted while containers use it).
pub(super) async fn rm(args: RefArgs) -> Result<()> {
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
    Ok(())
}

/// `vmdisk gc`: unused mounts stopped and the cache trimmed.
pub(super) async fn gc(args: GcArgs) -> Result<()> {
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
    Ok(())
}

/// `vmdisk stats`: the daemon's counters as JSON.
pub(super) async fn stats(args: ManageArgs) -> Result<()> {
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
        retry: crate::retry::RetryPolicy::registry(std::time::Duration::from_secs(
            args.daemon.timeout,
        )),
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
    let progress = args.progress.display().start(
        format!("prefetching {}", args.reference),
        crate::progress::Unit::Chunks,
    );
    progress.set_total(disk.chunks);
    loop {
        progress.set(disk.chunks_cached);
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
            progress.finish();
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
        .join(crate::serve::ready::VOLUMES_DIR);
    let names = match handed {
        Handed::Raw => vec![crate::serve::ready::volume_name(reference, DiskFormat::Raw)],
        Handed::AsPublished => vec![
            crate::serve::ready::volume_name(reference, DiskFormat::Qcow2),
            crate::serve::ready::volume_name(reference, DiskFormat::Raw),
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
        Handed::Raw => dir.join(crate::serve::ready::RAW_NAME),
        Handed::AsPublished => crate::serve::ready::published_path(dir, &disk.disk_path),
    };
    path.display().to_string()
}

/// `vmdisk ls`: the daemon's remote disks, one line each (or JSON).
pub(super) async fn ls(args: LsArgs) -> Result<()> {
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
                    "cache_full": d.cache_full, "memory_held": d.memory_held,
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
                (true, true) => format!(
                    " (cache_full: answered from memory, {} bytes held)",
                    d.memory_held
                ),
                (true, false) => String::new(),
            }
        );
    }
    Ok(())
}
