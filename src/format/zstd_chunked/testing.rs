//! Layers written for other modules' tests (the engine's, resolve's): fixtures shared through
//! here, not through another module's test module.

use std::sync::Arc;

use super::{EncodedChunk, EntryMeta, LayerSummary, LayerWriter};

/// Tar metadata of `path` with `mode`, owned by 107:107 (a containerDisk's).
fn meta(path: &str, mode: u32) -> EntryMeta {
    EntryMeta {
        path: path.into(),
        mode,
        uid: 107,
        gid: 107,
        mtime: 1_700_000_000,
    }
}

/// Writes a layer (directory `disk`, file `disk/d.raw`) with `content` cut into `chunk` byte
/// chunks.
pub(crate) fn write_layer(content: &[u8], chunk: usize) -> (LayerSummary, Vec<u8>) {
    let mut w = LayerWriter::new(Vec::new(), 3).unwrap();
    let mut c = zstd::bulk::Compressor::new(3).unwrap();
    w.add_dir(&meta("disk", 0o755)).unwrap();
    w.begin_file(&meta("disk/d.raw", 0o644), content.len() as u64)
        .unwrap();
    for part in content.chunks(chunk) {
        w.add_chunk(&EncodedChunk::encode(Arc::new(part.to_vec()), &mut c).unwrap())
            .unwrap();
    }
    w.end_file().unwrap();
    w.finish().unwrap()
}
