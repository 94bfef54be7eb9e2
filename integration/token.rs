//! A small token server for Bearer-auth tests against the real registry: it checks Basic
//! credentials, grants the requested repository scopes and signs a JWT (RS256, with the
//! signing certificate in `x5c`) that docker-registry verifies against its `rootcertbundle`.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use base64::Engine as _;

use crate::harness::{run, Registry, Scratch};

pub const SERVICE: &str = "vmdisk-test-registry";
pub const ISSUER: &str = "vmdisk-test-issuer";

pub struct TokenServer {
    pub port: u16,
    pub issued: Arc<AtomicU64>,
    pub cert: PathBuf,
}

fn b64url(data: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(data)
}

fn sign(key: &Path, data: &[u8]) -> Vec<u8> {
    let mut child = Command::new("openssl")
        .args(["dgst", "-sha256", "-sign"])
        .arg(key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(data).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    out.stdout
}

impl TokenServer {
    /// Serves 300 s tokens to `user`/`password` until the test process ends.
    pub fn start(scratch: &Scratch, user: &str, password: &str) -> Self {
        Self::start_for(scratch, &[(user, password)], 300)
    }

    /// Serves tokens that expire after `lifetime` seconds to each of `users` (name, password).
    pub fn start_for(scratch: &Scratch, users: &[(&str, &str)], lifetime: u64) -> Self {
        let key = scratch.path("token.key");
        let cert = scratch.path("token.pem");
        run(
            "openssl",
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                key.to_str().unwrap(),
                "-out",
                cert.to_str().unwrap(),
                "-days",
                "1",
                "-subj",
                "/CN=vmdisk-test-token",
            ],
        );
        let der = run(
            "openssl",
            &["x509", "-in", cert.to_str().unwrap(), "-outform", "der"],
        );
        let x5c = base64::engine::general_purpose::STANDARD.encode(der);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let issued = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&issued);
        let accepted: Vec<(String, String)> = users
            .iter()
            .map(|(user, password)| {
                let header = format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
                );
                (header, user.to_string())
            })
            .collect();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut request_line = String::new();
                if reader.read_line(&mut request_line).is_err() {
                    continue;
                }
                let mut authorized = None;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some((name, value)) = line.split_once(':') {
                        if name.eq_ignore_ascii_case("authorization") {
                            authorized = accepted
                                .iter()
                                .find(|(header, _)| value.trim() == header)
                                .map(|(_, user)| user.clone());
                        }
                    }
                }
                let Some(user) = authorized else {
                    let body =
                        r#"{"errors":[{"code":"UNAUTHORIZED","message":"bad credentials"}]}"#;
                    let _ = write!(stream, "HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
                    continue;
                };
                let target = request_line.split_whitespace().nth(1).unwrap_or("/");
                let query = target.split_once('?').map_or("", |(_, q)| q);
                let mut access = Vec::new();
                for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
                    if k == "scope" {
                        for scope in v.split(' ') {
                            let parts: Vec<&str> = scope.split(':').collect();
                            if let [kind, name, actions] = parts[..] {
                                access.push(serde_json::json!({"type": kind, "name": name, "actions": actions.split(',').collect::<Vec<_>>()}));
                            }
                        }
                    }
                }
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs();
                let n = counter.fetch_add(1, Ordering::SeqCst);
                let header = serde_json::json!({"typ": "JWT", "alg": "RS256", "x5c": [x5c]});
                let claims = serde_json::json!({"iss": ISSUER, "sub": user, "aud": SERVICE, "exp": now + lifetime, "nbf": now - 10, "iat": now, "jti": format!("t{n}"), "access": access});
                let signing_input = format!(
                    "{}.{}",
                    b64url(header.to_string().as_bytes()),
                    b64url(claims.to_string().as_bytes())
                );
                let signature = sign(&key, signing_input.as_bytes());
                let token = format!("{signing_input}.{}", b64url(&signature));
                let body = serde_json::json!({"token": token, "expires_in": lifetime}).to_string();
                let _ = write!(stream, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
            }
        });
        TokenServer { port, issued, cert }
    }

    /// A registry that accepts only this server's tokens.
    pub fn registry(&self, scratch: &Scratch) -> Registry {
        Registry::start_with(
            scratch,
            &format!(
                "auth: {{ token: {{ realm: \"http://127.0.0.1:{}/token\", service: {SERVICE}, issuer: {ISSUER}, rootcertbundle: {} }} }}\n",
                self.port,
                self.cert.display()
            ),
        )
    }
}
