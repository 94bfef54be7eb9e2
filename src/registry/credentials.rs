//! Whose credential a request carries ([`Principal`], [`Candidate`]), the access it needs
//! ([`Access`], [`scope`]) and an authorization kept for it ([`CachedAuth`]): what the token
//! exchange, the transport and pushes share.

use std::time::Instant;

use super::auth;

/// Whose credential a request carries: the node's own (or none), or one granted, named by a
/// digest of user and secret (two grants with the same user name stay apart).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum Principal {
    Node,
    Granted(String),
}

/// One credential a request may try, in the order they are tried.
pub(super) struct Candidate {
    pub(super) principal: Principal,
    pub(super) credential: Option<auth::Credential>,
    /// Until when it may be used (a grant expires; the node's own does not).
    pub(super) usable_until: Option<Instant>,
}

impl Candidate {
    pub(super) fn describe(&self) -> String {
        match (&self.principal, &self.credential) {
            (Principal::Node, None) => "anonymous access (the node has no credentials for it: REGISTRY_AUTH_FILE, $DOCKER_CONFIG/config.json, ~/.docker/config.json)".into(),
            (Principal::Node, Some(c)) => format!("the node's credentials (user {})", c.username),
            (Principal::Granted(_), Some(c)) => format!("the credentials kubelet sent (user {})", c.username),
            (Principal::Granted(_), None) => "a grant without a credential".into(),
        }
    }
}

/// An `Authorization` header value and when it stops being valid (tokens expire).
pub(super) struct CachedAuth {
    pub(super) header: String,
    pub(super) expires: Option<Instant>,
}

/// Which access a request needs, for token scopes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Access {
    Pull,
    Push,
}

pub(super) fn scope(repo: &str, access: Access) -> String {
    match access {
        Access::Pull => format!("repository:{repo}:pull"),
        Access::Push => format!("repository:{repo}:pull,push"),
    }
}
