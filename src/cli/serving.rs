//! The commands that serve a disk layer in this process: `mount` and `trace record`.

use super::args::{MountArgs, TraceRecordArgs};
use crate::error::{Error, ErrorKind, Result};
use crate::oci::Descriptor;
use crate::registry::RegistryClient;
use crate::serve::{Hydrate, ServeOptions};

/// `vmdisk mount`: serves the disk layer at `dir` until SIGINT or SIGTERM.
pub(super) async fn mount(args: MountArgs) -> Result<()> {
    let registry = &args.registry;
    use crate::engine::EngineOptions;
    let reference = args.reference.clone();
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
    let client = std::sync::Arc::new(RegistryClient::new(registry.config()?)?);
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
        crate::serve::Opening::Resolve(crate::resolve::Wanted::image(&reference)),
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
            verify_rate: args.verify_rate,
            announce: true,
            ready: None,
            registrations: None,
        },
        None,
    )
    .await?;
    println!(
        "ready: {} at {} ({} of {} chunks cached)",
        reference,
        serving.disk_path().display(),
        engine.present_count(),
        engine.layer().chunks.len()
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
pub(super) async fn trace_record(args: TraceRecordArgs) -> Result<()> {
    let registry = &args.registry;
    use crate::trace::BootTrace;
    if args.output.is_none() && !args.push {
        return Err(Error::invalid(
            "a recorded trace goes nowhere: give --output FILE, --push, or both",
        ));
    }
    let reference = args.reference.clone();
    let client = std::sync::Arc::new(registry.client()?);
    let cache = crate::cache::CacheRoot::open(&args.cache)?;
    let engine = crate::serve::open_engine(
        std::sync::Arc::clone(&client) as _,
        &cache,
        &crate::policy::Verifier::none(),
        crate::serve::Opening::Resolve(crate::resolve::Wanted::image(&reference)),
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
            verify_rate: 0,
            announce: false,
            ready: None,
            registrations: None,
        },
        None,
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
        engine.layer().file_size(engine.layer().disk),
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
