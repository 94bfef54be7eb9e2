//! A seekable index as a registry sends it (zstd-compressed JSON, bounded), as JSON checked
//! against the layer it claims, span bytes decoded from an arbitrary bit position after an
//! arbitrary window, and window frames: never more than the span's (window's) length, never
//! a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmdisk::oci::digest::Digest;
use vmdisk::format::seekable::{Compression, Expected, Layout, SeekIndex, Span};

fuzz_target!(|data: &[u8]| {
    let expected = Expected {
        layer: Digest::of(b""),
        layer_size: 1 << 20,
        compression: Some(Compression::Gzip),
        diff_id: Some(Digest::of(b"")),
        layout: Layout::Tar,
    };
    let _ = SeekIndex::decode(data, &expected);
    if let Ok(index) = serde_json::from_slice::<SeekIndex>(data) {
        // As an image layer's index (all pinned) and as a disk artifact's (nothing pinned).
        let own = Expected {
            layer: index.layer,
            layer_size: index.layer_size,
            compression: Some(index.compression),
            diff_id: Some(index.diff_id),
            layout: index.layout,
        };
        let _ = index.validate(&own);
        let _ = index.validate(&Expected {
            compression: None,
            diff_id: None,
            layout: Layout::File,
            ..own
        });
    }
    // A span over the input: the first byte picks the bit, the next two the window length.
    if data.len() < 4 {
        return;
    }
    let window = usize::from(u16::from_le_bytes([data[1], data[2]])).min(data.len() - 3);
    let window = window.min(32 << 10);
    let input = &data[3 + window..];
    let span = |offset: u64, input_end: u64, bits: u8, window_end: u64| Span {
        offset,
        input: 0,
        input_end,
        bits,
        window_end,
        digest: Digest::of(b""),
    };
    let index = SeekIndex {
        version: 2,
        layer: Digest::of(b""),
        layer_size: input.len() as u64,
        compression: Compression::Gzip,
        layout: Layout::Tar,
        diff_id: Digest::of(b""),
        stream_size: window as u64 + 65536,
        span_size: 65536,
        windows: None,
        entries: Vec::new(),
        // Span 1 starts `window` bytes into the stream, so its window is that long.
        spans: vec![
            span(0, 0, 0, 0),
            span(window as u64, input.len() as u64, data[0] % 8, 1),
        ],
    };
    if let Err(e) = index.decode_span(1, input, &data[3..3 + window]) {
        let _ = e.chain();
    }
    // The same bytes as a window frame.
    let _ = index.decode_window(1, &data[3..]);
});
