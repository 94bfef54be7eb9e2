//! Per-endpoint health and counters, so a mirror that is down or answers badly costs one
//! failed request, not one per chunk.
//!
//! An endpoint that fails (no connection, a timeout, a 5xx or 429, a Range request answered
//! with the whole blob, a wrong or short body) is *resting* for a while: 1 s after its first
//! failure in a row, doubling up to [`MAX_REST`]. Resting endpoints are tried after the others,
//! never skipped: when every endpoint rests, they are still tried in their configured order.
//! The first request after a rest is the probe; a success clears the record. A 404 or 401 is
//! not a failure of the endpoint (a P2P mirror lacks what no peer has; a mirror may want other
//! credentials): the request goes on to the next endpoint without the endpoint resting.
//!
//! A mirror that answers a Range request for a blob with the whole blob (a pull-through
//! registry cache — CNCF distribution, Harbor — that does not hold it yet) is not failing:
//! it has started fetching that blob from the origin to store it, and every further request
//! for the blob before it holds it makes it stream another copy from the origin. So that blob
//! (not the mirror) rests there: its ranges go to the other endpoints, and the mirror is asked
//! again for them after [`BLOB_REST`], doubling up to [`MAX_BLOB_REST`], until it answers
//! with a range. A mirror asked for a blob it has not served ranges of that sends no answer
//! within the mirror deadline ([`Failure::Silent`]) rests the blob there too: a pull-through
//! cache answers only once the origin has started sending, which on a busy link takes seconds,
//! and asking again at once would start another stream from the origin.
//!
//! What a mirror does with a blob shows only at its answer, and a pull-through cache that
//! holds one blob (the config another node had it fetch) answers that blob's ranges as a
//! Range cache does. So a mirror that has not served ranges of a blob is asked for it by one
//! request at a time ([`Health::first_ask`]); the others wait for that answer, while the ask is
//! young, or go on to the next endpoint ([`Health::claim`]), and a reader waits for it only
//! briefly (the registry client's hedge: `transport::MIRROR_HEDGE`).
//!
//! The first such answer also teaches that the mirror *is* such a cache (a Range cache — nginx's
//! slice cache — never answers one), and so does a whole answer to a Range request covering a
//! whole small blob (a config: [`Health::answered_whole`]), which costs nothing more than the
//! fetch it is part of and comes before any read of a disk. From then on the mirror is passed
//! by for the *demand* ranges ([`Purpose::Demand`]) of every blob it was not asked for before
//! and has not answered a range of in this process, because merely asking it for a blob it
//! does not hold — a Range GET or a HEAD — makes it fetch the whole blob from the origin,
//! which on a node's first reads of a disk costs the node's reads the link's bandwidth. Reads
//! of a whole blob in the background ([`Purpose::Whole`]: hydration, a preheat) do ask it: its
//! one fill then serves the fleet; while it fills (the blob rests there), such reads wait for
//! it ([`Health::filling`], at most [`MAX_FILL_WAIT`]) instead of fetching the blob from the
//! origin once per node. (A blob it was asked for is being fetched there anyway: it is asked
//! again after its rest, and used once it answers with ranges.) What was
//! learnt is kept in a notes file when the client has one (the node's cache), so the daemon's
//! mount servers, each a process of its own, and later starts know it. It holds for
//! [`NOTE_LIFETIME`] from when it was learnt: the address may come to serve something else (a
//! slice cache put where the pull-through cache was), and a note that never expired would pass
//! it by for good. After that the mirror is asked again, and a whole-blob answer teaches it
//! again.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;
use tokio::time::Instant;

use super::hosts::Endpoint;
use crate::digest::Digest;

/// The longest an endpoint rests after failures in a row.
pub const MAX_REST: Duration = Duration::from_secs(30);
/// How long a blob rests at a mirror that answered a Range request for it with the whole blob
/// (first time; it doubles each time the mirror does so again). Short: background reads wait
/// for the mirror's fill that long before they ask again, and a 134 MB fill behind a
/// 200 Mbit/s link takes about 6 s; each ask while it fills costs the origin the start of
/// another stream (hung up at once).
pub const BLOB_REST: Duration = Duration::from_secs(5);
/// The longest a blob rests at a mirror.
pub const MAX_BLOB_REST: Duration = Duration::from_secs(600);
/// The longest background reads of a blob wait for a mirror to hold it (from its first whole
/// answer): a mirror that fills for longer is passed by for them too.
pub const MAX_FILL_WAIT: Duration = Duration::from_secs(600);
/// Most blob rests (and blobs known held) kept per mirror: the expired are forgotten first.
const MAX_BLOB_RESTS: usize = 4096;
/// How long what was learnt of a mirror (that it fills whole blobs) holds, in this process and
/// in the notes file.
pub const NOTE_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// Most mirrors a notes file names (it is the node's file, and untrusted: more are ignored).
const MAX_NOTED: usize = 64;
/// Longest line of a notes file.
const MAX_NOTE: usize = 512;

/// What one endpoint did since this process started (monotonic).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointCounters {
    /// Requests sent to it (a request the registry's retry policy sends again counts once).
    pub requests: u64,
    /// Requests it answered badly or not at all (a 404 is an answer, not counted): each went
    /// on to the next endpoint or failed.
    pub failures: u64,
    /// Body bytes received from it for blobs and manifests.
    pub bytes: u64,
}

/// What ranges of a blob are read for: whether a mirror known to fill whole blobs (a
/// pull-through cache) is asked for a blob it has not served ranges of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// A reader waits for them (a guest's reads, a TOC): such a mirror is passed by.
    Demand,
    /// The whole blob, in the background (hydration, a preheat): such a mirror is asked (its
    /// one fill serves every node) and, while it fills, waited for ([`Health::filling`]).
    Whole,
}

/// Whose a failed request's failure is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The endpoint's: no connection or answer, an error status, a wrong answer.
    Endpoint,
    /// The request's credentials were refused there.
    Refused,
    /// It does not have what was asked (a P2P mirror without a peer that has it).
    NotFound,
    /// A mirror answered a Range request for this blob with the whole blob (a pull-through
    /// cache filling itself): counted, and the blob rests there, not the mirror.
    WholeBlob(Digest),
    /// A mirror asked for a blob it has not served ranges of sent no answer within the mirror
    /// deadline (a pull-through cache fetching it before it answers, a cold cache behind a
    /// congested link): counted, and the blob rests there as after a whole answer, without
    /// teaching what the mirror is. Asking it again at once would only start another stream
    /// from the origin behind the same link.
    Silent(Digest),
}

#[derive(Debug, Default)]
struct State {
    failures_in_a_row: u32,
    resting_until: Option<Instant>,
    counters: EndpointCounters,
    /// Blobs resting here: a Range request for each was answered with the whole blob.
    blob_rests: HashMap<Digest, BlobRest>,
    /// Set when this mirror is known to fetch a whole blob when asked for one it lacks (a
    /// pull-through registry cache).
    fills: Option<Fills>,
    /// Set when it answered a Range request covering a whole blob with that range: it serves
    /// ranges, or held that blob (what it is shows at its first whole answer).
    ranged_whole: bool,
    /// Blobs it answered a range of in this process (a mirror): it holds them.
    served: HashSet<Digest>,
    /// Blobs a request is asking it for now that it has not served ranges of, with when it
    /// asked: one such ask at a time ([`Health::first_ask`]).
    asking: HashMap<Digest, Instant>,
}

/// What is known of a mirror that fetches whole blobs it lacks.
#[derive(Debug)]
struct Fills {
    /// When it stops holding: [`NOTE_LIFETIME`] after it was learnt (here, or by the process
    /// whose note this is).
    expires: Instant,
    /// When it was learnt, on the wall clock, for the notes file.
    noted: SystemTime,
}

impl Fills {
    fn learnt_at(noted: SystemTime) -> Fills {
        let age = SystemTime::now()
            .duration_since(noted)
            .unwrap_or(Duration::ZERO);
        Fills {
            expires: Instant::now() + NOTE_LIFETIME.saturating_sub(age),
            noted,
        }
    }

    /// Whether it still holds at `now`.
    fn current(&self, now: Instant) -> bool {
        now < self.expires
    }
}

impl State {
    /// Rests `blob` here after a whole-blob answer to a Range request for it, or none in time
    /// to a first one (longer each time, but for answers to requests sent before the rest
    /// began: the same fill, not a longer one).
    fn rest_blob(&mut self, blob: Digest) {
        let now = Instant::now();
        if self.blob_rests.len() >= MAX_BLOB_RESTS {
            self.blob_rests.retain(|_, r| r.until > now);
            if self.blob_rests.len() >= MAX_BLOB_RESTS {
                self.blob_rests.clear();
            }
        }
        let rest = self.blob_rests.entry(blob).or_insert(BlobRest {
            until: now,
            times: 0,
            since: now,
        });
        if rest.until > now {
            return;
        }
        rest.times = rest.times.saturating_add(1);
        rest.until = now
            + BLOB_REST
                .saturating_mul(1 << (rest.times - 1).min(10))
                .min(MAX_BLOB_REST);
    }

    /// Knows this mirror fills whole blobs it lacks; whether that is new.
    fn learn_fills(&mut self, now: Instant) -> bool {
        if self.fills.as_ref().is_some_and(|f| f.current(now)) {
            return false;
        }
        self.fills = Some(Fills::learnt_at(SystemTime::now()));
        true
    }

    /// Whether ranges of `blob` read for `purpose` should pass this endpoint by for now.
    fn passes_by(&self, blob: &Digest, purpose: Purpose, now: Instant) -> bool {
        match (self.blob_rests.get(blob), purpose) {
            // Asked before and answered whole: it has been fetching the blob since.
            (Some(rest), _) => rest.until > now,
            // Never asked: a pull-through cache would fetch it whole for the asking, which a
            // background read of the whole blob wants (one fill for the fleet) and a reader
            // must not wait behind.
            (None, Purpose::Demand) => {
                self.fills.as_ref().is_some_and(|f| f.current(now)) && !self.served.contains(blob)
            }
            (None, Purpose::Whole) => false,
        }
    }

    /// Until when a background read of `blob` waits for this mirror's fill of it, if it is
    /// filling it and has not for [`MAX_FILL_WAIT`].
    fn fill_ends(&self, blob: &Digest, now: Instant) -> Option<Instant> {
        let rest = self.blob_rests.get(blob)?;
        (rest.until > now && now < rest.since + MAX_FILL_WAIT).then_some(rest.until)
    }
}

/// The mirrors a notes file names as pull-through caches, with when each was learnt, those
/// still current (the node's file, and untrusted: bounded in lines and their length; a line
/// `<base> <unix seconds>`; a time to come is taken as now, a line with no time, from before
/// notes had one, as the file's own).
fn read_notes(notes: &Path) -> Vec<(String, SystemTime)> {
    let Ok(text) = std::fs::read_to_string(notes) else {
        return Vec::new();
    };
    let now = SystemTime::now();
    let written = std::fs::metadata(notes)
        .and_then(|m| m.modified())
        .unwrap_or(now);
    text.lines()
        .filter(|l| !l.is_empty() && l.len() <= MAX_NOTE)
        .take(MAX_NOTED)
        .filter_map(|l| {
            let (base, noted) = match l.split_once(' ') {
                Some((base, secs)) => {
                    let secs = secs.trim().parse::<u64>().ok()?;
                    (base, SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
                }
                None => (l, written),
            };
            let noted = noted.min(now);
            let current = now.duration_since(noted).unwrap_or(Duration::ZERO) < NOTE_LIFETIME;
            current.then(|| (base.to_string(), noted))
        })
        .collect()
}

/// A notes file's line for mirror `base`, learnt at `noted`.
fn note_line(base: &str, noted: SystemTime) -> String {
    let secs = noted
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{base} {secs}\n")
}

/// A claim of [`Health::first_ask`], given up when dropped (it may outlive the request that
/// took it: a reader's ask of a mirror left to finish in the background).
pub struct Asking {
    health: Arc<Health>,
    base: String,
    /// The blob claimed, if the claim was needed: the mirror has not served ranges of it.
    blob: Option<Digest>,
}

impl Asking {
    /// The blob claimed, where the mirror has not served ranges of it (its first ask).
    pub fn first_of(&self) -> Option<&Digest> {
        self.blob.as_ref()
    }
}

impl Drop for Asking {
    fn drop(&mut self) {
        if let Some(blob) = self.blob {
            self.health.with(&self.base, |s| s.asking.remove(&blob));
            self.health.released.notify_waiters();
        }
    }
}

/// A blob a mirror cannot serve ranges of yet.
#[derive(Debug)]
struct BlobRest {
    until: Instant,
    times: u32,
    /// The first whole answer: background reads wait for the fill until [`MAX_FILL_WAIT`]
    /// after it.
    since: Instant,
}

/// Health and counters of every endpoint this client talked to, by endpoint base URL.
#[derive(Debug, Default)]
pub struct Health {
    states: Mutex<HashMap<String, State>>,
    /// Where what was learnt about mirrors is kept.
    notes: Option<PathBuf>,
    /// Told when a claim of [`Health::first_ask`] is given up.
    released: tokio::sync::Notify,
}

impl Health {
    /// Health that keeps what it learns about mirrors in `notes` (and knows what is there).
    pub fn with_notes(notes: &Path) -> Self {
        let states = read_notes(notes)
            .into_iter()
            .map(|(base, noted)| {
                let state = State {
                    fills: Some(Fills::learnt_at(noted)),
                    ..State::default()
                };
                (base, state)
            })
            .collect();
        Health {
            states: Mutex::new(states),
            notes: Some(notes.to_path_buf()),
            released: tokio::sync::Notify::new(),
        }
    }

    fn with<T>(&self, base: &str, f: impl FnOnce(&mut State) -> T) -> T {
        let mut states = self.states.lock();
        // Every chunk request comes here: no key allocation once the endpoint is known.
        if let Some(state) = states.get_mut(base) {
            return f(state);
        }
        f(states.entry(base.to_string()).or_default())
    }

    /// `endpoints` in the order to try them for a request (for ranges of `blob` read for a
    /// purpose, if given): those not resting (nor passing ranges of `blob` by) first, each
    /// group in the configured order.
    pub fn order(
        &self,
        endpoints: Vec<Endpoint>,
        ranges: Option<(&Digest, Purpose)>,
    ) -> Vec<Endpoint> {
        let now = Instant::now();
        let states = self.states.lock();
        let resting = |e: &Endpoint| {
            states.get(&e.base).is_some_and(|s| {
                s.resting_until.is_some_and(|t| t > now)
                    || ranges.is_some_and(|(b, purpose)| s.passes_by(b, purpose, now))
            })
        };
        let (mut ready, rest): (Vec<_>, Vec<_>) = endpoints.into_iter().partition(|e| !resting(e));
        ready.extend(rest);
        ready
    }

    /// Until when background reads of `blob` wait for one of the mirrors `bases` to fill it
    /// (the soonest such mirror asks again), if one is filling it.
    pub fn filling<'a>(
        &self,
        bases: impl IntoIterator<Item = &'a str>,
        blob: &Digest,
    ) -> Option<Instant> {
        let now = Instant::now();
        let states = self.states.lock();
        bases
            .into_iter()
            .filter_map(|b| states.get(b)?.fill_ends(blob, now))
            .min()
    }

    /// Mirror `base` answered a Range request covering a whole blob with `200` and the whole
    /// blob: it did not hold it and fetched it whole (a pull-through cache), which it is now
    /// known, and noted, to be. Nothing rests: the answer was what was wanted.
    pub fn answered_whole(&self, base: &str) {
        if self.with(base, |s| s.learn_fills(Instant::now())) {
            self.note_filler(base);
        }
    }

    /// Whether mirror `base` has shown whether it fills whole blobs it lacks (a whole answer
    /// to a Range request), as far as one answer can: a Range cache, or a pull-through cache
    /// that held the blob asked for, answers alike.
    pub fn shown(&self, base: &str) -> bool {
        let now = Instant::now();
        self.states
            .lock()
            .get(base)
            .is_some_and(|s| s.ranged_whole || s.fills.as_ref().is_some_and(|f| f.current(now)))
    }

    /// Mirror `base` answered a Range request covering a whole blob with that range.
    pub fn answered_range(&self, base: &str) {
        self.with(base, |s| s.ranged_whole = true);
    }

    /// A request's claim to ask mirror `base` for ranges of `blob`: where it has not served
    /// ranges of `blob`, one request at a time, and none while the blob rests there (it is
    /// filling, or did not answer in time) — a pull-through cache that lacks a blob streams
    /// another copy from the origin for each ask, and what a mirror is shows only at its
    /// answer, so one request asks and the others wait for that answer or go on to the next
    /// endpoint ([`Health::claim`]). Where it has served ranges of `blob`, every request may.
    pub fn first_ask(self: &Arc<Self>, base: &str, blob: &Digest) -> Option<Asking> {
        let now = Instant::now();
        let claimed = self.with(base, |s| {
            let free = s.blob_rests.get(blob).is_none_or(|r| r.until <= now)
                && !s.asking.contains_key(blob)
                && s.asking.len() < MAX_BLOB_RESTS;
            match s.served.contains(blob) {
                true => Some(false),
                false if free => {
                    s.asking.insert(*blob, now);
                    Some(true)
                }
                false => None,
            }
        })?;
        Some(Asking {
            health: Arc::clone(self),
            base: base.to_string(),
            blob: claimed.then_some(*blob),
        })
    }

    /// [`Health::first_ask`], waiting for another request's ask to end (it shows whether the
    /// mirror serves ranges of `blob`) until that ask is `within` old; none if it did not end
    /// by then or the blob rests there.
    pub async fn claim(
        self: &Arc<Self>,
        base: &str,
        blob: &Digest,
        within: Duration,
    ) -> Option<Asking> {
        loop {
            // Made before the look, so a claim given up after it wakes this wait.
            let released = self.released.notified();
            if let Some(asking) = self.first_ask(base, blob) {
                return Some(asking);
            }
            let now = Instant::now();
            let asked = self.with(base, |s| match s.blob_rests.get(blob) {
                Some(rest) if rest.until > now => None,
                _ => s.asking.get(blob).copied(),
            })?;
            tokio::time::timeout_at(asked + within, released)
                .await
                .ok()?;
        }
    }

    /// A request is about to be sent to `base`.
    pub fn sent(&self, base: &str) {
        self.with(base, |s| s.counters.requests += 1);
    }

    /// `n` body bytes arrived from `base`.
    pub fn received(&self, base: &str, n: u64) {
        self.with(base, |s| s.counters.bytes += n);
    }

    /// `base` answered well: its record of failures is cleared. For a mirror's answer to a
    /// Range request of `ranges_of`: it holds that blob (its rest there ends).
    pub fn succeeded(&self, base: &str, ranges_of: Option<&Digest>) {
        self.with(base, |s| {
            s.failures_in_a_row = 0;
            s.resting_until = None;
            if let Some(blob) = ranges_of {
                s.blob_rests.remove(blob);
                if s.served.len() < MAX_BLOB_RESTS {
                    s.served.insert(*blob);
                }
            }
        });
    }

    /// `base` failed a request: `Endpoint` (it rests and the failure is counted), `Refused`
    /// (a 401 or 403: counted, no rest), `NotFound` (neither), `WholeBlob` (counted; the
    /// blob rests there, [`BLOB_REST`] doubling up to [`MAX_BLOB_REST`], and the mirror is
    /// known, and noted, to be a pull-through cache) or `Silent` (the blob rests there).
    pub fn failed(&self, base: &str, failure: Failure) {
        let learnt = self.with(base, |s| {
            if failure != Failure::NotFound {
                s.counters.failures += 1;
            }
            match failure {
                Failure::Endpoint => {
                    s.failures_in_a_row = s.failures_in_a_row.saturating_add(1);
                    let rest = Duration::from_secs(1)
                        .saturating_mul(1 << (s.failures_in_a_row - 1).min(6))
                        .min(MAX_REST);
                    s.resting_until = Some(Instant::now() + rest);
                    false
                }
                Failure::WholeBlob(blob) => {
                    s.rest_blob(blob);
                    s.learn_fills(Instant::now())
                }
                Failure::Silent(blob) => {
                    s.rest_blob(blob);
                    false
                }
                Failure::Refused | Failure::NotFound => false,
            }
        });
        if learnt {
            self.note_filler(base);
        }
    }

    /// Whether mirror `base` is known to fetch whole blobs it is asked for and lacks.
    #[cfg(test)]
    fn fills_whole_blobs(&self, base: &str) -> bool {
        let now = Instant::now();
        self.states
            .lock()
            .get(base)
            .is_some_and(|s| s.fills.as_ref().is_some_and(|f| f.current(now)))
    }

    /// Keeps in the notes file (off the async workers) that mirror `base` fetches whole blobs
    /// it lacks; a failure to keep it only means learning it again.
    fn note_filler(&self, base: &str) {
        tracing::info!(endpoint = %base, "this mirror fetches a whole blob from the origin when asked for one it lacks (a pull-through registry cache): disk reads pass it by for blobs it has not served a range of");
        let Some(notes) = self.notes.clone() else {
            return;
        };
        let noted: Vec<(String, SystemTime)> = {
            let now = Instant::now();
            let states = self.states.lock();
            states
                .iter()
                .filter(|(b, _)| b.len() <= MAX_NOTE)
                .filter_map(|(b, s)| {
                    let f = s.fills.as_ref().filter(|f| f.current(now))?;
                    Some((b.clone(), f.noted))
                })
                .take(MAX_NOTED)
                .collect()
        };
        let keep = move || {
            // Other processes of the node (its mount servers) keep what they learnt here too:
            // theirs stay (the later of two notes of one mirror), and each writes its own
            // temporary file.
            let mut all = read_notes(&notes);
            for (base, at) in noted {
                if let Some((_, kept)) = all.iter_mut().find(|(b, _)| *b == base) {
                    *kept = (*kept).max(at);
                } else if all.len() < MAX_NOTED {
                    all.push((base, at));
                }
            }
            let text: String = all.iter().map(|(b, at)| note_line(b, *at)).collect();
            let tmp = notes.with_extension(format!("tmp-{}", std::process::id()));
            let kept = std::fs::write(&tmp, &text).and_then(|()| std::fs::rename(&tmp, &notes));
            if let Err(e) = kept {
                tracing::warn!(file = %notes.display(), error = %e, "keeping what was learnt about a mirror failed");
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(keep)),
            Err(_) => keep(),
        }
    }

    /// Every endpoint's counters, by base URL, sorted.
    pub fn counters(&self) -> Vec<(String, EndpointCounters)> {
        let states = self.states.lock();
        let mut out: Vec<_> = states
            .iter()
            .map(|(k, s)| (k.clone(), s.counters.clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(base: &str) -> Endpoint {
        let mut e = Endpoint::upstream("x", true);
        e.base = base.to_string();
        e
    }

    fn bases(v: &[Endpoint]) -> Vec<&str> {
        v.iter().map(|e| e.base.as_str()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_endpoint_rests_behind_the_others_and_comes_back() {
        let h = Health::default();
        let all = || vec![ep("m1"), ep("m2"), ep("origin")];
        assert_eq!(bases(&h.order(all(), None)), ["m1", "m2", "origin"]);
        h.failed("m1", Failure::Endpoint);
        assert_eq!(bases(&h.order(all(), None)), ["m2", "origin", "m1"]);
        // A 404 or a refusal is not the endpoint's fault: no rest.
        h.failed("m2", Failure::NotFound);
        h.failed("m2", Failure::Refused);
        assert_eq!(bases(&h.order(all(), None)), ["m2", "origin", "m1"]);
        tokio::time::advance(Duration::from_millis(1100)).await;
        assert_eq!(bases(&h.order(all(), None)), ["m1", "m2", "origin"]);
        // A second failure in a row rests twice as long.
        h.failed("m1", Failure::Endpoint);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(bases(&h.order(all(), None)), ["m2", "origin", "m1"]);
        tokio::time::advance(Duration::from_millis(600)).await;
        assert_eq!(bases(&h.order(all(), None)), ["m1", "m2", "origin"]);
        // A success clears the record; the next failure rests 1 s again.
        h.succeeded("m1", None);
        h.failed("m1", Failure::Endpoint);
        tokio::time::advance(Duration::from_millis(1100)).await;
        assert_eq!(bases(&h.order(all(), None)), ["m1", "m2", "origin"]);
        // Everything resting: still every endpoint, in configured order.
        for b in ["m1", "m2", "origin"] {
            h.failed(b, Failure::Endpoint);
        }
        assert_eq!(bases(&h.order(all(), None)), ["m1", "m2", "origin"]);
        let counters = h.counters();
        assert_eq!(counters[0].0, "m1");
        assert_eq!(counters[0].1.failures, 4);
        assert_eq!(counters[1].0, "m2");
        assert_eq!(counters[1].1.failures, 2, "the 404 is not counted");
    }

    #[tokio::test(start_paused = true)]
    async fn rests_are_capped() {
        let h = Health::default();
        for _ in 0..40 {
            h.failed("m", Failure::Endpoint);
        }
        let all = || vec![ep("m"), ep("o")];
        tokio::time::advance(MAX_REST - Duration::from_millis(10)).await;
        assert_eq!(bases(&h.order(all(), None)), ["o", "m"]);
        tokio::time::advance(Duration::from_millis(20)).await;
        assert_eq!(bases(&h.order(all(), None)), ["m", "o"]);
    }

    /// Background reads of a whole blob ask a mirror known to fill whole blobs for one it
    /// has not served, where a reader's pass it by; while it fills they wait (until the blob's
    /// rest ends, at most [`MAX_FILL_WAIT`] from its first whole answer). Answers to requests
    /// sent before a rest began do not make it longer.
    #[tokio::test(start_paused = true)]
    async fn background_reads_go_through_a_filling_mirror_and_wait_for_it() {
        let h = Health::default();
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        let all = || vec![ep("m"), ep("o")];
        h.answered_whole("m");
        assert!(h.fills_whole_blobs("m") && h.shown("m"));
        assert_eq!(
            bases(&h.order(all(), Some((&a, Purpose::Demand)))),
            ["o", "m"]
        );
        assert_eq!(
            bases(&h.order(all(), Some((&a, Purpose::Whole)))),
            ["m", "o"]
        );
        assert_eq!(h.filling(["m"], &a), None);
        h.failed("m", Failure::WholeBlob(a));
        h.failed("m", Failure::WholeBlob(a));
        let until = h.filling(["m", "o"], &a).expect("filling");
        assert_eq!(
            until - Instant::now(),
            BLOB_REST,
            "concurrent answers: one rest"
        );
        assert_eq!(
            bases(&h.order(all(), Some((&a, Purpose::Whole)))),
            ["o", "m"]
        );
        assert_eq!(h.filling(["m"], &b), None);
        tokio::time::advance(BLOB_REST).await;
        assert_eq!(h.filling(["m"], &a), None, "asked again after the rest");
        assert_eq!(
            bases(&h.order(all(), Some((&a, Purpose::Whole)))),
            ["m", "o"]
        );
        // A mirror that fills for longer than MAX_FILL_WAIT is not waited for.
        let mut waited = BLOB_REST;
        while waited < MAX_FILL_WAIT {
            h.failed("m", Failure::WholeBlob(a));
            let until = h.filling(["m"], &a).expect("still waited for");
            waited += until - Instant::now();
            tokio::time::advance(until - Instant::now()).await;
        }
        h.failed("m", Failure::WholeBlob(a));
        assert_eq!(h.filling(["m"], &a), None);
        // Once it served a range of the blob, readers use it too.
        h.succeeded("m", Some(&a));
        assert_eq!(
            bases(&h.order(all(), Some((&a, Purpose::Demand)))),
            ["m", "o"]
        );
        // Where it served ranges of a blob, any number of asks.
        let h = Arc::new(h);
        let held = h.first_ask("m", &a).expect("held");
        assert!(held.first_of().is_none() && h.first_ask("m", &a).is_some());
        drop(held);
        // A mirror that answered a whole range with a range has shown itself, as far as one
        // answer can; one never asked has not.
        h.answered_range("r");
        assert!(h.shown("r") && !h.fills_whole_blobs("r") && !h.shown("new"));
    }

    /// A mirror is asked for a blob it has not served ranges of by one request at a time
    /// (whatever it is known to be: what it is shows only at its answer), and not while the
    /// blob rests there; one that sent no answer in time to such an ask rests the blob, as a
    /// whole answer does, without being taken for a pull-through cache.
    #[tokio::test(start_paused = true)]
    async fn a_blob_a_mirror_has_not_served_is_asked_one_request_at_a_time() {
        let h = Arc::new(Health::default());
        let (c, d) = (Digest::of(b"c"), Digest::of(b"d"));
        let first = h.first_ask("m", &c).expect("the first ask");
        assert_eq!(first.first_of(), Some(&c));
        assert!(
            h.first_ask("m", &c).is_none(),
            "a second ask waits its turn"
        );
        assert!(h.first_ask("m", &d).is_some() && h.first_ask("other", &c).is_some());
        drop(first);
        let again = h
            .first_ask("m", &c)
            .expect("asked again once the first ended");
        h.failed("m", Failure::Silent(c));
        drop(again);
        assert!(h.first_ask("m", &c).is_none(), "the blob rests there");
        assert!(!h.fills_whole_blobs("m") && !h.shown("m"));
        assert_eq!(h.filling(["m"], &c), Some(Instant::now() + BLOB_REST));
        tokio::time::advance(BLOB_REST).await;
        let third = h.first_ask("m", &c).expect("asked after the rest");
        drop(third);
        h.succeeded("m", Some(&c));
        let served = h.first_ask("m", &c).expect("served");
        assert!(served.first_of().is_none() && h.first_ask("m", &c).is_some());
        // Another request waits for the first ask's answer, until that ask is `within` old.
        let within = Duration::from_secs(1);
        let e = Digest::of(b"e");
        let first = h.first_ask("m", &e).expect("the first ask");
        let waiter = tokio::spawn({
            let h = Arc::clone(&h);
            async move {
                h.claim("m", &e, within)
                    .await
                    .map(|a| a.first_of().is_none())
            }
        });
        tokio::time::advance(within / 2).await;
        h.succeeded("m", Some(&e));
        drop(first);
        assert_eq!(waiter.await.unwrap(), Some(true), "served: asked freely");
        let f = Digest::of(b"f");
        let _first = h.first_ask("m", &f).expect("the first ask");
        tokio::time::advance(within / 2).await;
        let started = Instant::now();
        assert!(h.claim("m", &f, within).await.is_none());
        assert_eq!(
            Instant::now() - started,
            within / 2,
            "until the ask is `within` old"
        );
        assert!(h.claim("m", &f, within).await.is_none());
        assert_eq!(Instant::now() - started, within / 2, "not at all past it");
    }

    /// What was learnt of a mirror holds for [`NOTE_LIFETIME`], in the process and in the
    /// notes file (also one written before notes had a time, by the file's age); then the
    /// mirror is asked again and a whole answer teaches it again, for another lifetime.
    #[tokio::test(start_paused = true)]
    async fn what_was_learnt_of_a_mirror_expires() {
        let dir = tempfile::tempdir().unwrap();
        let notes = dir.path().join("mirrors");
        let (a, b, c) = (Digest::of(b"a"), Digest::of(b"b"), Digest::of(b"c"));
        let all = || vec![ep("m"), ep("o")];
        let h = Health::default();
        h.failed("m", Failure::WholeBlob(a));
        tokio::time::advance(NOTE_LIFETIME - Duration::from_secs(1)).await;
        assert_eq!(
            bases(&h.order(all(), Some((&b, Purpose::Demand)))),
            ["o", "m"]
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(
            bases(&h.order(all(), Some((&b, Purpose::Demand)))),
            ["m", "o"]
        );
        h.failed("m", Failure::WholeBlob(b));
        assert_eq!(
            bases(&h.order(all(), Some((&c, Purpose::Demand)))),
            ["o", "m"],
            "learnt again"
        );
        // In the notes: a day-old note is forgotten, a fresh one kept; one from the future is
        // taken as now.
        let now = SystemTime::now();
        let day = NOTE_LIFETIME + Duration::from_secs(60);
        let text = [
            note_line("old", now - day),
            note_line("new", now - Duration::from_secs(60)),
            note_line("future", now + day * 100),
            "bad not-a-time\n".to_string(),
        ]
        .concat();
        std::fs::write(&notes, text).unwrap();
        let read = Health::with_notes(&notes);
        assert!(!read.fills_whole_blobs("old"));
        assert!(read.fills_whole_blobs("new"));
        assert!(read.fills_whole_blobs("future"));
        assert!(!read.fills_whole_blobs("bad"));
        assert_eq!(
            bases(&read.order(vec![ep("old"), ep("o")], Some((&a, Purpose::Demand)))),
            ["old", "o"]
        );
        // A line with no time is as old as the file.
        std::fs::write(&notes, "legacy\n").unwrap();
        assert!(Health::with_notes(&notes).fills_whole_blobs("legacy"));
        let old = std::fs::File::options().write(true).open(&notes).unwrap();
        old.set_modified(now - day).unwrap();
        assert!(!Health::with_notes(&notes).fills_whole_blobs("legacy"));
    }

    /// A blob a pull-through cache answered with whole rests there, growing each time; a range
    /// from it ends the rest. The mirror itself does not rest (manifests go there), but it is
    /// known for what it is: other blobs' ranges pass it by until it served a range of them.
    #[tokio::test(start_paused = true)]
    async fn a_blob_a_mirror_answers_whole_rests_there_and_the_mirror_is_known() {
        let dir = tempfile::tempdir().unwrap();
        let notes = dir.path().join("mirrors");
        let h = Health::with_notes(&notes);
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        let all = || vec![ep("m"), ep("o")];
        assert_eq!(
            bases(&h.order(all(), Some((&b, Purpose::Demand)))),
            ["m", "o"]
        );
        h.failed("m", Failure::WholeBlob(a));
        assert_eq!(
            bases(&h.order(all(), Some((&a, Purpose::Demand)))),
            ["o", "m"]
        );
        assert_eq!(
            bases(&h.order(all(), Some((&b, Purpose::Demand)))),
            ["o", "m"]
        );
        assert_eq!(bases(&h.order(all(), None)), ["m", "o"]);
        h.succeeded("m", Some(&b));
        assert_eq!(
            bases(&h.order(all(), Some((&b, Purpose::Demand)))),
            ["m", "o"]
        );
        // Another process of the node knows it from the notes.
        for _ in 0..100 {
            if notes.exists() {
                break;
            }
            tokio::task::yield_now().await;
            std::thread::sleep(Duration::from_millis(10));
        }
        let other = Health::with_notes(&notes);
        assert!(other.fills_whole_blobs("m") && !other.fills_whole_blobs("o"));
        assert_eq!(
            bases(&other.order(all(), Some((&b, Purpose::Demand)))),
            ["o", "m"]
        );
        let h = Health::default();
        h.failed("m", Failure::WholeBlob(a));
        assert_eq!(h.counters().iter().map(|c| c.1.failures).sum::<u64>(), 1);
        tokio::time::advance(BLOB_REST + Duration::from_millis(10)).await;
        assert_eq!(
            bases(&h.order(all(), Some((&a, Purpose::Demand)))),
            ["m", "o"]
        );
        // Still whole: twice as long.
        h.failed("m", Failure::WholeBlob(a));
        tokio::time::advance(BLOB_REST * 2 - Duration::from_millis(10)).await;
        assert_eq!(
            bases(&h.order(all(), Some((&a, Purpose::Demand)))),
            ["o", "m"]
        );
        tokio::time::advance(Duration::from_millis(20)).await;
        assert_eq!(
            bases(&h.order(all(), Some((&a, Purpose::Demand)))),
            ["m", "o"]
        );
        // It holds the blob now: the next whole answer starts again from the first rest.
        h.succeeded("m", Some(&a));
        h.failed("m", Failure::WholeBlob(a));
        tokio::time::advance(BLOB_REST + Duration::from_millis(10)).await;
        assert_eq!(
            bases(&h.order(all(), Some((&a, Purpose::Demand)))),
            ["m", "o"]
        );
        for _ in 0..20 {
            h.failed("m", Failure::WholeBlob(b));
            tokio::time::advance(MAX_BLOB_REST).await;
        }
        h.failed("m", Failure::WholeBlob(b));
        tokio::time::advance(MAX_BLOB_REST - Duration::from_millis(10)).await;
        let until = || h.states.lock()["m"].blob_rests[&b].until;
        assert!(until() > Instant::now());
        tokio::time::advance(Duration::from_millis(20)).await;
        assert!(until() <= Instant::now());
    }
}
