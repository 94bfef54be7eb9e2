//! Seekable indexes and streams crafted for the tests of other modules.

use std::io::Write;

use super::build::build;
use super::{Expected, SeekIndex, Windows};
use crate::oci::digest::Digest;

/// A tar of `files` as KubeVirt's containerDisk build writes it (uid/gid 107, 0644).
pub fn tar_of(files: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_uid(107);
        h.set_gid(107);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        b.append_data(&mut h, name, data.as_slice()).unwrap();
    }
    b.into_inner().unwrap()
}

pub fn gzip(data: &[u8], level: u32) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(level));
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

/// The index of `blob` with its windows blob.
pub fn index_of(blob: &[u8], expected: &Expected, span: u64) -> (SeekIndex, Vec<u8>) {
    let mut windows = Vec::new();
    let index = build(blob, expected, span, &mut windows).unwrap().index;
    (index, windows)
}

/// Span `i`'s window, from the windows blob `windows`.
pub fn window(index: &SeekIndex, windows: &[u8], i: usize) -> Vec<u8> {
    match index.window_range(i) {
        Some(r) => index
            .decode_window(i, &windows[r.start as usize..r.end as usize])
            .unwrap(),
        None => Vec::new(),
    }
}

/// What the index of a disk file `blob` must describe when nothing pins its content.
pub fn file_expected(blob: &[u8]) -> Expected {
    Expected {
        layer: Digest::of(blob),
        layer_size: blob.len() as u64,
        compression: None,
        diff_id: None,
        layout: super::Layout::File,
    }
}

/// `index` and `windows` with span `i`'s window replaced by `window` (the frames after it
/// moved, the blob's digest and size updated).
pub fn with_window(
    index: &SeekIndex,
    windows: &[u8],
    i: usize,
    window: &[u8],
) -> (SeekIndex, Vec<u8>) {
    let r = index.window_range(i).unwrap();
    let frame = zstd::bulk::compress(window, 3).unwrap();
    let mut out = windows[..r.start as usize].to_vec();
    out.extend_from_slice(&frame);
    out.extend_from_slice(&windows[r.end as usize..]);
    let mut index = index.clone();
    for s in &mut index.spans[i..] {
        s.window_end = s.window_end + frame.len() as u64 - (r.end - r.start);
    }
    index.windows = Some(Windows {
        digest: Digest::of(&out),
        size: out.len() as u64,
    });
    (index, out)
}

/// Pseudo-random, partly compressible disk content with long zero runs.
pub fn disk(size: usize) -> Vec<u8> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut d = vec![0u8; size];
    for block in d.chunks_mut(64 << 10).step_by(3) {
        for (i, b) in block.iter_mut().enumerate() {
            *b = if i % 7 == 0 {
                rng.gen()
            } else {
                (i % 251) as u8
            };
        }
    }
    d
}
