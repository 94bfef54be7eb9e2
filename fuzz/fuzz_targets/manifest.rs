//! Manifests, indexes and the layer annotations that locate a TOC.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = vmdisk::oci::parse_manifest(data, None);
    if let Ok(annotations) = serde_json::from_slice(data) {
        let _ = vmdisk::format::zstd_chunked::TocLocation::from_annotations(&annotations);
    }
});
