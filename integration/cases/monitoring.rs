//! The shipped monitoring against a real Prometheus (Debian 12's, unpacked by `make deps`):
//! `promtool` checks the alerting rules and runs their unit tests; Prometheus scrapes a real
//! daemon serving disks from the in-process registry of [`crate::hostile`] while the test
//! makes each alert's cause happen — chunks that fail verification, a disk that differs from
//! its image, a registry that stops answering, the cache's disk full, a mount server killed, a
//! cached chunk damaged on the node's disk, the daemon replaced — and every
//! alert is seen silent before its cause and firing after it. Every query of the Grafana
//! dashboard returns series from the same Prometheus.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::fixtures::cri::{run_quiet, Daemon};
use crate::fixtures::harness::*;
use crate::fixtures::hostile::{random, Answer, Claim, CraftedLayer, HostileRegistry, CHUNK};
use vmdisk::oci::digest::Digest;

/// The shipped rules, their unit tests and the dashboard.
fn monitoring(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("packaging/monitoring")
        .join(file)
}

/// Debian's `prometheus` or `promtool`, unpacked by `make deps`.
fn prometheus_tool(tool: &str) -> PathBuf {
    unpacked("prometheus/usr/bin", tool)
}

/// Every alert the rules file defines.
fn alert_names() -> Vec<String> {
    let text = std::fs::read_to_string(monitoring("vmdisk-alerts.yaml")).unwrap();
    let names: Vec<String> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(str::to_string)
        .collect();
    assert!(names.len() >= 10, "alerts found: {names:?}");
    names
}

#[test]
fn the_alerting_rules_pass_promtool_check_and_their_unit_tests() {
    let promtool = prometheus_tool("promtool");
    for args in [
        vec!["check", "rules", "vmdisk-alerts.yaml"],
        vec!["test", "rules", "vmdisk-alerts.test.yaml"],
    ] {
        let out = Command::new(&promtool)
            .args(&args)
            .current_dir(monitoring(""))
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("promtool {}: {text}", args.join(" "));
        assert!(out.status.success(), "promtool {}: {text}", args.join(" "));
    }
    // The unit tests cover every alert, firing and silent.
    let tests = std::fs::read_to_string(monitoring("vmdisk-alerts.test.yaml")).unwrap();
    for name in alert_names() {
        assert!(
            tests.contains(&format!("alertname: {name}, exp_alerts: []"))
                && tests.contains(&format!("alertname: {name}\n")),
            "vmdisk-alerts.test.yaml does not test {name} both silent and firing"
        );
    }
}

/// A Prometheus scraping one target every second and evaluating the shipped rules every
/// second; stopped when dropped.
struct Prometheus {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Prometheus {
    fn start(scratch: &Scratch, target: &str) -> Self {
        let dir = scratch.path("prometheus");
        std::fs::create_dir_all(dir.join("data")).unwrap();
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: vmdisk\n    static_configs:\n      - targets: ['{target}']\n",
                monitoring("vmdisk-alerts.yaml").display()
            ),
        )
        .unwrap();
        let port = free_port();
        let log = dir.join("prometheus.log");
        let child = Command::new(prometheus_tool("prometheus"))
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let p = Prometheus { child, port, log };
        let deadline = Instant::now() + Duration::from_secs(60);
        while p.get("/-/ready").is_none() {
            assert!(
                Instant::now() < deadline,
                "prometheus did not start: {}",
                std::fs::read_to_string(&p.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        p
    }

    fn get(&self, path: &str) -> Option<Vec<u8>> {
        let out = Command::new("curl")
            .args(["-sf", "--max-time", "10", "-G"])
            .arg(format!("http://127.0.0.1:{}{path}", self.port))
            .output()
            .unwrap();
        out.status.success().then_some(out.stdout)
    }

    /// The result of an instant query.
    fn query(&self, expr: &str) -> Vec<serde_json::Value> {
        let out = Command::new("curl")
            .args(["-sf", "--max-time", "10", "-G", "--data-urlencode"])
            .arg(format!("query={expr}"))
            .arg(format!("http://127.0.0.1:{}/api/v1/query", self.port))
            .output()
            .unwrap();
        assert!(out.status.success(), "query {expr} failed");
        let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(answer["status"], "success", "query {expr}: {answer}");
        answer["data"]["result"].as_array().unwrap().clone()
    }

    /// Each active alert's state (pending or firing), by name.
    fn alerts(&self) -> BTreeMap<String, String> {
        let answer: serde_json::Value =
            serde_json::from_slice(&self.get("/api/v1/alerts").expect("alerts")).unwrap();
        answer["data"]["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                (
                    a["labels"]["alertname"].as_str().unwrap().to_string(),
                    a["state"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    /// After `cause`: waits (at most `within`) until every alert of `firing` fires, then checks
    /// that no alert of `silent` (those whose causes were not made) is active, pending or firing.
    fn after(&self, cause: &str, firing: &[&str], silent: &[&str], within: Duration) {
        let deadline = Instant::now() + within;
        let active = loop {
            let active = self.alerts();
            if firing
                .iter()
                .all(|a| active.get(*a).map(String::as_str) == Some("firing"))
            {
                break active;
            }
            assert!(
                Instant::now() < deadline,
                "{cause}: {firing:?} not all firing within {within:?}: active {active:?}"
            );
            std::thread::sleep(Duration::from_millis(500));
        };
        eprintln!("{cause}: active alerts {active:?}");
        for name in silent {
            assert!(
                !active.contains_key(*name),
                "{name} is {} {cause}, before its cause: {active:?}",
                active[*name]
            );
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads all of `path` in 1 MiB reads (a short read is a failure: the kernel returns what it
/// read before the error), the last first (so no fetch of the disk's first bytes,
/// which answer well, reaches ahead over the rest); how many reads failed (the disk may be made
/// to fail).
fn read_all(path: &str) -> usize {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path.trim()).unwrap();
    let size = file.metadata().unwrap().len();
    let mut buf = vec![0u8; 1 << 20];
    let mib = buf.len() as u64;
    (0..size.div_ceil(mib))
        .rev()
        .filter(|&i| {
            let len = mib.min(size - i * mib) as usize;
            file.read_exact_at(&mut buf[..len], i * mib).is_err()
        })
        .count()
}

#[test]
fn each_shipped_alert_fires_under_its_cause_against_a_real_prometheus_and_every_dashboard_query_answers(
) {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    // The registry that stops answering is another one (its own endpoint).
    let far = HostileRegistry::start();
    let image_in = |reg: &HostileRegistry,
                    name: &str,
                    size: usize,
                    seed: u64,
                    answer: Answer,
                    diff_id: Option<Digest>| {
        let layer = CraftedLayer::honest(&[("disk/disk.img", &random(size, seed))], CHUNK);
        // The first quarter of the chunks answers well: making the ready-disk directory reads
        // the disk's first bytes. The disk is read from its end ([`read_all`]).
        let area = layer.chunk_area();
        let claim = Claim {
            at: if matches!(answer, Answer::Honest) {
                0..0
            } else {
                area.start + (area.end - area.start) / 4..area.end
            },
            answer,
            diff_id,
            ..Claim::default()
        };
        reg.publish(name, "1", &layer, claim)
    };
    let image = |name: &str, size: usize, seed: u64, answer: Answer, diff_id: Option<Digest>| {
        image_in(&reg, name, size, seed, answer, diff_id)
    };
    let healthy = image("vm/healthy", 2 << 20, 61, Answer::Honest, None);
    let damaged = image(
        "vm/damaged",
        2 << 20,
        62,
        Answer::LateAndDamaged(Duration::ZERO),
        None,
    );
    // Its chunks are right, the image config claims another layer.
    let differs = image(
        "vm/differs",
        256 << 10,
        65,
        Answer::Honest,
        Some(Digest::of(b"some other layer")),
    );
    let unanswered = image_in(
        &far,
        "vm/unanswered",
        2 << 20,
        63,
        Answer::Trickle(Duration::from_secs(3600)),
        None,
    );
    let big = image("vm/big", 40 << 20, 64, Answer::Honest, None);
    // The cache on an 8 MiB filesystem (the big disk fills it), 8 MiB of memory for what it
    // has no room for; only what is read is fetched (no hydration), so each cause is the
    // test's own.
    let cache = scratch.path("cache");
    let _fs = Tmpfs::mount(&cache, "8m");
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut daemon = Daemon::start(
        &scratch,
        &format!(
            "[cache]\ndir = \"{}\"\nhydrate = \"off\"\nmemory_budget = \"8M\"\n[metrics]\naddress = \"{metrics}\"\n",
            cache.display()
        ),
    );
    let prometheus = Prometheus::start(&scratch, &metrics);
    let all = alert_names();
    let names: Vec<&str> = all.iter().map(String::as_str).collect();

    // Healthy: a disk read twice (fetched, then from the cache). Nothing fires.
    let healthy_path = daemon.vmdisk_ok(&["path", &healthy]);
    // `vmdisk path`'s stdout is the path alone (scripts read it).
    assert_eq!(healthy_path, format!("{}\n", healthy_path.trim()));
    assert!(Path::new(healthy_path.trim()).is_file(), "{healthy_path:?}");
    assert_eq!(read_all(&healthy_path), 0);
    assert_eq!(read_all(&healthy_path), 0);
    // `prefetch --wait` in a pipe: its last progress line on stderr, its result on stdout.
    let prefetched = daemon.vmdisk(&["prefetch", "--wait", &healthy]);
    let said = String::from_utf8_lossy(&prefetched.stderr).to_string();
    assert!(prefetched.status.success(), "{said}");
    assert!(
        said.lines()
            .any(|l| l.starts_with(&format!("prefetching {healthy}: done, 32 chunks"))),
        "{said}"
    );
    assert!(String::from_utf8_lossy(&prefetched.stdout).contains("32 of 32 chunks cached"));
    std::thread::sleep(Duration::from_secs(10));
    let up = prometheus.query("up{job=\"vmdisk\"}");
    assert_eq!(up.len(), 1, "{up:?}");
    assert_eq!(up[0]["value"][1], "1", "the daemon is not scraped: {up:?}");
    prometheus.after("on a healthy node", &[], &names, Duration::ZERO);

    // Chunks that fail verification: every answer of the disk's chunks has a byte flipped.
    let damaged_path = daemon.vmdisk_ok(&["path", &damaged]);
    assert!(read_all(&damaged_path) > 0, "damaged chunks were served");
    let state_causes = [
        "VmdiskCacheFull",
        "VmdiskMemoryBudgetReached",
        "VmdiskLayersDown",
        "VmdiskMountServerRestarted",
        "VmdiskMountServersAdopted",
        "VmdiskCacheDamaged",
    ];
    prometheus.after(
        "after damaged chunks",
        &["VmdiskChunksFailingVerification"],
        &[&state_causes[..], &["VmdiskLayerIntegrityFailed"]].concat(),
        Duration::from_secs(30),
    );

    // A disk that differs from its image: every chunk right, the complete layer not what the
    // image config names.
    let differs_path = daemon.vmdisk_ok(&["path", &differs]);
    read_all(&differs_path);
    prometheus.after(
        "after a disk that differs from its image",
        &["VmdiskLayerIntegrityFailed"],
        &state_causes,
        Duration::from_secs(30),
    );

    // A registry that stops answering: the disk's chunks never come; reads fail at the fetch
    // deadline (5 s here).
    let unanswered_path = daemon.vmdisk_ok(&["path", &unanswered]);
    assert!(
        read_all(&unanswered_path) > 0,
        "reads of an unanswered disk succeeded"
    );
    prometheus.after(
        "after a registry stopped answering",
        &[
            "VmdiskReadsFailing",
            "VmdiskReadsTimingOut",
            "VmdiskRegistryEndpointFailing",
        ],
        &state_causes,
        Duration::from_secs(30),
    );

    let disk_of = |name: &str| -> serde_json::Value {
        let ls: serde_json::Value =
            serde_json::from_str(&daemon.vmdisk_ok(&["ls", "--json"])).unwrap();
        ls.as_array()
            .unwrap()
            .iter()
            .find(|d| d["reference"].as_str().unwrap().contains(name))
            .unwrap()
            .clone()
    };
    let kill_server_of = |name: &str| {
        let pid = disk_of(name)["server_pid"].as_u64().unwrap();
        run_quiet("kill", &["-KILL", &pid.to_string()]);
    };

    // The healthy disk's server killed, a chunk of its disk damaged on the cache's disk
    // meanwhile, and the disk asked for again: a new server (a restart), which checks what
    // the cache holds and finds the damaged chunk (fetched again: the reads are right).
    let healthy_key = disk_of("vm/healthy")["layer_key"]
        .as_str()
        .unwrap()
        .to_string();
    kill_server_of("vm/healthy");
    let data = cache
        .join("layers")
        .join(healthy_key.strip_prefix("sha256:").unwrap())
        .join("data/0");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[100] ^= 0x01;
    std::fs::write(&data, bytes).unwrap();
    daemon.vmdisk_ok(&["path", &healthy]);
    assert_eq!(read_all(&healthy_path), 0);
    prometheus.after(
        "after a server restart and a damaged cached chunk",
        &["VmdiskMountServerRestarted", "VmdiskCacheDamaged"],
        &[
            "VmdiskCacheFull",
            "VmdiskMemoryBudgetReached",
            "VmdiskMountServersAdopted",
        ],
        Duration::from_secs(30),
    );

    // The cache's disk full: the big disk read whole is answered from memory, up to the
    // budget. And the damaged disk's server killed for good: its disk has no server.
    let big_path = daemon.vmdisk_ok(&["path", &big]);
    assert_eq!(read_all(&big_path), 0, "reads on a full cache failed");
    kill_server_of("vm/damaged");
    prometheus.after(
        "after the cache filled and a server was killed",
        &[
            "VmdiskCacheFull",
            "VmdiskMemoryBudgetReached",
            "VmdiskLayersDown",
        ],
        &["VmdiskMountServersAdopted"],
        Duration::from_secs(120),
    );

    // The daemon replaced (SIGTERM, started again): it adopts the running servers.
    daemon.stop();
    daemon.restart();
    prometheus.after(
        "after the daemon was replaced",
        &["VmdiskMountServersAdopted"],
        &[],
        Duration::from_secs(60),
    );

    // Every dashboard query returns series ($instance: every node, the rate interval 1m).
    let dashboard: serde_json::Value =
        serde_json::from_slice(&std::fs::read(monitoring("vmdisk-dashboard.json")).unwrap())
            .unwrap();
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$instance", ".*")
                .replace("$__rate_interval", "1m");
            let result = prometheus.query(&expr);
            assert!(
                !result.is_empty(),
                "panel {:?}: {expr} returns no series",
                panel["title"]
            );
            queries += 1;
        }
    }
    let instances = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "instance")
        .unwrap()["definition"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(instances, "label_values(vmdisk_snapshots, instance)");
    assert_eq!(prometheus.query("vmdisk_snapshots").len(), 4);
    eprintln!("{queries} dashboard queries answered with series");
}
