//! tar-split metadata (github.com/vbatts/tar-split), as containers/storage embeds it in a
//! zstd:chunked layer: newline-separated JSON entries that describe the tar stream as raw
//! segments (headers, padding, end-of-archive) and files (name, size, CRC-64/ISO of content).
//! A consumer that fetched files individually rebuilds the exact tar stream from it, so the
//! layer's diffID can be checked without downloading the layer.

use base64::Engine as _;
use serde::Serialize;

/// CRC-64 with Go's ISO table, as tar-split checksums file contents.
pub const CRC64_ISO: crc::Crc<u64, crc::Table<16>> =
    crc::Crc::<u64, crc::Table<16>>::new(&crc::CRC_64_GO_ISO);

/// A running [`CRC64_ISO`].
pub type Crc64 = crc::Digest<'static, u64, crc::Table<16>>;

/// `crc` after `len` more zero bytes, in time logarithmic in `len` (a sparse disk is mostly
/// zeros): the CRC register is linear in what it held, so `len` zero bytes are one 64×64 matrix
/// over GF(2), raised to `len` by squaring.
pub fn crc64_after_zeros(crc: Crc64, len: u64) -> Crc64 {
    let algorithm = CRC64_ISO.algorithm;
    debug_assert!(algorithm.refin && algorithm.refout && algorithm.width == 64);
    let poly = algorithm.poly.reverse_bits();
    // The register as the crate keeps it (reflected): what finalize returns, before xorout.
    let mut register = crc.finalize() ^ algorithm.xorout;
    // One zero bit: column i is what bit i of the register becomes.
    let mut op: [u64; 64] = std::array::from_fn(|i| {
        let v = 1u64 << i;
        if v & 1 == 1 {
            (v >> 1) ^ poly
        } else {
            v >> 1
        }
    });
    for _ in 0..3 {
        op = square(&op); // one zero byte
    }
    let mut n = len;
    while n > 0 {
        if n & 1 == 1 {
            register = apply(&op, register);
        }
        op = square(&op);
        n >>= 1;
    }
    CRC64_ISO.digest_with_initial(register.reverse_bits())
}

fn apply(op: &[u64; 64], mut v: u64) -> u64 {
    let mut out = 0;
    let mut i = 0;
    while v != 0 {
        if v & 1 == 1 {
            out ^= op[i];
        }
        v >>= 1;
        i += 1;
    }
    out
}

fn square(op: &[u64; 64]) -> [u64; 64] {
    std::array::from_fn(|i| apply(op, op[i]))
}

#[derive(Serialize)]
struct Entry<'a> {
    #[serde(rename = "type")]
    kind: u8,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "is_zero")]
    size: u64,
    payload: Option<String>,
    position: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

const FILE_TYPE: u8 = 1;
const SEGMENT_TYPE: u8 = 2;

/// Accumulates tar-split entries in memory (a few per file; our layers hold two files).
#[derive(Default)]
pub struct TarSplitWriter {
    out: Vec<u8>,
    position: u64,
}

impl TarSplitWriter {
    /// Raw tar bytes that are not file content (headers, padding, end-of-archive).
    pub fn segment(&mut self, raw: &[u8]) {
        if raw.is_empty() {
            return;
        }
        let payload = base64::engine::general_purpose::STANDARD.encode(raw);
        self.push(Entry {
            kind: SEGMENT_TYPE,
            name: None,
            size: 0,
            payload: Some(payload),
            position: 0,
        });
    }

    /// A file entry; `crc64` is `None` for empty files (tar-split writes no checksum for them).
    pub fn file(&mut self, name: &str, size: u64, crc64: Option<u64>) {
        let payload =
            crc64.map(|c| base64::engine::general_purpose::STANDARD.encode(c.to_be_bytes()));
        self.push(Entry {
            kind: FILE_TYPE,
            name: Some(name),
            size,
            payload,
            position: 0,
        });
    }

    fn push(&mut self, mut entry: Entry<'_>) {
        entry.position = self.position;
        self.position += 1;
        // Serialising these plain structs cannot fail.
        serde_json::to_writer(&mut self.out, &entry).expect("tar-split entry serialises");
        self.out.push(b'\n');
    }

    /// The uncompressed tar-split stream.
    pub fn into_bytes(self) -> Vec<u8> {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_matches_go_iso() {
        // Go: crc64.Checksum([]byte("123456789"), crc64.MakeTable(crc64.ISO)) == 0xb90956c775a41001
        assert_eq!(CRC64_ISO.checksum(b"123456789"), 0xb909_56c7_75a4_1001);
    }

    #[test]
    fn zeros_extend_a_crc_as_hashing_them_does() {
        for (head, len) in [
            (&b""[..], 0u64),
            (b"", 1),
            (b"abc", 7),
            (b"123456789", 1000),
            (b"x", (1 << 20) + 3),
        ] {
            let mut hashed = CRC64_ISO.digest();
            hashed.update(head);
            hashed.update(&vec![0u8; len as usize]);
            let mut extended = CRC64_ISO.digest();
            extended.update(head);
            let mut extended = crc64_after_zeros(extended, len);
            extended.update(b"tail");
            hashed.update(b"tail");
            assert_eq!(
                extended.finalize(),
                hashed.finalize(),
                "{head:?} + {len} zeros"
            );
        }
    }

    #[test]
    fn entries_are_numbered_json_lines() {
        let mut w = TarSplitWriter::default();
        w.segment(&[0u8; 3]);
        w.file("disk/", 0, None);
        w.file("disk/d.raw", 9, Some(1));
        let text = String::from_utf8(w.into_bytes()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], r#"{"type":2,"payload":"AAAA","position":0}"#);
        assert_eq!(
            lines[1],
            r#"{"type":1,"name":"disk/","payload":null,"position":1}"#
        );
        assert_eq!(
            lines[2],
            r#"{"type":1,"name":"disk/d.raw","size":9,"payload":"AAAAAAAAAAE=","position":2}"#
        );
    }
}
