//! Prometheus metrics in the OpenMetrics text format (`prometheus-client`), on a unix socket
//! or a loopback TCP port (`metrics.address`). Names, types and units are documented in
//! `docs/snapshotter.md`. Counters come from the daemon's own [`crate::snapshotter::counters`] (they only
//! go up, across layer removals and server and daemon restarts); gauges are measured at
//! scrape time from the store and the servers' status, each server asked under a deadline.

use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::engine::stats::METRICS;
use crate::error::{Error, Result};
use crate::registry::health::EndpointCounter;
use crate::snapshotter::counters::EngineMetric;
use crate::snapshotter::daemon::grpc::{disks, LISTED};
use crate::snapshotter::daemon::grpc::{Call, Method};
use crate::snapshotter::prepare::classify::Outcome;
use crate::snapshotter::servers::supervisor::ServerEvent;
use crate::snapshotter::Snapshotter;

type Labels = Vec<(&'static str, String)>;

/// The snapshots API's methods, for per-method call counters.
fn counter(value: u64) -> Counter {
    let c = Counter::default();
    c.inc_by(value);
    c
}

fn gauge(value: usize) -> Gauge {
    let g = Gauge::default();
    g.set(i64::try_from(value).unwrap_or(i64::MAX));
    g
}

/// Renders every metric. What it shows is kept first (no later restart shows less).
pub async fn render(s: &Arc<Snapshotter>) -> Result<String> {
    let disks = disks(s, LISTED).await?;
    s.save_counters().await?;
    let me = Arc::clone(s);
    let records = crate::snapshotter::blocking(move || me.list()).await?;
    let mut registry = Registry::default();
    register_counters(&mut registry, s);
    register_state(&mut registry, &records, &disks);
    registry.register(
        "vmdisk_memory_budget_bytes",
        "The node's budget for verified chunks held in memory while the cache's disk has no room ([cache] memory_budget).",
        gauge(usize::try_from(s.memory_budget()).unwrap_or(usize::MAX)),
    );
    let mut out = String::new();
    encode(&mut out, &registry).map_err(|e| {
        Error::new(crate::error::ErrorKind::Io, "encoding the metrics").with_source(e)
    })?;
    Ok(out)
}

/// The counters that only go up: decisions, snapshots API calls, the servers' layer counters
/// and each registry endpoint's.
fn register_counters(registry: &mut Registry, s: &Snapshotter) {
    let decisions = Family::<Labels, Counter>::default();
    // Every outcome from zero: a first decision shows as an increase.
    for outcome in Outcome::all() {
        decisions
            .get_or_create(&vec![
                ("decision", outcome.decision().to_string()),
                ("reason", outcome.reason().to_string()),
            ])
            .inc_by(s.counters.get(&outcome));
    }
    registry.register(
        "vmdisk_prepare_decisions",
        "Layer Prepare decisions by outcome (remote, reused, ordinary, fallback, refused) and reason.",
        decisions,
    );
    let (calls, errors) = (
        Family::<Labels, Counter>::default(),
        Family::<Labels, Counter>::default(),
    );
    for m in Method::ALL {
        let labels = vec![("method", m.name().to_string())];
        calls
            .get_or_create(&labels)
            .inc_by(s.counters.get(&Call::Made(m)));
        errors
            .get_or_create(&labels)
            .inc_by(s.counters.get(&Call::Failed(m)));
    }
    registry.register(
        "vmdisk_snapshot_calls",
        "Snapshots API calls by method.",
        calls,
    );
    registry.register(
        "vmdisk_snapshot_call_errors",
        "Failed snapshots API calls by method (Prepare's AlreadyExists handshake excluded).",
        errors,
    );
    for &(name, help, _) in METRICS {
        registry.register(name, help, counter(s.counters.get(&EngineMetric(name))));
    }
    let starts = Family::<Labels, Counter>::default();
    for why in [ServerEvent::Started, ServerEvent::Restarted] {
        starts
            .get_or_create(&vec![("why", why.name().to_string())])
            .inc_by(s.counters.get(&why));
    }
    registry.register(
        "vmdisk_mount_server_starts",
        "Mount servers started: for a layer none served before (started), or for one whose server had ended without being stopped or had failed (restarted: a crash, a kill, the OOM killer; the successor takes over the mounts of one that died with them up).",
        starts,
    );
    registry.register(
        "vmdisk_mount_servers_adopted",
        "Running mount servers a daemon took over from an earlier one (an update, the daemon's crash, the DaemonSet's pod replaced).",
        counter(s.counters.get(&ServerEvent::Adopted)),
    );
    registry.register(
        "vmdisk_mount_server_give_ups",
        "Layers whose mount servers kept dying (5 times within 10 minutes): the daemon let their FUSE connections go, and their readers get I/O errors until the layer is served again.",
        counter(s.counters.get(&ServerEvent::GivenUp)),
    );
    for what in EndpointCounter::ALL {
        let family = Family::<Labels, Counter>::default();
        for (endpoint, v) in s.counters.endpoints(what) {
            family
                .get_or_create(&vec![("endpoint", endpoint)])
                .inc_by(v);
        }
        registry.register(
            format!("vmdisk_registry_endpoint_{}", what.name()),
            what.help(),
            family,
        );
    }
}

/// What the node holds now: snapshots by kind, remote layers by state, their chunks.
fn register_state(
    registry: &mut Registry,
    records: &[(String, crate::snapshotter::store::Record)],
    disks: &[crate::api::vmdisk::v1::Disk],
) {
    let snapshots = Family::<Labels, Gauge>::default();
    for kind in ["View", "Active", "Committed"] {
        let n = records
            .iter()
            .filter(|(_, r)| r.kind.name() == kind)
            .count();
        snapshots
            .get_or_create(&vec![("kind", kind.to_lowercase())])
            .set(n as i64);
    }
    let remote = records.iter().filter(|(_, r)| r.remote.is_some()).count();
    snapshots
        .get_or_create(&vec![("kind", "remote".to_string())])
        .set(remote as i64);
    registry.register(
        "vmdisk_snapshots",
        "Snapshots by kind; remote ones are also committed.",
        snapshots,
    );
    let serving = disks.iter().filter(|d| d.serving).count();
    let layers = Family::<Labels, Gauge>::default();
    layers
        .get_or_create(&vec![("state", "serving".to_string())])
        .set(serving as i64);
    layers
        .get_or_create(&vec![("state", "down".to_string())])
        .set((disks.len() - serving) as i64);
    registry.register(
        "vmdisk_remote_layers",
        "Remote layers by whether a mount server serves them.",
        layers,
    );
    registry.register(
        "vmdisk_layers_integrity_failed",
        "Remote layers whose complete tar stream differs from their image config (every read fails).",
        gauge(disks.iter().filter(|d| d.integrity.starts_with("failed")).count()),
    );
    registry.register(
        "vmdisk_layers_cache_full",
        "Remote layers whose chunks the cache's disk has no room for (answered from memory).",
        gauge(disks.iter().filter(|d| d.cache_full).count()),
    );
    let sum =
        |f: fn(&crate::api::vmdisk::v1::Disk) -> u64| disks.iter().map(f).sum::<u64>() as usize;
    registry.register(
        "vmdisk_memory_held_bytes",
        "Bytes of verified chunks held in memory because the cache's disk had no room, all layers together (bounded by [cache] memory_budget and one read burst per layer).",
        gauge(sum(|d| d.memory_held)),
    );
    registry.register(
        "vmdisk_chunks",
        "Chunks of the remote layers being served.",
        gauge(sum(|d| d.chunks)),
    );
    registry.register(
        "vmdisk_chunks_cached",
        "Chunks of the remote layers being served that are present in the cache.",
        gauge(sum(|d| d.chunks_cached)),
    );
}

/// `GET /metrics` (and `/`): the metrics, or a 500 that says why not.
async fn scrape(
    axum::extract::State(s): axum::extract::State<Arc<Snapshotter>>,
) -> axum::response::Response {
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;
    match render(&s).await {
        Ok(body) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.chain()).into_response(),
    }
}

/// Serves metrics at `address` until the task is dropped.
pub async fn serve(
    address: crate::snapshotter::config::MetricsAddress,
    s: Arc<Snapshotter>,
) -> Result<()> {
    use crate::snapshotter::config::MetricsAddress;
    let app = axum::Router::new()
        .route("/metrics", axum::routing::get(scrape))
        .route("/", axum::routing::get(scrape))
        .with_state(s);
    let failed = |e: std::io::Error| Error::io("serving metrics", e);
    match address {
        MetricsAddress::Off => Ok(()),
        MetricsAddress::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| Error::io(format!("listening on {addr} for metrics"), e))?;
            axum::serve(listener, app).await.map_err(failed)
        }
        MetricsAddress::Unix(path) => {
            let listener = crate::api::unix::bind(&path, 0o600)?;
            axum::serve(listener, app).await.map_err(failed)
        }
    }
}
