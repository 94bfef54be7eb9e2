//! Manifests, indexes, the layer annotations that locate a TOC, a disk artifact's choice of
//! its disk layer and the path it gets (always under `disk/` or `image/`), and boot traces
//! (the seed corpus holds one recorded on the layer `sha256("layer")`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(vmdisk::oci::ManifestKind::Image(m)) = vmdisk::oci::parse_manifest(data, None) {
        use vmdisk::format::artifact;
        let _ = artifact::is_artifact(&m);
        let _ = artifact::disk_source(&m);
        if let Ok(disk) = artifact::disk_file(&m) {
            let clean = vmdisk::format::tree::clean_path(&disk.path);
            assert_eq!(clean.as_deref().ok(), Some(disk.path.as_str()));
            assert!(vmdisk::format::layout::is_disk_path(&disk.path, None));
        }
    }
    if let Ok(annotations) = serde_json::from_slice(data) {
        let _ = vmdisk::format::zstd_chunked::TocLocation::from_annotations(&annotations);
    }
    let layer = vmdisk::oci::digest::Digest::of(b"layer");
    if let Ok(trace) = vmdisk::trace::BootTrace::parse(data, &layer, 1 << 30) {
        assert!(trace.byte_ranges().iter().all(|r| r.end <= 1 << 30 && !r.is_empty()));
    }
});
