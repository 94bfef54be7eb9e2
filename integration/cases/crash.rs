//! A mount server's crash is invisible to its readers: the daemon keeps each mount's FUSE
//! connection, notices the server's death at once and starts a successor that takes the
//! connection over (no new mount) and has the kernel resend what the dead one left unanswered.
//! Real daemon, registry, FUSE and qemu-img; servers killed with SIGKILL.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::fixtures::cri::{run_quiet, Daemon};
use crate::fixtures::harness::{
    assert_served_through, guest_bytes, read_through, ReaderSaw, Registry, Scratch,
};

/// The longest a read may wait across a server's crash.
const LONGEST: Duration = Duration::from_secs(2);

/// Kills `daemon`'s only mount server with SIGKILL and waits (at most 10 s) until another
/// serves; the new server's pid.
fn kill_server(daemon: &Daemon) -> u32 {
    let pids = daemon.server_pids();
    assert_eq!(pids.len(), 1, "one server: {pids:?}");
    // Reads from here on reach the server, not the page cache.
    crate::fixtures::harness::drop_caches();
    run_quiet("kill", &["-KILL", &pids[0].to_string()]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = daemon.server_pids();
        if let [pid] = now[..] {
            if pid != pids[0] {
                return pid;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no successor within 10 s of the kill; daemon log:\n{}",
            daemon.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn assert_quick(what: &str, saw: &ReaderSaw) {
    assert!(
        saw.longest <= LONGEST,
        "{what}: a read waited {:?} (at most {LONGEST:?})",
        saw.longest
    );
}

/// A daemon (with a deep root) serving the raw view of a published 8 MiB-data qcow2 disk; the
/// view's path and a file of the bytes it must show.
fn served_raw_view(scratch: &Scratch, extra: &str) -> (Registry, Daemon, PathBuf, PathBuf) {
    let (reg, disk) = crate::fixtures::images::registry_with_images(scratch, 8);
    // A root as deep as k3s nests it: the servers' sockets (`<root>/fds/<key>.sock` among them)
    // are longer than a socket address holds.
    let daemon = Daemon::start_in(scratch, &"long-root-".repeat(6), extra);
    let image = format!("{}/disk:1", reg.host());
    let raw = PathBuf::from(daemon.vmdisk_ok(&["path", "--raw", &image]).trim());
    let want = guest_bytes(&disk);
    (reg, daemon, raw, want)
}

/// How many files the daemon's only server opened with FUSE passthrough.
fn passthrough_opens(daemon: &Daemon) -> u64 {
    let socket = std::fs::read_dir(daemon.root.join("control"))
        .unwrap()
        .flatten()
        .next()
        .expect("a server's socket")
        .path();
    let status = crate::fixtures::cri::rt()
        .block_on(vmdisk::snapshotter::servers::control::status(&socket))
        .unwrap();
    status.counters.map_or(0, |c| c.passthrough_opens)
}

/// A server SIGKILLed under a reader holding the raw view open and qemu-img comparing it
/// whole; its successor killed again as soon as it serves; then the daemon itself killed and
/// started again, and the server it adopted killed: every read answered, right and whole,
/// none waiting more than 2 s. (Against the code before: the reader got ENOTCONN for good.)
#[test]
fn a_servers_crash_under_a_read_raw_view_costs_its_readers_nothing() {
    let scratch = Scratch::new();
    let (_reg, mut daemon, raw, want) = served_raw_view(&scratch, "");
    let (saw, qemu, successors) = read_through(&raw, &want, || {
        let first = kill_server(&daemon);
        // Killed again at once: the successor's successor takes over too.
        let second = kill_server(&daemon);
        [first, second]
    });
    assert_served_through("a server killed twice", &saw, &qemu);
    assert_quick("a server killed twice", &saw);
    assert_ne!(successors[0], successors[1]);
    let log = daemon.log_text();
    assert!(
        log.contains("a successor takes them over"),
        "the daemon says what happened:\n{log}"
    );

    // The daemon replaced after the takeovers adopts the successor and keeps its connections.
    let (saw, qemu, ()) = read_through(&raw, &want, || {
        daemon.kill();
        std::thread::sleep(Duration::from_millis(300));
        daemon.restart();
        kill_server(&daemon);
    });
    assert_served_through(
        "the daemon restarted, then its adopted server killed",
        &saw,
        &qemu,
    );
    assert_quick("the daemon restarted, then its adopted server killed", &saw);
}

/// Reads waiting for the registry when the server is killed — read from the connection by the
/// dead server, never answered — are sent again to its successor (FUSE_NOTIFY_RESEND) and
/// answered right; the successor itself starts while the registry does not answer. (Against
/// the code before: no successor.)
#[test]
fn reads_in_flight_when_the_server_dies_are_answered_by_its_successor() {
    let scratch = Scratch::new();
    let (reg, disk) = crate::fixtures::images::registry_with_images(&scratch, 8);
    // Nothing is fetched but what is read.
    let daemon = Daemon::start(&scratch, "[cache]\nhydrate = \"off\"\n");
    let image = format!("{}/disk:1", reg.host());
    let raw = PathBuf::from(daemon.vmdisk_ok(&["path", "--raw", &image]).trim());
    let want = std::fs::read(guest_bytes(&disk)).unwrap();
    // The registry stops answering: reads of what is not cached wait in the server.
    reg.pause();
    let readers: Vec<_> = (0..4u64)
        .map(|n| {
            let raw = raw.clone();
            // In the random data the disk holds at 512 MiB (not cached: never read).
            let at = (512 + n * 2) << 20;
            let want = want[at as usize..(at + (256 << 10)) as usize].to_vec();
            std::thread::spawn(move || {
                use std::os::unix::fs::FileExt;
                let file = std::fs::File::open(&raw).unwrap();
                let mut buf = vec![0u8; want.len()];
                let read = file.read_exact_at(&mut buf, at);
                (read.map_err(|e| e.to_string()), buf == want)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        readers.iter().all(|r| !r.is_finished()),
        "the reads wait for the paused registry"
    );
    // The successor starts from what the cache keeps (the image by digest, its manifest, record
    // and TOC): the registry, not answering, holds nothing up.
    let started = Instant::now();
    kill_server(&daemon);
    let took = started.elapsed();
    reg.resume();
    assert!(
        took <= LONGEST,
        "the successor served after {took:?} with the registry not answering"
    );
    for (n, reader) in readers.into_iter().enumerate() {
        let (read, right) = reader.join().unwrap();
        assert_eq!(read, Ok(()), "reader {n}");
        assert!(right, "reader {n} got other bytes");
    }
}

/// A disk read with FUSE passthrough (its cache complete, the file opened after): the open
/// file keeps reading across the crash, and files opened after it are served by the successor.
#[test]
fn a_passthrough_reader_and_new_opens_survive_the_servers_crash() {
    let scratch = Scratch::new();
    let (reg, disk) = crate::fixtures::images::registry_with_images(&scratch, 8);
    let daemon = Daemon::start(&scratch, "");
    let image = format!("{}/disk:1", reg.host());
    let path = PathBuf::from(daemon.vmdisk_ok(&["path", &image]).trim());
    daemon.vmdisk_ok(&["prefetch", "--wait", "-q", &image]);
    let want_file = scratch.path("published.qcow2");
    std::fs::copy(&disk, &want_file).unwrap();
    // The cache is complete and checked: opens from now on are passthrough ones.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        drop(std::fs::File::open(&path).unwrap());
        if passthrough_opens(&daemon) > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "no passthrough open");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (saw, qemu, ()) = read_through(&path, &want_file, || {
        kill_server(&daemon);
    });
    assert_served_through("a passthrough reader across a crash", &saw, &qemu);
    assert_quick("a passthrough reader across a crash", &saw);
    assert_eq!(
        crate::fixtures::harness::sha256_file(&path),
        crate::fixtures::harness::sha256_file(&want_file),
        "a new open after the takeover reads the disk"
    );
}

/// A layer whose servers keep dying is not restarted in a loop: after 5 deaths within 10 min
/// the daemon lets its connections go, its reader gets an error, and the log and /metrics say
/// why.
#[test]
fn a_layer_whose_servers_keep_dying_is_given_up_with_a_clear_error() {
    let scratch = Scratch::new();
    let metrics = scratch.path("metrics.sock");
    let (_reg, daemon, raw, _) = served_raw_view(
        &scratch,
        &format!("[metrics]\naddress = \"unix:{}\"\n", metrics.display()),
    );
    let file = std::fs::File::open(&raw).unwrap();
    for _ in 0..5 {
        kill_server(&daemon);
    }
    // The sixth death: no successor.
    let pid = daemon.server_pids()[0];
    run_quiet("kill", &["-KILL", &pid.to_string()]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !daemon.log_text().contains("keep dying") {
        assert!(
            Instant::now() < deadline,
            "no give-up:\n{}",
            daemon.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(daemon.server_pids().is_empty(), "no successor started");
    let mut buf = vec![0u8; 4096];
    use std::os::unix::fs::FileExt;
    assert!(
        file.read_at(&mut buf, 5 << 20).is_err(),
        "a read of the given-up mount fails"
    );
    let scraped = crate::fixtures::node::scrape(&metrics);
    assert!(
        scraped.contains("vmdisk_mount_server_give_ups_total 1"),
        "{scraped}"
    );
}

/// The servers' cgroup (`server_cgroup`) hits its memory limit while a reader fetches the
/// disk: the kernel's OOM killer kills the server, as on a node under pressure. Once the limit
/// is raised, a successor takes its mounts over; the reader sees every read answered right.
#[test]
fn a_server_killed_by_its_cgroups_memory_limit_is_succeeded() {
    let scratch = Scratch::new();
    let cgroup = format!("vmdisk-oom-{}", std::process::id());
    let (reg, disk) = crate::fixtures::images::registry_with_images(&scratch, 64);
    let daemon = Daemon::start_top(
        &scratch,
        &format!("server_cgroup = \"/{cgroup}\"\n"),
        "[cache]\nhydrate = \"off\"\n",
    );
    let image = format!("{}/disk:1", reg.host());
    let raw = PathBuf::from(daemon.vmdisk_ok(&["path", "--raw", &image]).trim());
    let want = std::fs::read(guest_bytes(&disk)).unwrap();
    let memory = PathBuf::from("/sys/fs/cgroup/memory").join(&cgroup);
    let read_number = |name: &str| -> u64 {
        let text = std::fs::read_to_string(memory.join(name)).unwrap();
        text.split_whitespace()
            .skip_while(|w| *w != "oom_kill")
            .nth(1)
            .unwrap_or(text.trim())
            .parse()
            .unwrap()
    };
    let server = daemon.server_pids()[0];
    assert!(
        std::fs::read_to_string(memory.join("cgroup.procs"))
            .unwrap()
            .contains(&server.to_string()),
        "the server is in the servers' cgroup"
    );
    // Room for a few more pages than the server holds now: fetching the disk needs more.
    let usage = read_number("memory.usage_in_bytes");
    std::fs::write(
        memory.join("memory.limit_in_bytes"),
        (usage + (1 << 20)).to_string(),
    )
    .unwrap();
    let saw = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            // The disk's random data, from 512 MiB on, in order, compared with the disk.
            let want = want[512 << 20..576 << 20].to_vec();
            let mut saw = ReaderSaw::default();
            let file = std::fs::File::open(&raw).unwrap();
            let mut buf = vec![0u8; 1 << 20];
            for (n, piece) in want.chunks(1 << 20).enumerate() {
                use std::os::unix::fs::FileExt;
                let started = Instant::now();
                let read = file.read_at(&mut buf, (512 << 20) + ((n as u64) << 20));
                saw.longest = saw.longest.max(started.elapsed());
                saw.reads += 1;
                match read {
                    Err(_) => saw.errors += 1,
                    Ok(got) if buf[..got] != *piece => saw.wrong_or_short += 1,
                    Ok(_) => {}
                }
            }
            saw
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        while read_number("memory.oom_control") == 0 {
            assert!(
                Instant::now() < deadline && !reader.is_finished(),
                "no OOM kill under a limit of {} bytes",
                usage + (1 << 20)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        std::fs::write(memory.join("memory.limit_in_bytes"), "-1").unwrap();
        reader.join().unwrap()
    });
    eprintln!("across an OOM kill the reader saw {saw:?}");
    assert_eq!(
        (saw.reads, saw.errors, saw.wrong_or_short),
        (64, 0, 0),
        "{saw:?}"
    );
    assert_ne!(daemon.server_pids(), [server], "a successor serves");
    drop(daemon);
    let _ = std::fs::remove_dir(&memory);
}
