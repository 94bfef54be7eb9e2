//! A node's bad days through `vmdisk mount` (real registry, real FUSE): a damaged cache file,
//! a registry gone after the mount, a full cache disk, a stop in the middle of fetches.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::fixtures::harness::*;
use crate::fixtures::images::{assert_same_range, random_raw_image, rng};

const CHUNK: u64 = 256 << 10;

/// The one layer directory of a cache.
fn layer_dir(cache: &Path) -> PathBuf {
    std::fs::read_dir(cache.join("layers"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path()
}

/// Flips one byte at each of `offsets` of `file`.
fn flip(file: &Path, offsets: &[u64]) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    for &at in offsets {
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).unwrap();
        b[0] ^= 0x5a;
        f.write_all_at(&b, at).unwrap();
    }
    f.sync_all().unwrap();
}

/// Reads the first `chunks` chunks of `mounted` in a scattered order, without the kernel's
/// read-ahead, and compares each with `original`: nothing but those chunks is fetched.
fn read_chunks_randomly(mounted: &Path, original: &std::fs::File, chunks: u64) {
    let f = std::fs::File::open(mounted).unwrap();
    let advised =
        nix::fcntl::posix_fadvise(&f, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_RANDOM);
    assert!(advised.is_ok(), "{advised:?}");
    for i in 0..chunks {
        let at = (i * 7 % chunks) * CHUNK;
        assert_same_range(&f, original, at, CHUNK as usize);
    }
}

fn counter(stats: &serde_json::Value, name: &str) -> u64 {
    stats[name]
        .as_u64()
        .unwrap_or_else(|| panic!("no {name} in {stats}"))
}

/// Bytes flipped in the cache's data file, with the mount stopped, never reach a reader: in
/// chunks cached by reads (the layer incomplete), and in a complete layer verified against
/// its diff_id (where the file would otherwise be handed to the kernel with passthrough).
/// Each damaged chunk is found when it is first read back, fetched again, counted.
#[test]
fn bytes_flipped_in_the_cache_are_never_served() {
    let scratch = Scratch::new();
    let (_reg, disk, reference) = random_raw_image(&scratch, 32 << 20, 21, "vm/damaged:1");
    let original = std::fs::File::open(&disk).unwrap();
    let (cache, mnt) = (scratch.path("cache"), scratch.path("mnt"));

    // 8 MiB cached by reads, then the mount stops cleanly.
    let mount = Mount::start(&reference, &cache, &mnt, &["--no-passthrough"]);
    read_chunks_randomly(&mount.disk, &original, 32);
    mount.stop();
    let data = layer_dir(&cache).join("data/0");
    flip(
        &data,
        &[100, 3 * CHUNK + 7, 9 * CHUNK + 4000, 31 * CHUNK + CHUNK - 1],
    );

    let mount = Mount::start(&reference, &cache, &mnt, &["--no-passthrough"]);
    read_chunks_randomly(&mount.disk, &original, 32);
    let stats = mount.stop();
    eprintln!("incomplete layer, 4 bytes flipped: {stats}");
    assert_eq!(counter(&stats, "cache_damaged"), 4, "{stats}");
    assert_eq!(
        counter(&stats, "chunks_fetched"),
        4,
        "only the damaged chunks: {stats}"
    );
    assert_eq!(counter(&stats, "read_errors"), 0, "{stats}");

    // The whole layer, checked against its diff_id; then two bytes flipped.
    let mut mount = Mount::start(&reference, &cache, &mnt, &["--hydrate", "eager"]);
    let hydrated = mount.wait_for("hydrated", Duration::from_secs(60));
    assert!(hydrated.contains("integrity verified"), "{hydrated}");
    mount.stop();
    flip(&data, &[10 * CHUNK + 5, 100 * CHUNK + 77]);
    drop_caches();

    // Opened at once (before the background check) and again after it: the bytes are the
    // published ones both times, and once the damaged chunks are fetched again the file is
    // handed to the kernel.
    let mut mount = Mount::start(&reference, &cache, &mnt, &[]);
    assert!(files_identical(&mount.disk, &disk), "the first full read");
    mount.wait_for("checked: ", Duration::from_secs(30));
    drop_caches();
    assert!(
        files_identical(&mount.disk, &disk),
        "the read after the check"
    );
    let stats = mount.stop();
    eprintln!("complete, verified layer, 2 bytes flipped: {stats}");
    assert_eq!(counter(&stats, "cache_damaged"), 2, "{stats}");
    assert_eq!(counter(&stats, "chunks_fetched"), 2, "{stats}");
    assert!(counter(&stats, "passthrough_opens") >= 1, "{stats}");
    assert_eq!(counter(&stats, "read_errors"), 0, "{stats}");
}

/// Bytes changed in a complete, verified layer's data file while it is mounted and handed to
/// the kernel (FUSE passthrough) never reach a new open: the open is served by the daemon,
/// which notices the change, checks the chunks again and fetches the changed ones; the verified
/// bytes are written back into the data file (what an open held across the change reads), and
/// later opens go to passthrough again.
#[test]
fn bytes_changed_under_a_passthrough_mount_never_reach_a_new_open() {
    let scratch = Scratch::new();
    let (_reg, disk, reference) = random_raw_image(&scratch, 32 << 20, 22, "vm/changed:1");
    let (cache, mnt) = (scratch.path("cache"), scratch.path("mnt"));
    let mut mount = Mount::start(&reference, &cache, &mnt, &["--hydrate", "eager"]);
    let hydrated = mount.wait_for("hydrated", Duration::from_secs(60));
    assert!(hydrated.contains("integrity verified"), "{hydrated}");
    assert!(
        files_identical(&mount.disk, &disk),
        "read through passthrough"
    );

    let data = layer_dir(&cache).join("data/0");
    let changed = [5 * CHUNK + 11, 77 * CHUNK + 4000];
    flip(&data, &changed);
    assert!(
        files_identical(&mount.disk, &disk),
        "a new open after the change reads the published bytes"
    );

    let (original, data) = (
        std::fs::File::open(&disk).unwrap(),
        std::fs::File::open(&data).unwrap(),
    );
    let mended = || {
        changed.iter().all(|&at| {
            let (mut want, mut got) = ([0u8; 1], [0u8; 1]);
            original.read_exact_at(&mut want, at).unwrap();
            data.read_exact_at(&mut got, at).unwrap();
            want == got
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !mended() {
        assert!(
            Instant::now() < deadline,
            "the changed bytes were not written back into the data file"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop_caches();
    assert!(
        files_identical(&mount.disk, &disk),
        "an open after the repair"
    );
    let stats = mount.stop();
    eprintln!("complete layer, 2 bytes changed under a passthrough mount: {stats}");
    assert_eq!(counter(&stats, "cache_damaged"), 2, "{stats}");
    assert_eq!(counter(&stats, "read_errors"), 0, "{stats}");
    assert!(
        counter(&stats, "passthrough_opens") >= 2,
        "passthrough before the change and after the repair: {stats}"
    );
}

/// With the registry gone, a buffered read of a chunk nobody cached fails with EIO within
/// `--fetch-timeout` (the kernel reads the page again at once after its read-ahead failed:
/// that second read must not wait as long again).
#[test]
fn a_read_with_the_registry_gone_ends_within_the_fetch_timeout() {
    let scratch = Scratch::new();
    let (reg, _disk, reference) = random_raw_image(&scratch, 16 << 20, 22, "vm/gone:1");
    let mount = Mount::start(
        &reference,
        &scratch.path("cache"),
        &scratch.path("mnt"),
        &["--fetch-timeout", "4"],
    );
    drop(reg);
    let mounted = std::fs::File::open(&mount.disk).unwrap();
    let started = Instant::now();
    let mut buf = vec![0u8; 64 << 10];
    let read = mounted.read_at(&mut buf, 5 << 20);
    let took = started.elapsed();
    eprintln!("read with the registry gone: {read:?} after {took:?}");
    assert_eq!(
        read.map_err(|e| e.raw_os_error()),
        Err(Some(libc::EIO)),
        "the read fails with EIO"
    );
    // 4 s and the tries' own time (a refused connection is instant), with room for a busy
    // machine; twice the deadline (the kernel's second read waiting again) is 8 s.
    assert!(
        took < Duration::from_secs(6),
        "the read ended after {took:?}, more than --fetch-timeout 4 s and one try"
    );
    drop(mounted);
    let stats = mount.stop();
    assert!(counter(&stats, "read_errors") >= 1, "{stats}");
}

/// The cache on a 64 MiB file system and a 192 MiB disk read in order, 1 MiB at a time: every
/// read is answered with the published bytes (chunks the disk has no room for are answered
/// from memory), and no chunk is fetched over and over.
#[test]
fn a_full_cache_disk_still_answers_every_read_with_the_right_bytes() {
    let scratch = Scratch::new();
    let size: u64 = 192 << 20;
    let (_reg, disk, reference) = random_raw_image(&scratch, size, 23, "vm/full:1");
    let cache = scratch.path("cache");
    let _fs = Tmpfs::mount(&cache, "64m");

    let mount = Mount::start(&reference, &cache, &scratch.path("mnt"), &[]);
    let mounted = std::fs::File::open(&mount.disk).unwrap();
    let original = std::fs::File::open(&disk).unwrap();
    let mib = 1u64 << 20;
    for i in 0..size / mib {
        assert_same_range(&mounted, &original, i * mib, mib as usize);
    }
    drop(mounted);
    let stats = mount.stop();
    eprintln!("192 MiB read with a 64 MiB cache: {stats}");
    assert_eq!(counter(&stats, "read_errors"), 0, "{stats}");
    let chunks = size / CHUNK;
    assert!(
        counter(&stats, "chunks_fetched") <= chunks + chunks / 10,
        "each chunk fetched about once: {stats}"
    );
}

/// Two disks served by the daemon (a mount server each) on a cache file system with no room:
/// what both hold in memory together stays within the node's `memory_budget` and one read
/// burst each (before, each server held up to 96 MiB of its own), every read is answered with
/// the published bytes, and `vmdisk ls` says how much each holds.
#[test]
fn disks_on_a_full_cache_share_one_memory_budget() {
    let scratch = Scratch::new();
    let size: u64 = 48 << 20;
    let reg = crate::fixtures::harness::Registry::start(&scratch);
    let disks: Vec<(PathBuf, String)> = (0..2u64)
        .map(|i| {
            let disk = scratch.path(&format!("d{i}.raw"));
            random_file(&disk, size, 40 + i);
            let reference =
                crate::fixtures::images::push_raw(&reg.host(), &format!("vm/full{i}:1"), &disk);
            (disk, reference)
        })
        .collect();
    let cache = scratch.path("cache");
    let _fs = Tmpfs::mount(&cache, "8m");
    let budget: u64 = 24 << 20;
    let daemon = crate::fixtures::cri::Daemon::start(
        &scratch,
        &format!(
            "[cache]\ndir = \"{}\"\nhydrate = \"off\"\nmemory_budget = \"24M\"\n",
            cache.display()
        ),
    );
    let paths: Vec<String> = disks
        .iter()
        .map(|(_, reference)| daemon.vmdisk_ok(&["path", reference]).trim().to_string())
        .collect();
    let held = || -> Vec<u64> {
        let ls: serde_json::Value =
            serde_json::from_str(&daemon.vmdisk_ok(&["ls", "--json"])).unwrap();
        ls.as_array()
            .unwrap()
            .iter()
            .map(|d| d["memory_held"].as_u64().unwrap())
            .collect()
    };
    let mib = 1u64 << 20;
    let mut most = 0;
    // Both disks read at once, 1 MiB at a time, in turns.
    let files: Vec<(std::fs::File, std::fs::File)> = disks
        .iter()
        .zip(&paths)
        .map(|((disk, _), path)| {
            (
                std::fs::File::open(path).unwrap(),
                std::fs::File::open(disk).unwrap(),
            )
        })
        .collect();
    for i in 0..size / mib {
        for (mounted, original) in &files {
            assert_same_range(mounted, original, i * mib, mib as usize);
        }
        if i % 8 == 7 {
            most = most.max(held().iter().sum::<u64>());
        }
    }
    let burst = vmdisk::cache::memory::READ_BURST;
    eprintln!("two 48 MiB disks on an 8 MiB cache: at most {most} bytes held in memory together (budget {budget})");
    assert!(
        most > 0,
        "the cache had no room: chunks were held in memory"
    );
    assert!(
        most <= budget + 2 * burst,
        "{most} bytes held, budget {budget} and a read burst each"
    );
    assert!(daemon.vmdisk_ok(&["ls"]).contains("bytes held"));
}

/// SIGTERM right after reads, while read-ahead and hydration fetches are still running (chunks
/// being decoded and written): the mount ends without a panic, every time.
#[test]
fn stopping_during_fetches_never_panics() {
    let scratch = Scratch::new();
    let (_reg, _disk, reference) = random_raw_image(&scratch, 64 << 20, 24, "vm/stop:1");
    let mnt = scratch.path("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let mut next = rng(24);
    for round in 0..20 {
        let cache = scratch.path(&format!("cache{round}"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_vmdisk"))
            .arg("mount")
            .args(["--hydrate", "eager", "--cache"])
            .arg(&cache)
            .arg(&reference)
            .arg(&mnt)
            .env("VMDISK_LOG", "warn")
            .env("HOME", "/nonexistent")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
        let ready = lines
            .find_map(|l| l.ok().filter(|l| l.starts_with("ready: ")))
            .expect("the mount becomes ready");
        let path = disk_of_ready_line(&ready);
        // A sequential reader starts read-ahead; it stops and closes, then the signal.
        {
            let f = std::fs::File::open(&path).unwrap();
            let mut buf = vec![0u8; 1 << 20];
            let start = (next() % 32) << 20;
            for i in 0..6 {
                f.read_exact_at(&mut buf, start + i * (1 << 20)).unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(next() % 200));
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("panicked"),
            "round {round}: the mount panicked on SIGTERM: {stderr}"
        );
        assert!(
            out.status.success(),
            "round {round}: {}: {stderr}",
            out.status
        );
        let _ = Command::new("umount").arg("-l").arg(&mnt).status();
    }
}

/// 20 crashes (SIGKILL: the process and its FUSE mount gone, as in a node's reboot) at random
/// moments of a hydration, each followed by a new mount on the same cache: no wrong byte is
/// ever served or kept, and the last mount completes the disk from what survived.
#[test]
fn crashes_during_hydration_never_leave_a_wrong_byte() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    // A registry about 12 MB/s away: a hydration takes seconds, and crashes land inside it.
    let proxy = FaultProxy::start_with(
        reg.port,
        Faults {
            response_delay: Some(Duration::from_millis(5)),
            ..Faults::default()
        },
    );
    let disk = scratch.path("d.raw");
    random_file(&disk, 64 << 20, 25);
    let reference = crate::fixtures::images::push_raw(&proxy.host(), "vm/crash20:1", &disk);
    let original = std::fs::File::open(&disk).unwrap();
    let (cache, mnt) = (scratch.path("cache"), scratch.path("mnt"));
    let mut next = rng(25);
    for _ in 0..20 {
        let mount = Mount::start(&reference, &cache, &mnt, &["--hydrate", "eager"]);
        // A read of what may or may not have survived the last crash.
        let f = std::fs::File::open(&mount.disk).unwrap();
        let at = (next() % 255) * CHUNK;
        assert_same_range(&f, &original, at, CHUNK as usize);
        drop(f);
        std::thread::sleep(Duration::from_millis(200 + next() % 1600));
        mount.kill();
    }
    let mut mount = Mount::start(&reference, &cache, &mnt, &["--hydrate", "eager"]);
    let hydrated = mount.wait_for("hydrated", Duration::from_secs(60));
    assert!(hydrated.contains("integrity verified"), "{hydrated}");
    assert!(
        files_identical(&mount.disk, &disk),
        "the disk after 20 crashes"
    );
    let stats = mount.stop();
    eprintln!("after 20 crashes: {stats}");
    assert_eq!(counter(&stats, "cache_damaged"), 0, "{stats}");
    assert_eq!(counter(&stats, "read_errors"), 0, "{stats}");
    assert!(
        counter(&stats, "chunks_fetched") < 256,
        "what the crashed mounts made durable was kept: {stats}"
    );
}

/// With the daemon's default settings a disk stops depending on the registry soon after it was
/// read: `vmdisk ls` says it needs the registry (and since when) until background hydration
/// has fetched the rest, then a registry outage costs its readers nothing.
#[test]
fn by_default_a_disk_outlives_its_registry_soon_after_its_boot() {
    let scratch = Scratch::new();
    let (reg, disk, reference) = random_raw_image(&scratch, 32 << 20, 26, "vm/outlive:1");
    let daemon = crate::fixtures::cri::Daemon::start(&scratch, "");
    let path = daemon.vmdisk_ok(&["path", &reference]);
    let original = std::fs::File::open(&disk).unwrap();
    // A "boot": a few scattered reads.
    let mounted = std::fs::File::open(path.trim()).unwrap();
    for at in [0, 7 << 20, 19 << 20] {
        assert_same_range(&mounted, &original, at, 64 << 10);
    }
    let needed = |daemon: &crate::fixtures::cri::Daemon| -> i64 {
        let ls: serde_json::Value =
            serde_json::from_str(&daemon.vmdisk_ok(&["ls", "--json"])).unwrap();
        ls[0]["registry_needed_since"].as_i64().unwrap()
    };
    let since = needed(&daemon);
    assert!(
        since > 1_700_000_000,
        "the disk needs the registry since it was served: {since}"
    );
    assert!(daemon
        .vmdisk_ok(&["ls"])
        .contains("needs the registry since"));
    let deadline = Instant::now() + Duration::from_secs(60);
    while needed(&daemon) != 0 {
        assert!(
            Instant::now() < deadline,
            "the disk was not hydrated within 60 s"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    drop(reg);
    drop(mounted);
    assert!(
        files_identical(Path::new(path.trim()), &disk),
        "the whole disk reads right with the registry gone"
    );
}

/// The raw view of a qcow2 (what Kata boots, `vmdisk path --raw`) from a complete, verified
/// layer whose cached chunks were damaged while no server ran: a new server serves the
/// published bytes, fetching the damaged chunks again.
#[test]
fn bytes_flipped_in_the_cache_never_reach_the_raw_view() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let qcow2 = scratch.path("d.qcow2");
    make_qcow2(&qcow2, "64M", &[]);
    write_random(&qcow2, 1 << 20, 24 << 20, 27);
    let raw = scratch.path("expected.raw");
    qemu_img_raw(&qcow2, &raw);
    let reference = format!("{}/vm/rawdamage:1", reg.host());
    vmdisk_ok(&["push", qcow2.to_str().unwrap(), &reference]);
    let mut daemon = crate::fixtures::cri::Daemon::start(&scratch, "[cache]\nhydrate = \"off\"\n");
    let out = daemon.vmdisk_ok(&["prefetch", "--wait", &reference]);
    assert!(out.contains("chunks cached"), "{out}");
    let path = daemon.vmdisk_ok(&["path", "--raw", &reference]);
    assert!(files_identical(Path::new(path.trim()), &raw));

    // The daemon and the server go (as in a node's reboot: no one keeps the mount's
    // connection, the next server mounts anew), once the server's flusher made every chunk
    // durable (each second); the data file is damaged meanwhile.
    std::thread::sleep(Duration::from_millis(1500));
    let pid = daemon.disks()[0].server_pid;
    daemon.kill();
    crate::fixtures::cri::run_quiet("kill", &["-KILL", &pid.to_string()]);
    std::thread::sleep(Duration::from_millis(300));
    let data = layer_dir(&daemon.root.join("cache")).join("data/0");
    flip(&data, &[70_000, 5 << 20, (20 << 20) + 3]);
    drop_caches();
    daemon.restart();

    let path = daemon.vmdisk_ok(&["path", "--raw", &reference]);
    assert!(
        files_identical(Path::new(path.trim()), &raw),
        "the raw view serves the published bytes"
    );
    let disks = daemon.disks();
    assert_ne!(disks[0].server_pid, pid, "a new server");
    assert_eq!(disks[0].integrity, "verified");
    let damaged: u64 = std::fs::read_dir(daemon.root.join("control"))
        .unwrap()
        .flatten()
        .filter_map(|s| {
            crate::fixtures::cri::rt()
                .block_on(vmdisk::snapshotter::servers::control::status(&s.path()))
                .ok()
        })
        .filter_map(|st| st.counters.map(|c| c.cache_damaged))
        .sum();
    assert_eq!(
        damaged, 3,
        "each damaged chunk found once, by the new server"
    );
}
