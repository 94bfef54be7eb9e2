//! A seekable index as a registry sends it (zstd-compressed JSON, bounded), as JSON checked
//! against the layer it claims, and span bytes decoded from an arbitrary bit position after an
//! arbitrary window: never more than the span's length, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmdisk::digest::Digest;
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
    // One span over the input: the first byte picks the bit, the next two the window length.
    if data.len() < 4 {
        return;
    }
    let window = usize::from(u16::from_le_bytes([data[1], data[2]])).min(data.len() - 3);
    let window = window.min(32 << 10);
    let input = &data[3 + window..];
    use base64::Engine as _;
    let index = SeekIndex {
        version: 1,
        layer: Digest::of(b""),
        layer_size: input.len() as u64,
        compression: Compression::Gzip,
        layout: Layout::Tar,
        diff_id: Digest::of(b""),
        stream_size: window as u64 + 65536,
        span_size: 65536,
        entries: Vec::new(),
        spans: vec![Span {
            offset: window as u64,
            input: 0,
            input_end: input.len() as u64,
            bits: data[0] % 8,
            window: base64::engine::general_purpose::STANDARD.encode(&data[3..3 + window]),
            digest: Digest::of(b""),
        }],
    };
    if let Err(e) = index.decode_span(0, input) {
        let _ = e.chain();
    }
});
