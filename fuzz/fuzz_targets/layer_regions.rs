//! The parts of a layer blob read between chunks, and chunk ranges, as a registry sends them:
//! zstd frames decoded as an ordinary decoder would (bounded), and the check that a chunk is
//! whole regular frames. Then the decoded bytes as tar headers, as the structure check reads
//! them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmdisk::format::zstd_frames::{check_regular_frames, decode_region};

fuzz_target!(|data: &[u8]| {
    let _ = check_regular_frames(data);
    if let Ok(decoded) = decode_region(data, 1 << 20) {
        assert!(decoded.len() <= 1 << 20, "decoding is bounded");
        let mut archive = tar::Archive::new(&decoded[..]);
        if let Ok(entries) = archive.entries() {
            for entry in entries.take(64) {
                let Ok(entry) = entry else { break };
                let _ = entry.path_bytes();
                let _ = entry.link_name_bytes();
                let _ = entry.header().mode();
            }
        }
    }
});
