//! Credentials a registry client was granted beyond the node's own.
//!
//! A client always acts with the node's own credentials (docker config files, their helpers,
//! or none). On a node, kubelet's credentials for a pod (a CRI `PullImage`'s `auth`) may be
//! granted to the clients that serve that pod's images, each for one repository of one
//! registry and until it expires; the snapshotter decides who gets what (its tenants module).
//! A granted credential is tried only after the node's own, and only for its repository. In
//! memory only: never written to a file, never logged ([`Credential`]'s `Debug` is redacted),
//! handed to a mount server over its stdin or its private control socket.

use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::auth::Credential;

/// Most grants one client holds; the one closest to expiring makes room.
pub const MAX_GRANTS: usize = 64;

/// One credential for one repository, until `expires`.
#[derive(Clone, Debug)]
pub struct Grant {
    pub registry: String,
    pub repository: String,
    pub credential: Credential,
    pub expires: Instant,
}

impl Grant {
    /// `credential` for `repository` of `registry`, for `ttl` from now.
    pub fn new(registry: &str, repository: &str, credential: Credential, ttl: Duration) -> Self {
        Grant {
            registry: registry.to_string(),
            repository: repository.to_string(),
            credential,
            expires: Instant::now() + ttl,
        }
    }

    fn covers(&self, registry: &str, repository: &str) -> bool {
        self.registry == registry && self.repository == repository
    }
}

/// The credentials a client was granted, per repository, each until it expires.
#[derive(Debug, Default)]
pub struct Granted {
    grants: Mutex<Vec<Grant>>,
}

impl Granted {
    /// A store holding `grants`.
    pub fn of(grants: impl IntoIterator<Item = Grant>) -> Self {
        let store = Granted::default();
        for g in grants {
            store.add(g);
        }
        store
    }

    /// Adds `grant`; one for the same repository and credential is replaced (renewed).
    pub fn add(&self, grant: Grant) {
        let now = Instant::now();
        let mut grants = self.grants.lock();
        grants.retain(|g| {
            g.expires > now
                && !(g.covers(&grant.registry, &grant.repository)
                    && g.credential == grant.credential)
        });
        if grants.len() >= MAX_GRANTS {
            if let Some(oldest) = grants
                .iter()
                .enumerate()
                .min_by_key(|(_, g)| g.expires)
                .map(|(i, _)| i)
            {
                grants.remove(oldest);
            }
        }
        grants.push(grant);
    }

    /// The unexpired credentials for `repository` of `registry`, newest first, each with how
    /// long it stays valid.
    pub fn for_repository(&self, registry: &str, repository: &str) -> Vec<(Credential, Duration)> {
        let now = Instant::now();
        let grants = self.grants.lock();
        grants
            .iter()
            .rev()
            .filter(|g| g.expires > now && g.covers(registry, repository))
            .map(|g| (g.credential.clone(), g.expires - now))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cred(user: &str) -> Credential {
        Credential {
            username: user.into(),
            secret: "s3cret".into(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn grants_are_per_repository_expire_and_never_displace_each_other() {
        let g = Granted::default();
        g.add(Grant::new(
            "r.example",
            "vm/a",
            cred("alice"),
            Duration::from_secs(60),
        ));
        g.add(Grant::new(
            "r.example",
            "vm/a",
            cred("bob"),
            Duration::from_secs(30),
        ));
        let users = |g: &Granted| -> Vec<String> {
            g.for_repository("r.example", "vm/a")
                .into_iter()
                .map(|(c, _)| c.username)
                .collect()
        };
        // Both kept, newest first: one never replaces the other.
        assert_eq!(users(&g), ["bob", "alice"]);
        assert!(g.for_repository("r.example", "vm/b").is_empty());
        assert!(g.for_repository("other.example", "vm/a").is_empty());
        tokio::time::advance(Duration::from_secs(31)).await;
        assert_eq!(users(&g), ["alice"]);
        // The same credential again renews it.
        g.add(Grant::new(
            "r.example",
            "vm/a",
            cred("alice"),
            Duration::from_secs(60),
        ));
        tokio::time::advance(Duration::from_secs(45)).await;
        assert_eq!(users(&g), ["alice"]);
        assert!(!format!("{g:?}").contains("s3cret"));
    }

    #[tokio::test(start_paused = true)]
    async fn the_store_is_bounded() {
        let g = Granted::default();
        for i in 0..MAX_GRANTS + 10 {
            g.add(Grant::new(
                "r",
                &format!("repo{i}"),
                cred("u"),
                Duration::from_secs(100 + i as u64),
            ));
        }
        assert_eq!(g.grants.lock().len(), MAX_GRANTS);
        assert!(g.for_repository("r", "repo0").is_empty());
        assert!(!g
            .for_repository("r", &format!("repo{}", MAX_GRANTS + 9))
            .is_empty());
    }
}
