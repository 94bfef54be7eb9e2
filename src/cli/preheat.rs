//! `vmdisk preheat`: warms the registry's mirrors (a regional cache) with an image — its
//! manifests, its config and every layer's blob, read through them by ranges — so that a
//! rollout of the disk starts warm and costs the origin nothing (docs/fleet.md).
//!
//! A Range cache (nginx's slice cache) keeps the slices each range covers: every range of every
//! blob is asked once. A pull-through cache (CNCF distribution, Harbor) answers the first range
//! of a blob it lacks with all of it and fetches it whole: the ranges then wait for that fill
//! ([`Registry::filling`]) and are asked again until it answers them. Either way the bytes that
//! came back are checked against the blob's digest, so a preheat that ends well says that the
//! mirror serves the blob, rightly.

use std::ops::Range;
use std::time::Instant;

use futures_util::StreamExt;

use super::args::PreheatArgs;
use crate::blob::Blob;
use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::Hasher;
use crate::oci::reference::Reference;
use crate::oci::Descriptor;
use crate::registry::{Ask, Registry, RegistryClient};

/// Bytes of one range asked of the mirrors: 16 of the shipped slice cache's 512 KiB slices.
const PIECE: u64 = 8 << 20;
/// Ranges of one blob asked at once.
const IN_FLIGHT: usize = 4;

/// `vmdisk preheat`.
pub(super) async fn preheat(args: PreheatArgs) -> Result<()> {
    let started = Instant::now();
    let client = args.registry.client()?;
    let r = &args.reference;
    let (manifest, digest, _) = crate::resolve::platform_manifest(&client, None, r).await?;
    client
        .get_blob(r, &manifest.config, crate::oci::MAX_CONFIG_SIZE)
        .await
        .map_err(|e| e.context(format!("warming the config of {r}")))?;
    let mut bytes = 0;
    let progress = args
        .progress
        .display()
        .start(format!("warming {r}"), crate::progress::Unit::Bytes);
    progress.set_total(manifest.layers.iter().map(|l| l.size).sum());
    for layer in &manifest.layers {
        warm(&client, r, layer, &progress)
            .await
            .map_err(|e| e.context(format!("warming layer {} of {r}", layer.digest)))?;
        bytes += layer.size;
    }
    progress.finish();
    let through: Vec<String> = client
        .endpoint_counters()
        .into_iter()
        .filter(|(_, c)| c.bytes > 0)
        .map(|(base, c)| format!("{base} ({:.1} MB)", c.bytes as f64 / 1e6))
        .collect();
    println!(
        "warmed {r} ({digest}): {} layer{}, {:.1} MB, checked, in {:.1} s, through {}",
        manifest.layers.len(),
        if manifest.layers.len() == 1 { "" } else { "s" },
        bytes as f64 / 1e6,
        started.elapsed().as_secs_f64(),
        through.join(", ")
    );
    Ok(())
}

/// Reads every byte of blob `layer` through the mirrors, in order, and checks them against its
/// digest. The first range is asked alone: a pull-through cache that lacks the blob is made to
/// fetch it once, not once per range in flight.
async fn warm(
    client: &RegistryClient,
    r: &Reference,
    layer: &Descriptor,
    progress: &crate::progress::Progress,
) -> Result<()> {
    let mut ranges = (0..layer.size)
        .step_by(PIECE as usize)
        .map(|start| start..(start + PIECE).min(layer.size));
    let blob = &Blob::in_registry(client as &dyn Registry, r, layer.digest);
    let mut hasher = Hasher::new();
    let mut take = |bytes: &[u8]| {
        hasher.update(bytes);
        progress.inc(bytes.len() as u64);
    };
    if let Some(first) = ranges.next() {
        take(&piece(blob, first).await?);
    }
    let mut rest =
        futures_util::stream::iter(ranges.map(|range| piece(blob, range))).buffered(IN_FLIGHT);
    while let Some(bytes) = rest.next().await {
        take(&bytes?);
    }
    let got = hasher.finish();
    if got != layer.digest {
        return Err(Error::corrupt(format!(
            "the mirrors served {got} for blob {}: a mirror holds other bytes than the registry's",
            layer.digest
        )));
    }
    Ok(())
}

/// `range` of `blob` from the mirrors, under the registry retry policy; while a mirror fills
/// the blob (a pull-through cache), asked again when it may hold it, for at most
/// `registry::health::MAX_FILL_WAIT`.
async fn piece(blob: &Blob<'_>, range: Range<u64>) -> Result<bytes::Bytes> {
    loop {
        let tried = blob.fetch(range.clone(), Ask::Mirrors).await;
        match (tried, blob.filling()) {
            (Ok(bytes), _) => return Ok(bytes),
            (Err(_), Some(until)) => tokio::time::sleep_until(until).await,
            (Err(e), None) if e.kind() == ErrorKind::Unsupported => {
                return Err(e.context(
                    "no mirror answered it with a range (a pull-through cache that has not held the blob within 10 minutes, or no mirror serves ranges)",
                ))
            }
            (Err(e), None) => return Err(e),
        }
    }
}
