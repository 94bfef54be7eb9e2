//! The daemon's counters: Prepare decisions, snapshots API calls, and the engine counters of
//! every mount server it ran. They only go up, across a layer's removal, a server's restart and
//! the daemon's own restart, as Prometheus counters must.
//!
//! A server's counters start at zero with each server (its `instance`); the daemon remembers
//! what each instance last reported and adds only the increase to its totals, so a server that
//! goes away takes nothing with it (its final counters come with its `Stop` answer) and a new
//! one adds from zero. Totals and what each instance reported are kept in
//! `<root>/counters.json`, written before any value is shown (a scrape, `vmdisk stats`), so
//! no value once seen is lost by a crash.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::api::vmdisk::v1::LayerCounters;
use crate::engine::stats::{StatsSnapshot, METRICS};
use crate::error::{Error, Result};
use crate::registry::health::{EndpointCounter, EndpointCounters};

/// A counter of the daemon's, by the name its total is kept under (in `counters.json`, so
/// names never change): each kind of counter says its own once, where it is defined (a
/// Prepare's outcome, a snapshots API call, a mount server event), and is counted and read by
/// it.
pub trait Counted {
    /// The name its total is kept under.
    fn key(&self) -> String;
}

/// An engine counter of the mount servers', summed: kept under its metric name ([`METRICS`]).
pub struct EngineMetric(pub &'static str);

impl Counted for EngineMetric {
    fn key(&self) -> String {
        self.0.to_string()
    }
}

/// A registry endpoint's counter, summed over the mount servers: `endpoint/<name>/<base URL>`.
struct Endpoint<'a>(EndpointCounter, &'a str);

impl Counted for Endpoint<'_> {
    fn key(&self) -> String {
        format!("endpoint/{}/{}", self.0.name(), self.1)
    }
}

/// The totals a server's counters feed: the engine's [`METRICS`], and each registry
/// endpoint's [`EndpointCounter`]s.
fn reported_values(counters: &LayerCounters) -> Vec<(String, u64)> {
    let engine = StatsSnapshot::from(counters);
    let mut out: Vec<(String, u64)> = METRICS
        .iter()
        .map(|(name, _, get)| (EngineMetric(name).key(), get(&engine)))
        .collect();
    for e in &counters.endpoints {
        let values = EndpointCounters::from(e);
        for counter in EndpointCounter::ALL {
            out.push((Endpoint(counter, &e.endpoint).key(), counter.of(&values)));
        }
    }
    out
}

/// How long what a server reported is remembered after it was last heard of; a server silent
/// that long is gone (a crash: its last counters were counted already).
const FORGET_AFTER_SECS: u64 = 24 * 3600;

#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    /// Each counter's total, by name (`decision/<outcome>`, `call/<method>`, a metric name).
    totals: BTreeMap<String, u64>,
    /// What each server instance reported last, and when (Unix seconds).
    servers: BTreeMap<String, Reported>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Reported {
    counters: BTreeMap<String, u64>,
    heard: u64,
}

/// The counters and where they are kept.
#[derive(Debug)]
pub struct Counters {
    path: PathBuf,
    /// The state and whether it changed since it was written.
    state: Mutex<(State, bool)>,
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Counters {
    /// The counters kept at `path`; a missing file starts from zero, an unreadable one too
    /// (logged: the counters then restart, which Prometheus reads as a reset).
    pub fn load(path: &Path) -> Self {
        let state = match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::warn!(path = %path.display(), error = %e, "the counters file is unreadable; counting from zero");
                State::default()
            }),
            Err(_) => State::default(),
        };
        Counters {
            path: path.to_path_buf(),
            state: Mutex::new((state, false)),
        }
    }

    /// Applies `change`, which says whether it changed anything worth writing.
    fn change(&self, change: impl FnOnce(&mut State) -> bool) {
        let mut guard = self.state.lock();
        let (state, dirty) = &mut *guard;
        if change(state) {
            *dirty = true;
        }
    }

    /// Adds `n` to `counter`.
    pub fn add(&self, counter: &impl Counted, n: u64) {
        self.change(|s| {
            *s.totals.entry(counter.key()).or_default() += n;
            n > 0
        });
    }

    /// The total of `counter`.
    pub fn get(&self, counter: &impl Counted) -> u64 {
        let guard = self.state.lock();
        guard.0.totals.get(&counter.key()).copied().unwrap_or(0)
    }

    /// Those of `counters` that counted anything, with their totals.
    pub fn counted<C: Counted>(&self, counters: impl IntoIterator<Item = C>) -> Vec<(C, u64)> {
        counters
            .into_iter()
            .map(|c| {
                let n = self.get(&c);
                (c, n)
            })
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Each registry endpoint's total of `counter`, by the endpoint's base URL.
    pub fn endpoints(&self, counter: EndpointCounter) -> BTreeMap<String, u64> {
        self.with_prefix(&Endpoint(counter, "").key())
    }

    /// Every counter whose name starts with `prefix`, with the prefix removed.
    fn with_prefix(&self, prefix: &str) -> BTreeMap<String, u64> {
        let guard = self.state.lock();
        guard
            .0
            .totals
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k[prefix.len()..].to_string(), *v))
            .collect()
    }

    /// Takes in what server `instance` reports now: adds the increase since its last report.
    pub fn observe(&self, instance: &str, counters: &LayerCounters) {
        if instance.is_empty() {
            return;
        }
        let heard = now();
        self.change(|s| {
            let known = s.servers.len();
            let reported = s.servers.entry(instance.to_string()).or_default();
            // An idle server changes nothing but when it was last heard of; that is written
            // at most hourly, enough for the 24-hour pruning below.
            let mut changed = heard.saturating_sub(reported.heard) >= 3600;
            reported.heard = heard;
            for (name, value) in reported_values(counters) {
                let before = reported.counters.entry(name.clone()).or_default();
                let increase = value.saturating_sub(*before);
                *before = (*before).max(value);
                *s.totals.entry(name).or_default() += increase;
                changed |= increase > 0;
            }
            s.servers
                .retain(|_, r| heard.saturating_sub(r.heard) < FORGET_AFTER_SECS);
            changed || s.servers.len() != known
        });
    }

    /// Forgets server `instance` once its final counters were observed (it exited).
    pub fn forget(&self, instance: &str) {
        self.change(|s| s.servers.remove(instance).is_some());
    }

    /// Writes the counters if they changed (atomically). Blocking: call off the async workers.
    pub fn save(&self) -> Result<()> {
        let bytes = {
            let mut guard = self.state.lock();
            if !guard.1 {
                return Ok(());
            }
            guard.1 = false;
            serde_json::to_vec(&guard.0).expect("counters serialise")
        };
        let tmp = self.path.with_extension("json.tmp");
        std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::rename(&tmp, &self.path))
            .map_err(|e| {
                // Written again next time.
                self.state.lock().1 = true;
                Error::io(format!("writing {}", self.path.display()), e)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BYTES: EngineMetric = EngineMetric("vmdisk_registry_bytes");
    const SERVED: EngineMetric = EngineMetric("vmdisk_served_bytes");

    /// A counter by the name its total is kept under.
    struct Named(&'static str);

    impl Counted for Named {
        fn key(&self) -> String {
            self.0.to_string()
        }
    }

    fn counters(fetched: u64, served: u64) -> LayerCounters {
        LayerCounters {
            bytes_fetched: fetched,
            bytes_served: served,
            ..Default::default()
        }
    }

    #[test]
    fn endpoint_counters_add_up_per_endpoint_across_servers() {
        let dir = tempfile::tempdir().unwrap();
        let c = Counters::load(&dir.path().join("counters.json"));
        let report = |mirror_requests: u64, origin_requests: u64| LayerCounters {
            endpoints: vec![
                crate::api::vmdisk::v1::EndpointCounters {
                    endpoint: "http://mirror:5001".into(),
                    requests: mirror_requests,
                    failures: 1,
                    bytes: 10,
                },
                crate::api::vmdisk::v1::EndpointCounters {
                    endpoint: "http://origin:5000".into(),
                    requests: origin_requests,
                    failures: 0,
                    bytes: 20,
                },
            ],
            ..Default::default()
        };
        c.observe("a", &report(3, 1));
        c.observe("a", &report(5, 1));
        c.observe("b", &report(2, 4));
        let requests = c.endpoints(EndpointCounter::Requests);
        assert_eq!(requests.get("http://mirror:5001"), Some(&7));
        assert_eq!(requests.get("http://origin:5000"), Some(&5));
        assert_eq!(
            c.endpoints(EndpointCounter::Failures)
                .get("http://mirror:5001"),
            Some(&2)
        );
        assert_eq!(
            c.endpoints(EndpointCounter::Bytes)
                .get("http://origin:5000"),
            Some(&40)
        );
    }

    #[test]
    fn totals_only_go_up_across_servers_and_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("counters.json");
        let c = Counters::load(&path);
        c.observe("a", &counters(100, 10));
        c.observe("a", &counters(150, 10));
        assert_eq!(c.get(&BYTES), 150);
        // The server restarts: a new instance counts from zero; nothing is subtracted.
        c.observe("b", &counters(20, 5));
        assert_eq!(c.get(&BYTES), 170);
        assert_eq!(c.get(&SERVED), 15);
        // A report never lowers what an instance was credited with.
        c.observe("a", &counters(120, 10));
        c.observe("a", &counters(160, 10));
        assert_eq!(c.get(&BYTES), 180);
        c.add(&Named("decision/remote"), 2);
        c.save().unwrap();
        // The daemon restarts: totals and what each server reported come back, so an adopted
        // server's counters are not counted twice.
        let again = Counters::load(&path);
        assert_eq!(again.get(&BYTES), 180);
        again.observe("b", &counters(25, 5));
        assert_eq!(again.get(&BYTES), 185);
        assert_eq!(again.get(&Named("decision/remote")), 2);
        // Nothing new from a server: nothing to write.
        again.save().unwrap();
        std::fs::remove_file(&path).unwrap();
        again.observe("b", &counters(25, 5));
        again.save().unwrap();
        assert!(!path.exists(), "an unchanged report rewrote the counters");
        again.forget("b");
        again.observe("b", &counters(25, 5));
        assert_eq!(again.get(&BYTES), 210);
    }

    #[test]
    fn a_corrupt_file_starts_from_zero() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("counters.json");
        std::fs::write(&path, b"{not json").unwrap();
        let c = Counters::load(&path);
        assert_eq!(c.get(&BYTES), 0);
        c.add(&Named("call/Prepare"), 1);
        c.save().unwrap();
        assert_eq!(Counters::load(&path).get(&Named("call/Prepare")), 1);
    }
}
