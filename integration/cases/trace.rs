//! Boot traces end to end: `vmdisk trace record --push` against the real registry records what
//! a command reads and publishes it beside the image; a daemon on a fresh node then fetches
//! exactly the traced chunks at its cold start, before anything reads.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::fixtures::cri::Daemon;
use crate::fixtures::harness::*;

const CHUNK: u64 = 256 << 10;

/// Reads 64 KiB of `disk` at 64 KiB block `block` with O_DIRECT (no kernel read-ahead);
/// whether the read succeeded.
fn direct_read(disk: &Path, block: u64) -> bool {
    Command::new("dd")
        .arg(format!("if={}", disk.display()))
        .args(["of=/dev/null", "bs=64K", "count=1", "iflag=direct"])
        .arg(format!("skip={block}"))
        .status()
        .unwrap()
        .success()
}

#[test]
fn a_published_trace_is_fetched_first_at_a_cold_start_on_another_node() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("d.raw");
    random_file(&disk, 64 << 20, 5);
    let reference = format!("{}/vm/traced:1", reg.host());
    let pushed = vmdisk_ok(&[
        "push",
        "--format",
        "raw",
        disk.to_str().unwrap(),
        &reference,
    ]);
    let manifest = pushed.lines().last().unwrap().trim().to_string();

    // The "boot": three reads, at 20 MiB, 5 MiB and 10 MiB + 64 KiB, in that order.
    let blocks = [320u64, 80, 161];
    let script = blocks
        .iter()
        .map(|b| format!("dd if=\"$VMDISK_DISK\" of=/dev/null bs=64K count=1 skip={b} iflag=direct 2>/dev/null"))
        .collect::<Vec<_>>()
        .join(" && ");
    let trace_file = scratch.path("trace.json");
    let out = vmdisk_ok(&[
        "trace",
        "record",
        "--cache",
        scratch.path("recording-cache").to_str().unwrap(),
        "--output",
        trace_file.to_str().unwrap(),
        "--push",
        &reference,
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert!(out.contains("recorded 3 ranges"), "{out}");
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&trace_file).unwrap()).unwrap();
    let chunk_of = |block: u64| block * (64 << 10) / CHUNK * CHUNK;
    let expected: Vec<serde_json::Value> = blocks
        .iter()
        .map(|&b| serde_json::json!([chunk_of(b), CHUNK]))
        .collect();
    assert_eq!(
        trace["ranges"],
        serde_json::Value::from(expected),
        "{trace}"
    );
    assert_eq!(trace["disk"], "disk/d.raw");

    // Published beside the image: the referrers fallback tag lists the trace artifact.
    let index: serde_json::Value = serde_json::from_slice(&curl(&[
        "-sf",
        "-H",
        "Accept: application/vnd.oci.image.index.v1+json",
        &format!(
            "http://{}/v2/vm/traced/manifests/sha256-{}",
            reg.host(),
            manifest.trim_start_matches("sha256:")
        ),
    ]))
    .unwrap();
    assert_eq!(
        index["manifests"][0]["artifactType"], "application/vnd.vmdisk.boot-trace.v1+json",
        "{index}"
    );

    // Another node: its daemon makes the disk ready and, with nothing reading, fetches the
    // traced chunks (and the disk's first chunk, which describing it reads).
    let node = Scratch::new();
    let daemon = Daemon::start(&node, "");
    let path = daemon.vmdisk_ok(&["path", &reference]).trim().to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ls: Vec<serde_json::Value> =
            serde_json::from_str(&daemon.vmdisk_ok(&["ls", "--json"])).unwrap();
        let cached = ls[0]["chunks_cached"].as_u64().unwrap();
        if cached >= 4 {
            assert_eq!(cached, 4, "only the traced chunks and the first: {}", ls[0]);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the trace was not fetched: {}",
            ls[0]
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // With the registry gone, the traced reads are served from the node's cache; others fail.
    drop(reg);
    for &b in &blocks {
        assert!(direct_read(Path::new(&path), b), "traced block {b}");
    }
    assert!(
        !direct_read(Path::new(&path), 600),
        "untraced block 600 must not be cached"
    );
}
