//! containerd's own snapshotter conformance suite (`snapshots/testsuite`) of each release —
//! 1.6.20 (Debian 12), 1.7 (Debian 13) and 2.1 (Debian unstable), built offline from Debian's
//! packaged Go sources, and 2.3 and 2.4, built from the Go module proxy by module version, by
//! `integration/deps/conformance/build.sh` — against vmdisk-snapshotter, over
//! the Snapshots API as containerd's proxy plugin reaches it. Each of its subtests starts a
//! daemon with the suite's own fresh root; those roots are made long here (k3s nests
//! containerd's state under `/var/lib/rancher/k3s/agent/containerd/`), far past what a socket
//! address holds. The reference, containerd's overlayfs, passes 20 and skips `Rename` on 1.6,
//! and passes all 21 on 1.7 and 2.x.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::fixtures::cri::Release;
use crate::fixtures::harness::*;

/// The suite's test binary for `release`, built once per checkout of its source.
fn suite_binary(release: Release) -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("integration/deps/conformance");
    let mut source = std::fs::read(here.join("conformance_test.go")).unwrap();
    source.extend(std::fs::read(here.join("build.sh")).unwrap());
    // Debian's sources are of one release each; 2.3 and 2.4 are built from the Go module
    // proxy at the version `make deps` built their containerd at.
    let module = matches!(release, Release::V2_3 | Release::V2_4).then(|| release.version());
    if let Some(version) = &module {
        source.extend(version.as_bytes());
    }
    let tag = &sha256(&source)[7..19];
    let out =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("conformance-{release:?}-{tag}.test"));
    if !out.exists() {
        let deps = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/deps");
        let mut args = vec![out.to_str().unwrap().to_string()];
        let root = match release {
            Release::V1_6 => None,
            Release::V1_7 => Some(deps.join("suite-1.7")),
            Release::V2_1 => Some(deps.join("suite-2.1")),
            Release::V2_3 | Release::V2_4 => None,
        };
        if let Some(root) = root {
            assert!(
                root.join("usr/share/gocode").is_dir(),
                "{} is missing: `make deps` unpacks containerd's Go sources there",
                root.display()
            );
            args.push(root.display().to_string());
        }
        if let Some(version) = module {
            args.extend(["--module".to_string(), format!("v{version}")]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run(here.join("build.sh").to_str().unwrap(), &args);
    }
    out
}

/// Runs the suite of `release` with k3s-length roots; its passed, skipped and failed subtests.
fn run_suite(release: Release) -> (Vec<String>, Vec<String>, Vec<String>, String) {
    let suite = suite_binary(release);
    let scratch = Scratch::new();
    // A temporary directory as deep as a k3s node's containerd state: every root the suite
    // makes lies below it.
    let tmp = scratch.path("var/lib/rancher/k3s/agent/containerd/io.containerd.snapshotter.v1.vmdisk/suite-roots-of-a-k3s-length");
    std::fs::create_dir_all(&tmp).unwrap();
    // The roots really are longer than a socket address holds.
    assert!(
        tmp.join("snapshot-suite-overlayfs-0000000000/root/vmdisk/control/0123456789abcdef0123456789abcdef.sock")
            .as_os_str()
            .len()
            > vmdisk::api::unix::MAX_SOCKET_PATH
    );
    let out = Command::new(&suite)
        .arg("-test.v")
        .env(
            "VMDISK_SNAPSHOTTER",
            env!("CARGO_BIN_EXE_vmdisk-snapshotter"),
        )
        .env("TMPDIR", &tmp)
        .output()
        .expect("run the conformance suite");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
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
        out.status.success() || !failed.is_empty(),
        "{release:?}: the suite failed without a failed subtest: {text}"
    );
    (passed, skipped, failed, text)
}

#[test]
fn containerds_snapshotter_suites_pass_with_long_roots() {
    require("go");
    for release in Release::ALL {
        let (passed, skipped, failed, text) = run_suite(release);
        eprintln!(
            "{release:?}: {} passed, {} skipped ({skipped:?}), {} failed",
            passed.len(),
            skipped.len(),
            failed.len()
        );
        assert!(failed.is_empty(), "{release:?} failed: {failed:?}\n{text}");
        match release {
            // As overlayfs: 1.6's suite skips Rename for every snapshotter.
            Release::V1_6 => {
                assert_eq!(skipped, ["Rename"], "{text}");
                assert_eq!(passed.len(), 20, "passed {passed:?}\n{text}");
            }
            _ => {
                assert!(skipped.is_empty(), "{text}");
                assert_eq!(passed.len(), 21, "passed {passed:?}\n{text}");
            }
        }
    }
}
