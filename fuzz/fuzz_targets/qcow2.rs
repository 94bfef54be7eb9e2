//! qcow2 header and cluster-table validation, and the raw view's mapping and reads, on
//! arbitrary bytes: the image in memory, read the way `view::qcow2` reads it lazily.
#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use vmdisk::format::qcow2_raw::{Qcow2Map, Source, HEADER_BYTES};

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = vmdisk::format::qcow2::check_complete(data) {
        assert!((9..=21).contains(&header.cluster_bits));
    }
    let _ = vmdisk::format::disk::sniff(data, data, data.len() as u64);
    let _ = raw_reads(data);
});

/// Reads of the raw view either produce exactly the bytes asked for or fail; they never panic
/// or overrun.
fn raw_reads(image: &[u8]) -> Option<()> {
    let size = image.len() as u64;
    let header = Qcow2Map::header(&image[..image.len().min(HEADER_BYTES as usize)]).ok()?;
    let tables = header.tables(size).ok()?;
    let l1 = image.get(tables.l1.start as usize..tables.l1.end as usize)?;
    let map = Qcow2Map::new(header, l1, size);
    let cs = map.cluster_size();
    for offset in [0, map.size() / 2, map.size().saturating_sub(64 << 10)] {
        let range = offset..offset.saturating_add(64 << 10);
        let mut l2: HashMap<u64, Vec<u64>> = HashMap::new();
        for index in map.clusters(range.clone()) {
            let Some(table) = map.l2_table(index) else { continue };
            if map.check_inside(&table, "L2 table").is_err() {
                return None;
            }
            let bytes = &image[table.start as usize..table.end as usize];
            l2.insert(index, Qcow2Map::l2_entries(bytes));
        }
        let pieces = map.pieces(range.clone(), |index| l2.get(&index).map(Vec::as_slice));
        let total: u64 = pieces.iter().map(|p| p.len).sum();
        assert_eq!(total, range.end.min(map.size()).saturating_sub(range.start));
        for piece in pieces {
            let Some(bytes) = map.image_range(&piece.source) else { continue };
            if map.check_inside(&bytes, "cluster").is_err() {
                return None;
            }
            let input = &image[bytes.start as usize..bytes.end as usize];
            if let Source::Compressed { offset, within, .. } = piece.source {
                if let Ok(cluster) = map.decompress(offset, input) {
                    assert_eq!(cluster.len() as u64, cs);
                    assert!(within + piece.len <= cs);
                }
            }
        }
    }
    Some(())
}
