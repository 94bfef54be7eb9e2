//! containerd's own snapshotter conformance suite (`snapshots/testsuite` of containerd 1.6.20,
//! built offline from Debian's packaged source by `integration/conformance/build.sh`) against
//! vmdisk-snapshotter, over the Snapshots API as containerd's proxy plugin reaches it. Each of
//! its subtests starts a daemon with the suite's own fresh root; those roots are made long here
//! (k3s nests containerd's state under `/var/lib/rancher/k3s/agent/containerd/`), far past
//! what a socket address holds. The reference, containerd's overlayfs behind the same API,
//! passes 20 and skips `Rename`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::harness::*;

/// The suite's test binary, built once per checkout of its source.
fn suite_binary() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("integration/conformance");
    let source = std::fs::read(here.join("conformance_test.go")).unwrap();
    let tag = &sha256(&source)[7..19];
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("conformance-{tag}.test"));
    if !out.exists() {
        run(
            here.join("build.sh").to_str().unwrap(),
            &[out.to_str().unwrap()],
        );
    }
    out
}

#[test]
fn containerds_snapshotter_suite_passes_with_long_roots() {
    require("go");
    let suite = suite_binary();
    let scratch = Scratch::new();
    // A temporary directory as deep as a k3s node's containerd state: every root the suite
    // makes lies below it.
    let tmp = scratch.path("var/lib/rancher/k3s/agent/containerd/io.containerd.snapshotter.v1.vmdisk/suite-roots-of-a-k3s-length");
    std::fs::create_dir_all(&tmp).unwrap();
    let out = Command::new(&suite)
        .arg("-test.v")
        .env(
            "VMDISK_SNAPSHOTTER",
            env!("CARGO_BIN_EXE_vmdisk-snapshotter"),
        )
        .env("TMPDIR", &tmp)
        .output()
        .expect("run the conformance suite");
    let text = String::from_utf8_lossy(&out.stdout);
    let subtests = |outcome: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| {
                l.trim()
                    .strip_prefix(&format!("--- {outcome}: TestVmdiskSnapshotter/"))
            })
            .map(|l| l.split(' ').next().unwrap_or_default().to_string())
            .collect()
    };
    let (passed, skipped, failed) = (subtests("PASS"), subtests("SKIP"), subtests("FAIL"));
    assert!(
        failed.is_empty() && out.status.success(),
        "failed: {failed:?}\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // As overlayfs: Rename is skipped (the suite skips it for overlay-style snapshotters).
    assert_eq!(skipped, ["Rename"], "{text}");
    assert_eq!(passed.len(), 20, "passed {passed:?}\n{text}");
    // The roots really were longer than a socket address holds.
    assert!(
        tmp.join("snapshot-suite-vmdisk-0000000000/root/vmdisk/control/0123456789abcdef0123456789abcdef.sock")
            .as_os_str()
            .len()
            > vmdisk::api::unix::MAX_SOCKET_PATH
    );
}
