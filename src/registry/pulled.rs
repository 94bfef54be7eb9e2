//! Credentials kubelet sent with a CRI `PullImage`, kept for the lazy fetches of that image.
//!
//! containerd uses a PullImage's `auth` for its own requests and tells a proxy snapshotter
//! nothing of it; vmdisk's CRI image-service proxy (`snapshotter::cri`) sees it and keeps it
//! here, per registry and repository, until it expires. In memory only: never written to a
//! file, never logged ([`Credential`]'s `Debug` is redacted), handed to a mount server over its
//! stdin or its private control socket. They are looked up before the docker config files.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::auth::Credential;

/// Most (registry, repository) pairs kept; the entry closest to expiring makes room.
pub const MAX_ENTRIES: usize = 4096;

/// Credentials per (registry host, repository), each until its expiry.
#[derive(Debug, Default)]
pub struct PulledCredentials {
    entries: Mutex<HashMap<(String, String), (Credential, Instant)>>,
}

impl PulledCredentials {
    /// Keeps `credential` for `repository` of `registry` for `ttl` (replacing what was kept).
    pub fn insert(&self, registry: &str, repository: &str, credential: Credential, ttl: Duration) {
        let now = Instant::now();
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.retain(|_, (_, expiry)| *expiry > now);
        if entries.len() >= MAX_ENTRIES {
            if let Some(oldest) = entries
                .iter()
                .min_by_key(|(_, (_, expiry))| *expiry)
                .map(|(k, _)| k.clone())
            {
                entries.remove(&oldest);
            }
        }
        entries.insert(
            (registry.to_string(), repository.to_string()),
            (credential, now + ttl),
        );
    }

    /// The unexpired credential for `repository` of `registry`, and how long it stays valid.
    pub fn get(&self, registry: &str, repository: &str) -> Option<(Credential, Duration)> {
        let now = Instant::now();
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries
            .get(&(registry.to_string(), repository.to_string()))
            .filter(|(_, expiry)| *expiry > now)
            .map(|(c, expiry)| (c.clone(), *expiry - now))
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
    async fn credentials_are_per_repository_and_expire() {
        let p = PulledCredentials::default();
        p.insert("r.example", "vm/a", cred("alice"), Duration::from_secs(60));
        assert_eq!(p.get("r.example", "vm/a").unwrap().0.username, "alice");
        assert!(p.get("r.example", "vm/b").is_none());
        assert!(p.get("other.example", "vm/a").is_none());
        tokio::time::advance(Duration::from_secs(30)).await;
        let (_, left) = p.get("r.example", "vm/a").unwrap();
        assert_eq!(left, Duration::from_secs(30));
        // A new pull replaces and extends.
        p.insert("r.example", "vm/a", cred("bob"), Duration::from_secs(60));
        tokio::time::advance(Duration::from_secs(45)).await;
        assert_eq!(p.get("r.example", "vm/a").unwrap().0.username, "bob");
        tokio::time::advance(Duration::from_secs(16)).await;
        assert!(p.get("r.example", "vm/a").is_none());
        // Debug never shows the secret.
        assert!(!format!("{p:?}").contains("s3cret"));
    }

    #[tokio::test(start_paused = true)]
    async fn the_store_is_bounded() {
        let p = PulledCredentials::default();
        for i in 0..MAX_ENTRIES + 10 {
            p.insert(
                "r",
                &format!("repo{i}"),
                cred("u"),
                Duration::from_secs(100 + i as u64),
            );
        }
        assert_eq!(p.entries.lock().unwrap().len(), MAX_ENTRIES);
        // The ones closest to expiring made room.
        assert!(p.get("r", "repo0").is_none());
        assert!(p.get("r", &format!("repo{}", MAX_ENTRIES + 9)).is_some());
    }
}
