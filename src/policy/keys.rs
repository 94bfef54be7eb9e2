//! Public keys and signatures: what a signature policy trusts, checked with webpki's algorithms
//! on ring.

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{SignatureVerificationAlgorithm, SubjectPublicKeyInfoDer};
use webpki::ring as alg;

use crate::error::{Error, Result};

/// Longest key file read (a PEM public key is well under 4 KiB).
pub const MAX_KEY_FILE: u64 = 64 << 10;

/// The algorithms a key-based signature (cosign) may use: ECDSA (cosign's default is P-256),
/// Ed25519, RSA PKCS#1 v1.5 and PSS. The key's own algorithm picks among them.
const KEY_ALGS: [&dyn SignatureVerificationAlgorithm; 9] = [
    alg::ECDSA_P256_SHA256,
    alg::ECDSA_P384_SHA384,
    alg::ECDSA_P256_SHA384,
    alg::ECDSA_P384_SHA256,
    alg::ED25519,
    alg::RSA_PKCS1_2048_8192_SHA256,
    alg::RSA_PKCS1_2048_8192_SHA512,
    alg::RSA_PSS_2048_8192_SHA256_LEGACY_KEY,
    alg::RSA_PSS_2048_8192_SHA512_LEGACY_KEY,
];

/// A trusted public key and where it came from (for messages).
#[derive(Clone, Debug)]
pub struct PublicKey {
    spki: SubjectPublicKeyInfoDer<'static>,
    pub source: String,
}

impl PublicKey {
    /// The key of a PEM `PUBLIC KEY` block (what `cosign generate-key-pair` writes as
    /// `cosign.pub`).
    pub fn from_pem(pem: &[u8], source: &str) -> Result<PublicKey> {
        let spki = SubjectPublicKeyInfoDer::from_pem_slice(pem).map_err(|e| {
            Error::invalid(format!(
                "{source} is not a PEM public key (\"-----BEGIN PUBLIC KEY-----\"): {e}"
            ))
        })?;
        // Refuses what is not a key webpki knows, at load rather than at the first check.
        webpki::RawPublicKeyEntity::try_from(&spki)
            .map_err(|e| Error::invalid(format!("{source}: not a usable public key: {e}")))?;
        Ok(PublicKey {
            spki,
            source: source.to_string(),
        })
    }

    /// The key (SubjectPublicKeyInfo DER).
    pub fn der(&self) -> &[u8] {
        self.spki.as_ref()
    }

    /// Whether `signature` (DER for ECDSA, as cosign writes it) signs `message` with this key.
    pub fn verifies(&self, message: &[u8], signature: &[u8]) -> bool {
        let Ok(entity) = webpki::RawPublicKeyEntity::try_from(&self.spki) else {
            return false;
        };
        KEY_ALGS
            .iter()
            .any(|a| entity.verify_signature(*a, message, signature).is_ok())
    }
}

/// An ECDSA signature as JWS writes it (r and s, each `len / 2` bytes, big-endian) in the
/// ASN.1 DER form (`SEQUENCE { INTEGER r, INTEGER s }`) the verifiers take; `None` if its
/// length is not even or its parts too long for a short-form DER length.
pub fn ecdsa_fixed_to_der(fixed: &[u8]) -> Option<Vec<u8>> {
    if fixed.is_empty() || !fixed.len().is_multiple_of(2) || fixed.len() > 132 {
        return None;
    }
    let integer = |bytes: &[u8]| {
        let trimmed = match bytes.iter().position(|&b| b != 0) {
            Some(i) => &bytes[i..],
            None => &[0u8][..],
        };
        let mut out = vec![0x02];
        let pad = trimmed[0] & 0x80 != 0;
        out.push((trimmed.len() + usize::from(pad)) as u8);
        if pad {
            out.push(0);
        }
        out.extend_from_slice(trimmed);
        out
    };
    let (r, s) = fixed.split_at(fixed.len() / 2);
    let body = [integer(r), integer(s)].concat();
    let mut der = vec![0x30];
    if body.len() < 0x80 {
        der.push(body.len() as u8);
    } else {
        der.extend([0x81, body.len() as u8]);
    }
    der.extend(body);
    Some(der)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_ecdsa_signatures_become_der() {
        // r with its high bit set gains a zero byte; s with leading zeros loses them.
        let mut fixed = vec![0x80u8; 32];
        fixed.extend([0u8; 31]);
        fixed.push(5);
        let der = ecdsa_fixed_to_der(&fixed).unwrap();
        assert_eq!(&der[..4], &[0x30, 33 + 2 + 3, 0x02, 33]);
        assert_eq!(&der[der.len() - 3..], &[0x02, 1, 5]);
        assert!(ecdsa_fixed_to_der(&[1, 2, 3]).is_none());
    }

    #[test]
    fn a_pem_that_is_not_a_public_key_is_refused_at_load() {
        let e = PublicKey::from_pem(b"not a key", "k.pub").unwrap_err();
        assert!(e.to_string().contains("k.pub"), "{e}");
    }
}
