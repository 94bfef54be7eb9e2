//! Manifests, indexes, the layer annotations that locate a TOC, and boot traces (the seed
//! corpus holds one recorded on the layer `sha256("layer")`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = vmdisk::oci::parse_manifest(data, None);
    if let Ok(annotations) = serde_json::from_slice(data) {
        let _ = vmdisk::format::zstd_chunked::TocLocation::from_annotations(&annotations);
    }
    let layer = vmdisk::digest::Digest::of(b"layer");
    if let Ok(trace) = vmdisk::trace::BootTrace::parse(data, &layer, 1 << 30) {
        assert!(trace.byte_ranges().iter().all(|r| r.end <= 1 << 30 && !r.is_empty()));
    }
});
