//! Registry endpoints from a containerd `hosts.toml` directory (the `certs.d` layout), so the
//! mirrors a node already has for containerd (Spegel, Dragonfly, a pull-through cache) serve
//! vmdisk too.
//!
//! For registry `host:port` the file is `<dir>/<host:port>/hosts.toml`, else
//! `<dir>/_default/hosts.toml`. Each `[host."URL"]` table is a mirror tried in file order for
//! the capabilities it lists (`pull`, `resolve`, `push`); `server` is the upstream, tried last.
//!
//! Every chunk request asks for endpoints, so [`HostsCache`] keeps what was read and looks at
//! the file again at most every [`RECHECK`] (one `stat`), re-reading it only when it changed:
//! an edited `hosts.toml` takes effect within a second without a restart.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use serde::Deserialize;

use crate::error::{Error, Result};

/// One place to send registry requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Scheme, host and optional path prefix, without trailing slash.
    pub base: String,
    /// A `[host."URL"]` entry of a hosts.toml rather than the registry (`server`) itself.
    pub mirror: bool,
    pub pull: bool,
    pub resolve: bool,
    pub push: bool,
    /// The base already contains the API path (`override_path = true`): no `/v2` is added.
    pub override_path: bool,
    pub skip_verify: bool,
    /// Extra CA certificate files (PEM).
    pub ca: Vec<PathBuf>,
    /// Client certificate for mutual TLS: a PEM file with certificate and key, or a
    /// certificate file and a key file.
    pub client_cert: Option<(PathBuf, Option<PathBuf>)>,
    pub headers: BTreeMap<String, String>,
}

impl Endpoint {
    /// The default endpoint of a registry host.
    pub fn upstream(host: &str, plain_http: bool) -> Self {
        let scheme = if plain_http { "http" } else { "https" };
        Endpoint {
            base: format!("{scheme}://{host}"),
            mirror: false,
            pull: true,
            resolve: true,
            push: true,
            override_path: false,
            skip_verify: false,
            ca: Vec::new(),
            client_cert: None,
            headers: BTreeMap::new(),
        }
    }

    /// How errors name this endpoint: `registry <host>`, or `mirror <URL> of registry <host>`.
    pub fn describe(&self, registry: &str) -> String {
        if self.mirror {
            format!("mirror {} of registry {registry}", self.base)
        } else {
            format!("registry {registry}")
        }
    }

    /// URL of `path` (e.g. `repo/manifests/tag`) under this endpoint's API root.
    pub fn url(&self, path: &str) -> String {
        if self.override_path {
            format!("{}/{path}", self.base)
        } else {
            format!("{}/v2/{path}", self.base)
        }
    }
}

/// The top level of a hosts.toml: the upstream `server` and its settings.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostsFile {
    server: Option<String>,
    #[serde(default)]
    capabilities: Option<Vec<String>>,
    #[serde(default)]
    skip_verify: Option<bool>,
    #[serde(default)]
    ca: Option<StringOrList>,
    #[serde(default)]
    client: Option<toml::Value>,
    #[serde(default)]
    header: BTreeMap<String, StringOrList>,
    #[serde(default)]
    override_path: Option<bool>,
    #[serde(default)]
    host: BTreeMap<String, HostEntry>,
}

/// One `[host."URL"]` table (and the settings shared with the top level).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct HostEntry {
    #[serde(default)]
    capabilities: Option<Vec<String>>,
    #[serde(default)]
    skip_verify: Option<bool>,
    #[serde(default)]
    ca: Option<StringOrList>,
    /// `"both.pem"`, `["both.pem"]` or `[["cert.pem", "key.pem"]]`; the first is used.
    #[serde(default)]
    client: Option<toml::Value>,
    #[serde(default)]
    header: BTreeMap<String, StringOrList>,
    #[serde(default)]
    override_path: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => vec![s],
            StringOrList::Many(v) => v,
        }
    }
}

fn resolve_path(base_dir: &Path, p: String) -> PathBuf {
    let p = PathBuf::from(p);
    if p.is_absolute() {
        p
    } else {
        base_dir.join(p)
    }
}

/// The first client certificate of a `client` setting.
fn client_cert(
    value: Option<toml::Value>,
    dir: &Path,
    base: &str,
) -> Result<Option<(PathBuf, Option<PathBuf>)>> {
    use toml::Value;
    let bad = || {
        Error::invalid(format!("hosts.toml: client for {base} must be \"file.pem\", [\"file.pem\"] or [[\"cert.pem\", \"key.pem\"]]"))
    };
    let first = match value {
        None => return Ok(None),
        Some(Value::Array(items)) => match items.into_iter().next() {
            Some(v) => v,
            None => return Ok(None),
        },
        Some(v) => v,
    };
    match first {
        Value::String(both) => Ok(Some((resolve_path(dir, both), None))),
        Value::Array(pair) => match <[Value; 2]>::try_from(pair) {
            Ok([Value::String(cert), Value::String(key)]) => Ok(Some((
                resolve_path(dir, cert),
                Some(resolve_path(dir, key)),
            ))),
            _ => Err(bad()),
        },
        _ => Err(bad()),
    }
}

fn build(base: &str, entry: HostEntry, dir: &Path, default_caps: &[&str]) -> Result<Endpoint> {
    let caps = entry
        .capabilities
        .unwrap_or_else(|| default_caps.iter().map(|s| s.to_string()).collect());
    for c in &caps {
        if !matches!(c.as_str(), "pull" | "resolve" | "push") {
            return Err(Error::invalid(format!(
                "hosts.toml: unknown capability {c:?} for {base}"
            )));
        }
    }
    let base = base.trim_end_matches('/');
    let url = url::Url::parse(base)
        .map_err(|e| Error::invalid(format!("hosts.toml: host {base:?} is not a URL: {e}")))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err(Error::invalid(format!(
            "hosts.toml: host {base:?} must be an http:// or https:// URL"
        )));
    }
    Ok(Endpoint {
        base: base.to_string(),
        mirror: false,
        pull: caps.iter().any(|c| c == "pull"),
        resolve: caps.iter().any(|c| c == "resolve"),
        push: caps.iter().any(|c| c == "push"),
        override_path: entry.override_path.unwrap_or(false),
        skip_verify: entry.skip_verify.unwrap_or(false),
        client_cert: client_cert(entry.client, dir, base)?,
        ca: entry
            .ca
            .map(StringOrList::into_vec)
            .unwrap_or_default()
            .into_iter()
            .map(|p| resolve_path(dir, p))
            .collect(),
        headers: entry
            .header
            .into_iter()
            .map(|(k, v)| (k, v.into_vec().join(", ")))
            .collect(),
    })
}

/// Parses one `hosts.toml`; `dir` resolves relative certificate paths. The upstream server is
/// the registry itself unless `server` says otherwise. Mirrors come first, in file order.
pub fn parse_hosts_toml(text: &str, dir: &Path, upstream: Endpoint) -> Result<Vec<Endpoint>> {
    let file: HostsFile = toml::from_str(text)
        .map_err(|e| Error::invalid(format!("hosts.toml in {} is invalid: {e}", dir.display())))?;
    // toml tables are sorted by key; containerd keeps file order. Recover it from the text.
    let mut mirrors: Vec<(usize, Endpoint)> = Vec::new();
    for (url, entry) in file.host {
        let pos = text.find(&format!("\"{url}\"")).unwrap_or(usize::MAX);
        let mirror = Endpoint {
            mirror: true,
            ..build(&url, entry, dir, &["pull", "resolve"])?
        };
        mirrors.push((pos, mirror));
    }
    mirrors.sort_by_key(|(pos, _)| *pos);
    let server = match file.server {
        Some(s) => {
            let settings = HostEntry {
                capabilities: file.capabilities,
                skip_verify: file.skip_verify,
                ca: file.ca,
                client: file.client,
                header: file.header,
                override_path: file.override_path,
            };
            build(&s, settings, dir, &["pull", "resolve", "push"])?
        }
        None => upstream,
    };
    let mut endpoints: Vec<Endpoint> = mirrors.into_iter().map(|(_, e)| e).collect();
    endpoints.push(server);
    Ok(endpoints)
}

/// How often a cached registry's `hosts.toml` is looked at again.
pub const RECHECK: Duration = Duration::from_secs(1);

/// Which file configures a registry, and its modification time and size when read.
type Stamp = Option<(PathBuf, SystemTime, u64)>;

/// The file that configures `registry` under `root` (its own, else `_default`), stamped.
fn stamp(root: &Path, registry: &str) -> Stamp {
    [registry, "_default"].iter().find_map(|name| {
        let file = root.join(name).join("hosts.toml");
        let m = std::fs::metadata(&file).ok()?;
        Some((file, m.modified().ok()?, m.len()))
    })
}

/// Endpoints per registry as last read from a hosts directory.
#[derive(Debug, Default)]
pub struct HostsCache {
    entries: Mutex<HashMap<String, Cached>>,
}

#[derive(Debug)]
struct Cached {
    stamp: Stamp,
    endpoints: Vec<Endpoint>,
    checked: Instant,
}

impl HostsCache {
    /// [`endpoints_for`], read again only when the registry's file changed.
    pub fn endpoints(
        &self,
        hosts_dir: Option<&Path>,
        registry: &str,
        upstream: Endpoint,
    ) -> Result<Vec<Endpoint>> {
        let Some(root) = hosts_dir else {
            return Ok(vec![upstream]);
        };
        let now = Instant::now();
        let stamp = {
            let mut entries = self.entries.lock();
            if let Some(c) = entries.get_mut(registry) {
                if now.duration_since(c.checked) < RECHECK {
                    return Ok(c.endpoints.clone());
                }
                let current = stamp(root, registry);
                if current == c.stamp {
                    c.checked = now;
                    return Ok(c.endpoints.clone());
                }
                current
            } else {
                stamp(root, registry)
            }
        };
        // Read outside the lock; a file that fails to parse is not kept (read again next time).
        let endpoints = endpoints_for(hosts_dir, registry, upstream)?;
        self.entries.lock().insert(
            registry.to_string(),
            Cached {
                stamp,
                endpoints: endpoints.clone(),
                checked: now,
            },
        );
        Ok(endpoints)
    }
}

/// The endpoints for `registry`, from `hosts_dir` if it has a file for it, else the upstream.
pub fn endpoints_for(
    hosts_dir: Option<&Path>,
    registry: &str,
    upstream: Endpoint,
) -> Result<Vec<Endpoint>> {
    let Some(root) = hosts_dir else {
        return Ok(vec![upstream]);
    };
    for name in [registry, "_default"] {
        let dir = root.join(name);
        let file = dir.join("hosts.toml");
        match std::fs::read_to_string(&file) {
            Ok(text) => return parse_hosts_toml(&text, &dir, upstream),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(format!("reading {}", file.display()), e)),
        }
    }
    Ok(vec![upstream])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirrors_first_in_file_order_then_server() {
        let text = r#"
server = "https://registry.example:5000"

[host."http://zz-mirror.local:5001"]
  capabilities = ["pull", "resolve"]
  header = { X-Mirror = "1" }

[host."https://aa-mirror.local/v2/proxy"]
  capabilities = ["pull"]
  override_path = true
  skip_verify = true
  ca = "ca.pem"
  client = [["client.cert", "client.key"]]
"#;
        let eps = parse_hosts_toml(
            text,
            Path::new("/etc/containerd/certs.d/r"),
            Endpoint::upstream("r", false),
        )
        .unwrap();
        assert_eq!(eps.len(), 3);
        assert_eq!(eps[0].base, "http://zz-mirror.local:5001");
        assert_eq!(eps[0].headers["X-Mirror"], "1");
        assert!(!eps[0].push);
        assert_eq!(
            eps[1].url("a/manifests/t"),
            "https://aa-mirror.local/v2/proxy/a/manifests/t"
        );
        assert_eq!(
            eps[1].ca,
            vec![PathBuf::from("/etc/containerd/certs.d/r/ca.pem")]
        );
        assert!(eps[1].skip_verify && !eps[1].resolve);
        let certs = Path::new("/etc/containerd/certs.d/r");
        assert_eq!(
            eps[1].client_cert,
            Some((certs.join("client.cert"), Some(certs.join("client.key"))))
        );
        assert_eq!(eps[0].client_cert, None);
        assert_eq!(
            eps[2].url("a/blobs/x"),
            "https://registry.example:5000/v2/a/blobs/x"
        );
        assert!(eps[2].push);
    }

    #[test]
    fn rejects_bad_files() {
        let up = || Endpoint::upstream("r", false);
        assert!(parse_hosts_toml("server = 5", Path::new("/"), up()).is_err());
        assert!(parse_hosts_toml("[host.\"ftp://x\"]\n", Path::new("/"), up()).is_err());
        assert!(parse_hosts_toml(
            "[host.\"http://x\"]\ncapabilities=[\"fly\"]\n",
            Path::new("/"),
            up()
        )
        .is_err());
        assert!(parse_hosts_toml("bogus = 1", Path::new("/"), up()).is_err());
        assert!(
            parse_hosts_toml("[host.\"http://x\"]\nclient = 5\n", Path::new("/"), up()).is_err()
        );
    }

    #[test]
    fn directory_lookup_falls_back_to_default() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("_default")).unwrap();
        std::fs::write(
            dir.path().join("_default/hosts.toml"),
            "[host.\"http://127.0.0.1:6000\"]\n",
        )
        .unwrap();
        let eps = endpoints_for(
            Some(dir.path()),
            "quay.io",
            Endpoint::upstream("quay.io", false),
        )
        .unwrap();
        assert_eq!(eps[0].base, "http://127.0.0.1:6000");
        assert_eq!(eps[1].base, "https://quay.io");
        let eps = endpoints_for(None, "quay.io", Endpoint::upstream("quay.io", false)).unwrap();
        assert_eq!(eps.len(), 1);
    }

    #[test]
    fn the_cache_rereads_a_changed_file_only() {
        let dir = tempfile::tempdir().unwrap();
        let reg_dir = dir.path().join("r.example");
        std::fs::create_dir_all(&reg_dir).unwrap();
        let file = reg_dir.join("hosts.toml");
        let mirror =
            |n: u32| format!("[host.\"http://mirror{n}.example\"]\ncapabilities = [\"pull\"]\n");
        std::fs::write(&file, mirror(1)).unwrap();
        let cache = HostsCache::default();
        let upstream = Endpoint::upstream("r.example", false);
        let get = || {
            cache
                .endpoints(Some(dir.path()), "r.example", upstream.clone())
                .unwrap()[0]
                .base
                .clone()
        };
        assert_eq!(get(), "http://mirror1.example");
        // Within RECHECK nothing is looked at; after it, a changed file is read again.
        std::fs::write(&file, mirror(22)).unwrap();
        assert_eq!(get(), "http://mirror1.example");
        std::thread::sleep(RECHECK + Duration::from_millis(50));
        assert_eq!(get(), "http://mirror22.example");
        // A removed file falls back to the upstream.
        std::fs::remove_file(&file).unwrap();
        std::thread::sleep(RECHECK + Duration::from_millis(50));
        assert_eq!(get(), upstream.base);
    }
}
