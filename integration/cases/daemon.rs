//! The daemon under load and across restarts: a stuck mount holds up only its own layer,
//! counters only go up, List filters are RE2 and linear, hydration can be asked for again
//! after it failed, servers are driven through their control sockets, and the daemon's
//! threads run ahead of its servers'.
//!
//! Real daemon, real mount servers and FUSE, the in-process registry of [`crate::hostile`]
//! (which can trickle or garble Range answers).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::fixtures::cri::{rt, Daemon};
use crate::fixtures::harness::*;
use crate::fixtures::hostile::{random, Answer, Claim, CraftedLayer, HostileRegistry, CHUNK};
use crate::fixtures::node::scrape;

/// A daemon with its metrics on a unix socket.
fn daemon_with_metrics(scratch: &Scratch) -> (Daemon, PathBuf) {
    let metrics = scratch.path("metrics.sock");
    let daemon = Daemon::start(
        scratch,
        &format!("[metrics]\naddress = \"unix:{}\"\n", metrics.display()),
    );
    (daemon, metrics)
}

/// Every counter sample (`…_total`) of a scrape, by series.
fn counters(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(series, _)| series.split('{').next().unwrap().ends_with("_total"))
        .map(|(series, v)| (series.to_string(), v.parse().unwrap()))
        .collect()
}

/// Asserts no counter of `before` is lower (or missing) in `after`.
fn never_lower(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>, when: &str) {
    for (series, v) in before {
        let now = after.get(series).copied();
        assert!(
            now.is_some_and(|n| n >= *v),
            "{series} went from {v} to {now:?} {when}"
        );
    }
}

fn ls(daemon: &Daemon) -> Vec<serde_json::Value> {
    serde_json::from_str(&daemon.vmdisk_ok(&["ls", "--json"])).unwrap()
}

/// Runs `f` and returns how long it took.
fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let started = Instant::now();
    let out = f();
    (out, started.elapsed())
}

#[test]
fn a_stuck_mount_holds_up_only_its_own_layer() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let good = CraftedLayer::honest(&[("disk/disk.img", &random(4 * CHUNK, 21))], CHUNK);
    let good_ref = reg.publish("good/disk", "1", &good, Claim::default());
    // Every Range answer of this blob trickles one byte an hour: its server cannot fetch the
    // TOC, so its mount never comes up. Manifest and config answer at once.
    let stuck = CraftedLayer::honest(&[("disk/disk.img", &random(4 * CHUNK, 22))], CHUNK);
    let stuck_ref = reg.publish(
        "stuck/disk",
        "1",
        &stuck,
        Claim {
            answer: Answer::Trickle(Duration::from_secs(3600)),
            at: 0..u64::MAX,
            ..Claim::default()
        },
    );
    let (daemon, metrics) = daemon_with_metrics(&scratch);
    let started = Instant::now();
    let stuck_path = Command::new(env!("CARGO_BIN_EXE_vmdisk"))
        .args([
            "path",
            &stuck_ref,
            "--manage",
            daemon.manage.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Its server is up and starting (its control socket answers).
    let control = daemon.root.join("control");
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::read_dir(&control).map_or(0, |d| d.count()) == 0 {
        assert!(Instant::now() < deadline, "no mount server started");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));

    // Meanwhile the daemon answers at once, and another image's disk gets ready.
    let (_, took) = timed(|| daemon.vmdisk_ok(&["ls"]));
    eprintln!("ls while a mount is stuck: {took:?}");
    assert!(took < Duration::from_secs(1), "ls took {took:?}");
    let (stats, took) = timed(|| daemon.vmdisk_ok(&["stats"]));
    eprintln!("stats (Status) while a mount is stuck: {took:?}");
    assert!(
        took < Duration::from_secs(1),
        "stats took {took:?}: {stats}"
    );
    let (text, took) = timed(|| scrape(&metrics));
    eprintln!("/metrics while a mount is stuck: {took:?}");
    assert!(took < Duration::from_secs(1), "/metrics took {took:?}");
    assert!(text.contains("vmdisk_remote_layers"), "{text}");
    let (path, took) = timed(|| daemon.vmdisk_ok(&["path", &good_ref]));
    eprintln!("another image's disk made ready while a mount is stuck: {took:?}");
    assert_eq!(
        std::fs::read(path.trim()).unwrap(),
        random(4 * CHUNK, 21),
        "the other disk serves its bytes"
    );
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "the other disk waited for the stuck one"
    );

    // The stuck one fails, naming why: the fetch deadline for its TOC (5 s here), or the mount
    // timeout, whichever comes first; and its server is gone.
    let out = stuck_path.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a stuck mount reported success");
    assert!(
        text.contains("mount_timeout")
            || text.contains("zstd:chunked TOC of layer")
                && text.contains("did not succeed within"),
        "{text}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_dir(&control).map_or(0, |d| d.count()) > 1 {
        assert!(
            Instant::now() < deadline,
            "the stuck server was not stopped"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let disks = ls(&daemon);
    assert_eq!(disks.len(), 1, "{disks:?}");
    assert_eq!(disks[0]["server"], "serving");
}

#[test]
fn counters_never_decrease_across_removal_and_restarts() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let data = random(8 * CHUNK, 31);
    let layer = CraftedLayer::honest(&[("disk/disk.img", &data)], CHUNK);
    let reference = reg.publish("count/disk", "1", &layer, Claim::default());
    let (mut daemon, metrics) = daemon_with_metrics(&scratch);

    // A first server reads the whole disk: bytes come from the registry.
    let path = daemon.vmdisk_ok(&["path", &reference]);
    assert_eq!(std::fs::read(path.trim()).unwrap(), data);
    let fetched = ls(&daemon)[0]["registry_bytes"].as_u64().unwrap();
    assert!(fetched > 0);
    let m0 = counters(&scrape(&metrics));
    assert!(m0["vmdisk_registry_bytes_total"] >= fetched, "{m0:?}");

    // Its removal stops the server; what it counted stays.
    daemon.vmdisk_ok(&["rm", &reference]);
    assert!(ls(&daemon).is_empty());
    let m1 = counters(&scrape(&metrics));
    never_lower(&m0, &m1, "after vmdisk rm");
    assert_eq!(
        m1["vmdisk_registry_bytes_total"], m0["vmdisk_registry_bytes_total"],
        "nothing was fetched since"
    );

    // A new server, killed and started again: the new one counts from zero, the totals not.
    daemon.vmdisk_ok(&["path", &reference]);
    let pid = ls(&daemon)[0]["server_pid"].as_u64().unwrap();
    let m2 = counters(&scrape(&metrics));
    never_lower(&m1, &m2, "after a new server started");
    crate::fixtures::cri::run_quiet("kill", &["-KILL", &pid.to_string()]);
    std::thread::sleep(Duration::from_millis(300));
    daemon.vmdisk_ok(&["path", &reference]);
    let restarted = ls(&daemon);
    assert_ne!(restarted[0]["server_pid"].as_u64().unwrap(), pid);
    let m3 = counters(&scrape(&metrics));
    never_lower(&m2, &m3, "after a server restart");

    // The daemon itself is killed and started again: it adopts the server and keeps totals.
    daemon.kill();
    daemon.restart();
    let m4 = counters(&scrape(&metrics));
    never_lower(&m3, &m4, "after a daemon restart (kill -9)");
    assert_eq!(
        ls(&daemon)[0]["server_pid"],
        restarted[0]["server_pid"],
        "the running server was adopted"
    );
}

#[test]
fn list_filters_are_re2_and_answer_pathological_patterns_at_once() {
    use vmdisk::api::containerd::services::snapshots::v1 as pb;
    let scratch = Scratch::new();
    let daemon = Daemon::start(&scratch, "");
    let names = ["a".repeat(40), "web-1".to_string(), "web-x".to_string()];
    rt().block_on(async {
        let mut s = daemon.snapshots().await;
        for key in &names {
            s.prepare(pb::PrepareSnapshotRequest {
                snapshotter: "vmdisk".into(),
                key: key.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        }
        let list = |filter: String| {
            let mut s = s.clone();
            async move {
                let mut stream = s
                    .list(pb::ListSnapshotsRequest {
                        snapshotter: "vmdisk".into(),
                        filters: vec![filter],
                    })
                    .await
                    .unwrap()
                    .into_inner();
                let mut out = Vec::new();
                while let Some(batch) = stream.message().await.unwrap() {
                    out.extend(batch.info.into_iter().map(|i| i.name));
                }
                out.sort();
                out
            }
        };
        // RE2 character classes and alternation, as containerd's Go regexp reads them.
        assert_eq!(list("name~=^web-[0-9]$".into()).await, ["web-1"]);
        assert_eq!(
            list("name~=^(web-[[:alpha:]]|a+)$".into()).await,
            [names[0].clone(), "web-x".into()]
        );
        // Exponential for a backtracking matcher; linear here.
        let pathological = format!("name~=^{}c$", "a*".repeat(30));
        let started = Instant::now();
        assert!(list(pathological).await.is_empty());
        let took = started.elapsed();
        eprintln!("List with a pathological pattern: {took:?}");
        assert!(took < Duration::from_secs(1), "List took {took:?}");
    });
}

#[test]
fn prefetch_after_a_failed_hydration_starts_again_and_wait_names_its_timeout() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let data = random(8 * CHUNK, 41);
    let layer = CraftedLayer::honest(&[("disk/disk.img", &data)], CHUNK);
    // Chunk 0 answers honestly; the rest answer with the wrong range until the registry is
    // fixed below.
    let mut broken = layer.chunk_area();
    broken.start += 1;
    let reference = reg.publish(
        "flaky/disk",
        "1",
        &layer,
        Claim {
            answer: Answer::WrongContentRange,
            at: broken.clone(),
            ..Claim::default()
        },
    );
    let daemon = Daemon::start(&scratch, "");
    let out = daemon.vmdisk(&["prefetch", "--wait", &reference]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "hydration through a broken registry succeeded"
    );
    assert!(text.contains("fetching the disk stopped"), "{text}");
    let disks = ls(&daemon);
    assert!(
        disks[0]["hydration"]
            .as_str()
            .unwrap()
            .starts_with("failed"),
        "{disks:?}"
    );

    // The registry recovers: asking again starts a new hydration, which completes.
    let (blob, _) = layer.blob();
    reg.put_blob_answering(
        "flaky/disk",
        vmdisk::oci::digest::Digest::of(&blob),
        blob,
        Answer::Honest,
        0..0,
    );
    let out = daemon.vmdisk_ok(&["prefetch", "--wait", &reference]);
    assert!(out.contains("8 of 8 chunks cached"), "{out}");
    let disks = ls(&daemon);
    assert_eq!(disks[0]["hydration"], "done", "{disks:?}");
    assert_eq!(disks[0]["integrity"], "verified", "{disks:?}");

    // A registry that trickles: `--wait` gives up after the timeout it was given, saying so.
    let slow = CraftedLayer::honest(&[("disk/disk.img", &random(8 * CHUNK, 42))], CHUNK);
    let mut area = slow.chunk_area();
    area.start += 1;
    let slow_ref = reg.publish(
        "slow/disk",
        "1",
        &slow,
        Claim {
            answer: Answer::Trickle(Duration::from_millis(200)),
            at: area,
            ..Claim::default()
        },
    );
    let (out, took) =
        timed(|| daemon.vmdisk(&["prefetch", "--wait", "--wait-timeout", "2", &slow_ref]));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("--wait-timeout 2s"), "{text}");
    assert!(
        took < Duration::from_secs(20),
        "--wait-timeout 2 took {took:?}"
    );
}

#[test]
fn a_sequential_read_of_the_raw_view_reads_ahead() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    // 48 MiB of random data in a 64 MiB qcow2 (64 KiB clusters), published at 256 KiB chunks.
    let qcow2 = scratch.path("seq.qcow2");
    make_qcow2(&qcow2, "64M", &[]);
    write_random(&qcow2, 8 << 20, 48 << 20, 5);
    let reference = format!("{}/vm/seq:1", reg.host());
    vmdisk_ok(&["push", qcow2.to_str().unwrap(), &reference]);
    let (daemon, metrics) = daemon_with_metrics(&scratch);
    let raw = daemon.vmdisk_ok(&["path", "--raw", &reference]);
    let before = counters(&scrape(&metrics));
    dd_read(Path::new(raw.trim()), "1M");
    let after = counters(&scrape(&metrics));
    let delta = |name: &str| {
        let sum = |m: &BTreeMap<String, u64>| -> u64 {
            m.iter()
                .filter(|(k, _)| k.starts_with(name))
                .map(|(_, v)| v)
                .sum()
        };
        sum(&after) - sum(&before)
    };
    let (requests, chunks) = (
        delta("vmdisk_registry_requests_total"),
        delta("vmdisk_chunks_fetched_total"),
    );
    eprintln!("sequential read of the raw view: {requests} range requests for {chunks} chunks");
    // The 48 MiB of data are 192 chunks; the view reads them a 64 KiB cluster at a time, so
    // without read-ahead each chunk is its own request. Read-ahead fetches runs of up to 4 MiB.
    assert!(chunks >= 180, "{chunks} chunks fetched");
    assert!(
        requests <= chunks / 4,
        "{requests} requests for {chunks} chunks"
    );
    // And the view is still the guest's bytes.
    let want = scratch.path("seq.raw");
    qemu_img_raw(&qcow2, &want);
    assert_eq!(sha256_file(Path::new(raw.trim())), sha256_file(&want));
}

/// The nice level of each thread of process `pid`.
fn thread_levels(pid: u32) -> Vec<i64> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
        // Fields after the command's closing parenthesis; the nice level is the 17th.
        .map(|stat| {
            let rest = &stat[stat.rfind(')').unwrap() + 2..];
            rest.split_whitespace().nth(16).unwrap().parse().unwrap()
        })
        .collect()
}

/// The control plane answers ahead of the disks' reads: every thread of the daemon runs
/// `control_priority` (5) nice levels above the level it was started at, every thread of its
/// mount server (a process it started) at that level.
#[test]
fn the_daemons_threads_run_ahead_of_its_servers() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let layer = CraftedLayer::honest(&[("disk/disk.img", &random(4 * CHUNK, 41))], CHUNK);
    let reference = reg.publish("nice/disk", "1", &layer, Claim::default());
    let daemon = Daemon::start(&scratch, "");
    daemon.vmdisk_ok(&["path", &reference]);
    let base: i64 = thread_levels(std::process::id())[0];
    let daemon_levels = thread_levels(daemon.pid());
    let boost = 5;
    assert!(
        daemon_levels.iter().all(|&n| n == (base - boost).max(-20)),
        "daemon threads at {daemon_levels:?}, started at {base}"
    );
    let servers = daemon.server_pids();
    assert_eq!(servers.len(), 1);
    let server_levels = thread_levels(servers[0]);
    assert!(
        server_levels.len() > 1 && server_levels.iter().all(|&n| n == base),
        "server threads at {server_levels:?}, started at {base}"
    );
}

/// The package's daemon crashes (SIGKILL, as `systemctl restart` with `KillMode=process` or an
/// upgrade leaves it) and is started again while a VM reads its disk: a reader holding the raw
/// view open and qemu-img reading it whole see no error and no wrong byte (the mount server
/// keeps serving), and the new daemon adopts the server.
#[test]
fn a_daemon_restart_under_a_read_raw_view_costs_its_readers_nothing() {
    let scratch = Scratch::new();
    let (reg, disk) = crate::fixtures::images::registry_with_images(&scratch, 8);
    let mut daemon = Daemon::start(&scratch, "");
    let image = format!("{}/disk:1", reg.host());
    let raw = PathBuf::from(daemon.vmdisk_ok(&["path", "--raw", &image]).trim());
    let want_file = guest_bytes(&disk);
    let server = daemon.server_pids();
    let (saw, qemu, ()) = read_through(&raw, &want_file, || {
        daemon.kill();
        std::thread::sleep(Duration::from_millis(300));
        daemon.restart();
    });
    assert_served_through("the daemon's crash and restart", &saw, &qemu);
    assert_eq!(daemon.server_pids(), server, "the server was adopted");
}
