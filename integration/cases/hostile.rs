//! A hostile registry: an in-process OCI registry that serves hand-crafted manifests, configs,
//! TOCs and disks, and answers Range requests badly on purpose. Each test asserts the exact
//! outcome (a named error, EIO, or the right bytes) and, where input could exhaust the node, a
//! bound on memory and time measured on the real `vmdisk` process.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vmdisk::format::toc::TocEntry;
use vmdisk::oci::digest::Digest;

use crate::fixtures::harness::*;
use crate::fixtures::hostile::{random, Answer, Claim, CraftedLayer, HostileRegistry, CHUNK};

/// What a finished `vmdisk` run left: exit status, stderr, peak RSS and wall time.
struct Run {
    ok: bool,
    stderr: String,
    max_rss_bytes: u64,
    took: Duration,
}

/// Runs `vmdisk args` under GNU time (peak RSS), killing it after `limit`.
fn vmdisk_measured(args: &[&str], limit: Duration) -> Run {
    require("/usr/bin/time");
    let rss_file = tempfile::NamedTempFile::new().unwrap();
    let started = Instant::now();
    let mut child = Command::new("/usr/bin/time")
        .arg("-f")
        .arg("%M")
        .arg("-o")
        .arg(rss_file.path())
        .arg(env!("CARGO_BIN_EXE_vmdisk"))
        .args(args)
        .env("VMDISK_LOG", "warn")
        .env("HOME", "/nonexistent")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("vmdisk {args:?} still ran after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let kib: u64 = std::fs::read_to_string(rss_file.path())
        .unwrap()
        .lines()
        .last()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    Run {
        ok: out.status.success(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        max_rss_bytes: kib * 1024,
        took: started.elapsed(),
    }
}

/// `vmdisk mount` of `reference` must fail, saying `why`, within bounds.
fn mount_refused(scratch: &Scratch, reference: &str, why: &str) -> Run {
    std::fs::create_dir_all(scratch.path("mnt")).unwrap();
    let run = vmdisk_measured(
        &[
            "mount",
            "--cache",
            scratch.path("cache").to_str().unwrap(),
            reference,
            scratch.path("mnt").to_str().unwrap(),
        ],
        Duration::from_secs(60),
    );
    assert!(!run.ok, "mounting {reference} should fail");
    assert!(
        run.stderr.contains(why),
        "mounting {reference}: expected {why:?} in: {}",
        run.stderr
    );
    assert!(
        run.max_rss_bytes < 1 << 30,
        "peak RSS {}",
        run.max_rss_bytes
    );
    run
}

/// Reads `len` bytes at `offset` of `path` with O_DIRECT (no page cache, no read-ahead), the
/// time it took, and whether it failed with EIO.
fn direct_read(path: &Path, offset: u64, len: usize) -> (std::io::Result<Vec<u8>>, Duration) {
    let started = Instant::now();
    let out = Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args([
            "iflag=direct,skip_bytes,count_bytes",
            "status=none",
            "bs=4096",
        ])
        .arg(format!("skip={offset}"))
        .arg(format!("count={len}"))
        .output()
        .unwrap();
    let result = if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(std::io::Error::other(
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    };
    (result, started.elapsed())
}

#[test]
fn an_image_claiming_anothers_layer_digest_never_changes_what_that_image_serves() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let good = random(1 << 20, 1);
    let evil = random(1 << 20, 2);
    let victim = CraftedLayer::honest(&[("disk/disk.img", &good)], CHUNK);
    let victim_ref = reg.publish("good/disk", "1", &victim, Claim::default());
    let (victim_blob, _) = victim.blob();
    // The attacker's own layer, published under the victim's layer digest.
    let attacker = CraftedLayer::honest(&[("disk/disk.img", &evil)], CHUNK);
    let attacker_ref = reg.publish(
        "evil/disk",
        "1",
        &attacker,
        Claim {
            digest: Some(Digest::of(&victim_blob)),
            ..Claim::default()
        },
    );
    let cache = scratch.path("cache");
    let mount = Mount::start(&attacker_ref, &cache, &scratch.path("a"), &[]);
    assert!(std::fs::read(&mount.disk).unwrap() == evil);
    mount.stop();
    let mount = Mount::start(&victim_ref, &cache, &scratch.path("v"), &[]);
    assert!(
        std::fs::read(&mount.disk).unwrap() == good,
        "the victim's image serves its own disk"
    );
    mount.stop();
    let layers = std::fs::read_dir(cache.join("layers")).unwrap().count();
    assert_eq!(layers, 2, "the two claims are two cache entries");
}

#[test]
fn a_chunk_marked_zeros_is_verified_like_any_other() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let data = random(4 * CHUNK, 3);
    let mut layer = CraftedLayer::honest(&[("disk/disk.img", &data)], CHUNK);
    // Chunk 1 holds data in the tar; the TOC calls it zeros with the digest of zeros.
    let zeros = Digest::of(&vec![0u8; CHUNK]).to_string();
    let chunk1 = layer
        .toc
        .entries
        .iter_mut()
        .find(|e| e.kind == "chunk" && e.chunk_offset == CHUNK as i64)
        .unwrap();
    chunk1.chunk_type = "zeros".into();
    chunk1.chunk_digest = zeros;
    let reference = reg.publish("zeros/disk", "1", &layer, Claim::default());
    let mount = Mount::start(
        &reference,
        &scratch.path("cache"),
        &scratch.path("mnt"),
        &[],
    );
    let (first, _) = direct_read(&mount.disk, 0, 4096);
    assert_eq!(first.unwrap(), data[..4096]);
    let (lied, _) = direct_read(&mount.disk, CHUNK as u64, 4096);
    assert!(
        lied.is_err(),
        "a 'zeros' chunk whose bytes are not zeros is EIO, not zeros"
    );
    let stats = mount.stop();
    assert!(stats["verify_failures"].as_u64().unwrap() >= 1, "{stats}");
}

#[test]
fn a_lazy_view_that_would_differ_from_the_extracted_tar_is_refused_before_it_serves() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let a = random(2 * CHUNK, 4);
    let b = random(CHUNK, 5);
    let honest = CraftedLayer::honest(&[("disk/a.img", &a), ("disk/b.img", &b)], CHUNK);

    // A chunk hidden in a skippable frame (ordinary decoders skip it; the real bytes follow).
    let mut hidden = honest.clone();
    let start = hidden.reg("disk/a.img").offset as usize;
    let fake = vec![0x41u8; CHUNK];
    let frame = zstd::bulk::compress(&fake, 1).unwrap();
    let mut data = hidden.data[..start].to_vec();
    data.extend_from_slice(&[0x50, 0x2a, 0x4d, 0x18]);
    data.extend_from_slice(&(frame.len() as u32).to_le_bytes());
    let fake_at = data.len() as i64;
    data.extend_from_slice(&frame);
    let shift = (data.len() - start) as i64;
    data.extend_from_slice(&hidden.data[start..]);
    hidden.data = data;
    for e in &mut hidden.toc.entries {
        if e.offset > 0 {
            e.offset += shift;
        }
        if e.end_offset > 0 {
            e.end_offset += shift;
        }
    }
    let reg_a = hidden.reg("disk/a.img");
    reg_a.offset = fake_at;
    reg_a.chunk_digest = Digest::of(&fake).to_string();
    let r = reg.publish("hidden/disk", "1", &hidden, Claim::default());
    mount_refused(&scratch, &r, "does not hold what its TOC describes");

    // The TOC names a file differently from the tar header.
    let mut renamed = honest.clone();
    for e in &mut renamed.toc.entries {
        e.name = e.name.replace("b.img", "c.img");
    }
    let r = reg.publish("renamed/disk", "1", &renamed, Claim::default());
    mount_refused(&scratch, &r, "the TOC says disk/c.img");

    // The same name twice (tar extraction keeps the last).
    let mut twice = honest.clone();
    for e in &mut twice.toc.entries {
        e.name = e.name.replace("b.img", "a.img");
    }
    let r = reg.publish("twice/disk", "1", &twice, Claim::default());
    mount_refused(&scratch, &r, "listed twice");

    // A hardlink with an empty target (was: an alias of the layer root).
    let mut link = honest.clone();
    link.toc.entries.push(TocEntry {
        kind: "hardlink".into(),
        name: "disk/link".into(),
        ..TocEntry::default()
    });
    let r = reg.publish("link/disk", "1", &link, Claim::default());
    mount_refused(&scratch, &r, "unusable target");
}

#[test]
fn a_diff_id_lie_is_caught_once_the_layer_is_complete_and_every_read_fails() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let data = random(8 * CHUNK, 6);
    let layer = CraftedLayer::honest(&[("disk/disk.img", &data)], CHUNK);
    let reference = reg.publish(
        "liar/disk",
        "1",
        &layer,
        Claim {
            diff_id: Some(Digest::of(b"some other layer")),
            ..Claim::default()
        },
    );
    let cache = scratch.path("cache");
    let mut mount = Mount::start(
        &reference,
        &cache,
        &scratch.path("mnt"),
        &["--hydrate", "eager"],
    );
    let line = mount.wait_for("hydrated:", Duration::from_secs(60));
    assert!(
        line.contains("integrity failed: the layer's tar stream hashes to"),
        "{line}"
    );
    let (read, _) = direct_read(&mount.disk, 0, 4096);
    assert!(
        read.is_err(),
        "a layer that differs from its config serves nothing"
    );
    let stats = mount.stop();
    assert_eq!(stats["integrity_failures"], 1, "{stats}");
    // The verdict is kept: the layer is not served again.
    let run = vmdisk_measured(
        &[
            "mount",
            "--cache",
            cache.to_str().unwrap(),
            &reference,
            scratch.path("again").to_str().unwrap(),
        ],
        Duration::from_secs(30),
    );
    assert!(
        !run.ok
            && run
                .stderr
                .contains("differs from what its image config says"),
        "{}",
        run.stderr
    );
    // The honest twin, same blob, verifies.
    let honest = reg.publish("honest/disk", "1", &layer, Claim::default());
    let mut mount = Mount::start(
        &honest,
        &cache,
        &scratch.path("honest"),
        &["--hydrate", "eager"],
    );
    let line = mount.wait_for("hydrated:", Duration::from_secs(60));
    assert!(line.ends_with("integrity verified"), "{line}");
    assert!(std::fs::read(&mount.disk).unwrap() == data);
    mount.stop();
}

#[test]
fn crafted_sizes_and_counts_stay_within_memory_and_time() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();

    // TOCs of a few hundred KiB compressed holding millions of tiny entries: one just over
    // the entry bound (refused at its first entry that does not fit, as entries are validated
    // while they are parsed) and one of 4 M entries, which parsed would take well over 1 GiB
    // (refused by its announced size).
    let base = CraftedLayer::honest(&[("disk/disk.img", &random(CHUNK, 7))], CHUNK);
    let tiny_entries = |n: usize| {
        let mut toc = base.toc.clone();
        toc.tar_split_digest = None;
        let mut json = serde_json::to_vec(&toc).unwrap();
        assert!(json.ends_with(b"]}"));
        json.truncate(json.len() - 2);
        for _ in 0..n {
            json.extend_from_slice(br#",{"type":"chunk","name":"disk/disk.img"}"#);
        }
        json.extend_from_slice(b"]}");
        json
    };
    for (entries, why) in [
        (
            vmdisk::format::toc::MAX_TOC_ENTRIES,
            "outside the layer data",
        ),
        (4 << 20, "outside the accepted bounds"),
    ] {
        let mut bomb = base.clone();
        bomb.toc_json = Some(tiny_entries(entries));
        let r = reg.publish(
            &format!("bomb/entries{entries}"),
            "1",
            &bomb,
            Claim::default(),
        );
        let run = mount_refused(&scratch, &r, why);
        eprintln!(
            "TOC of {entries} extra entries: refused in {:?}, peak RSS {} MiB",
            run.took,
            run.max_rss_bytes >> 20
        );
    }

    // More files than a VM-disk layer needs.
    let mut many = CraftedLayer::honest(&[("disk/disk.img", &random(CHUNK, 8))], CHUNK);
    many.toc.entries.extend((0..5000).map(|i| TocEntry {
        kind: "dir".into(),
        name: format!("d/{i}"),
        ..TocEntry::default()
    }));
    let r = reg.publish("bomb/files", "1", &many, Claim::default());
    let run = mount_refused(&scratch, &r, "more than 4096 files");
    eprintln!("TOC of 5000 directories: refused in {:?}", run.took);

    // A 1.5 GiB disk, nearly all zeros, whose qcow2 header claims a 2 GiB L1 table and a huge
    // refcount table: describing it for its ready directory must refuse the claim, not
    // allocate it (as much of it as the file holds, before), and serve the disk as published.
    let mut header = vec![0u8; CHUNK];
    header[..4].copy_from_slice(b"QFI\xfb");
    header[4..8].copy_from_slice(&3u32.to_be_bytes());
    header[20..24].copy_from_slice(&16u32.to_be_bytes());
    header[24..32].copy_from_slice(&(1u64 << 50).to_be_bytes());
    header[36..40].copy_from_slice(&(1u32 << 28).to_be_bytes());
    header[40..48].copy_from_slice(&(CHUNK as u64).to_be_bytes());
    header[48..56].copy_from_slice(&(2 * CHUNK as u64).to_be_bytes());
    header[56..60].copy_from_slice(&(1u32 << 20).to_be_bytes());
    header[100..104].copy_from_slice(&104u32.to_be_bytes());
    let mut disk = vec![0u8; 3 << 29];
    disk[..CHUNK].copy_from_slice(&header);
    let started = Instant::now();
    let qcow = CraftedLayer::honest(&[("disk/disk.qcow2", &disk)], 64 << 20);
    drop(disk);
    eprintln!("built the 1.5 GiB layer in {:?}", started.elapsed());
    let r = reg.publish("bomb/qcow2", "1", &qcow, Claim::default());
    let daemon = crate::fixtures::cri::Daemon::start(&scratch, "");
    let served = std::path::PathBuf::from(daemon.vmdisk_ok(&["path", &r]).trim());
    let (head, _) = direct_read(&served, 0, 4096);
    assert_eq!(head.unwrap(), header[..4096]);
    let metadata: serde_json::Value = serde_json::from_slice(
        &std::fs::read(served.parent().unwrap().join("metadata.json")).unwrap(),
    )
    .unwrap();
    assert!(
        metadata["raw_error"]
            .as_str()
            .is_some_and(|e| e.contains("L1 table size")),
        "the ready directory names the bad claim: {metadata}"
    );
    let servers = daemon.server_pids();
    assert_eq!(servers.len(), 1, "one mount server");
    let status = std::fs::read_to_string(format!("/proc/{}/status", servers[0])).unwrap();
    let rss: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap();
    eprintln!(
        "qcow2 claiming a 2 GiB L1 table: mount server peak RSS {} MiB",
        rss >> 10
    );
    assert!(rss << 10 < 1 << 30, "peak RSS {rss} KiB");
}

#[test]
fn misbehaving_range_answers_fail_the_read_within_the_fetch_timeout() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let data = random(4 * CHUNK, 9);
    let layer = CraftedLayer::honest(&[("disk/disk.img", &data)], CHUNK);
    let fetch_timeout = Duration::from_secs(3);
    for (n, answer) in [
        Answer::Trickle(Duration::from_millis(500)),
        Answer::Whole,
        Answer::WrongContentRange,
        Answer::ExtraBytes,
    ]
    .into_iter()
    .enumerate()
    {
        // Chunk 0 answers honestly (the mount reads it first); the rest misbehave.
        let mut area = layer.chunk_area();
        area.start += 1;
        let reference = reg.publish(
            &format!("bad{n}/disk"),
            "1",
            &layer,
            Claim {
                answer: answer.clone(),
                at: area,
                ..Claim::default()
            },
        );
        let mount = Mount::start(
            &reference,
            &scratch.path(&format!("cache{n}")),
            &scratch.path(&format!("mnt{n}")),
            &["--fetch-timeout", "3"],
        );
        let (good, _) = direct_read(&mount.disk, 0, 4096);
        assert_eq!(good.unwrap(), data[..4096]);
        let (bad, took) = direct_read(&mount.disk, 2 * CHUNK as u64, 4096);
        eprintln!("{answer:?}: read failed after {took:?}");
        assert!(bad.is_err(), "{answer:?} gave bytes");
        // One deadline: a trickle is cut at the fetch timeout; an answer for other bytes
        // than asked is refused at once, not retried until the deadline.
        let bound = match answer {
            Answer::Trickle(_) => fetch_timeout + Duration::from_secs(1),
            _ => Duration::from_millis(500),
        };
        assert!(took <= bound, "{answer:?} held the read {took:?}");
        let stats = mount.stop();
        assert!(stats["read_errors"].as_u64().unwrap() >= 1, "{stats}");
    }
}

/// A registry whose every answer for a chunk fails its check, each answer nearly a fetch
/// timeout late: the read still ends within the fetch timeout and one more try (before, the
/// fetches of a chunk that failed its check were retried around the deadline's own loop: three
/// late answers, about three timeouts).
#[test]
fn a_registry_that_fails_every_check_ends_the_read_within_the_fetch_timeout() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let data = random(4 * CHUNK, 10);
    let layer = CraftedLayer::honest(&[("disk/disk.img", &data)], CHUNK);
    let mut area = layer.chunk_area();
    area.start += 1;
    let reference = reg.publish(
        "late/disk",
        "1",
        &layer,
        Claim {
            answer: Answer::LateAndDamaged(Duration::from_millis(2800)),
            at: area,
            ..Claim::default()
        },
    );
    let mount = Mount::start(
        &reference,
        &scratch.path("cache"),
        &scratch.path("mnt"),
        &["--fetch-timeout", "3"],
    );
    let (bad, took) = direct_read(&mount.disk, 2 * CHUNK as u64, 4096);
    eprintln!("every answer late and damaged: the read failed after {took:?}");
    assert!(bad.is_err(), "damaged bytes were served");
    let bound = Duration::from_secs(3) + vmdisk::engine::READ_GRACE + Duration::from_secs(1);
    assert!(
        took <= bound,
        "the read was held {took:?} (bound {bound:?})"
    );
    let stats = mount.stop();
    assert!(stats["read_errors"].as_u64().unwrap() >= 1, "{stats}");
}

/// A mirror that damages every range it serves, TOCs included, yet answers (so it counts as
/// healthy and is asked first): the TOC that failed its pinned checksum is fetched from the
/// registry itself next, the mount becomes ready, and every byte read is the published one.
#[test]
fn a_mirror_serving_a_damaged_toc_does_not_keep_the_mount_from_the_registry() {
    let scratch = Scratch::new();
    let (origin, mirror) = (HostileRegistry::start(), HostileRegistry::start());
    let data = random(4 * CHUNK, 11);
    let layer = CraftedLayer::honest(&[("disk/disk.img", &data)], CHUNK);
    let reference = origin.publish("vm/disk", "1", &layer, Claim::default());
    mirror.publish(
        "vm/disk",
        "1",
        &layer,
        Claim {
            answer: Answer::LateAndDamaged(Duration::ZERO),
            at: 0..u64::MAX,
            ..Claim::default()
        },
    );
    let hosts = crate::fixtures::node::hosts_dir(&scratch, &origin.host(), &mirror.host());
    let mount = Mount::start(
        &reference,
        &scratch.path("cache"),
        &scratch.path("mnt"),
        &["--hosts-dir", hosts.to_str().unwrap(), "--plain-http"],
    );
    let (read, _) = direct_read(&mount.disk, 0, data.len());
    assert!(read.unwrap() == data, "the published bytes");
    assert!(mirror.ranges_asked() > 0, "the mirror was asked");
    let stats = mount.stop();
    assert_eq!(stats["read_errors"].as_u64(), Some(0), "{stats}");
}

/// A registry whose Range answers contradict the request (Content-Range shifted by one byte,
/// or more body than asked) where the mount's structure check reads: a lie is the same every
/// time, so the mount is refused at once, naming the registry's answer (not the layer), and
/// well within `--timeout`.
#[test]
fn a_registry_that_lies_about_ranges_is_refused_within_the_timeout_naming_its_answer() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let layer = CraftedLayer::honest(&[("disk/disk.img", &random(4 * CHUNK, 5))], CHUNK);
    for (n, (answer, named)) in [
        (Answer::WrongContentRange, "Content-Range"),
        (Answer::ExtraBytes, "body"),
    ]
    .into_iter()
    .enumerate()
    {
        let reference = reg.publish(
            &format!("lies{n}/disk"),
            "1",
            &layer,
            Claim {
                answer: answer.clone(),
                at: 0..layer.chunk_area().start + 1,
                ..Claim::default()
            },
        );
        std::fs::create_dir_all(scratch.path("mnt")).unwrap();
        let run = vmdisk_measured(
            &[
                "mount",
                "--timeout",
                "20",
                "--cache",
                scratch.path(&format!("cache{n}")).to_str().unwrap(),
                &reference,
                scratch.path("mnt").to_str().unwrap(),
            ],
            Duration::from_secs(60),
        );
        eprintln!("{answer:?}: refused after {:?}", run.took);
        assert!(!run.ok, "{answer:?}: the mount should be refused");
        assert!(
            run.stderr.contains(named) && run.stderr.contains("other bytes than asked")
                || run.stderr.contains(named) && run.stderr.contains("answered a request"),
            "{answer:?}: the error names the registry's answer: {}",
            run.stderr
        );
        assert!(
            !run.stderr.contains("does not hold what its TOC describes"),
            "{answer:?}: the layer is not blamed for the registry's answer: {}",
            run.stderr
        );
        assert!(
            run.took < Duration::from_secs(20),
            "{answer:?}: refused after {:?}, past --timeout",
            run.took
        );
    }
}

#[test]
fn ready_disks_are_keyed_and_named_by_what_was_verified() {
    use crate::fixtures::cri::Daemon;
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let good = random(1 << 20, 11);
    let evil = random(1 << 20, 12);
    let victim = CraftedLayer::honest(&[("disk/disk.img", &good)], CHUNK);
    let (victim_blob, _) = victim.blob();
    // Two references whose ready names used to collide (`/` and `:` both became `_`), the
    // second claiming the first's layer digest for its own disk.
    let victim_ref = reg.publish("a/b/c", "1", &victim, Claim::default());
    let attacker = CraftedLayer::honest(&[("disk/disk.img", &evil)], CHUNK);
    let attacker_ref = reg.publish(
        "a/b_c",
        "1",
        &attacker,
        Claim {
            digest: Some(Digest::of(&victim_blob)),
            ..Claim::default()
        },
    );
    let daemon = Daemon::start(&scratch, "");
    let path = |args: &[&str]| std::path::PathBuf::from(daemon.vmdisk_ok(args).trim());
    let evil_path = path(&["path", &attacker_ref]);
    assert!(std::fs::read(&evil_path).unwrap() == evil);
    let good_path = path(&["path", &victim_ref]);
    assert!(
        std::fs::read(&good_path).unwrap() == good,
        "the victim's ready disk is its own"
    );
    let disks = daemon.disks();
    assert_eq!(disks.len(), 2, "two layer keys, two mounts");
    assert_eq!(
        disks[0].layer_digest, disks[1].layer_digest,
        "both claim one blob digest"
    );
    assert_ne!(disks[0].layer_key, disks[1].layer_key);
    // Each reference's by-name link and libvirt volume point at its own disk.
    let ready = daemon.ready.clone();
    for (reference, bytes) in [(&victim_ref, &good), (&attacker_ref, &evil)] {
        let name = vmdisk::serve::ready::alias_name(reference);
        let by_name = ready.join("by-name").join(&name).join("disk.img");
        assert!(
            std::fs::read(&by_name).unwrap() == **bytes,
            "{}",
            by_name.display()
        );
        let volume = ready.join("volumes").join(format!("{name}.raw"));
        assert!(
            std::fs::read(&volume).unwrap() == **bytes,
            "{}",
            volume.display()
        );
    }
    // Forgetting the attacker's disk leaves the victim's serving.
    path(&["rm", &attacker_ref]);
    assert!(std::fs::read(&good_path).unwrap() == good);

    // A layer whose config lies about its diff_id: `prefetch --wait` fails naming it once the
    // layer is complete, `ls` shows it, and its disk serves nothing more.
    let liar = CraftedLayer::honest(&[("disk/disk.img", &random(4 * CHUNK, 14))], CHUNK);
    let liar_ref = reg.publish(
        "liar/disk",
        "1",
        &liar,
        Claim {
            diff_id: Some(Digest::of(b"some other layer")),
            ..Claim::default()
        },
    );
    let out = daemon.vmdisk(&["prefetch", "--wait", &liar_ref]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "prefetch of a lying layer succeeded");
    assert!(
        text.contains("differs from its image config") && text.contains("hashes to"),
        "{text}"
    );
    let ls: serde_json::Value = serde_json::from_str(&String::from_utf8_lossy(
        &daemon.vmdisk(&["ls", "--json"]).stdout,
    ))
    .unwrap();
    let row = ls
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["reference"].as_str().unwrap().contains("liar/disk"))
        .unwrap();
    assert!(
        row["integrity"].as_str().unwrap().starts_with("failed: "),
        "{row}"
    );
    let liar_disk = std::path::PathBuf::from(row["path"].as_str().unwrap());
    assert!(
        std::fs::read(&liar_disk).is_err(),
        "a failed layer serves nothing"
    );

    // A qcow2 published under the name `disk.raw`: `disk.raw` stays the raw view.
    let qcow2 = scratch.path("q.qcow2");
    make_qcow2(&qcow2, "64M", &[(1 << 20, 2 << 20, 0x5a)]);
    let layer = CraftedLayer::honest(&[("disk/disk.raw", &std::fs::read(&qcow2).unwrap())], CHUNK);
    let shadow_ref = reg.publish("shadow/disk", "1", &layer, Claim::default());
    let published = path(&["path", &shadow_ref]);
    assert_eq!(published.file_name().unwrap(), "image-disk.raw");
    assert!(files_identical(&published, &qcow2));
    let raw_path = path(&["path", "--raw", &shadow_ref]);
    assert_eq!(raw_path.file_name().unwrap(), "disk.raw");
    let raw = scratch.path("q.raw");
    qemu_img_raw(&qcow2, &raw);
    assert!(
        files_identical(&raw_path, &raw),
        "`path --raw` is the raw view, not the qcow2"
    );

    // Neither the daemon nor any of its mount servers grew past the bound.
    for pid in std::iter::once(daemon.pid()).chain(daemon.server_pids()) {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let peak_kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            .unwrap();
        eprintln!("pid {pid}: peak RSS {} MiB", peak_kib >> 10);
        assert!(
            peak_kib << 10 < 1 << 30,
            "pid {pid} peaked at {peak_kib} KiB"
        );
    }
}

#[test]
fn what_already_held_still_holds_traversal_offsets_and_digests() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let data = random(3 * CHUNK, 13);
    let honest = CraftedLayer::honest(&[("disk/disk.img", &data)], CHUNK);

    let mut traversal = honest.clone();
    for e in &mut traversal.toc.entries {
        e.name = e.name.replace("disk/disk.img", "disk/../../etc/passwd");
    }
    let r = reg.publish("traversal/disk", "1", &traversal, Claim::default());
    mount_refused(&scratch, &r, "unsafe: contains '..'");

    let mut offset = honest.clone();
    let end = offset.data.len() as i64 + 4096;
    let reg_entry = offset.reg("disk/disk.img");
    reg_entry.end_offset = end;
    let last = offset.toc.entries.last_mut().unwrap();
    last.offset = end - 100;
    let r = reg.publish("offset/disk", "1", &offset, Claim::default());
    mount_refused(&scratch, &r, "outside the layer data");

    // A chunk whose digest does not match its bytes: EIO for it, the rest serves.
    let mut digest = honest.clone();
    let chunk1 = digest
        .toc
        .entries
        .iter_mut()
        .find(|e| e.kind == "chunk" && e.chunk_offset == CHUNK as i64)
        .unwrap();
    chunk1.chunk_digest = Digest::of(b"not these bytes").to_string();
    let r = reg.publish("digest/disk", "1", &digest, Claim::default());
    let mount = Mount::start(&r, &scratch.path("cache"), &scratch.path("mnt2"), &[]);
    let (first, _) = direct_read(&mount.disk, 0, 4096);
    assert_eq!(first.unwrap(), data[..4096]);
    let (bad, _) = direct_read(&mount.disk, CHUNK as u64, 4096);
    assert!(bad.is_err(), "a chunk that fails its digest is EIO");
    let (third, _) = direct_read(&mount.disk, 2 * CHUNK as u64, 4096);
    assert_eq!(third.unwrap(), data[2 * CHUNK..2 * CHUNK + 4096]);
    let stats = mount.stop();
    // Its copy in the blob's head fetched with the TOC failed first (so it was not kept), then
    // the read's three fetches (VERIFY_TRIES).
    assert_eq!(
        stats["verify_failures"], 4,
        "the head's copy and three fetches, each failed: {stats}"
    );
}

/// A registry that only ever serves a corrupt image config: the fetch is tried again under the
/// retry policy (a transient flip would have passed), then the mount fails naming the blob and
/// what was wrong, well within the fetch deadline.
#[test]
fn a_blob_that_is_always_corrupt_fails_naming_it_within_the_deadline() {
    let scratch = Scratch::new();
    let reg = HostileRegistry::start();
    let layer = CraftedLayer::honest(&[("disk/disk.img", &random(1 << 20, 9))], 256 << 10);
    let reference = reg.publish("vm/bad-config", "1", &layer, Claim::default());
    let config = reg.corrupt_config("vm/bad-config", "1");
    let run = mount_refused(&scratch, &reference, &config.to_string());
    assert!(
        run.stderr.contains("does not match"),
        "the error says what was wrong: {}",
        run.stderr
    );
    assert!(
        run.took < Duration::from_secs(30),
        "gave up after {:?}",
        run.took
    );
}
