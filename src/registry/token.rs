//! Authorization: answering a registry's `WWW-Authenticate` challenge (Basic, or a Bearer
//! token from its token service) with one of the credentials a request may carry, and the
//! authorizations kept per endpoint, scope and principal until they expire.

use std::time::{Duration, Instant};

use reqwest::header::AUTHORIZATION;

use super::auth::{self, Challenge};
use super::client::{read_limited, registry_error_text, RegistryClient};
use super::credentials::{CachedAuth, Candidate, Principal};
use super::hosts::Endpoint;
use crate::error::{Error, ErrorKind, Result};
use crate::oci::reference::{is_loopback_host, Reference};

impl RegistryClient {
    /// Answers `challenge` for `candidate` and keeps the authorization under its principal.
    pub(super) async fn authorize(
        &self,
        ep: &Endpoint,
        r: &Reference,
        challenge: &str,
        scope_key: &str,
        scopes: &[String],
        candidate: &Candidate,
    ) -> Result<()> {
        let host = &r.registry;
        let challenge =
            auth::parse_challenge(challenge).map_err(|e| e.context(format!("registry {host}")))?;
        let (credential, usable_until) = (&candidate.credential, candidate.usable_until);
        let (value, expiry) = match challenge {
            Challenge::Basic => {
                let c = credential.as_ref().ok_or_else(|| {
                    Error::new(ErrorKind::Auth, format!("registry {host} requires credentials and none were found; add them to a docker config file (REGISTRY_AUTH_FILE, $DOCKER_CONFIG/config.json or ~/.docker/config.json)"))
                })?;
                (c.basic_header(), usable_until)
            }
            Challenge::Bearer {
                realm,
                service,
                scope,
            } => {
                let challenge = (realm.as_str(), service.as_deref(), scope.as_deref());
                let (token, token_end) = self
                    .bearer_token(ep, host, challenge, scopes, credential.as_ref())
                    .await?;
                (
                    format!("Bearer {token}"),
                    // A token outlives neither itself nor the credential it was got with.
                    Some(usable_until.map_or(token_end, |u| u.min(token_end))),
                )
            }
        };
        self.shared.auth.lock().insert(
            (
                ep.base.clone(),
                scope_key.to_string(),
                candidate.principal.clone(),
            ),
            CachedAuth {
                header: value,
                expires: expiry,
            },
        );
        Ok(())
    }

    /// A token from the token service `realm` names (with its `service` and `scope`, or the
    /// `scopes` the request needs), asked with `credential` or anonymously; the token and
    /// until when it may be used.
    async fn bearer_token(
        &self,
        ep: &Endpoint,
        host: &str,
        (realm, service, scope): (&str, Option<&str>, Option<&str>),
        scopes: &[String],
        credential: Option<&auth::Credential>,
    ) -> Result<(String, Instant)> {
        let mut url = url::Url::parse(realm).map_err(|e| {
            Error::new(
                ErrorKind::Auth,
                format!("registry {host}: token realm {realm:?} is not a URL: {e}"),
            )
        })?;
        {
            let mut q = url.query_pairs_mut();
            if let Some(s) = service {
                q.append_pair("service", s);
            }
            let mut sent = false;
            for s in scopes {
                q.append_pair("scope", s);
                sent = true;
            }
            if let (false, Some(s)) = (sent, scope) {
                q.append_pair("scope", s);
            }
        }
        let realm_host = url.host_str().unwrap_or_default().to_string();
        if url.scheme() == "http" && !self.plain_http(&realm_host) && !is_loopback_host(&realm_host)
        {
            return Err(Error::new(ErrorKind::Auth, format!("registry {host}: token realm {realm} is plain HTTP; refusing to send credentials")));
        }
        let mut req = self.http(ep)?.get(url);
        if let Some(c) = credential {
            req = req.header(AUTHORIZATION, c.basic_header());
        }
        let resp = req.send().await.map_err(|e| {
            Error::new(
                ErrorKind::Network,
                format!("registry {host}: token request to {realm} failed"),
            )
            .with_source(e)
        })?;
        let status = resp.status();
        let body = read_limited(resp, 1 << 20, "token response").await?;
        if !status.is_success() {
            let who = credential
                .as_ref()
                .map_or("anonymous access".to_string(), |c| {
                    format!("user {}", c.username)
                });
            return Err(Error::new(
                ErrorKind::Auth,
                format!(
                    "registry {host}: token server {realm} refused {who} (HTTP {status}: {})",
                    registry_error_text(&body)
                ),
            ));
        }
        #[derive(serde::Deserialize)]
        struct Token {
            token: Option<String>,
            access_token: Option<String>,
            expires_in: Option<u64>,
        }
        let t: Token = serde_json::from_slice(&body).map_err(|e| {
            Error::new(
                ErrorKind::Auth,
                format!("registry {host}: token response is malformed: {e}"),
            )
        })?;
        let token = t
            .token
            .or(t.access_token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Auth,
                    format!("registry {host}: token response has no token"),
                )
            })?;
        let ttl = Duration::from_secs(t.expires_in.unwrap_or(60).clamp(10, 3600));
        let token_end = Instant::now() + ttl - Duration::from_secs(5);
        Ok((token, token_end))
    }

    pub(super) fn cached_auth(
        &self,
        ep: &Endpoint,
        scope_key: &str,
        principal: &Principal,
    ) -> Option<String> {
        let auth = self.shared.auth.lock();
        auth.get(&(ep.base.clone(), scope_key.to_string(), principal.clone()))
            .filter(|a| a.expires.is_none_or(|e| e > Instant::now()))
            .map(|a| a.header.clone())
    }
}
