//! containers-policy.json (`/etc/containers/policy.json` of podman, CRI-O and skopeo; the
//! format of `containers-policy.json(5)`): a default requirement list, and lists per scope of
//! the `docker` transport. The most specific scope that names an image applies: the reference
//! as named (`host/repo:tag` or `host/repo@digest`), then the repository, each enclosing
//! namespace, the registry, wildcard domains (`*.example.com`), the transport's `""` scope,
//! and the default. Every requirement of that list must hold.
//!
//! Requirements vmdisk checks: `insecureAcceptAnything`, `reject`, and `sigstoreSigned` with
//! keys (`keyPath`, `keyPaths`, `keyData`, `keyDatas`) and `signedIdentity`. Keyless signing
//! (`fulcio`, `pki`), `signedBy` (GPG) and `remapIdentity` are recognised and refuse whatever
//! they apply to, saying so: a node that cannot check a requirement does not pass it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde_json::Value;

use super::keys::{PublicKey, MAX_KEY_FILE};
use crate::error::{Error, Result};
use crate::oci::reference::Reference;

/// Longest policy file read.
pub const MAX_POLICY_FILE: u64 = 1 << 20;

/// A loaded containers-policy.json: its requirements with their keys read.
#[derive(Debug)]
pub struct Policy {
    pub path: PathBuf,
    /// The file as read.
    text: Vec<u8>,
    default: Vec<Requirement>,
    /// The `docker` transport's scopes.
    docker: BTreeMap<String, Vec<Requirement>>,
}

/// One requirement of a scope's list.
#[derive(Debug)]
pub enum Requirement {
    Accept,
    Reject,
    Sigstore {
        keys: Vec<PublicKey>,
        identity: Identity,
    },
    /// A requirement vmdisk cannot check; it refuses, saying why.
    Unchecked(String),
}

/// What a signature's claimed identity must be (`signedIdentity`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    MatchExact,
    MatchRepoDigestOrExact,
    MatchRepository,
    ExactReference(String),
    ExactRepository(String),
}

/// The requirements that apply to an image and where they came from.
pub struct Applicable<'a> {
    /// `default` or `transports.docker["<scope>"]`.
    pub entry: String,
    pub requirements: &'a [Requirement],
}

impl Policy {
    /// Reads and checks `path`; keys named by path are read now (relative paths against the
    /// policy's directory).
    pub fn load(path: &Path) -> Result<Policy> {
        let bytes = super::read::read_bounded(path, MAX_POLICY_FILE, "signature policy")?;
        Policy::parse(&bytes, path)
    }

    /// Parses policy text `bytes` read from `path`.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Policy> {
        let bad =
            |why: String| Error::invalid(format!("signature policy {}: {why}", path.display()));
        let doc: Value = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        let dir = path.parent().unwrap_or(Path::new("/"));
        let list = |v: &Value, entry: &str| -> Result<Vec<Requirement>> {
            let items = v
                .as_array()
                .ok_or_else(|| bad(format!("{entry} is not a list of requirements")))?;
            if items.is_empty() {
                return Err(bad(format!(
                    "{entry} is an empty list (use reject or insecureAcceptAnything)"
                )));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, r)| requirement(r, dir).map_err(|e| bad(format!("{entry}[{i}]: {e}"))))
                .collect()
        };
        let default = list(
            doc.get("default")
                .ok_or_else(|| bad("no \"default\" requirement list".into()))?,
            "default",
        )?;
        let mut docker = BTreeMap::new();
        if let Some(transports) = doc.get("transports") {
            let transports = transports
                .as_object()
                .ok_or_else(|| bad("\"transports\" is not an object".into()))?;
            if let Some(scopes) = transports.get("docker") {
                let scopes = scopes
                    .as_object()
                    .ok_or_else(|| bad("transports.docker is not an object".into()))?;
                for (scope, v) in scopes {
                    docker.insert(
                        scope.clone(),
                        list(v, &format!("transports.docker[{scope:?}]"))?,
                    );
                }
            }
        }
        Ok(Policy {
            path: path.to_path_buf(),
            text: bytes.to_vec(),
            default,
            docker,
        })
    }

    /// What its decisions depend on: the file and every key it names, as read.
    pub fn material(&self) -> Vec<&[u8]> {
        let keys = self
            .docker
            .values()
            .chain(std::iter::once(&self.default))
            .flatten()
            .filter_map(|r| match r {
                Requirement::Sigstore { keys, .. } => Some(keys),
                _ => None,
            })
            .flatten()
            .map(|k| k.der());
        std::iter::once(self.text.as_slice()).chain(keys).collect()
    }

    /// The requirements for `reference` (as named: tag or digest) and the entry they are.
    pub fn applicable(&self, reference: &Reference) -> Applicable<'_> {
        for scope in scopes(reference) {
            if let Some(requirements) = self.docker.get(&scope) {
                return Applicable {
                    entry: format!("transports.docker[{scope:?}]"),
                    requirements,
                };
            }
        }
        Applicable {
            entry: "default".into(),
            requirements: &self.default,
        }
    }
}

/// The scopes that may name `reference`, most specific first (containers-policy.json(5)).
fn scopes(reference: &Reference) -> Vec<String> {
    let repo = format!("{}/{}", reference.registry, reference.repository);
    let mut out = vec![reference.to_string()];
    if let (Some(_), Some(digest)) = (&reference.tag, reference.digest) {
        out.push(format!("{repo}@{digest}"));
    }
    let mut namespace = repo.as_str();
    out.push(namespace.to_string());
    while let Some((parent, _)) = namespace.rsplit_once('/') {
        out.push(parent.to_string());
        namespace = parent;
    }
    let host = reference.registry.split(':').next().unwrap_or_default();
    let mut domain = host;
    while let Some((_, rest)) = domain.split_once('.') {
        out.push(format!("*.{rest}"));
        domain = rest;
    }
    out.push(String::new());
    out
}

fn requirement(v: &Value, dir: &Path) -> Result<Requirement> {
    let kind = v
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| Error::invalid("a requirement without a \"type\""))?;
    Ok(match kind {
        "insecureAcceptAnything" => Requirement::Accept,
        "reject" => Requirement::Reject,
        "signedBy" => Requirement::Unchecked(
            "signedBy (GPG signatures) is not checked by vmdisk; use sigstoreSigned with a key"
                .into(),
        ),
        "sigstoreSigned" => sigstore(v, dir)?,
        other => {
            return Err(Error::invalid(format!(
                "unknown requirement type {other:?}"
            )))
        }
    })
}

fn sigstore(v: &Value, dir: &Path) -> Result<Requirement> {
    if v.get("fulcio").is_some() || v.get("pki").is_some() {
        return Ok(Requirement::Unchecked(
            "keyless sigstoreSigned (fulcio/pki) needs the certificate authority and transparency \
             log, which vmdisk does not consult; use keyPath or keyData"
                .into(),
        ));
    }
    let strings = |name: &str| -> Result<Vec<String>> {
        match v.get(name) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|s| {
                    s.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| Error::invalid(format!("{name} holds a non-string")))
                })
                .collect(),
            Some(_) => Err(Error::invalid(format!("{name} is not a string or list"))),
        }
    };
    let mut keys = Vec::new();
    for path in strings("keyPath")?.into_iter().chain(strings("keyPaths")?) {
        let path = dir.join(PathBuf::from(&path));
        let pem = super::read::read_bounded(&path, MAX_KEY_FILE, "public key")?;
        keys.push(PublicKey::from_pem(&pem, &path.display().to_string())?);
    }
    for (i, data) in strings("keyData")?
        .into_iter()
        .chain(strings("keyDatas")?)
        .enumerate()
    {
        let pem = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map_err(|e| Error::invalid(format!("keyData {i} is not base64: {e}")))?;
        keys.push(PublicKey::from_pem(&pem, &format!("keyData {i}"))?);
    }
    if keys.is_empty() {
        return Err(Error::invalid(
            "sigstoreSigned names no key (keyPath, keyPaths, keyData or keyDatas)",
        ));
    }
    let identity = match v.get("signedIdentity") {
        None => Identity::MatchRepoDigestOrExact,
        Some(id) => {
            let field = |name: &str| {
                id.get(name)
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or_else(|| Error::invalid(format!("signedIdentity needs {name:?}")))
            };
            match id.get("type").and_then(Value::as_str) {
                Some("matchExact") => Identity::MatchExact,
                Some("matchRepoDigestOrExact") => Identity::MatchRepoDigestOrExact,
                Some("matchRepository") => Identity::MatchRepository,
                Some("exactReference") => Identity::ExactReference(field("dockerReference")?),
                Some("exactRepository") => Identity::ExactRepository(field("dockerRepository")?),
                Some("remapIdentity") => {
                    return Ok(Requirement::Unchecked(
                        "signedIdentity remapIdentity is not checked by vmdisk".into(),
                    ))
                }
                other => {
                    return Err(Error::invalid(format!(
                        "unknown signedIdentity type {other:?}"
                    )))
                }
            }
        }
    };
    Ok(Requirement::Sigstore { keys, identity })
}

impl Identity {
    /// Whether a signature claiming `claimed` (a docker reference, `None` where the format
    /// claims none) satisfies this for `reference` (as named). A claim-less signature (cosign's
    /// bundles sign the digest alone) satisfies only the repository-level identities.
    pub fn accepts(&self, claimed: Option<&str>, reference: &Reference) -> bool {
        let repo_of = |r: &Reference| format!("{}/{}", r.registry, r.repository);
        let Some(claimed) = claimed else {
            return matches!(
                self,
                Identity::MatchRepository | Identity::MatchRepoDigestOrExact
            );
        };
        let Ok(claimed) = claimed.parse::<Reference>() else {
            return false;
        };
        let same_repo = repo_of(&claimed) == repo_of(reference);
        let exact = same_repo && claimed.tag == reference.tag && claimed.digest == reference.digest;
        match self {
            Identity::MatchExact => exact && claimed.digest.is_none(),
            Identity::MatchRepoDigestOrExact => match reference.digest {
                Some(_) if reference.tag.is_none() => same_repo,
                _ => same_repo && claimed.tag == reference.tag,
            },
            Identity::MatchRepository => same_repo,
            Identity::ExactReference(want) => want
                .parse::<Reference>()
                .is_ok_and(|w| w.to_string() == claimed.to_string()),
            Identity::ExactRepository(want) => want
                .parse::<Reference>()
                .is_ok_and(|w| repo_of(&w) == repo_of(&claimed)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE/bGFoGaKYc5Ua80zG+07l/1K8oI2\nwrPhc+TNhQLtScL+1s19UW717ia5tnRRAa0YG6rKgzY1qJDUTkeQ52kgjQ==\n-----END PUBLIC KEY-----\n";

    fn policy(text: &str) -> Result<Policy> {
        Policy::parse(text.as_bytes(), Path::new("/etc/containers/policy.json"))
    }

    #[test]
    fn the_most_specific_scope_applies() {
        use base64::Engine as _;
        let key = base64::engine::general_purpose::STANDARD.encode(KEY);
        let p = policy(&format!(
            r#"{{"default":[{{"type":"reject"}}],"transports":{{"docker":{{
                "r.example:5000/vm":[{{"type":"sigstoreSigned","keyData":"{key}","signedIdentity":{{"type":"matchRepository"}}}}],
                "r.example:5000/vm/open":[{{"type":"insecureAcceptAnything"}}],
                "*.example.org":[{{"type":"insecureAcceptAnything"}}],
                "":[{{"type":"reject"}}]}}}}}}"#
        ))
        .unwrap();
        let entry = |r: &str| p.applicable(&r.parse().unwrap()).entry;
        assert_eq!(
            entry("r.example:5000/vm/disk:1"),
            r#"transports.docker["r.example:5000/vm"]"#
        );
        assert_eq!(
            entry("r.example:5000/vm/open:1"),
            r#"transports.docker["r.example:5000/vm/open"]"#
        );
        assert_eq!(
            entry("a.b.example.org/x/y:1"),
            r#"transports.docker["*.example.org"]"#
        );
        assert_eq!(entry("other.example/x:1"), r#"transports.docker[""]"#);
        let Requirement::Sigstore { keys, identity } = &p
            .applicable(&"r.example:5000/vm/disk:1".parse().unwrap())
            .requirements[0]
        else {
            panic!("not sigstoreSigned")
        };
        assert_eq!((keys.len(), identity), (1, &Identity::MatchRepository));
    }

    #[test]
    fn what_cannot_be_checked_refuses_and_what_is_malformed_does_not_load() {
        let p = policy(
            r#"{"default":[{"type":"sigstoreSigned","fulcio":{},"rekorPublicKeyPath":"/r"}]}"#,
        )
        .unwrap();
        assert!(matches!(
            p.applicable(&"x.example/a:1".parse().unwrap()).requirements[0],
            Requirement::Unchecked(_)
        ));
        for bad in [
            r#"{"transports":{}}"#,
            r#"{"default":[]}"#,
            r#"{"default":[{"type":"acceptEverything"}]}"#,
            r#"{"default":[{"type":"sigstoreSigned"}]}"#,
            r#"{"default":[{"type":"sigstoreSigned","keyPath":"/nonexistent/k.pub"}]}"#,
        ] {
            let e = policy(bad).unwrap_err();
            assert!(e.to_string().contains("policy.json"), "{e}");
        }
    }

    #[test]
    fn identities_follow_containers_policy_json() {
        let tag: Reference = "r.example/vm/disk:1".parse().unwrap();
        let pinned: Reference = format!("r.example/vm/disk@sha256:{}", "a".repeat(64))
            .parse()
            .unwrap();
        let id = Identity::MatchRepoDigestOrExact;
        assert!(id.accepts(Some("r.example/vm/disk"), &pinned));
        assert!(!id.accepts(Some("r.example/vm/disk"), &tag));
        assert!(id.accepts(Some("r.example/vm/disk:1"), &tag));
        assert!(!id.accepts(Some("r.example/vm/other:1"), &tag));
        assert!(Identity::MatchRepository.accepts(Some("r.example/vm/disk"), &tag));
        assert!(Identity::MatchRepository.accepts(None, &tag));
        assert!(!Identity::MatchExact.accepts(None, &tag));
        assert!(Identity::ExactRepository("r.example/vm/disk".into())
            .accepts(Some("r.example/vm/disk:7"), &tag));
    }
}
