//! Where a blob's bytes are, once an endpoint has redirected a request for them: the blob
//! host's URL (a signed, expiring URL on a CDN or an object store, as every public registry
//! answers a blob GET with), kept per endpoint, repository and blob, so that every later range
//! of the blob goes straight to the blob host instead of asking the registry's API again
//! first. A kept URL serves until the blob host refuses it (expired, revoked: S3, GCS, Azure
//! and CloudFront answer 400, 401 or 403) or fails; the request is then sent to the endpoint
//! again, which redirects anew. One request resolves a blob while the others that need it
//! wait for its answer's headers (bounded by [`RESOLVE_WAIT`]), so a burst of cold reads costs
//! the registry one request; an endpoint that answered with the bytes themselves is asked
//! directly from then on.
//!
//! It never holds credentials: the registry's `Authorization` never goes to another host
//! ([`super::transport`] follows the redirects).

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::oci::digest::Digest;

/// How many blobs' URLs are kept at most; past that the oldest are forgotten.
const KEPT_AT_MOST: usize = 4096;

/// How long a request waits for another's resolution of the same blob before it asks the
/// endpoint itself.
pub const RESOLVE_WAIT: Duration = Duration::from_secs(10);

/// Whose redirect: the endpoint's base URL, the repository, the blob.
type Key = (String, String, Digest);

enum Entry {
    /// The blob host's URL, and when it was kept (to forget the oldest first).
    Kept(reqwest::Url, u64),
    /// The endpoint answered with the bytes itself (no redirect), and when.
    Direct(u64),
    /// A request is resolving it; its answer comes on the channel.
    Resolving(watch::Receiver<Resolved>),
}

/// What a resolving request learnt.
#[derive(Clone, PartialEq)]
enum Resolved {
    Pending,
    Kept(reqwest::Url),
    Direct,
}

/// The kept blob URLs of one client.
#[derive(Default)]
pub struct Locations {
    entries: Mutex<HashMap<Key, Entry>>,
    /// A counter ordering the kept entries.
    kept: std::sync::atomic::AtomicU64,
}

/// What a request for a blob's bytes does about its location.
pub enum Lookup<'a> {
    /// Send to this URL.
    Kept(reqwest::Url),
    /// Ask the endpoint: it answers with the bytes itself.
    Endpoint,
    /// Ask the endpoint, and tell what it did through this claim.
    Resolve(Claim<'a>),
}

/// The one request resolving a blob's location: [`Claim::keep`] or [`Claim::direct`] stores
/// what it learnt; dropped without either (it failed), the waiters ask the endpoint
/// themselves.
pub struct Claim<'a> {
    locations: &'a Locations,
    key: Key,
    tx: Option<watch::Sender<Resolved>>,
}

impl Locations {
    /// Where to send a request for `blob` in `repository` at endpoint `base`: a kept URL, or a
    /// claim to resolve it. `refresh`: resolve anew (the bytes from the kept URL failed their
    /// check). Waits for another request's resolution of the same blob, [`RESOLVE_WAIT`] at
    /// most.
    pub async fn lookup(
        &self,
        base: &str,
        repository: &str,
        blob: &Digest,
        refresh: bool,
    ) -> Lookup<'_> {
        let key: Key = (base.to_string(), repository.to_string(), *blob);
        let waiting = {
            let entries = self.entries.lock();
            match entries.get(&key) {
                Some(Entry::Kept(url, _)) if !refresh => return Lookup::Kept(url.clone()),
                Some(Entry::Direct(_)) if !refresh => return Lookup::Endpoint,
                Some(Entry::Resolving(rx)) => Some(rx.clone()),
                _ => None,
            }
        };
        if let Some(mut rx) = waiting {
            let answered =
                match tokio::time::timeout(RESOLVE_WAIT, rx.wait_for(|r| *r != Resolved::Pending))
                    .await
                {
                    Ok(Ok(r)) => (*r).clone(),
                    _ => Resolved::Pending,
                };
            match answered {
                Resolved::Kept(url) => return Lookup::Kept(url),
                Resolved::Direct => return Lookup::Endpoint,
                Resolved::Pending => {}
            }
        }
        let (tx, rx) = watch::channel(Resolved::Pending);
        self.entries
            .lock()
            .insert(key.clone(), Entry::Resolving(rx));
        Lookup::Resolve(Claim {
            locations: self,
            key,
            tx: Some(tx),
        })
    }

    /// Forgets the kept URL of `blob` if it is `url` (the blob host refused or failed it).
    pub fn forget(&self, base: &str, repository: &str, blob: &Digest, url: &reqwest::Url) {
        let key: Key = (base.to_string(), repository.to_string(), *blob);
        let mut entries = self.entries.lock();
        if matches!(entries.get(&key), Some(Entry::Kept(kept, _)) if kept == url) {
            entries.remove(&key);
        }
    }

    /// How many blobs' URLs are kept.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries
            .lock()
            .values()
            .filter(|e| matches!(e, Entry::Kept(..)))
            .count()
    }

    /// Stores what a resolution learnt of `key`, forgetting the oldest entry if there are too
    /// many.
    fn store(&self, key: &Key, resolved: &Resolved) {
        let order = self.kept.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let entry = match resolved {
            Resolved::Kept(url) => Entry::Kept(url.clone(), order),
            Resolved::Direct => Entry::Direct(order),
            Resolved::Pending => return,
        };
        let mut entries = self.entries.lock();
        if entries.len() >= KEPT_AT_MOST {
            let oldest = entries
                .iter()
                .filter_map(|(k, e)| match e {
                    Entry::Kept(_, at) | Entry::Direct(at) => Some((*at, k.clone())),
                    Entry::Resolving(_) => None,
                })
                .min();
            if let Some((_, k)) = oldest {
                entries.remove(&k);
            }
        }
        entries.insert(key.clone(), entry);
    }
}

impl Claim<'_> {
    /// Keeps `url` as where the blob's bytes are (the endpoint redirected there and the blob
    /// host answered), and hands it to the waiting requests.
    pub fn keep(self, url: reqwest::Url) {
        self.resolved(Resolved::Kept(url));
    }

    /// Notes that the endpoint answered with the bytes itself.
    pub fn direct(self) {
        self.resolved(Resolved::Direct);
    }

    fn resolved(mut self, resolved: Resolved) {
        self.locations.store(&self.key, &resolved);
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(resolved);
        }
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if self.tx.is_some() {
            // Not resolved (no redirect, or it failed): nothing is kept; the waiters ask
            // themselves (the sender's drop wakes them).
            let mut entries = self.locations.entries.lock();
            if matches!(entries.get(&self.key), Some(Entry::Resolving(_))) {
                entries.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> reqwest::Url {
        reqwest::Url::parse(s).unwrap()
    }

    #[tokio::test]
    async fn one_request_resolves_and_the_others_wait_for_it() {
        let locations = std::sync::Arc::new(Locations::default());
        let blob = Digest::of(b"blob");
        let Lookup::Resolve(claim) = locations.lookup("https://r", "a/b", &blob, false).await
        else {
            panic!("nothing is kept yet")
        };
        let waiter = tokio::spawn({
            let locations = std::sync::Arc::clone(&locations);
            async move {
                match locations.lookup("https://r", "a/b", &blob, false).await {
                    Lookup::Kept(u) => Some(u),
                    Lookup::Endpoint | Lookup::Resolve(_) => None,
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        claim.keep(url("https://cdn/x?sig=1"));
        assert_eq!(waiter.await.unwrap(), Some(url("https://cdn/x?sig=1")));
        // Kept per endpoint and repository; forgotten when refused; a refresh resolves anew; an
        // endpoint that answered itself is asked directly.
        assert!(matches!(
            locations.lookup("https://r", "a/b", &blob, false).await,
            Lookup::Kept(_)
        ));
        assert!(matches!(
            locations.lookup("https://r", "other", &blob, false).await,
            Lookup::Resolve(_)
        ));
        assert!(matches!(
            locations.lookup("https://r", "a/b", &blob, true).await,
            Lookup::Resolve(_)
        ));
        assert_eq!(
            locations.len(),
            0,
            "a refresh's claim dropped unresolved keeps nothing"
        );
        let Lookup::Resolve(claim) = locations.lookup("https://r", "a/b", &blob, false).await
        else {
            panic!()
        };
        claim.keep(url("https://cdn/x?sig=2"));
        locations.forget("https://r", "a/b", &blob, &url("https://cdn/x?sig=1"));
        assert_eq!(
            locations.len(),
            1,
            "an older URL's refusal forgets nothing newer"
        );
        locations.forget("https://r", "a/b", &blob, &url("https://cdn/x?sig=2"));
        assert_eq!(locations.len(), 0);
        let Lookup::Resolve(claim) = locations.lookup("https://r", "a/b", &blob, false).await
        else {
            panic!()
        };
        claim.direct();
        assert!(matches!(
            locations.lookup("https://r", "a/b", &blob, false).await,
            Lookup::Endpoint
        ));
    }

    #[tokio::test]
    async fn a_failed_resolution_lets_the_waiters_ask_themselves() {
        let locations = std::sync::Arc::new(Locations::default());
        let blob = Digest::of(b"blob");
        let Lookup::Resolve(claim) = locations.lookup("https://r", "a", &blob, false).await else {
            panic!()
        };
        let waiter = tokio::spawn({
            let locations = std::sync::Arc::clone(&locations);
            async move {
                matches!(
                    locations.lookup("https://r", "a", &blob, false).await,
                    Lookup::Resolve(_)
                )
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(claim);
        assert!(waiter.await.unwrap(), "the waiter resolves itself");
    }
}
