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

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::hosts::Endpoint;

/// The longest an endpoint rests after failures in a row.
pub const MAX_REST: Duration = Duration::from_secs(30);

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

/// Whose a failed request's failure is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The endpoint's: no connection or answer, an error status, a wrong answer.
    Endpoint,
    /// The request's credentials were refused there.
    Refused,
    /// It does not have what was asked (a P2P mirror without a peer that has it).
    NotFound,
}

#[derive(Debug, Default)]
struct State {
    failures_in_a_row: u32,
    resting_until: Option<Instant>,
    counters: EndpointCounters,
}

/// Health and counters of every endpoint this client talked to, by endpoint base URL.
#[derive(Debug, Default)]
pub struct Health {
    states: Mutex<HashMap<String, State>>,
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

    /// `endpoints` in the order to try them: those not resting first, each group in the
    /// configured order.
    pub fn order(&self, endpoints: Vec<Endpoint>) -> Vec<Endpoint> {
        let now = Instant::now();
        let states = self.states.lock();
        let resting = |e: &Endpoint| {
            states
                .get(&e.base)
                .and_then(|s| s.resting_until)
                .is_some_and(|t| t > now)
        };
        let (mut ready, rest): (Vec<_>, Vec<_>) = endpoints.into_iter().partition(|e| !resting(e));
        ready.extend(rest);
        ready
    }

    /// A request is about to be sent to `base`.
    pub fn sent(&self, base: &str) {
        self.with(base, |s| s.counters.requests += 1);
    }

    /// `n` body bytes arrived from `base`.
    pub fn received(&self, base: &str, n: u64) {
        self.with(base, |s| s.counters.bytes += n);
    }

    /// `base` answered well: its record of failures is cleared.
    pub fn succeeded(&self, base: &str) {
        self.with(base, |s| {
            s.failures_in_a_row = 0;
            s.resting_until = None;
        });
    }

    /// `base` failed a request: `Endpoint` (it rests and the failure is counted), `Refused`
    /// (a 401 or 403: counted, no rest) or `NotFound` (neither).
    pub fn failed(&self, base: &str, failure: Failure) {
        self.with(base, |s| {
            if failure != Failure::NotFound {
                s.counters.failures += 1;
            }
            if failure == Failure::Endpoint {
                s.failures_in_a_row = s.failures_in_a_row.saturating_add(1);
                let rest = Duration::from_secs(1)
                    .saturating_mul(1 << (s.failures_in_a_row - 1).min(6))
                    .min(MAX_REST);
                s.resting_until = Some(Instant::now() + rest);
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
        assert_eq!(bases(&h.order(all())), ["m1", "m2", "origin"]);
        h.failed("m1", Failure::Endpoint);
        assert_eq!(bases(&h.order(all())), ["m2", "origin", "m1"]);
        // A 404 or a refusal is not the endpoint's fault: no rest.
        h.failed("m2", Failure::NotFound);
        h.failed("m2", Failure::Refused);
        assert_eq!(bases(&h.order(all())), ["m2", "origin", "m1"]);
        tokio::time::advance(Duration::from_millis(1100)).await;
        assert_eq!(bases(&h.order(all())), ["m1", "m2", "origin"]);
        // A second failure in a row rests twice as long.
        h.failed("m1", Failure::Endpoint);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(bases(&h.order(all())), ["m2", "origin", "m1"]);
        tokio::time::advance(Duration::from_millis(600)).await;
        assert_eq!(bases(&h.order(all())), ["m1", "m2", "origin"]);
        // A success clears the record; the next failure rests 1 s again.
        h.succeeded("m1");
        h.failed("m1", Failure::Endpoint);
        tokio::time::advance(Duration::from_millis(1100)).await;
        assert_eq!(bases(&h.order(all())), ["m1", "m2", "origin"]);
        // Everything resting: still every endpoint, in configured order.
        for b in ["m1", "m2", "origin"] {
            h.failed(b, Failure::Endpoint);
        }
        assert_eq!(bases(&h.order(all())), ["m1", "m2", "origin"]);
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
        assert_eq!(bases(&h.order(all())), ["o", "m"]);
        tokio::time::advance(Duration::from_millis(20)).await;
        assert_eq!(bases(&h.order(all())), ["m", "o"]);
    }
}
