//! qcow2 header and cluster-table validation on arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = vmdisk::format::qcow2::check_complete(data) {
        assert!((9..=21).contains(&header.cluster_bits));
    }
    let _ = vmdisk::format::disk::sniff(data, data, data.len() as u64);
});
