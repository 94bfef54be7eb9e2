//! Content digests (`sha256:<64 hex>`), the only way bytes from outside are trusted.
//!
//! A [`Digest`] is always well formed: parsing rejects other algorithms and malformed hex, so a
//! digest from a manifest or label can be used in a URL or a file name without further checks.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest as _, Sha256};

use crate::error::{Error, Result};

/// A sha256 content digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest([u8; 32]);

impl Digest {
    /// The digest of `data`.
    pub fn of(data: &[u8]) -> Self {
        Digest(Sha256::digest(data).into())
    }

    /// The digest whose raw 32 bytes are `bytes`.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Digest(bytes)
    }

    /// The raw 32 bytes.
    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The 64 lowercase hex characters, without the algorithm.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Fails with a `Corrupt` error naming `what` unless `data` hashes to this digest.
    pub fn verify(&self, data: &[u8], what: &str) -> Result<()> {
        let actual = Digest::of(data);
        if actual != *self {
            return Err(Error::corrupt(format!(
                "{what}: content digest {actual} does not match the expected {self}"
            )));
        }
        Ok(())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Digest {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let hex_part = s.strip_prefix("sha256:").ok_or_else(|| {
            Error::invalid(format!(
                "digest {s:?} is not of the form sha256:<64 hex digits>"
            ))
        })?;
        let invalid = || {
            Error::invalid(format!(
                "digest {s:?} is not of the form sha256:<64 lowercase hex digits>"
            ))
        };
        // One pass, lowercase only: digests are parsed by the ten thousand from TOCs.
        let nibble = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let hex_part = hex_part.as_bytes();
        if hex_part.len() != 64 {
            return Err(invalid());
        }
        let mut out = [0u8; 32];
        for (byte, pair) in out.iter_mut().zip(hex_part.chunks_exact(2)) {
            *byte = (nibble(pair[0]).ok_or_else(invalid)? << 4)
                | nibble(pair[1]).ok_or_else(invalid)?;
        }
        Ok(Digest(out))
    }
}

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// An incremental sha256 that also counts bytes.
#[derive(Clone, Default)]
pub struct Hasher {
    inner: Sha256,
    len: u64,
}

impl Hasher {
    /// A fresh hasher.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed bytes.
    pub fn update(&mut self, data: &[u8]) {
        self.inner.update(data);
        self.len += data.len() as u64;
    }

    /// Bytes fed so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing was fed yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The digest of everything fed.
    pub fn finish(self) -> Digest {
        Digest(self.inner.finalize().into())
    }
}

impl std::io::Write for Hasher {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        let d = Digest::of(b"");
        assert_eq!(
            d.to_string(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(d.to_string().parse::<Digest>().unwrap(), d);
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "",
            "sha256:",
            "sha512:00",
            "sha256:XYZ",
            "sha256:../../etc/passwd",
            &format!("sha256:{}", "A".repeat(64)),
        ] {
            assert!(bad.parse::<Digest>().is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn verify_names_what() {
        let d = Digest::of(b"abc");
        assert!(d.verify(b"abc", "x").is_ok());
        let err = d.verify(b"abd", "blob of repo").unwrap_err();
        assert!(err.to_string().contains("blob of repo"));
    }

    #[test]
    fn hasher_matches_one_shot() {
        let mut h = Hasher::new();
        h.update(b"ab");
        h.update(b"c");
        assert_eq!(h.len(), 3);
        assert_eq!(h.finish(), Digest::of(b"abc"));
    }
}
