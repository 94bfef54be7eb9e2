//! Boot traces: which parts of a disk a boot reads, in the order it first reads them.
//!
//! `vmdisk trace record` mounts an image, runs a boot against it and records the chunks of
//! the disk file the boot touches ([`crate::engine::Engine::start_recording`]); the trace is
//! written to a file and/or published beside the image as an OCI 1.1 artifact whose `subject`
//! is the image's platform manifest (found through the referrers API, or the `sha256-<hex>`
//! fallback tag on registries without it). A mount server that starts on a layer that is not
//! complete looks for a published trace and fetches the traced chunks first, in order, a few
//! requests at a time, while reads are served as they come ([`replay_published`]).
//!
//! A trace is untrusted input like any registry bytes: it only orders prefetching. It is
//! bounded ([`MAX_TRACE_BYTES`], [`MAX_RANGES`]), must name the layer it was recorded on, and
//! every range must lie inside the disk file; every chunk it leads to is verified as always.
//! The format is in `docs/format.md` ("Boot traces").

use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::{self, Descriptor};
use crate::registry::RegistryClient;

/// Media type of a trace blob, and artifact type of its manifest.
pub const MEDIA_TYPE: &str = "application/vnd.vmdisk.boot-trace.v1+json";
/// The largest trace accepted (about 40 000 ranges).
pub const MAX_TRACE_BYTES: u64 = 1 << 20;
/// The most ranges a trace may hold.
pub const MAX_RANGES: usize = 65_536;

/// A recorded boot: byte ranges of the layer's disk file in first-read order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BootTrace {
    /// Always 1.
    pub version: u32,
    /// The layer (compressed blob digest) the trace was recorded on.
    pub layer: Digest,
    /// The disk file's path in the layer.
    pub disk: String,
    /// `[offset, length]` pairs.
    pub ranges: Vec<[u64; 2]>,
}

impl BootTrace {
    /// A trace of `ranges` of `engine`'s disk.
    pub fn of(engine: &Engine, ranges: Vec<Range<u64>>) -> Self {
        let layer = engine.layer();
        BootTrace {
            version: 1,
            layer: layer.meta.layer_digest,
            disk: layer.disk_path().to_string(),
            ranges: ranges
                .into_iter()
                .map(|r| [r.start, r.end - r.start])
                .collect(),
        }
    }

    /// Parses and checks a trace for the layer `layer` whose disk file is `disk_size` bytes.
    pub fn parse(bytes: &[u8], layer: &Digest, disk_size: u64) -> Result<Self> {
        if bytes.len() as u64 > MAX_TRACE_BYTES {
            return Err(Error::corrupt(format!(
                "boot trace is {} bytes, more than the {MAX_TRACE_BYTES} accepted",
                bytes.len()
            )));
        }
        let trace: BootTrace = serde_json::from_slice(bytes)
            .map_err(|e| Error::corrupt(format!("boot trace is not valid: {e}")))?;
        if trace.version != 1 {
            return Err(Error::unsupported(format!(
                "boot trace version {} is not supported (only 1)",
                trace.version
            )));
        }
        if trace.layer != *layer {
            return Err(Error::corrupt(format!(
                "boot trace was recorded on layer {}, not {layer}",
                trace.layer
            )));
        }
        if trace.ranges.len() > MAX_RANGES {
            return Err(Error::corrupt(format!(
                "boot trace holds {} ranges, more than the {MAX_RANGES} accepted",
                trace.ranges.len()
            )));
        }
        if let Some([offset, len]) = trace.ranges.iter().find(|[offset, len]| {
            *len == 0 || offset.checked_add(*len).is_none_or(|end| end > disk_size)
        }) {
            return Err(Error::corrupt(format!(
                "boot trace range {offset}+{len} is empty or outside the {disk_size}-byte disk"
            )));
        }
        Ok(trace)
    }

    /// The ranges as byte ranges.
    pub fn byte_ranges(&self) -> Vec<Range<u64>> {
        self.ranges.iter().map(|[o, l]| *o..o + l).collect()
    }

    /// The trace as JSON.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("trace serialises")
    }
}

/// Publishes `trace` as an artifact referring to the image manifest `subject` in `target`'s
/// repository (one trace per image: a new one replaces the old in the fallback tag). Returns
/// the artifact manifest's digest.
pub async fn publish(
    client: &RegistryClient,
    target: &Reference,
    subject: Descriptor,
    trace: &BootTrace,
) -> Result<Digest> {
    let blob = trace.to_json();
    let layer = Descriptor::of(MEDIA_TYPE, &blob);
    let published = async {
        client.push_blob(target, &layer.digest, blob.into()).await?;
        client
            .push_referrer(target, subject, MEDIA_TYPE, vec![layer], Default::default())
            .await
    };
    published
        .await
        .map_err(|e| e.context("publishing the boot trace"))
}

/// The boot trace published for image manifest `manifest` of `reference` for `engine`'s
/// layer, if there is one (the newest listed).
pub async fn find(
    client: &RegistryClient,
    reference: &Reference,
    manifest: &Digest,
    engine: &Engine,
) -> Result<Option<BootTrace>> {
    let referrers = client.referrers(reference, manifest, &[MEDIA_TYPE]).await?;
    let Some(desc) = referrers.last() else {
        return Ok(None);
    };
    let artifact = client
        .get_manifest(&reference.with_digest(desc.digest))
        .await?;
    let oci::ManifestKind::Image(artifact) = artifact.manifest else {
        return Err(Error::corrupt(format!(
            "boot trace {} is an index, not a manifest",
            desc.digest
        )));
    };
    let blob = artifact
        .layers
        .iter()
        .find(|l| l.media_type == MEDIA_TYPE)
        .ok_or_else(|| {
            Error::corrupt(format!(
                "boot trace artifact {} holds no {MEDIA_TYPE} layer",
                desc.digest
            ))
        })?;
    let bytes = client.get_blob(reference, blob, MAX_TRACE_BYTES).await?;
    let layer = engine.layer();
    BootTrace::parse(
        &bytes,
        &layer.meta.layer_digest,
        layer.file_size(layer.disk),
    )
    .map(Some)
}

/// Looks for a trace published for `engine`'s image and, if there is one, fetches what it
/// lists first, in order. Does nothing for a complete layer; failures are logged, never fatal
/// (the boot then simply reads on demand).
pub async fn replay_published(
    client: Arc<RegistryClient>,
    engine: Arc<Engine>,
    reference: Reference,
    manifest: Digest,
) {
    if engine.complete() {
        return;
    }
    match find(&client, &reference, &manifest, &engine).await {
        Ok(Some(trace)) => {
            let started = std::time::Instant::now();
            let ranges = trace.byte_ranges();
            match engine.replay(&ranges).await {
                Ok(chunks) => tracing::info!(
                    ranges = ranges.len(),
                    chunks,
                    ms = started.elapsed().as_millis() as u64,
                    "fetched the chunks of the published boot trace"
                ),
                Err(e) => tracing::warn!(error = %e.chain(), "replaying the boot trace stopped"),
            }
        }
        Ok(None) => tracing::debug!(%reference, "no boot trace published"),
        Err(e) => {
            tracing::warn!(%reference, error = %e.chain(), "ignoring the published boot trace")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer() -> Digest {
        Digest::of(b"layer")
    }

    fn trace(ranges: Vec<[u64; 2]>) -> Vec<u8> {
        BootTrace {
            version: 1,
            layer: layer(),
            disk: "disk/d.qcow2".into(),
            ranges,
        }
        .to_json()
    }

    #[test]
    fn a_trace_round_trips() {
        let bytes = trace(vec![[0, 262_144], [1 << 20, 524_288]]);
        let parsed = BootTrace::parse(&bytes, &layer(), 4 << 20).unwrap();
        assert_eq!(
            parsed.byte_ranges(),
            vec![0..262_144, (1 << 20)..(1 << 20) + 524_288]
        );
    }

    #[test]
    fn crafted_traces_are_refused() {
        let size = 4 << 20;
        // Another layer's trace, a range past the end, an overflowing range, an empty range.
        let other = BootTrace {
            layer: Digest::of(b"other"),
            ..BootTrace::parse(&trace(vec![[0, 1]]), &layer(), size).unwrap()
        }
        .to_json();
        assert!(BootTrace::parse(&other, &layer(), size).is_err());
        assert!(BootTrace::parse(&trace(vec![[size - 1, 2]]), &layer(), size).is_err());
        assert!(BootTrace::parse(&trace(vec![[u64::MAX, 2]]), &layer(), size).is_err());
        assert!(BootTrace::parse(&trace(vec![[0, 0]]), &layer(), size).is_err());
        // Too many ranges; too many bytes; unknown fields; another version; not JSON.
        let many = trace(vec![[0, 1]; MAX_RANGES + 1]);
        assert!(BootTrace::parse(&many, &layer(), size).is_err());
        let big = vec![b' '; MAX_TRACE_BYTES as usize + 1];
        assert!(BootTrace::parse(&big, &layer(), size).is_err());
        let text = String::from_utf8(trace(vec![[0, 1]])).unwrap();
        let extra = text.replacen('{', "{\"x\":1,", 1);
        assert!(BootTrace::parse(extra.as_bytes(), &layer(), size).is_err());
        let v2 = text.replacen("\"version\":1", "\"version\":2", 1);
        assert!(BootTrace::parse(v2.as_bytes(), &layer(), size).is_err());
        assert!(BootTrace::parse(b"\x00\xff", &layer(), size).is_err());
    }
}
