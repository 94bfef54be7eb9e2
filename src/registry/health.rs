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
//! registry cache — CNCF distribution, Harbor, Zot — that does not hold it yet) is not failing:
//! it has started fetching that blob from the origin to store it, and every further request
//! for the blob before it holds it makes it stream another copy from the origin. So that blob
//! (not the mirror) rests there: the mirror is asked again for it after [`BLOB_REST`],
//! doubling up to [`MAX_BLOB_REST`], until it answers with a range. A mirror asked for a blob
//! it has not served ranges of that sends no answer within the mirror deadline
//! ([`Failure::Silent`]) rests the blob there too: a pull-through cache answers only once the
//! origin has started sending, which on a busy link takes seconds, and asking again at once
//! would only start another stream from the origin.
//!
//! **A reader's ranges go to a mirror only where they are answered as ranges**: a mirror that
//! declares itself a Range cache (its answers carry [`RANGE_CACHE_HEADER`], as the shipped
//! nginx slice cache's do: it answers any range at once, one slice fetch per fleet), or one
//! that has served ranges of that blob in this process (it holds it). Any other mirror is
//! passed by for the *demand* ranges ([`Purpose::Demand`]) of a blob: merely asking a
//! pull-through cache for a blob it lacks — a Range GET or a HEAD alike — makes it fetch the
//! whole blob from the origin, and on a node's first reads of a disk that fill takes the boot
//! reads' share of the link; and no answer tells such a cache from a Range cache before the
//! first range of a blob (one that holds the config answers its range as a Range cache does).
//! Reads of a whole blob in the background ([`Purpose::Whole`]: hydration, a preheat) do ask
//! every mirror: a pull-through cache's one fill then serves the fleet, and a range it answers
//! shows it holds the blob (readers use it from then on); while it fills (the blob rests
//! there), such reads wait for it ([`Health::filling`], at most [`MAX_FILL_WAIT`]) instead of
//! fetching the blob from the origin once per node. What a mirror declares is what its latest
//! answer said: the address may come to serve something else.
//!
//! A mirror that has not served ranges of a blob is asked for it by one request at a time
//! ([`Health::first_ask`]); the others wait for that answer, while the ask is young, or go on
//! to the next endpoint ([`Health::claim`]), and a reader waits for it only briefly (the
//! registry client's hedge: `transport::MIRROR_HEDGE`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::hosts::Endpoint;
use crate::oci::digest::Digest;

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
/// The response header by which a mirror declares itself a Range cache (any value): it answers
/// any range of a blob at once, whether it holds the blob or not (the shipped nginx slice
/// cache, `config/nginx-regional-cache.conf`, sends it on every answer).
pub const RANGE_CACHE_HEADER: &str = "vmdisk-range-cache";

/// Each of an endpoint's counters: the one list the control protocol's report, the daemon's
/// totals and its metrics (`vmdisk_registry_endpoint_<name>_total`) are made from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndpointCounter {
    Requests,
    Failures,
    Bytes,
}

impl EndpointCounter {
    pub const ALL: [EndpointCounter; 3] = [
        EndpointCounter::Requests,
        EndpointCounter::Failures,
        EndpointCounter::Bytes,
    ];

    /// Its name (in its metric's name and the daemon's totals).
    pub fn name(self) -> &'static str {
        match self {
            EndpointCounter::Requests => "requests",
            EndpointCounter::Failures => "failures",
            EndpointCounter::Bytes => "bytes",
        }
    }

    /// Its metric's help.
    pub fn help(self) -> &'static str {
        match self {
            EndpointCounter::Requests => "Requests sent to each registry endpoint (the registry, or a hosts.toml mirror) by the mount servers.",
            EndpointCounter::Failures => "Requests that failed at each registry endpoint (then went on to the next endpoint, or failed).",
            EndpointCounter::Bytes => "Body bytes received from each registry endpoint by the mount servers.",
        }
    }

    /// Its value in `counters`.
    pub fn of(self, counters: &EndpointCounters) -> u64 {
        match self {
            EndpointCounter::Requests => counters.requests,
            EndpointCounter::Failures => counters.failures,
            EndpointCounter::Bytes => counters.bytes,
        }
    }
}

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

/// What ranges of a blob are read for: whether a mirror that has not served ranges of the blob
/// and does not declare itself a Range cache is asked for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// A reader waits for them (a guest's reads, a TOC): such a mirror is passed by.
    Demand,
    /// The whole blob, in the background (hydration, a preheat): such a mirror is asked (a
    /// pull-through cache's one fill serves every node) and, while it fills, waited for
    /// ([`Health::filling`]).
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
    /// A request given up before it ended (the reader's deadline passed while the endpoint
    /// sent nothing, or too slowly): counted, no rest (the retry policy's deadline already
    /// bounds what it costs).
    Abandoned,
}

/// A request sent to an endpoint and not yet settled: dropped unsettled, it counts as a
/// failure of the endpoint ([`Failure::Abandoned`]). An endpoint that never answers thus shows
/// in its failures, not only in its requests.
pub struct Unsettled<'a> {
    health: &'a Health,
    base: &'a str,
}

impl<'a> Unsettled<'a> {
    /// The request to `base` is about to be sent (counted as sent).
    pub fn send(health: &'a Health, base: &'a str) -> Self {
        health.sent(base);
        Unsettled { health, base }
    }

    /// Its outcome is known (and told to the health by whoever knows it).
    pub fn settle(self) {
        std::mem::forget(self);
    }
}

impl Drop for Unsettled<'_> {
    fn drop(&mut self) {
        self.health.failed(self.base, Failure::Abandoned);
    }
}

#[derive(Debug, Default)]
struct State {
    failures_in_a_row: u32,
    resting_until: Option<Instant>,
    counters: EndpointCounters,
    /// Blobs resting here: a Range request for each was answered with the whole blob.
    blob_rests: HashMap<Digest, BlobRest>,
    /// Whether its latest answer declared it a Range cache ([`RANGE_CACHE_HEADER`]); none
    /// before its first answer.
    declares_ranges: Option<bool>,
    /// Blobs it answered a range of in this process (a mirror): it holds them.
    served: HashSet<Digest>,
    /// Blobs a request is asking it for now that it has not served ranges of, with when it
    /// asked: one such ask at a time ([`Health::first_ask`]).
    asking: HashMap<Digest, Instant>,
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

    /// Whether ranges of `blob` read for `purpose` should pass this mirror by for now: while
    /// the blob rests here (asked before, and answered whole or not in time: it has been
    /// fetching the blob since), and, for a reader, unless it serves ranges of the blob (it
    /// declares itself a Range cache, or served ranges of it).
    /// (`state`: none if nothing was asked of it yet.)
    fn passes_by(state: Option<&State>, blob: &Digest, purpose: Purpose, now: Instant) -> bool {
        let rests = state
            .and_then(|s| s.blob_rests.get(blob))
            .is_some_and(|r| r.until > now);
        let serves =
            state.is_some_and(|s| s.declares_ranges == Some(true) || s.served.contains(blob));
        rests || (purpose == Purpose::Demand && !serves)
    }

    /// Until when a background read of `blob` waits for this mirror's fill of it, if it is
    /// filling it and has not for [`MAX_FILL_WAIT`].
    fn fill_ends(&self, blob: &Digest, now: Instant) -> Option<Instant> {
        let rest = self.blob_rests.get(blob)?;
        (rest.until > now && now < rest.since + MAX_FILL_WAIT).then_some(rest.until)
    }
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
    /// Each mirror's look before a reader's first range ([`Health::look`]), by base URL.
    looks: Mutex<HashMap<String, Arc<tokio::sync::OnceCell<()>>>>,
    /// Told when a claim of [`Health::first_ask`] is given up.
    released: tokio::sync::Notify,
}

impl Health {
    fn with<T>(&self, base: &str, f: impl FnOnce(&mut State) -> T) -> T {
        let mut states = self.states.lock();
        // Every chunk request comes here: no key allocation once the endpoint is known.
        if let Some(state) = states.get_mut(base) {
            return f(state);
        }
        f(states.entry(base.to_string()).or_default())
    }

    /// `endpoints` in the order to try them for a request (for ranges of `blob` read for a
    /// purpose, if given): those not resting (nor mirrors passing ranges of `blob` by) first,
    /// each group in the configured order.
    pub fn order(
        &self,
        endpoints: Vec<Endpoint>,
        ranges: Option<(&Digest, Purpose)>,
    ) -> Vec<Endpoint> {
        let now = Instant::now();
        let states = self.states.lock();
        let resting = |e: &Endpoint| {
            let state = states.get(&e.base);
            state.is_some_and(|s| s.resting_until.is_some_and(|t| t > now))
                || ranges.is_some_and(|(b, purpose)| {
                    e.mirror && State::passes_by(state, b, purpose, now)
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

    /// Mirror `base` answered a request; whether the answer declared it a Range cache
    /// ([`RANGE_CACHE_HEADER`]).
    pub fn answered(&self, base: &str, declares_ranges: bool) {
        self.with(base, |s| {
            if s.declares_ranges != Some(declares_ranges) {
                tracing::info!(endpoint = %base, declares_ranges, "a mirror's answer says whether it is a Range cache: readers' ranges go there only if so, or for blobs it has served ranges of");
            }
            s.declares_ranges = Some(declares_ranges);
        });
    }

    /// Whether mirror `base` declared itself a Range cache in its latest answer; none if it
    /// has not answered yet.
    pub fn declares_ranges(&self, base: &str) -> Option<bool> {
        self.states.lock().get(base).and_then(|s| s.declares_ranges)
    }

    /// Runs `look` once for mirror `base` (concurrent callers wait for that one): what a
    /// reader's first range needs to know of a mirror no answer has come from yet.
    pub async fn look<F>(&self, base: &str, look: F)
    where
        F: std::future::Future<Output = ()>,
    {
        let once = Arc::clone(self.looks.lock().entry(base.to_string()).or_default());
        once.get_or_init(|| look).await;
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
    /// (a 401 or 403: counted, no rest), `NotFound` (neither), `WholeBlob` or `Silent`
    /// (counted; the blob rests there, [`BLOB_REST`] doubling up to [`MAX_BLOB_REST`]).
    pub fn failed(&self, base: &str, failure: Failure) {
        self.with(base, |s| {
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
                }
                Failure::WholeBlob(blob) | Failure::Silent(blob) => s.rest_blob(blob),
                Failure::Refused | Failure::NotFound | Failure::Abandoned => {}
            }
        });
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

    /// An endpoint at `base`: the registry itself if it starts with `o` (origin), else a mirror.
    fn ep(base: &str) -> Endpoint {
        let mut e = Endpoint::upstream("x", true);
        e.base = base.to_string();
        e.mirror = !base.starts_with('o');
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

    #[test]
    fn a_request_given_up_unanswered_is_a_failure_and_rests_nothing() {
        let h = Health::default();
        Unsettled::send(&h, "origin").settle();
        drop(Unsettled::send(&h, "origin"));
        let counters = h.counters();
        assert_eq!((counters[0].1.requests, counters[0].1.failures), (2, 1));
        assert_eq!(
            bases(&h.order(vec![ep("m"), ep("origin")], None)),
            ["m", "origin"]
        );
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

    /// Background reads of a whole blob ask a mirror that does not declare itself a Range
    /// cache for one it has not served, where a reader's pass it by; while it fills they wait (until the blob's
    /// rest ends, at most [`MAX_FILL_WAIT`] from its first whole answer). Answers to requests
    /// sent before a rest began do not make it longer.
    #[tokio::test(start_paused = true)]
    async fn background_reads_go_through_a_filling_mirror_and_wait_for_it() {
        let h = Health::default();
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        let all = || vec![ep("m"), ep("o")];
        h.answered("m", false);
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

    /// A reader's ranges go to a mirror that declares itself a Range cache in its latest
    /// answer, or that served ranges of the blob; never to one that has not answered yet or
    /// declares nothing (the registry itself is never passed by for that). What it declares
    /// is what its latest answer says.
    #[tokio::test(start_paused = true)]
    async fn a_readers_ranges_go_to_a_mirror_that_declares_a_range_cache_or_served_the_blob() {
        let h = Health::default();
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        let all = || vec![ep("m"), ep("o")];
        let demand = |blob| bases(&h.order(all(), Some((blob, Purpose::Demand)))).join(" ");
        let whole = |blob| bases(&h.order(all(), Some((blob, Purpose::Whole)))).join(" ");
        assert_eq!((demand(&a), whole(&a)), ("o m".into(), "m o".into()));
        assert_eq!(h.declares_ranges("m"), None);
        h.answered("m", false);
        assert_eq!(demand(&a), "o m");
        h.succeeded("m", Some(&a));
        assert_eq!((demand(&a), demand(&b)), ("m o".into(), "o m".into()));
        h.answered("m", true);
        assert_eq!(demand(&b), "m o");
        assert_eq!(h.declares_ranges("m"), Some(true));
        h.answered("m", false);
        assert_eq!((demand(&a), demand(&b)), ("m o".into(), "o m".into()));
        // A look is made once, however many readers wait for it.
        let h = Arc::new(Health::default());
        let looks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let look = |h: Arc<Health>, looks: Arc<std::sync::atomic::AtomicUsize>| async move {
            h.look("m", async {
                looks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
            })
            .await
        };
        let both = tokio::join!(
            look(Arc::clone(&h), Arc::clone(&looks)),
            look(Arc::clone(&h), Arc::clone(&looks))
        );
        assert_eq!(both, ((), ()));
        look(Arc::clone(&h), Arc::clone(&looks)).await;
        assert_eq!(looks.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    /// A blob a pull-through cache answered with whole rests there, growing each time; a range
    /// from it ends the rest. The mirror itself does not rest (manifests go there). (The
    /// mirror here declares a Range cache, so only the rest passes it by.)
    #[tokio::test(start_paused = true)]
    async fn a_blob_a_mirror_answers_whole_rests_there() {
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        let all = || vec![ep("m"), ep("o")];
        let h = Health::default();
        h.answered("m", true);
        h.failed("m", Failure::WholeBlob(a));
        assert_eq!(
            bases(&h.order(all(), Some((&a, Purpose::Demand)))),
            ["o", "m"]
        );
        assert_eq!(bases(&h.order(all(), None)), ["m", "o"]);
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
