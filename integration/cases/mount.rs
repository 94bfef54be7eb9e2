//! The lazy disk engine through `vmdisk mount`: real registry, real FUSE, qemu tools.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use crate::fixtures::harness::*;
use crate::fixtures::images::{assert_same_range, push_raw, random_raw_image, rng};

#[test]
fn mounted_qcow2_equals_the_original_under_qemu_img_and_random_reads() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("d.qcow2");
    scattered_qcow2(&disk);
    let reference = format!("{}/vm/mount:1", reg.host());
    vmdisk_ok(&["push", disk.to_str().unwrap(), &reference]);

    let mount = Mount::start(
        &reference,
        &scratch.path("cache"),
        &scratch.path("mnt"),
        &[],
    );
    assert_eq!(mount.disk, scratch.path("mnt/disk/d.qcow2"));
    let cmp = run(
        "qemu-img",
        &[
            "compare",
            mount.disk.to_str().unwrap(),
            disk.to_str().unwrap(),
        ],
    );
    assert!(String::from_utf8_lossy(&cmp).contains("identical"));
    run("qemu-img", &["check", mount.disk.to_str().unwrap()]);

    drop_caches();
    let mounted = std::fs::File::open(&mount.disk).unwrap();
    let original = std::fs::File::open(&disk).unwrap();
    let size = original.metadata().unwrap().len();
    assert_eq!(mounted.metadata().unwrap().len(), size);
    let mut next = rng(42);
    for i in 0..3000 {
        let len = match i % 4 {
            0 => (next() % 512 + 1) as usize,         // small, unaligned
            1 => (next() % (600 << 10) + 1) as usize, // straddling chunks
            2 => 4096,
            _ => (next() % (4 << 20) + 1) as usize, // large
        };
        let offset = if i % 50 == 0 {
            size - (next() % 4096)
        } else {
            next() % size
        };
        assert_same_range(&mounted, &original, offset, len);
    }
    assert_same_range(&mounted, &original, size, 100); // at EOF: nothing
    drop(mounted);
    let stats = mount.stop();
    assert_eq!(stats["read_errors"], 0, "{stats}");
    assert_eq!(stats["verify_failures"], 0, "{stats}");
}

#[test]
fn random_reads_of_one_percent_fetch_at_most_1_3_times_what_they_read_and_offline_remount_serves_them(
) {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("big.raw");
    let size: u64 = 2 << 30;
    random_file(&disk, size, 9);
    let proxy = FaultProxy::counting(reg.port);
    let reference = push_raw(&proxy.host(), "vm/big:1", &disk);
    let pushed = proxy.bytes_to_client();

    let cache = scratch.path("cache");
    let mount = Mount::start(
        &reference,
        &cache,
        &scratch.path("mnt"),
        &["--fetch-timeout", "3"],
    );
    // A buffered reader that gives no hint (a guest's page cache through qemu's
    // cache=writeback): the kernel's read-ahead would pull in up to a chunk more past each
    // read (1.485x here before the view was opened for direct I/O while not whole).
    let mounted = std::fs::File::open(&mount.disk).unwrap();
    let original = std::fs::File::open(&disk).unwrap();
    let mut next = rng(7);
    // 1 MiB reads at page-aligned (not chunk-aligned) random offsets: none may look like a
    // stream to the engine's read-ahead.
    let read_len = 1 << 20;
    let reads = (size / 100).div_ceil(read_len as u64);
    let mut offsets = Vec::new();
    for _ in 0..reads {
        let offset = next() % (size - read_len as u64) / 4096 * 4096;
        assert_same_range(&mounted, &original, offset, read_len);
        offsets.push(offset);
    }
    drop(mounted);
    let stats = mount.stop();
    // Everything from the registry counts: manifest, config, TOC and chunks.
    let fetched = proxy.bytes_to_client() - pushed;
    let read = reads * read_len as u64;
    let ratio = fetched as f64 / read as f64;
    eprintln!("reading {read} bytes (1%) of a {size}-byte disk in 1 MiB random reads: {fetched} bytes from the registry ({ratio:.3}x), {} range requests", stats["fetch_requests"]);
    // A 1 MiB read at an unaligned offset touches five 256 KiB chunks: 1.25x is the floor.
    assert!(ratio <= 1.3, "fetched {ratio:.3}x what was read");

    // The registry goes away; everything read before is served from the cache alone.
    drop(proxy);
    drop(reg);
    let mount = Mount::start(
        &reference,
        &cache,
        &scratch.path("mnt"),
        &["--fetch-timeout", "2"],
    );
    let mounted = std::fs::File::open(&mount.disk).unwrap();
    for &offset in &offsets {
        assert_same_range(&mounted, &original, offset, read_len);
    }
    // Never-fetched data cannot be served: EIO, not zeros.
    // (The first chunk is always fetched at mount, to recognise qcow2.)
    let untouched = (1..size / (1 << 20))
        .map(|mb| mb << 20)
        .find(|o| {
            offsets
                .iter()
                .all(|&r| r + (1 << 20) < *o || *o + (2 << 20) < r)
        })
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let err = mounted.read_at(&mut buf, untouched).unwrap_err();
    assert_eq!(
        err.raw_os_error(),
        Some(5),
        "EIO for data that is not cached: {err}"
    );
    drop(mounted);
    let stats = mount.stop();
    assert_eq!(stats["bytes_fetched"], 0, "offline: {stats}");
    assert!(stats["read_errors"].as_u64().unwrap() >= 1);
}

/// A link that flips, truncates, resets or 503s 12% of responses: 20 fresh mounts of a good
/// image each become ready (a manifest, config or TOC hit by a fault is fetched again under the
/// one retry policy, like a chunk), and 300 random reads through them give only the published
/// bytes. What the faulty link left in a cache is sound.
#[test]
fn transient_faults_never_fail_a_mount_and_never_yield_wrong_bytes() {
    let scratch = Scratch::new();
    let (reg, disk, reference) = random_raw_image(&scratch, 96 << 20, 3, "vm/faults:1");
    let original = std::fs::File::open(&disk).unwrap();
    let size = original.metadata().unwrap().len();
    let proxy = FaultProxy::start_with(
        reg.port,
        Faults {
            mixed_response_rate: 0.12,
            seed: 1,
            ..Faults::default()
        },
    );
    let faulty_ref = format!("{}/vm/faults:1", proxy.host());
    let (mut good, mut eio) = (0, 0);
    let mut next = rng(1);
    for i in 0..20 {
        // A fresh cache each time: the mount resolves everything through the faulty link.
        let cache = scratch.path(&format!("cache-{i}"));
        let mount = Mount::start(
            &faulty_ref,
            &cache,
            &scratch.path("mnt"),
            &["--fetch-timeout", "10"],
        );
        let mounted = std::fs::File::open(&mount.disk).unwrap();
        for _ in 0..15 {
            let offset = next() % size;
            let len = (next() % (256 << 10) + 1) as usize;
            let mut a = vec![0u8; len];
            match mounted.read_at(&mut a, offset) {
                Ok(n) => {
                    let mut b = vec![0u8; n];
                    original.read_exact_at(&mut b, offset).unwrap();
                    assert!(a[..n] == b[..], "wrong bytes at {offset}+{n} (mount {i})");
                    good += 1;
                }
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(5), "only EIO may fail a read: {e}");
                    eio += 1;
                }
            }
        }
        drop(mounted);
        mount.stop();
    }
    let kinds: Vec<u64> = proxy
        .mixed
        .iter()
        .map(|c| c.load(std::sync::atomic::Ordering::SeqCst))
        .collect();
    eprintln!(
        "20 mounts through the faulty link: {good} reads correct, {eio} EIO; responses, flips, truncations, resets, 503s: {kinds:?}"
    );
    assert!(
        kinds[1..].iter().all(|&k| k > 0),
        "every kind of fault was injected: {kinds:?}"
    );
    assert!(eio <= 3, "reads retry through transient faults: {eio} EIO");

    // What the faulty runs cached is sound: read everything again straight from the registry.
    let mount = Mount::start(
        &reference,
        &scratch.path("cache-19"),
        &scratch.path("mnt"),
        &[],
    );
    assert!(
        files_identical(&mount.disk, &disk),
        "the cache holds only verified bytes"
    );
    mount.stop();
}

#[test]
fn a_second_image_sharing_chunks_fetches_only_the_difference() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let v1 = scratch.path("v1.raw");
    random_file(&v1, 64 << 20, 5);
    let v2 = scratch.path("v2.raw");
    std::fs::copy(&v1, &v2).unwrap();
    // Change three 256 KiB-aligned regions: 3 chunks (one spans two) differ.
    let f = std::fs::OpenOptions::new().write(true).open(&v2).unwrap();
    for (offset, len) in [
        (1u64 << 20, 4096usize),
        (20 << 20, 100_000),
        ((40 << 20) + (200 << 10), 100 << 10),
    ] {
        f.write_all_at(&vec![0x5a; len], offset).unwrap();
    }
    drop(f);
    let proxy = FaultProxy::counting(reg.port);
    let r1 = push_raw(&proxy.host(), "vm/v:1", &v1);
    let r2 = push_raw(&proxy.host(), "vm/v:2", &v2);
    let cache = scratch.path("cache");

    let mount = Mount::start(&r1, &cache, &scratch.path("mnt"), &["--hydrate", "eager"]);
    let mut mount = mount;
    mount.wait_for("hydrated", Duration::from_secs(120));
    mount.stop();

    let before = proxy.bytes_to_client();
    let mut mount = Mount::start(&r2, &cache, &scratch.path("mnt"), &["--hydrate", "eager"]);
    mount.wait_for("hydrated", Duration::from_secs(120));
    assert!(files_identical(&mount.disk, &v2));
    let stats = mount.stop();
    let fetched_chunks = stats["chunks_fetched"].as_u64().unwrap();
    let network = proxy.bytes_to_client() - before;
    eprintln!("second image: {fetched_chunks} chunks fetched, {} deduplicated, {network} bytes from the registry (TOC included)", stats["chunks_deduplicated"]);
    assert_eq!(fetched_chunks, 4, "only the changed chunks: {stats}");
    assert_eq!(stats["chunks_deduplicated"].as_u64().unwrap(), 256 - 4);
    assert!(
        network < 2 << 20,
        "{network} bytes for a 4-chunk difference"
    );
}

/// A background hydration whose fetches fail (the registry stops answering for longer than a
/// hydration's fetch may take: 6 fetch deadlines) pauses and goes on once the registry answers
/// again, 10 to 20 s later. Before, the first failed pass ended it for the mount's life: a
/// fleet of nodes hydrating over a congested link stopped hydrating.
#[test]
fn a_background_hydration_that_fails_goes_on_when_the_registry_answers_again() {
    let scratch = Scratch::new();
    let (registry, disk, reference) = random_raw_image(&scratch, 16 << 20, 9, "vm/paused:1");
    let mut mount = Mount::start(
        &reference,
        &scratch.path("cache"),
        &scratch.path("mnt"),
        &["--hydrate", "background", "--fetch-timeout", "1"],
    );
    // Hydration starts once readers have rested 5 s; its first fetch fails 6 s later.
    registry.pause();
    std::thread::sleep(Duration::from_secs(14));
    registry.resume();
    mount.wait_for("hydrated", Duration::from_secs(60));
    assert!(files_identical(&mount.disk, &disk), "the disk as published");
}

#[test]
fn kill_during_hydration_refetches_nothing_marked_present() {
    let scratch = Scratch::new();
    let (_reg, disk, reference) = random_raw_image(&scratch, 128 << 20, 8, "vm/crash:1");
    let cache = scratch.path("cache");

    let mount = Mount::start(
        &reference,
        &cache,
        &scratch.path("mnt"),
        &["--hydrate", "background", "--hydrate-rate", "30"],
    );
    // Background hydration starts once readers have rested 5 s (none read here).
    std::thread::sleep(Duration::from_millis(7500));
    mount.kill();

    // What the crashed process made durable.
    let layer_dir = std::fs::read_dir(cache.join("layers"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let bitmap = std::fs::read(layer_dir.join("bitmap")).unwrap();
    let total = 512u64;
    assert_eq!(u64::from_le_bytes(bitmap[8..16].try_into().unwrap()), total);
    let durable: u64 = bitmap[16..].iter().map(|b| u64::from(b.count_ones())).sum();
    eprintln!("{durable} of {total} chunks were durable when the mount was killed");
    assert!(
        durable > 0 && durable < total,
        "the kill landed mid-hydration ({durable})"
    );

    let mut mount = Mount::start(
        &reference,
        &cache,
        &scratch.path("mnt"),
        &["--hydrate", "eager"],
    );
    mount.wait_for("hydrated", Duration::from_secs(120));
    assert!(
        files_identical(&mount.disk, &disk),
        "nothing served is corrupt"
    );
    let stats = mount.stop();
    assert_eq!(
        stats["chunks_fetched"].as_u64().unwrap(),
        total - durable,
        "only what was not durable is fetched again: {stats}"
    );
}

#[test]
fn a_sequential_read_fetches_each_chunk_once_in_few_large_requests() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("seq.raw");
    let size: u64 = 256 << 20;
    random_file(&disk, size, 11);
    let proxy = FaultProxy::counting(reg.port);
    let reference = push_raw(&proxy.host(), "vm/seq:1", &disk);
    let pushed = proxy.bytes_to_client();
    let mount = Mount::start(
        &reference,
        &scratch.path("cache"),
        &scratch.path("mnt"),
        &[],
    );
    dd_read(&mount.disk, "4M");
    let stats = mount.stop();
    let chunks = size / (256 << 10);
    let requests = stats["fetch_requests"].as_u64().unwrap();
    let fetched = proxy.bytes_to_client() - pushed;
    eprintln!("sequential read of {size} bytes: {requests} range requests for {chunks} chunks, {fetched} bytes from the registry");
    assert_eq!(stats["chunks_fetched"].as_u64().unwrap(), chunks, "{stats}");
    // Random data does not compress: the chunks' frames are about the file's size, and
    // nothing is fetched twice or past the end.
    assert!(
        fetched < size + size / 50,
        "{fetched} bytes for a {size}-byte file"
    );
    // Read-ahead cuts the stream into requests of up to 4 MiB (16 chunks); only the first
    // 4 MiB, before the reader counts as a stream, go chunk by chunk.
    assert!(
        requests <= chunks / 6,
        "{requests} requests for {chunks} chunks"
    );
}

#[test]
fn complete_files_are_read_through_passthrough() {
    let scratch = Scratch::new();
    let (_reg, disk, reference) = random_raw_image(&scratch, 32 << 20, 4, "vm/pt:1");
    let cache = scratch.path("cache");

    // Without passthrough every read of the cached file reaches the daemon.
    let mut mount = Mount::start(
        &reference,
        &cache,
        &scratch.path("mnt"),
        &["--hydrate", "eager", "--no-passthrough"],
    );
    mount.wait_for("hydrated", Duration::from_secs(60));
    drop_caches();
    assert!(files_identical(&mount.disk, &disk));
    let without = mount.stop();
    assert!(without["read_calls"].as_u64().unwrap() > 0, "{without}");
    assert_eq!(without["passthrough_opens"], 0);

    // With passthrough, the kernel reads the cache file directly: no read reaches the daemon,
    // once this process has checked what an earlier one cached.
    let mut mount = Mount::start(&reference, &cache, &scratch.path("mnt"), &[]);
    mount.wait_for("checked: ", Duration::from_secs(30));
    drop_caches();
    assert!(files_identical(&mount.disk, &disk));
    let with = mount.stop();
    eprintln!(
        "daemon read calls for a full read: {} without passthrough, {} with",
        without["read_calls"], with["read_calls"]
    );
    assert!(with["passthrough_opens"].as_u64().unwrap() >= 1, "{with}");
    assert_eq!(with["read_calls"], 0, "{with}");
}

/// Reads one 4 KiB page with O_DIRECT through `dd`, so the kernel neither caches nor merges it.
fn direct_read_page(path: &Path, page: u64) -> std::process::Child {
    std::process::Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args([
            "of=/dev/null",
            "bs=4096",
            "count=1",
            "iflag=direct",
            "status=none",
            &format!("skip={page}"),
        ])
        .spawn()
        .unwrap()
}

#[test]
fn concurrent_reads_of_a_missing_chunk_fetch_it_once() {
    let scratch = Scratch::new();
    let (_reg, _disk, reference) = random_raw_image(&scratch, 16 << 20, 12, "vm/concurrent:1");
    let mount = Mount::start(
        &reference,
        &scratch.path("cache"),
        &scratch.path("mnt"),
        &[],
    );
    // Chunk 0 first, so that the count below is of the concurrent readers' chunks alone.
    assert!(direct_read_page(&mount.disk, 0).wait().unwrap().success());
    // 32 readers, 8 different pages in each of chunks 4..8 (1 MiB..2 MiB), all at once.
    let readers: Vec<_> = (0..32u64)
        .map(|i| direct_read_page(&mount.disk, 256 + (i % 4) * 64 + (i / 4) * 8))
        .collect();
    for mut r in readers {
        assert!(r.wait().unwrap().success());
    }
    let stats = mount.stop();
    // Chunk 0 and chunks 4..8, once each.
    assert_eq!(stats["chunks_fetched"], 5, "{stats}");
    assert!(
        stats["read_calls"].as_u64().unwrap() >= 32,
        "the reads reached the daemon separately: {stats}"
    );
}

#[test]
fn a_read_waiting_for_the_registry_does_not_hold_up_cached_reads() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("d.raw");
    random_file(&disk, 16 << 20, 13);
    push_raw(&reg.host(), "vm/slow:1", &disk);
    let slow = FaultProxy::start_with(
        reg.port,
        Faults {
            response_delay: Some(Duration::from_millis(1500)),
            ..Faults::default()
        },
    );
    let mount = Mount::start(
        &format!("{}/vm/slow:1", slow.host()),
        &scratch.path("cache"),
        &scratch.path("mnt"),
        &[],
    );
    // Cache chunk 0 first (a read through the slow registry), then start a read of an
    // uncached chunk and read chunk 0 again: the cached read must finish while the slow one
    // is still waiting.
    assert!(direct_read_page(&mount.disk, 0).wait().unwrap().success());
    let mut missing = direct_read_page(&mount.disk, 2048);
    std::thread::sleep(Duration::from_millis(200));
    let mut cached = direct_read_page(&mount.disk, 0);
    assert!(cached.wait().unwrap().success());
    assert!(
        missing.try_wait().unwrap().is_none(),
        "the slow read is still waiting for the registry"
    );
    assert!(missing.wait().unwrap().success());
    mount.stop();
}

#[test]
fn zero_chunks_are_verified_from_their_tiny_frames_and_never_written() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("d.raw");
    random_file(&disk, 16 << 20, 14);
    // Chunks 8..24 (2 MiB..6 MiB) are all zeros.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&disk)
        .unwrap()
        .write_all_at(&vec![0u8; 4 << 20], 2 << 20)
        .unwrap();
    let reference = push_raw(&reg.host(), "vm/zeros:1", &disk);
    let mount = Mount::start(
        &reference,
        &scratch.path("cache"),
        &scratch.path("mnt"),
        &[],
    );
    // Chunk 0 first, so that the counts below are of the scattered reads alone.
    assert!(direct_read_page(&mount.disk, 0).wait().unwrap().success());
    // Scattered single pages inside the zero region, O_DIRECT: no read-ahead pulls in the
    // random data around it.
    for page in [520u64, 700, 901, 1111, 1300, 1530] {
        let out = std::process::Command::new("dd")
            .arg(format!("if={}", mount.disk.display()))
            .args([
                "bs=4096",
                "count=1",
                "iflag=direct",
                "status=none",
                &format!("skip={page}"),
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success() && out.stdout.len() == 4096 && out.stdout.iter().all(|&b| b == 0)
        );
    }
    let stats = mount.stop();
    // Chunk 0 and the one chunk the 4 MiB of zeros were published as (a run of zero chunks is
    // one chunk): a "zeros" mark is the publisher's claim, so the run is verified like any
    // chunk, from a frame of a few bytes, once for all six pages. (Two more requests fetched
    // the tar headers before and after the disk, checked at mount.)
    assert_eq!(stats["chunks_fetched"], 2, "{stats}");
    assert_eq!(stats["fetch_requests"], 2 + 2, "{stats}");
    let fetched = stats["bytes_fetched"].as_u64().unwrap();
    assert!(
        fetched < (256 + 4) << 10,
        "chunk 0 and one tiny frame: {stats}"
    );
    assert_eq!(stats["bytes_served"], 7 * 4096);
    // Verified zeros stay holes in the cache: only chunk 0 takes space.
    let layers = scratch.path("cache").join("layers");
    let layer = std::fs::read_dir(&layers)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let blocks =
        std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(layer.join("data/0")).unwrap());
    assert!(
        blocks * 512 <= (256 + 64) << 10,
        "{} bytes allocated",
        blocks * 512
    );
}

#[test]
fn cache_size_evicts_unmounted_layers_but_never_the_mounted_one() {
    let scratch = Scratch::new();
    let (reg, _disk, first) = random_raw_image(&scratch, 8 << 20, 15, "vm/evict:1");
    let second_disk = scratch.path("second.raw");
    random_file(&second_disk, 8 << 20, 16);
    let second = push_raw(&reg.host(), "vm/evict:2", &second_disk);
    let cache = scratch.path("cache");
    let layers = || {
        std::fs::read_dir(cache.join("layers"))
            .map(|d| d.count())
            .unwrap_or(0)
    };

    let mut mount = Mount::start(
        &first,
        &cache,
        &scratch.path("mnt"),
        &["--hydrate", "eager"],
    );
    mount.wait_for("hydrated", Duration::from_secs(60));
    mount.stop();
    assert_eq!(layers(), 1);

    // A 1-byte limit: everything not mounted goes, the layer being mounted stays.
    let mount = Mount::start(
        &second,
        &cache,
        &scratch.path("mnt"),
        &["--cache-size", "1"],
    );
    assert_eq!(layers(), 1, "the first image's layer was evicted");
    assert!(
        files_identical(&mount.disk, &second_disk),
        "the mounted layer is intact"
    );
    mount.stop();
}

/// A sparse raw disk of 8 GiB and one of 256 GiB with as much data: the 256 GiB one mounts,
/// what its mount fetches before it is ready stays a few KiB more than the 8 GiB one's, and its
/// TOC lists about as many chunks (a run of zeros is one chunk of up to 256 MiB). Before, the
/// TOC listed a chunk per 256 KiB of disk: 1 048 576 at 256 GiB, over the TOC's bound (the
/// mount was refused), and 0.36 s to ready at 50 GiB against 0.14 s at 10 GiB. The times are
/// printed, not asserted (a debug build, beside other tests): `integration/benches/ready.sh`
/// measures them.
#[test]
fn a_256_gib_disk_mounts_and_fetches_before_ready_what_an_8_gib_one_does() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let proxy = FaultProxy::counting(reg.port);
    let mut images = Vec::new();
    for gib in [8u64, 256] {
        let disk = scratch.path(&format!("{gib}.raw"));
        let size = gib << 30;
        std::fs::File::create(&disk).unwrap().set_len(size).unwrap();
        // 4 MiB of data at the start, the middle and the end: the rest is a hole, read as one.
        let data = scratch.path("data");
        random_file(&data, 4 << 20, gib);
        let data = std::fs::read(&data).unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&disk).unwrap();
        for at in [0, size / 2, size - (4 << 20)] {
            file.write_all_at(&data, at).unwrap();
        }
        drop(file);
        let reference = push_raw(&proxy.host(), &format!("vm/sparse{gib}:1"), &disk);
        std::fs::remove_file(&disk).unwrap();
        let inspect = vmdisk_ok(&["inspect", "--json", &reference]);
        let inspect: serde_json::Value = serde_json::from_str(&inspect).unwrap();
        let chunks = inspect["platforms"][0]["layers"][0]["chunks"]
            .as_u64()
            .unwrap();
        images.push((gib, reference, chunks));
    }
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    let mut before_ready = [0u64; 2];
    for (i, (gib, reference, _)) in images.iter().enumerate() {
        let cache = scratch.path(&format!("cache-{gib}"));
        let mnt = scratch.path("mnt");
        let bytes = proxy.bytes_to_client();
        let started = std::time::Instant::now();
        let mount = Mount::start(reference, &cache, &mnt, &[]);
        cold.push(started.elapsed());
        before_ready[i] = proxy.bytes_to_client() - bytes;
        // Its size is the disk's, and a page in a hole reads as zeros.
        let disk = std::fs::File::open(&mount.disk).unwrap();
        let size = disk.metadata().unwrap().len();
        assert_eq!(size, gib << 30);
        let mut page = vec![1u8; 4096];
        disk.read_exact_at(&mut page, size / 4).unwrap();
        assert!(page.iter().all(|&b| b == 0), "a hole reads as zeros");
        drop(disk);
        let stats = mount.stop();
        assert_eq!(stats["read_errors"], 0, "{stats}");
        let started = std::time::Instant::now();
        let mount = Mount::start(reference, &cache, &mnt, &[]);
        warm.push(started.elapsed());
        drop(mount.stop());
    }
    let chunks: Vec<u64> = images.iter().map(|(_, _, c)| *c).collect();
    eprintln!(
        "start to ready (debug build), 8 / 256 GiB: cold {:?} / {:?}, warm {:?} / {:?}; chunks {chunks:?}; fetched before ready: {before_ready:?} bytes",
        cold[0], cold[1], warm[0], warm[1]
    );
    // 8 GiB: 48 chunks of data, 32 runs of zeros; 256 GiB: the same data, 1 024 runs.
    assert!(chunks[1] <= chunks[0] + 1024, "TOC chunks {chunks:?}");
    assert!(
        before_ready[1] < before_ready[0] + (32 << 10),
        "a 256 GiB disk fetched {} bytes before it was ready, an 8 GiB one {}",
        before_ready[1],
        before_ready[0]
    );
}
