//! The certificate authorities a registry's TLS certificate is checked against (beside the
//! CAs an endpoint's `hosts.toml` names): the system's, read once per process, or those a
//! daemon handed the mount server it started.
//!
//! Reading the system's means opening every file of its certificate directory (`/etc/ssl/certs`
//! holds some 300) and parsing each: about 2 ms, and 20 ms when the page cache no longer holds
//! them. A mount server starts at every lazy Prepare, so it takes its daemon's instead (the
//! handover on `serve-layer`'s stdin): one daemon, one reading, the same roots in all its
//! servers.
//! Like containerd's, they are those of the daemon's start: a changed CA bundle needs a restart.

use std::sync::{Arc, OnceLock};

use rustls_pki_types::CertificateDer;

use crate::error::{Error, Result};

/// Most certificates a daemon hands over (a system's store holds a few hundred).
pub const MAX_HANDED: usize = 4096;
/// Largest certificate handed over, in bytes (a root is one to two KiB of DER).
pub const MAX_HANDED_BYTES: usize = 64 << 10;

/// A set of trust anchors; cheap to clone. The default is the system's, read when first
/// needed.
#[derive(Clone, Default)]
pub struct Roots(Option<Arc<[CertificateDer<'static>]>>);

impl std::fmt::Debug for Roots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            None => f.write_str("Roots(the system's)"),
            Some(c) => write!(f, "Roots({} handed)", c.len()),
        }
    }
}

impl Roots {
    /// Those a daemon handed over, each checked to be a trust anchor; refused when there are
    /// more than [`MAX_HANDED`] or one is larger than [`MAX_HANDED_BYTES`].
    pub fn handed(der: Vec<Vec<u8>>) -> Result<Self> {
        if der.len() > MAX_HANDED {
            return Err(Error::invalid(format!(
                "{} TLS roots were handed over; at most {MAX_HANDED} are taken",
                der.len()
            )));
        }
        let mut certificates = Vec::with_capacity(der.len());
        for (i, cert) in der.into_iter().enumerate() {
            if cert.len() > MAX_HANDED_BYTES {
                return Err(Error::invalid(format!(
                    "TLS root {i} handed over is {} bytes; at most {MAX_HANDED_BYTES} are taken",
                    cert.len()
                )));
            }
            let cert = CertificateDer::from(cert);
            webpki::anchor_from_trusted_cert(&cert).map_err(|e| {
                Error::invalid(format!(
                    "TLS root {i} handed over is not a certificate: {e}"
                ))
            })?;
            certificates.push(cert);
        }
        Ok(Self(Some(certificates.into())))
    }

    /// The certificates; the system's are read on the first call in the process (blocking
    /// work: call it off the async workers).
    pub fn certificates(&self) -> Arc<[CertificateDer<'static>]> {
        match &self.0 {
            Some(c) => Arc::clone(c),
            None => Arc::clone(system()),
        }
    }
}

/// The system's trust anchors (`SSL_CERT_FILE`, `SSL_CERT_DIR`, else where the platform keeps
/// them), read once per process. What cannot be read or parsed is left out and logged, as
/// reqwest does with the platform's store.
fn system() -> &'static Arc<[CertificateDer<'static>]> {
    static SYSTEM: OnceLock<Arc<[CertificateDer<'static>]>> = OnceLock::new();
    SYSTEM.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        for e in &found.errors {
            tracing::warn!(error = %e, "a TLS root certificate of the system could not be read");
        }
        let total = found.certs.len();
        let usable: Vec<_> = found
            .certs
            .into_iter()
            .filter(|c| webpki::anchor_from_trusted_cert(c).is_ok())
            .collect();
        if usable.len() < total {
            tracing::debug!(
                left_out = total - usable.len(),
                "system TLS roots that are not usable trust anchors"
            );
        }
        if usable.is_empty() {
            tracing::warn!("no TLS root certificates found on the system: HTTPS registries will be refused unless hosts.toml names their CA");
        }
        usable.into()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handed_roots_are_bounded_and_must_be_certificates() {
        let e = Roots::handed(vec![b"not a certificate".to_vec()]).unwrap_err();
        assert!(e.to_string().contains("TLS root 0"), "{e}");
        let e = Roots::handed(vec![vec![0; MAX_HANDED_BYTES + 1]]).unwrap_err();
        assert!(e.to_string().contains("bytes"), "{e}");
        let e = Roots::handed(vec![Vec::new(); MAX_HANDED + 1]).unwrap_err();
        assert!(e.to_string().contains("at most"), "{e}");
        let none = Roots::handed(Vec::new()).unwrap();
        assert!(none.certificates().is_empty());
    }
}
