//! Registry credentials and authentication challenges.
//!
//! Credentials come from docker-style config files (`REGISTRY_AUTH_FILE`,
//! `$DOCKER_CONFIG/config.json`, `~/.docker/config.json`), including credential helpers. They
//! are never logged: [`Credential`]'s `Debug` prints only the user name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use base64::Engine as _;
use serde::Deserialize;

use crate::error::{Error, ErrorKind, Result};

/// A user name and secret for one registry.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential {
    pub username: String,
    pub secret: String,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credential({}, <redacted>)", self.username)
    }
}

impl Credential {
    /// The credential an `auth` field carries (docker config files, CRI's `AuthConfig`): the
    /// base64 of `user:password`.
    pub fn from_auth(auth: &str) -> Result<Credential> {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|_| Error::invalid("auth is not valid base64"))?;
        let text = String::from_utf8(raw).map_err(|_| Error::invalid("auth is not valid UTF-8"))?;
        let (u, p) = text
            .split_once(':')
            .ok_or_else(|| Error::invalid("auth is not user:password"))?;
        Ok(Credential {
            username: u.to_string(),
            secret: p.to_string(),
        })
    }

    /// The `Authorization: Basic` value.
    pub fn basic_header(&self) -> String {
        let raw = format!("{}:{}", self.username, self.secret);
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(raw)
        )
    }
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
    #[serde(default)]
    creds_store: Option<String>,
    #[serde(default)]
    cred_helpers: BTreeMap<String, String>,
}

#[derive(Deserialize, Default)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

/// Credentials from docker config files, looked up by registry host.
#[derive(Default)]
pub struct CredentialStore {
    files: Vec<(PathBuf, DockerConfig)>,
}

/// `https://index.docker.io/v1/`, `http://host:5000/x`, `host:5000` all key `host:5000`.
fn normalize_key(key: &str) -> String {
    let key = key
        .trim_start_matches("https://")
        .trim_start_matches("http://");
    let host = key.split('/').next().unwrap_or(key);
    match host {
        "index.docker.io" | "registry-1.docker.io" => "docker.io".to_string(),
        h => h.to_string(),
    }
}

impl std::fmt::Debug for CredentialStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.files.iter().map(|(p, _)| p))
            .finish()
    }
}

impl CredentialStore {
    /// The default search path: `REGISTRY_AUTH_FILE`, `$DOCKER_CONFIG/config.json`,
    /// `~/.docker/config.json`, in that order of preference. Missing files are skipped; a file
    /// that exists but cannot be parsed is an error.
    pub fn from_env() -> Result<Self> {
        let mut paths = Vec::new();
        if let Some(p) = std::env::var_os("REGISTRY_AUTH_FILE") {
            paths.push(PathBuf::from(p));
        }
        if let Some(d) = std::env::var_os("DOCKER_CONFIG") {
            paths.push(Path::new(&d).join("config.json"));
        }
        if let Some(h) = std::env::var_os("HOME") {
            paths.push(Path::new(&h).join(".docker/config.json"));
        }
        Self::from_files(&paths)
    }

    /// Loads the given docker config files; missing ones are skipped.
    pub fn from_files(paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::new();
        for path in paths {
            let text = match std::fs::read(path) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    return Err(Error::io(
                        format!("reading credentials file {}", path.display()),
                        e,
                    ))
                }
            };
            let config: DockerConfig = serde_json::from_slice(&text).map_err(|e| {
                Error::invalid(format!(
                    "credentials file {} is not a valid docker config: {e}",
                    path.display()
                ))
            })?;
            files.push((path.clone(), config));
        }
        Ok(CredentialStore { files })
    }

    /// The credential for `registry` (`host[:port]`), if any file has one.
    pub async fn get(&self, registry: &str) -> Result<Option<Credential>> {
        let want = normalize_key(registry);
        for (path, config) in &self.files {
            if let Some(helper) = config
                .cred_helpers
                .get(&want)
                .or(config.creds_store.as_ref())
            {
                if let Some(c) = run_helper(helper, registry).await? {
                    return Ok(Some(c));
                }
            }
            for (key, entry) in &config.auths {
                if normalize_key(key) != want {
                    continue;
                }
                return decode_entry(entry)
                    .map(Some)
                    .map_err(|e| e.context(format!("{}: entry for {key}", path.display())));
            }
        }
        Ok(None)
    }
}

fn decode_entry(entry: &AuthEntry) -> Result<Credential> {
    if let (Some(u), Some(p)) = (&entry.username, &entry.password) {
        return Ok(Credential {
            username: u.clone(),
            secret: p.clone(),
        });
    }
    let auth = entry
        .auth
        .as_deref()
        .ok_or_else(|| Error::invalid("has neither auth nor username/password"))?;
    Credential::from_auth(auth)
}

/// How long a credential helper may take to answer.
pub const HELPER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Asks `docker-credential-<helper> get` for `registry`'s credential, within
/// [`HELPER_TIMEOUT`] (a helper that hangs, waiting for a keyring or a prompt, is killed).
async fn run_helper(helper: &str, registry: &str) -> Result<Option<Credential>> {
    use tokio::io::AsyncWriteExt;
    if !helper
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(Error::invalid(format!(
            "credential helper name {helper:?} is invalid"
        )));
    }
    let program = format!("docker-credential-{helper}");
    let mut child = match tokio::process::Command::new(&program)
        .arg("get")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(format!("running {program}"), e)),
    };
    let stdin = child.stdin.take();
    let asked = async move {
        if let Some(mut stdin) = stdin {
            let _ = stdin.write_all(registry.as_bytes()).await;
        }
        child.wait_with_output().await
    };
    let out = tokio::time::timeout(HELPER_TIMEOUT, asked)
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::Timeout,
                format!(
                    "{program} did not answer within {}s; check the helper (a locked keyring?)",
                    HELPER_TIMEOUT.as_secs()
                ),
            )
        })?
        .map_err(|e| Error::io(format!("running {program}"), e))?;
    if !out.status.success() {
        return Ok(None);
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct HelperReply {
        username: String,
        secret: String,
    }
    let reply: HelperReply = serde_json::from_slice(&out.stdout).map_err(|e| {
        Error::new(
            ErrorKind::Auth,
            format!("{program} answered malformed JSON: {e}"),
        )
    })?;
    Ok(Some(Credential {
        username: reply.username,
        secret: reply.secret,
    }))
}

/// A parsed `WWW-Authenticate` challenge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Challenge {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
        scope: Option<String>,
    },
}

/// Parses `Basic realm="x"` or `Bearer realm="...",service="...",scope="..."`.
pub fn parse_challenge(header: &str) -> Result<Challenge> {
    let header = header.trim();
    let (scheme, rest) = header.split_once(' ').unwrap_or((header, ""));
    let mut params = BTreeMap::new();
    let mut chars = rest.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let key: String = chars
            .by_ref()
            .take_while(|c| *c != '=')
            .collect::<String>()
            .trim()
            .to_ascii_lowercase();
        if key.is_empty() {
            break;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next()),
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            value = chars
                .by_ref()
                .take_while(|c| *c != ',')
                .collect::<String>()
                .trim()
                .to_string();
        }
        params.insert(key, value);
    }
    match scheme.to_ascii_lowercase().as_str() {
        "basic" => Ok(Challenge::Basic),
        "bearer" => Ok(Challenge::Bearer {
            realm: params.remove("realm").ok_or_else(|| {
                Error::new(
                    ErrorKind::Auth,
                    format!("Bearer challenge without realm: {header:?}"),
                )
            })?,
            service: params.remove("service"),
            scope: params.remove("scope"),
        }),
        other => Err(Error::new(
            ErrorKind::Unsupported,
            format!("authentication scheme {other:?} is not supported"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_challenges() {
        assert_eq!(
            parse_challenge(r#"Basic realm="Registry Realm""#).unwrap(),
            Challenge::Basic
        );
        let c = parse_challenge(r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#).unwrap();
        assert_eq!(
            c,
            Challenge::Bearer {
                realm: "https://auth.example/token".into(),
                service: Some("registry.example".into()),
                scope: Some("repository:a/b:pull,push".into())
            }
        );
        assert!(parse_challenge("Bearer service=x").is_err());
        assert!(parse_challenge("Negotiate abc").is_err());
    }

    #[tokio::test]
    async fn reads_docker_config_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret");
        std::fs::write(
            &path,
            format!(r#"{{"auths":{{"http://127.0.0.1:5000":{{"auth":"{auth}"}},"https://index.docker.io/v1/":{{"username":"bob","password":"pw"}}}}}}"#),
        )
        .unwrap();
        let store =
            CredentialStore::from_files(&[dir.path().join("missing.json"), path.clone()]).unwrap();
        let c = store.get("127.0.0.1:5000").await.unwrap().unwrap();
        assert_eq!(
            (c.username.as_str(), c.secret.as_str()),
            ("alice", "s3cret")
        );
        assert_eq!(
            store.get("docker.io").await.unwrap().unwrap().username,
            "bob"
        );
        assert!(store.get("quay.io").await.unwrap().is_none());
        assert!(!format!("{c:?}").contains("s3cret"));
        std::fs::write(&path, "{not json").unwrap();
        assert!(CredentialStore::from_files(&[path])
            .unwrap_err()
            .to_string()
            .contains("not a valid docker config"));
    }

    /// Installs the test's credential helpers (real programs on PATH; nextest runs each test
    /// in its own process, so changing PATH here touches no other test) and a config naming
    /// them.
    fn helpers(dir: &Path) -> CredentialStore {
        use std::os::unix::fs::PermissionsExt;
        for (name, body) in [
            (
                "vmdisk-test-ok",
                r#"read host; echo "{\"Username\":\"carol\",\"Secret\":\"for-$host\"}""#,
            ),
            ("vmdisk-test-hang", "exec sleep 60"),
        ] {
            let path = dir.join(format!("docker-credential-{name}"));
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let path = format!(
            "{}:{}",
            dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        std::env::set_var("PATH", path);
        let config = dir.join("config.json");
        std::fs::write(
            &config,
            r#"{"credHelpers":{"ok.example":"vmdisk-test-ok","hang.example":"vmdisk-test-hang"}}"#,
        )
        .unwrap();
        CredentialStore::from_files(&[config]).unwrap()
    }

    #[tokio::test]
    async fn credential_helpers_are_asked() {
        let dir = tempfile::tempdir().unwrap();
        let store = helpers(dir.path());
        let c = store.get("ok.example").await.unwrap().unwrap();
        assert_eq!(
            (c.username.as_str(), c.secret.as_str()),
            ("carol", "for-ok.example")
        );
    }

    /// Paused time: the deadline passes as soon as the hanging helper is all there is to wait
    /// for, so the test takes no 10 s.
    #[tokio::test(start_paused = true)]
    async fn a_hanging_credential_helper_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let store = helpers(dir.path());
        let err = store.get("hang.example").await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Timeout, "{}", err.chain());
        assert!(err.chain().contains("docker-credential-vmdisk-test-hang"));
    }
}
