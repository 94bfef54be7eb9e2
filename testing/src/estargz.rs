//! eStargz layers as stargz-snapshotter's writer lays them out: each tar header in its own gzip
//! member, each chunk of a file in its own member (the last one with the file's tar padding),
//! then the TOC as a tar entry with the end of the archive, then the 51-byte footer that
//! points at the TOC.

use std::io::Write;

use crate::sha256;

/// The footer's size.
pub const FOOTER_SIZE: usize = 51;
/// The TOC's name in the tar stream.
pub const TOC_NAME: &str = "stargz.index.json";

/// A written layer.
pub struct Layer {
    /// The layer blob.
    pub blob: Vec<u8>,
    /// The digest of the TOC JSON (what the `containerd.io/snapshot/stargz/toc.digest`
    /// annotation pins).
    pub toc_digest: String,
    /// The digest of the uncompressed tar stream (the layer's diff_id).
    pub diff_id: String,
}

fn member(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
    e.write_all(data).expect("gzip into memory");
    e.finish().expect("gzip into memory")
}

fn padding(size: usize) -> usize {
    size.next_multiple_of(512) - size
}

/// The layer of `files` (path, content, owned by 107:107, mode 0644) in chunks of `chunk`
/// bytes.
pub fn layer(files: &[(&str, Vec<u8>)], chunk: usize) -> Layer {
    let mut blob = Vec::new();
    let mut stream = Vec::new();
    let mut entries = Vec::new();
    let mut put = |blob: &mut Vec<u8>, bytes: &[u8]| {
        blob.extend(member(bytes));
        stream.extend_from_slice(bytes);
    };
    for (name, data) in files {
        let mut h = tar::Header::new_ustar();
        h.set_path(name).expect("a tar path");
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_uid(107);
        h.set_gid(107);
        h.set_mtime(0);
        h.set_cksum();
        put(&mut blob, h.as_bytes());
        let parts: Vec<&[u8]> = data.chunks(chunk).collect();
        for (i, part) in parts.iter().enumerate() {
            let mut e = serde_json::json!({"type": if i == 0 { "reg" } else { "chunk" },
                "name": name, "offset": blob.len(), "chunkOffset": i * chunk,
                "chunkSize": part.len(), "chunkDigest": sha256(part)});
            if i == 0 {
                e["size"] = data.len().into();
                e["mode"] = 0o644.into();
                e["uid"] = 107.into();
                e["gid"] = 107.into();
                e["digest"] = sha256(data).into();
            }
            entries.push(e);
            let mut bytes = part.to_vec();
            if i + 1 == parts.len() {
                bytes.resize(bytes.len() + padding(data.len()), 0);
            }
            put(&mut blob, &bytes);
        }
    }
    let json = serde_json::to_vec(&serde_json::json!({"version": 1, "entries": entries}))
        .expect("JSON into memory");
    let toc_offset = blob.len();
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_ustar();
    h.set_path(TOC_NAME).expect("a tar path");
    h.set_size(json.len() as u64);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_cksum();
    b.append(&h, json.as_slice()).expect("tar into memory");
    put(&mut blob, &b.into_inner().expect("tar into memory"));
    let mut footer = vec![
        0x1f, 0x8b, 8, 4, 0, 0, 0, 0, 0, 0xff, 26, 0, b'S', b'G', 22, 0,
    ];
    footer.extend_from_slice(format!("{toc_offset:016x}STARGZ").as_bytes());
    footer.extend_from_slice(&[1, 0, 0, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(footer.len(), FOOTER_SIZE);
    blob.extend(footer);
    Layer {
        blob,
        toc_digest: sha256(&json),
        diff_id: sha256(&stream),
    }
}
