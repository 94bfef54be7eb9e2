//! The zstd:chunked TOC as it arrives from a registry: compressed bytes (checksum matching, as
//! an attacker controlling the annotation could arrange), or JSON directly; parsed and
//! validated in one streaming pass, as the engine reads it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmdisk::oci::digest::Digest;
use vmdisk::format::toc::parse_toc;
use vmdisk::format::zstd_chunked::{read_toc, TocLocation};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let data_end = u64::from(mode) << 20;
    let nodes = if mode & 1 == 0 {
        let loc = TocLocation { offset: data_end + 8, length: rest.len() as u64, uncompressed_length: 0, checksum: Digest::of(rest) };
        read_toc(rest, &loc)
    } else {
        parse_toc(serde_json::Deserializer::from_slice(rest), data_end)
    };
    if let Ok(nodes) = nodes {
        for node in nodes {
            let mut expected = 0;
            for chunk in &node.chunks {
                assert_eq!(chunk.offset, expected, "validated chunks tile the file");
                assert!(chunk.compressed.end <= data_end && chunk.compressed.start < chunk.compressed.end);
                expected += chunk.size;
            }
            assert!(node.chunks.is_empty() || expected == node.size);
            assert!(!node.path.split('/').any(|c| c == ".." || c.is_empty()));
        }
    }
});
