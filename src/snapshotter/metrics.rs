//! Prometheus metrics in the text exposition format, on a unix socket or a loopback TCP port
//! (`metrics.address`). Names, types and units are documented in `docs/snapshotter.md`; the
//! per-layer counters are summed over the mount servers' status files at scrape time.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::grpc::{disks, CallCounts};
use super::Snapshotter;
use crate::error::{Error, Result};

/// One metric family and its samples (`labels` → value).
struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    samples: Vec<(String, u64)>,
}

impl Family {
    fn new(name: &'static str, kind: &'static str, help: &'static str) -> Self {
        Family {
            name,
            kind,
            help,
            samples: Vec::new(),
        }
    }

    fn one(name: &'static str, kind: &'static str, help: &'static str, value: u64) -> Self {
        let mut f = Family::new(name, kind, help);
        f.samples.push((String::new(), value));
        f
    }

    fn write(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP {} {}\n# TYPE {} {}",
            self.name, self.help, self.name, self.kind
        );
        for (labels, v) in &self.samples {
            let labels = if labels.is_empty() {
                String::new()
            } else {
                format!("{{{labels}}}")
            };
            let _ = writeln!(out, "{}{labels} {v}", self.name);
        }
    }
}

/// Renders every metric.
pub async fn render(s: &Arc<Snapshotter>, calls: &CallCounts) -> Result<String> {
    let mut families = Vec::new();
    let mut f = Family::new(
        "vmdisk_prepare_decisions_total",
        "counter",
        "Layer Prepare decisions by outcome (remote, reused, ordinary, fallback) and reason.",
    );
    for (d, v) in s.decisions.snapshot() {
        let (outcome, reason) = d.split_once(':').unwrap_or((&d, ""));
        f.samples
            .push((format!("decision=\"{outcome}\",reason=\"{reason}\""), v));
    }
    families.push(f);
    let mut c = Family::new(
        "vmdisk_snapshot_calls_total",
        "counter",
        "Snapshots API calls by method.",
    );
    let mut e = Family::new(
        "vmdisk_snapshot_call_errors_total",
        "counter",
        "Failed snapshots API calls by method (Prepare's AlreadyExists handshake excluded).",
    );
    for (m, n) in &calls.calls {
        c.samples
            .push((format!("method=\"{m}\""), n.load(Ordering::Relaxed)));
        e.samples.push((
            format!("method=\"{m}\""),
            calls.errors[m].load(Ordering::Relaxed),
        ));
    }
    families.extend([c, e]);

    let me = Arc::clone(s);
    let records = super::blocking(move || me.list()).await?;
    let mut f = Family::new(
        "vmdisk_snapshots",
        "gauge",
        "Snapshots by kind; remote ones are also committed.",
    );
    for kind in ["View", "Active", "Committed"] {
        let n = records
            .iter()
            .filter(|(_, r)| r.kind.name() == kind)
            .count();
        f.samples
            .push((format!("kind=\"{}\"", kind.to_lowercase()), n as u64));
    }
    let remote = records.iter().filter(|(_, r)| r.remote.is_some()).count();
    f.samples.push(("kind=\"remote\"".into(), remote as u64));
    families.push(f);

    let disks = disks(s).await?;
    let serving = disks.iter().filter(|d| d.serving).count() as u64;
    let mut f = Family::new(
        "vmdisk_remote_layers",
        "gauge",
        "Remote layers by whether a mount server serves them.",
    );
    f.samples.push(("state=\"serving\"".into(), serving));
    f.samples
        .push(("state=\"down\"".into(), disks.len() as u64 - serving));
    families.push(f);
    families.push(Family::one(
        "vmdisk_layers_integrity_failed",
        "gauge",
        "Remote layers whose complete tar stream differs from their image config (every read fails).",
        disks
            .iter()
            .filter(|d| d.integrity.starts_with("failed"))
            .count() as u64,
    ));

    let statuses: Vec<crate::serve::LayerStatus> = disks
        .iter()
        .filter_map(|d| d.layer_key.parse().ok())
        .filter_map(|l| s.servers.paths(&l).stats())
        .collect();
    let sum = |g: fn(&crate::serve::LayerStatus) -> u64| statuses.iter().map(g).sum::<u64>();
    families.extend([
        Family::one(
            "vmdisk_registry_bytes_total",
            "counter",
            "Compressed chunk bytes received from registries.",
            sum(|x| x.counters.bytes_fetched),
        ),
        Family::one(
            "vmdisk_registry_requests_total",
            "counter",
            "Range requests sent for chunks.",
            sum(|x| x.counters.fetch_requests),
        ),
        Family::one(
            "vmdisk_chunks_fetched_total",
            "counter",
            "Chunks fetched and verified.",
            sum(|x| x.counters.chunks_fetched),
        ),
        Family::one(
            "vmdisk_chunks_deduplicated_total",
            "counter",
            "Chunks copied from another cached layer instead of fetched.",
            sum(|x| x.counters.chunks_deduplicated),
        ),
        Family::one(
            "vmdisk_verify_failures_total",
            "counter",
            "Chunks that failed digest verification.",
            sum(|x| x.counters.verify_failures),
        ),
        Family::one(
            "vmdisk_read_errors_total",
            "counter",
            "FUSE reads answered with EIO.",
            sum(|x| x.counters.read_errors),
        ),
        Family::one(
            "vmdisk_served_bytes_total",
            "counter",
            "Bytes returned to FUSE readers by the servers (passthrough reads excluded).",
            sum(|x| x.counters.bytes_served),
        ),
        Family::one(
            "vmdisk_chunks",
            "gauge",
            "Chunks of all remote layers.",
            sum(|x| x.chunks),
        ),
        Family::one(
            "vmdisk_chunks_cached",
            "gauge",
            "Chunks of remote layers present in the cache.",
            sum(|x| x.chunks_cached),
        ),
    ]);
    let mut out = String::new();
    for f in &families {
        f.write(&mut out);
    }
    Ok(out)
}

/// Answers one HTTP request on `stream` with the metrics (GET /metrics) or 404.
async fn answer<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut stream: S,
    s: Arc<Snapshotter>,
    calls: Arc<CallCounts>,
) {
    let mut buf = vec![0u8; 8192];
    let mut len = 0;
    // Read the request head (bounded); the body, if any, is ignored.
    while len < buf.len() {
        match tokio::time::timeout(
            std::time::Duration::from_secs(5),
            stream.read(&mut buf[len..]),
        )
        .await
        {
            Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
            Ok(Ok(n)) => len += n,
        }
        if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let head = String::from_utf8_lossy(&buf[..len]);
    let response = if head.starts_with("GET /metrics ") || head.starts_with("GET / ") {
        match render(&s, &calls).await {
            Ok(body) => format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            ),
            Err(e) => {
                let body = e.chain();
                format!("HTTP/1.1 500 Internal Server Error\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
            }
        }
    } else {
        "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string()
    };
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// Serves metrics at `address` until the task is dropped.
pub async fn serve(
    address: super::config::MetricsAddress,
    s: Arc<Snapshotter>,
    calls: Arc<CallCounts>,
) -> Result<()> {
    use super::config::MetricsAddress;
    match address {
        MetricsAddress::Off => Ok(()),
        MetricsAddress::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| Error::io(format!("listening on {addr} for metrics"), e))?;
            loop {
                if let Ok((stream, _)) = listener.accept().await {
                    tokio::spawn(answer(stream, Arc::clone(&s), Arc::clone(&calls)));
                }
            }
        }
        MetricsAddress::Unix(path) => {
            let listener = super::daemon::bind_unix(&path, 0o600)?;
            loop {
                if let Ok((stream, _)) = listener.accept().await {
                    tokio::spawn(answer(stream, Arc::clone(&s), Arc::clone(&calls)));
                }
            }
        }
    }
}
