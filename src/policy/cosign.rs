//! cosign's key-based signatures of a manifest digest, in both formats cosign writes:
//!
//! - a sigstore bundle (cosign 3's default): an OCI 1.1 referrer of the digest whose layer is
//!   `application/vnd.dev.sigstore.bundle.v0.3+json`, a DSSE envelope of an in-toto statement
//!   whose subject is the digest and whose predicate type is cosign's signing predicate
//!   (`cosign attest` statements have other predicate types and are not signatures);
//! - the older simple signing payload: the image `sha256-<hex>.sig` beside the signed one, one
//!   layer per signature with the signature in the `dev.cosignproject.cosign/signature`
//!   annotation, naming the digest and the repository it was signed for.
//!
//! Signatures are checked against the policy's keys only; the transparency-log entries a
//! bundle may carry are not consulted (a node need not reach Rekor).

use base64::Engine as _;
use serde::Deserialize;

use super::containers::Identity;
use super::keys::PublicKey;
use crate::error::{ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::{self, ManifestKind};
use crate::registry::Registry;

pub const BUNDLE_TYPE: &str = "application/vnd.dev.sigstore.bundle.v0.3+json";
const SIMPLE_SIGNING: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
const SIGN_PREDICATE: &str = "https://sigstore.dev/cosign/sign/v1";
const IN_TOTO: &str = "application/vnd.in-toto+json";
const SIMPLE_SIGNING_TYPE: &str = "cosign container image signature";

/// One signature as found in the registry: the bytes it signs and the signature. What the
/// bytes claim is read only once a key verifies them.
pub struct Found {
    /// Where it was found (for messages).
    pub origin: String,
    signed: Vec<u8>,
    signature: Vec<u8>,
    format: Format,
}

enum Format {
    /// A DSSE envelope of an in-toto statement (`signed` is the envelope's PAE; the payload
    /// is kept apart).
    Bundle { payload: Vec<u8> },
    /// A simple signing payload (`signed` is the payload).
    SimpleSigning,
}

/// The cosign signatures of manifest `digest` in `repo` (both formats), at most
/// `super::read::MAX_SIGNATURES` of each.
pub async fn signatures(
    client: &dyn Registry,
    repo: &Reference,
    digest: &Digest,
) -> Result<Vec<Found>> {
    let mut found = Vec::new();
    let tag = Reference {
        tag: Some(format!("sha256-{}.sig", digest.hex())),
        digest: None,
        ..repo.clone()
    };
    // Both formats are looked up at once: one round trip, not two. cosign lists its bundles in
    // the referrers fallback index with the empty config's type.
    let (referrers, image) = tokio::join!(
        client.referrers(repo, digest, &[BUNDLE_TYPE, oci::OCI_EMPTY]),
        client.get_manifest(&tag)
    );
    let referrers = referrers?;
    for desc in referrers.iter().rev().take(super::read::MAX_SIGNATURES) {
        let layers = super::read::artifact_layers(client, repo, desc).await?;
        let Some(layer) = layers.into_iter().find(|l| l.media_type == BUNDLE_TYPE) else {
            continue;
        };
        let origin = format!(
            "cosign bundle {}/{}@{}",
            repo.registry, repo.repository, desc.digest
        );
        let bytes = client
            .get_blob(repo, &layer, super::read::MAX_SIGNATURE_BLOB)
            .await?;
        match bundle(&bytes, &origin) {
            Ok(sigs) => found.extend(sigs),
            Err(why) => tracing::warn!(%origin, why, "ignoring a malformed cosign bundle"),
        }
    }
    let image = match image {
        Ok(m) => Some(m.manifest),
        Err(e) if e.kind() == ErrorKind::NotFound => None,
        Err(e) => return Err(e.context(format!("reading cosign's signature image {tag}"))),
    };
    if let Some(ManifestKind::Image(image)) = image {
        for layer in image
            .layers
            .iter()
            .filter(|l| l.media_type == SIMPLE_SIGNING)
            .take(super::read::MAX_SIGNATURES)
        {
            let Some(signature) = layer
                .annotations
                .get(SIGNATURE_ANNOTATION)
                .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
            else {
                continue;
            };
            let payload = client
                .get_blob(repo, layer, super::read::MAX_SIGNATURE_BLOB)
                .await?;
            found.push(Found {
                origin: format!("cosign signature {tag}"),
                signed: payload,
                signature,
                format: Format::SimpleSigning,
            });
        }
    }
    Ok(found)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Bundle {
    dsse_envelope: Option<Envelope>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Envelope {
    payload: String,
    payload_type: String,
    signatures: Vec<EnvelopeSignature>,
}

#[derive(Deserialize)]
struct EnvelopeSignature {
    sig: String,
}

/// The signatures of a bundle's DSSE envelope, found at `origin`.
fn bundle(bytes: &[u8], origin: &str) -> std::result::Result<Vec<Found>, String> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let bundle: Bundle = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let env = bundle
        .dsse_envelope
        .ok_or("no DSSE envelope (a message signature is not an image signature)")?;
    if env.payload_type != IN_TOTO {
        return Err(format!("a DSSE payload of type {:?}", env.payload_type));
    }
    let payload = b64.decode(&env.payload).map_err(|e| e.to_string())?;
    let pae = dsse_pae(&env.payload_type, &payload);
    env.signatures
        .iter()
        .take(super::read::MAX_SIGNATURES)
        .map(|s| {
            Ok(Found {
                origin: origin.to_string(),
                signed: pae.clone(),
                signature: b64.decode(&s.sig).map_err(|e| e.to_string())?,
                format: Format::Bundle {
                    payload: payload.clone(),
                },
            })
        })
        .collect()
}

/// DSSE's pre-authentication encoding of a payload of `payload_type`.
fn dsse_pae(payload_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "DSSEv1 {} {} {} ",
        payload_type.len(),
        payload_type,
        payload.len()
    )
    .into_bytes();
    out.extend_from_slice(payload);
    out
}

#[derive(Deserialize)]
struct Statement {
    subject: Vec<StatementSubject>,
    #[serde(rename = "predicateType")]
    predicate_type: String,
}

#[derive(Deserialize)]
struct StatementSubject {
    digest: std::collections::BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct SimpleSigning {
    critical: Critical,
}

#[derive(Deserialize)]
struct Critical {
    identity: CriticalIdentity,
    image: CriticalImage,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize)]
struct CriticalIdentity {
    #[serde(rename = "docker-reference")]
    docker_reference: String,
}

#[derive(Deserialize)]
struct CriticalImage {
    #[serde(rename = "docker-manifest-digest")]
    docker_manifest_digest: String,
}

impl Found {
    /// Whether this signature satisfies a requirement of `keys` and `identity` for manifest
    /// `digest` of `reference` (as named); if not, why.
    pub fn check(
        &self,
        keys: &[PublicKey],
        identity: &Identity,
        reference: &Reference,
        digest: &Digest,
    ) -> std::result::Result<(), String> {
        if !keys
            .iter()
            .any(|k| k.verifies(&self.signed, &self.signature))
        {
            let names: Vec<&str> = keys.iter().map(|k| k.source.as_str()).collect();
            return Err(format!(
                "not signed by the policy's key ({})",
                names.join(", ")
            ));
        }
        let (signed_digest, claimed) = match &self.format {
            Format::Bundle { payload } => {
                let s: Statement = serde_json::from_slice(payload)
                    .map_err(|e| format!("its in-toto statement is malformed: {e}"))?;
                if s.predicate_type != SIGN_PREDICATE {
                    return Err(format!(
                        "an attestation ({}), not a signature",
                        s.predicate_type
                    ));
                }
                let digests: Vec<String> = s
                    .subject
                    .iter()
                    .filter_map(|s| s.digest.get("sha256").map(|h| format!("sha256:{h}")))
                    .collect();
                let want = digest.to_string();
                let signed = if digests.contains(&want) {
                    want
                } else {
                    digests.join(", ")
                };
                (signed, None)
            }
            Format::SimpleSigning => {
                let s: SimpleSigning = serde_json::from_slice(&self.signed)
                    .map_err(|e| format!("its payload is malformed: {e}"))?;
                if s.critical.kind != SIMPLE_SIGNING_TYPE {
                    return Err(format!("a payload of type {:?}", s.critical.kind));
                }
                (
                    s.critical.image.docker_manifest_digest,
                    Some(s.critical.identity.docker_reference),
                )
            }
        };
        if signed_digest != digest.to_string() {
            return Err(format!("it signs {signed_digest}, not {digest}"));
        }
        if !identity.accepts(claimed.as_deref(), reference) {
            return Err(match claimed {
                Some(c) => format!("it was signed for {c}, which {identity:?} does not accept for {reference}"),
                None => format!(
                    "a bundle signs the digest alone, and signedIdentity {identity:?} needs a signed reference (use matchRepository, or sign with --new-bundle-format=false)"
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pae_is_dsse_v1() {
        assert_eq!(
            dsse_pae(IN_TOTO, b"{}"),
            b"DSSEv1 28 application/vnd.in-toto+json 2 {}".to_vec()
        );
    }
}
