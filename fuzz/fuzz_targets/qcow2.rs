//! qcow2 header and cluster-table validation, and the raw view's reads, on arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = vmdisk::format::qcow2::check_complete(data) {
        assert!((9..=21).contains(&header.cluster_bits));
    }
    let _ = vmdisk::format::disk::sniff(data, data, data.len() as u64);
    // Reads of the raw view either fill the buffer or fail; they never panic or overrun.
    if let Ok(view) = vmdisk::format::qcow2_raw::RawView::open(data) {
        let mut buf = vec![0u8; 64 << 10];
        for offset in [0, view.size() / 2, view.size().saturating_sub(buf.len() as u64)] {
            let n = (view.size() - offset.min(view.size())).min(buf.len() as u64) as usize;
            let _ = view.read_at(&mut buf[..n], offset);
        }
    }
});
