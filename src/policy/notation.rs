//! The Notary Project's signatures (`notation sign`): a trust policy (`trustpolicy.json` or
//! `trustpolicy.oci.json`, version 1.0) and its trust store
//! (`<store>/x509/{ca,signingAuthority}/<name>/*.{crt,pem,cer}`).
//!
//! A signature is an OCI 1.1 referrer of the manifest digest of artifact type
//! `application/vnd.cncf.notary.signature` whose layer is a JWS envelope
//! (`application/jose+json`, notation's default format). It is accepted when, under the
//! policy whose `registryScopes` names the repository (else the `"*"` one): its certificate
//! chain leads to a certificate of one of the policy's trust stores and is valid now, the leaf
//! may sign code, the leaf's subject matches a trusted identity, the envelope's signature
//! verifies with the leaf's key, it has not expired, and its payload names the digest.
//! Levels: `strict` and `permissive` enforce all of that (`permissive` logs an expired
//! signature instead); `audit` enforces integrity (the envelope verifies with its own leaf and
//! names the digest) and logs the rest; `skip` checks nothing. Revocation (OCSP, CRL) is not
//! checked: a node may not reach the responders. COSE envelopes are refused as unsupported.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use rustls_pki_types::{CertificateDer, SignatureVerificationAlgorithm, UnixTime};
use serde::Deserialize;
use webpki::ring as alg;

use super::keys::ecdsa_fixed_to_der;
use crate::error::{Error, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::registry::Registry;

pub const SIGNATURE_TYPE: &str = "application/vnd.cncf.notary.signature";
const JWS: &str = "application/jose+json";
const COSE: &str = "application/cose";
const PAYLOAD_TYPE: &str = "application/vnd.cncf.notary.payload.v1+json";
/// id-kp-codeSigning (1.3.6.1.5.5.7.3.3), the DER of its value.
const CODE_SIGNING: &[u8] = &[0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x03];
/// Most certificates read from one trust store, or carried by one envelope.
const MAX_CERTS: usize = 64;
/// Longest certificate file read.
const MAX_CERT_FILE: u64 = 1 << 20;

/// The certificate chain algorithms webpki checks certificates with.
const CERT_ALGS: &[&dyn SignatureVerificationAlgorithm] = webpki::ALL_VERIFICATION_ALGS;

/// How much of a signature a policy checks (`signatureVerification.level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Strict,
    Permissive,
    Audit,
    Skip,
}

/// A loaded trust policy document with its trust stores read.
#[derive(Debug)]
pub struct TrustPolicy {
    pub path: PathBuf,
    /// The file as read.
    text: Vec<u8>,
    policies: Vec<Entry>,
}

#[derive(Debug)]
struct Entry {
    name: String,
    scopes: Vec<String>,
    level: Level,
    /// The trust stores' certificates (DER).
    anchors: Vec<CertificateDer<'static>>,
    /// `None`: any identity (`"*"`); else subject attributes, each set all of which the leaf's
    /// subject must hold.
    identities: Option<Vec<Vec<(String, String)>>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Document {
    version: String,
    trust_policies: Vec<PolicyJson>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PolicyJson {
    name: String,
    registry_scopes: Vec<String>,
    signature_verification: VerificationJson,
    #[serde(default)]
    trust_stores: Vec<String>,
    #[serde(default)]
    trusted_identities: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VerificationJson {
    level: String,
    #[serde(default, rename = "override")]
    _override: Option<serde_json::Value>,
}

impl TrustPolicy {
    /// Reads the trust policy `path` and the certificates of the stores it names from
    /// `store` (notation's `truststore` directory).
    pub fn load(path: &Path, store: &Path) -> Result<TrustPolicy> {
        let bytes =
            super::read::read_bounded(path, super::containers::MAX_POLICY_FILE, "trust policy")?;
        let bad = |why: String| Error::invalid(format!("trust policy {}: {why}", path.display()));
        let doc: Document = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        if doc.version != "1.0" {
            return Err(bad(format!("version {:?} (1.0 is read)", doc.version)));
        }
        let mut policies = Vec::new();
        for p in doc.trust_policies {
            let level = match p.signature_verification.level.as_str() {
                "strict" => Level::Strict,
                "permissive" => Level::Permissive,
                "audit" => Level::Audit,
                "skip" => Level::Skip,
                other => return Err(bad(format!("policy {:?}: level {other:?}", p.name))),
            };
            let mut anchors = Vec::new();
            for s in &p.trust_stores {
                let (kind, name) = s.split_once(':').ok_or_else(|| {
                    bad(format!(
                        "policy {:?}: trust store {s:?} is not type:name",
                        p.name
                    ))
                })?;
                if !matches!(kind, "ca" | "signingAuthority")
                    || name.contains('/')
                    || name.is_empty()
                {
                    return Err(bad(format!(
                        "policy {:?}: trust store {s:?} (ca:NAME or signingAuthority:NAME)",
                        p.name
                    )));
                }
                anchors.extend(read_store(&store.join("x509").join(kind).join(name))?);
            }
            if level != Level::Skip && anchors.is_empty() {
                return Err(bad(format!(
                    "policy {:?}: its trust stores hold no certificate",
                    p.name
                )));
            }
            let identities = if p.trusted_identities.iter().any(|i| i == "*") {
                None
            } else {
                let parsed: Result<Vec<_>> = p
                    .trusted_identities
                    .iter()
                    .map(|i| {
                        let dn = i.strip_prefix("x509.subject:").ok_or_else(|| {
                            bad(format!("policy {:?}: trusted identity {i:?} (\"*\" or \"x509.subject: DN\")", p.name))
                        })?;
                        Ok(parse_dn(dn))
                    })
                    .collect();
                Some(parsed?)
            };
            if level != Level::Skip && identities.as_ref().is_some_and(|i| i.is_empty()) {
                return Err(bad(format!("policy {:?}: no trusted identity", p.name)));
            }
            policies.push(Entry {
                name: p.name,
                scopes: p.registry_scopes,
                level,
                anchors,
                identities,
            });
        }
        Ok(TrustPolicy {
            path: path.to_path_buf(),
            text: bytes,
            policies,
        })
    }

    /// What its decisions depend on: the file and every trust store certificate, as read.
    pub fn material(&self) -> Vec<&[u8]> {
        std::iter::once(self.text.as_slice())
            .chain(
                self.policies
                    .iter()
                    .flat_map(|p| p.anchors.iter().map(|c| c.as_ref())),
            )
            .collect()
    }

    /// The policy for `repo` (`host/repository`): the one whose scopes name it, else `"*"`'s.
    fn applicable(&self, repo: &str) -> Option<&Entry> {
        self.policies
            .iter()
            .find(|p| p.scopes.iter().any(|s| s == repo))
            .or_else(|| {
                self.policies
                    .iter()
                    .find(|p| p.scopes.iter().any(|s| s == "*"))
            })
    }

    /// Checks the notation signatures of manifest `digest` of `reference`: `Ok(until)` (when
    /// the decision lapses: the leaf certificate's end, or never) or the reason for refusal.
    pub async fn check(
        &self,
        client: &dyn Registry,
        reference: &Reference,
        digest: &Digest,
    ) -> Result<std::result::Result<u64, String>> {
        let repo = format!("{}/{}", reference.registry, reference.repository);
        let Some(policy) = self.applicable(&repo) else {
            return Ok(Err(format!(
                "no trust policy of {} applies to {repo} (add its scope or \"*\")",
                self.path.display()
            )));
        };
        let entry = format!("{} policy {:?}", self.path.display(), policy.name);
        if policy.level == Level::Skip {
            return Ok(Ok(u64::MAX));
        }
        let referrers = client
            .referrers(reference, digest, &[SIGNATURE_TYPE])
            .await?;
        let mut reasons = Vec::new();
        for desc in referrers.iter().rev().take(super::read::MAX_SIGNATURES) {
            let layers = super::read::artifact_layers(client, reference, desc).await?;
            let Some(layer) = layers.iter().find(|l| l.media_type == JWS) else {
                reasons.push(if layers.iter().any(|l| l.media_type == COSE) {
                    format!(
                        "{}: a COSE envelope, which vmdisk does not read (sign with --signature-format jws)",
                        desc.digest
                    )
                } else {
                    format!("{}: no JWS envelope", desc.digest)
                });
                continue;
            };
            let envelope = client
                .get_blob(reference, layer, super::read::MAX_SIGNATURE_BLOB)
                .await?;
            match verify_jws(&envelope, digest, policy) {
                Ok(until) => return Ok(Ok(until)),
                Err(why) => reasons.push(format!("{}: {why}", desc.digest)),
            }
        }
        Ok(Err(if reasons.is_empty() {
            format!("{entry}: no notation signature of {digest}")
        } else {
            format!(
                "{entry}: no notation signature verifies: {}",
                reasons.join("; ")
            )
        }))
    }
}

/// The certificates (PEM or DER) in trust store directory `dir`.
fn read_store(dir: &Path) -> Result<Vec<CertificateDer<'static>>> {
    use rustls_pki_types::pem::PemObject;
    let entries = std::fs::read_dir(dir)
        .map_err(|e| Error::io(format!("reading the trust store {}", dir.display()), e))?;
    let mut certs = Vec::new();
    let mut names: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    names.sort();
    for path in names.into_iter().filter(|p| p.is_file()) {
        let bytes = super::read::read_bounded(&path, MAX_CERT_FILE, "certificate")?;
        if bytes.starts_with(b"-----") {
            for cert in CertificateDer::pem_slice_iter(&bytes) {
                let cert = cert.map_err(|e| {
                    Error::invalid(format!("{}: not a PEM certificate: {e}", path.display()))
                })?;
                certs.push(cert);
            }
        } else {
            certs.push(CertificateDer::from(bytes));
        }
        if certs.len() > MAX_CERTS {
            return Err(Error::invalid(format!(
                "trust store {} holds over {MAX_CERTS} certificates",
                dir.display()
            )));
        }
    }
    Ok(certs)
}

/// The attributes of a distinguished name written `C=US, ST=WA, O=Notary, CN=name`.
fn parse_dn(text: &str) -> Vec<(String, String)> {
    text.split(',')
        .filter_map(|part| {
            let (k, v) = part.split_once('=')?;
            Some((k.trim().to_ascii_uppercase(), v.trim().to_string()))
        })
        .collect()
}

/// The subject attributes of certificate `cert` as notation names them.
fn subject_of(cert: &x509_parser::certificate::X509Certificate<'_>) -> Vec<(String, String)> {
    let reg = x509_parser::objects::oid_registry();
    cert.subject()
        .iter_attributes()
        .filter_map(|a| {
            let name = reg.get(a.attr_type())?.sn().to_string();
            let name = match name.as_str() {
                "countryName" => "C",
                "stateOrProvinceName" => "ST",
                "localityName" => "L",
                "organizationName" => "O",
                "organizationalUnitName" => "OU",
                "commonName" => "CN",
                other => other,
            }
            .to_ascii_uppercase();
            Some((name, a.as_str().ok()?.to_string()))
        })
        .collect()
}

#[derive(Deserialize)]
struct Jws {
    payload: String,
    protected: String,
    header: JwsHeader,
    signature: String,
}

#[derive(Deserialize)]
struct JwsHeader {
    x5c: Vec<String>,
}

#[derive(Deserialize)]
struct Protected {
    alg: String,
    #[serde(default)]
    crit: Vec<String>,
    cty: String,
    #[serde(rename = "io.cncf.notary.signingScheme")]
    scheme: String,
    #[serde(rename = "io.cncf.notary.expiry", default)]
    expiry: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Payload {
    target_artifact: Target,
}

#[derive(Deserialize)]
struct Target {
    digest: String,
}

/// Critical headers vmdisk understands.
const KNOWN_CRITICAL: [&str; 3] = [
    "io.cncf.notary.signingScheme",
    "io.cncf.notary.expiry",
    "io.cncf.notary.authenticSigningTime",
];

/// The envelope's protected header is one this checks: no unknown critical header, notation's
/// payload type, the `notary.x509` scheme; the signature algorithm it names, and whether an
/// ECDSA signature comes in JWS's fixed form.
fn protected_checked(
    protected: &Protected,
) -> std::result::Result<
    (
        &'static dyn rustls_pki_types::SignatureVerificationAlgorithm,
        bool,
    ),
    String,
> {
    if let Some(c) = protected
        .crit
        .iter()
        .find(|c| !KNOWN_CRITICAL.contains(&c.as_str()))
    {
        return Err(format!("an unknown critical header {c:?}"));
    }
    if protected.cty != PAYLOAD_TYPE {
        return Err(format!("content type {:?}", protected.cty));
    }
    if protected.scheme != "notary.x509" {
        return Err(format!(
            "signing scheme {:?} (notary.x509 is checked; notary.x509.signingAuthority needs a timestamping authority)",
            protected.scheme
        ));
    }
    Ok(match protected.alg.as_str() {
        "PS256" => (alg::RSA_PSS_2048_8192_SHA256_LEGACY_KEY, false),
        "PS384" => (alg::RSA_PSS_2048_8192_SHA384_LEGACY_KEY, false),
        "PS512" => (alg::RSA_PSS_2048_8192_SHA512_LEGACY_KEY, false),
        "ES256" => (alg::ECDSA_P256_SHA256, true),
        "ES384" => (alg::ECDSA_P384_SHA384, true),
        other => return Err(format!("signature algorithm {other:?}")),
    })
}

/// Verifies JWS envelope `bytes` for `digest` under `policy`: `Ok(until)` or why not.
fn verify_jws(bytes: &[u8], digest: &Digest, policy: &Entry) -> std::result::Result<u64, String> {
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let jws: Jws = serde_json::from_slice(bytes).map_err(|e| format!("malformed envelope: {e}"))?;
    let protected_json = b64
        .decode(jws.protected.trim_end_matches('='))
        .map_err(|e| format!("protected header: {e}"))?;
    let protected: Protected =
        serde_json::from_slice(&protected_json).map_err(|e| format!("protected header: {e}"))?;
    let (verify_alg, fixed_ecdsa) = protected_checked(&protected)?;
    let certs: Vec<CertificateDer<'static>> = jws
        .header
        .x5c
        .iter()
        .take(MAX_CERTS)
        .map(|c| {
            base64::engine::general_purpose::STANDARD
                .decode(c)
                .map(CertificateDer::from)
                .map_err(|e| format!("x5c: {e}"))
        })
        .collect::<std::result::Result<_, _>>()?;
    let leaf_der = certs.first().ok_or("no certificate chain (x5c)")?;
    let leaf =
        webpki::EndEntityCert::try_from(leaf_der).map_err(|e| format!("leaf certificate: {e}"))?;
    let mut signature = b64
        .decode(jws.signature.trim_end_matches('='))
        .map_err(|e| format!("signature: {e}"))?;
    if fixed_ecdsa {
        signature = ecdsa_fixed_to_der(&signature).ok_or("a malformed ECDSA signature")?;
    }
    let signing_input = format!("{}.{}", jws.protected, jws.payload);
    leaf.verify_signature(verify_alg, signing_input.as_bytes(), &signature)
        .map_err(|_| "the envelope's signature does not verify with its certificate".to_string())?;
    let payload = b64
        .decode(jws.payload.trim_end_matches('='))
        .map_err(|e| format!("payload: {e}"))?;
    let payload: Payload = serde_json::from_slice(&payload).map_err(|e| format!("payload: {e}"))?;
    if payload.target_artifact.digest != digest.to_string() {
        return Err(format!(
            "it signs {}, not {digest}",
            payload.target_artifact.digest
        ));
    }
    if policy.level == Level::Audit {
        return Ok(u64::MAX);
    }
    let now = UnixTime::now();
    if let Some(expiry) = &protected.expiry {
        let at =
            time::OffsetDateTime::parse(expiry, &time::format_description::well_known::Rfc3339)
                .map_err(|e| format!("expiry {expiry:?}: {e}"))?;
        if at.unix_timestamp() < now.as_secs() as i64 {
            if policy.level == Level::Strict {
                return Err(format!("the signature expired at {expiry}"));
            }
            tracing::warn!(
                expiry,
                policy = policy.name,
                "an expired notation signature accepted (permissive)"
            );
        }
    }
    let anchors: Vec<_> = policy
        .anchors
        .iter()
        .filter_map(|c| webpki::anchor_from_trusted_cert(c).ok())
        .collect();
    leaf.verify_for_usage(
        CERT_ALGS,
        &anchors,
        &certs[1..],
        now,
        webpki::KeyUsage::required_if_present(CODE_SIGNING),
        None,
        None,
    )
    .map_err(|e| {
        format!("its certificate chain does not lead to the policy's trust stores: {e}")
    })?;
    let (_, cert) = x509_parser::parse_x509_certificate(leaf_der).map_err(|e| e.to_string())?;
    if let Some(identities) = &policy.identities {
        let subject = subject_of(&cert);
        let matches = identities
            .iter()
            .any(|want| want.iter().all(|attr| subject.contains(attr)));
        if !matches {
            return Err(format!(
                "its signer {subject:?} is not a trusted identity of policy {:?}",
                policy.name
            ));
        }
    }
    Ok(cert.validity().not_after.timestamp().max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinguished_names_parse_as_notation_writes_them() {
        assert_eq!(
            parse_dn(" C=US, ST=WA, O=Notary, CN=vmdisk test"),
            vec![
                ("C".to_string(), "US".to_string()),
                ("ST".into(), "WA".into()),
                ("O".into(), "Notary".into()),
                ("CN".into(), "vmdisk test".into())
            ]
        );
    }
}
