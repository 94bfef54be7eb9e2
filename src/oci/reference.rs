//! Image references: `[registry[:port]/]repository[:tag][@digest]`, as docker and containerd
//! read them. Parsing validates every part, so a reference can be put into a URL as it is.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::oci::digest::Digest;

/// The registry docker.io names resolve to.
pub const DOCKER_HUB: &str = "docker.io";
const DOCKER_HUB_API: &str = "registry-1.docker.io";

/// A parsed image reference; equal references name the same thing the same way (a key of
/// maps as it is, never as its text).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Reference {
    /// Registry host with optional port, e.g. `127.0.0.1:5000`.
    pub registry: String,
    /// Repository path, e.g. `library/fedora`.
    pub repository: String,
    /// Tag, if given.
    pub tag: Option<String>,
    /// Digest, if given (wins over the tag for fetching).
    pub digest: Option<Digest>,
}

impl Reference {
    /// What to ask the registry for: the digest if there is one, else the tag, else `latest`.
    pub fn object(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(d), _) => d.to_string(),
            (None, Some(t)) => t.clone(),
            (None, None) => "latest".to_string(),
        }
    }

    /// The host to talk to for this registry (docker.io's API lives elsewhere).
    pub fn api_host(&self) -> &str {
        if self.registry == DOCKER_HUB {
            DOCKER_HUB_API
        } else {
            &self.registry
        }
    }

    /// The same repository pinned to `digest` (tag kept for display).
    pub fn with_digest(&self, digest: Digest) -> Reference {
        Reference {
            digest: Some(digest),
            ..self.clone()
        }
    }

    /// Whether the registry host is a loopback address, where plain HTTP is allowed by default.
    pub fn is_loopback(&self) -> bool {
        is_loopback_host(&self.registry)
    }
}

/// Whether `host[:port]` names the loopback interface.
/// `text` as a repository (`registry/repository`, no tag or digest), such as a place to
/// publish to or search in.
pub fn parse_repository(text: &str) -> Result<Reference> {
    let r: Reference = text.parse()?;
    if r.tag.is_some() || r.digest.is_some() || !text.contains('/') {
        return Err(Error::invalid(format!(
            "{text:?} must be a repository such as registry.example/vmdisk-indexes"
        )));
    }
    Ok(r)
}

pub fn is_loopback_host(host_port: &str) -> bool {
    let host = if let Some(rest) = host_port.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host_port.rsplit_once(':').map_or(host_port, |(h, _)| h)
    };
    host == "localhost"
        || host == "::1"
        || host
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn valid_component(c: &str) -> bool {
    // docker/distribution: [a-z0-9]+(?:(?:[._]|__|[-]*)[a-z0-9]+)*
    let bytes = c.as_bytes();
    !c.is_empty()
        && bytes.iter().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
        })
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
}

fn valid_tag(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 128
        && (t.as_bytes()[0].is_ascii_alphanumeric() || t.starts_with('_'))
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn valid_host(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 255
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'))
}

impl FromStr for Reference {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::invalid(format!(
                "image reference {s:?} is malformed: {why} (expected [registry/]repository[:tag][@sha256:digest])"
            ))
        };
        if s.is_empty() || s.len() > 4096 {
            return Err(bad("empty or too long"));
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => (
                r,
                Some(d.parse::<Digest>().map_err(|e| bad(&e.to_string()))?),
            ),
            None => (s, None),
        };
        let (registry, path) = match rest.split_once('/') {
            Some((first, path))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                (first.to_string(), path.to_string())
            }
            _ => (DOCKER_HUB.to_string(), rest.to_string()),
        };
        if !valid_host(&registry) {
            return Err(bad("registry host has invalid characters"));
        }
        let (repository, tag) = match path.rsplit_once(':') {
            Some((repo, tag)) if !tag.contains('/') => (repo.to_string(), Some(tag.to_string())),
            _ => (path, None),
        };
        if let Some(t) = &tag {
            if !valid_tag(t) {
                return Err(bad(
                    "tag may hold only letters, digits, '.', '_' and '-', at most 128",
                ));
            }
        }
        if repository.is_empty() || !repository.split('/').all(valid_component) {
            return Err(bad(
                "repository components must be lowercase letters, digits and separators",
            ));
        }
        let repository = if registry == DOCKER_HUB && !repository.contains('/') {
            format!("library/{repository}")
        } else {
            repository
        };
        Ok(Reference {
            registry,
            repository,
            tag,
            digest,
        })
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

/// Kept in records as the string it displays as, parsed (and so checked) when read back.
impl serde::Serialize for Reference {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Reference {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_common_forms() {
        let r: Reference = "127.0.0.1:5000/vm/fedora:39".parse().unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.tag.as_deref()),
            ("127.0.0.1:5000", "vm/fedora", Some("39"))
        );
        assert!(r.is_loopback());
        let r: Reference = "fedora".parse().unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.object()),
            ("docker.io", "library/fedora", "latest".to_string())
        );
        assert_eq!(r.api_host(), "registry-1.docker.io");
        let d = Digest::of(b"x");
        let r: Reference = format!("quay.io/a/b:t@{d}").parse().unwrap();
        assert_eq!(r.object(), d.to_string());
        assert_eq!(r.to_string(), format!("quay.io/a/b:t@{d}"));
        let r: Reference = "localhost/x".parse().unwrap();
        assert_eq!(r.registry, "localhost");
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "",
            "UPPER/case",
            "a//b",
            "host:5000/repo:bad tag",
            "repo@sha256:zz",
            "reg.io/-x",
            "r:",
        ] {
            let err = bad.parse::<Reference>().unwrap_err();
            assert!(err.to_string().contains("malformed"), "{bad}: {err}");
        }
    }

    #[test]
    fn loopback_hosts() {
        assert!(is_loopback_host("localhost:5000"));
        assert!(is_loopback_host("127.0.0.7"));
        assert!(is_loopback_host("[::1]:5000"));
        assert!(!is_loopback_host("10.0.0.1:5000"));
        assert!(!is_loopback_host("quay.io"));
    }
}
