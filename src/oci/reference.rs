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

/// Whether `host[:port]` names the loopback interface.
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

/// docker/distribution's domain: dot-separated names of letters, digits and inner `-`, or an
/// IPv6 address in brackets, then an optional `:port`.
fn valid_host(h: &str) -> bool {
    let (host, port) = match h.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((v6, port)) => {
                if v6.is_empty() || !v6.bytes().all(|b| b.is_ascii_hexdigit() || b == b':') {
                    return false;
                }
                (None, port)
            }
            None => return false,
        },
        None => match h.find(':') {
            Some(at) => (Some(&h[..at]), &h[at..]),
            None => (Some(h), ""),
        },
    };
    let port_ok = port.is_empty()
        || port.strip_prefix(':').is_some_and(|p| {
            !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
        });
    let label_ok = |l: &str| {
        let b = l.as_bytes();
        !b.is_empty()
            && b.len() <= 63
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-')
    };
    h.len() <= 255 && port_ok && host.is_none_or(|host| host.split('.').all(label_ok))
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

/// An image as a user or a pull named it: the text as written and that text parsed. The text
/// names the image's ready-disk links (`fedora:39` is `by-name/fedora+39`, where the name a
/// user typed finds its disk), so it is kept as written, not as the reference displays
/// (`docker.io/library/fedora:39`). Kept in records as the text, parsed (and so checked) when
/// read back.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ImageName {
    text: String,
    reference: Reference,
}

impl ImageName {
    /// The name as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The image it names.
    pub fn reference(&self) -> &Reference {
        &self.reference
    }
}

impl FromStr for ImageName {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(ImageName {
            reference: s.parse()?,
            text: s.to_string(),
        })
    }
}

impl fmt::Display for ImageName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl serde::Serialize for ImageName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> serde::Deserialize<'de> for ImageName {
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
        let r: Reference = "[::1]:5000/x".parse().unwrap();
        assert_eq!(r.registry, "[::1]:5000");
        assert!(r.is_loopback());
    }

    #[test]
    fn an_image_name_keeps_the_text_it_was_written_as() {
        let name: ImageName = "fedora:39".parse().unwrap();
        assert_eq!(name.as_str(), "fedora:39");
        assert_eq!(name.reference().to_string(), "docker.io/library/fedora:39");
        let json = serde_json::to_string(&name).unwrap();
        assert_eq!(json, "\"fedora:39\"");
        assert_eq!(serde_json::from_str::<ImageName>(&json).unwrap(), name);
        assert!(serde_json::from_str::<ImageName>("\"UPPER/case\"").is_err());
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
            "../x",
            "a..b/x",
            "-a.io/x",
            "a.io:port/x",
            "[::1/x",
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
