//! Clients that end and errors that help: every command against a registry or a daemon that
//! accepts connections and never answers ends within its bound, saying what did not answer;
//! each bad input gives one clear line and changes nothing.

use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::fixtures::cri::Daemon;
use crate::fixtures::harness::*;

/// A TCP listener on loopback that accepts every connection and never answers.
fn silent_tcp() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().flatten() {
            held.push(conn);
        }
    });
    port
}

/// Runs `vmdisk ARGS`; its stderr, whether it succeeded, and how long it took.
fn timed_vmdisk(args: &[&str]) -> (String, bool, Duration) {
    let started = Instant::now();
    let out = vmdisk(args);
    (
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.success(),
        started.elapsed(),
    )
}

/// One line on stderr naming `what`.
fn one_clear_line(stderr: &str, what: &str) {
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "more than one line: {stderr}");
    assert!(lines[0].contains(what), "{what:?} not in: {stderr}");
}

#[test]
fn clients_end_within_their_bound_and_bad_input_fails_clearly() {
    let scratch = Scratch::new();

    // A registry that accepts and never answers: inspect and mount end at their deadline,
    // naming the registry and what they were fetching.
    let port = silent_tcp();
    let silent = format!("127.0.0.1:{port}/vm/disk:1");
    for args in [
        vec!["inspect", "--timeout", "5", silent.as_str()],
        vec![
            "mount",
            "--timeout",
            "5",
            "--cache",
            "/nonexistent-cache",
            silent.as_str(),
            "/tmp",
        ],
    ] {
        let (err, ok, took) = timed_vmdisk(&args);
        eprintln!("{args:?} against a silent registry: {took:?}: {err}");
        assert!(!ok);
        assert!(took < Duration::from_secs(9), "{args:?} took {took:?}");
        // The fetch's own deadline names what it fetched; mount's --timeout, which bounds
        // resolution and checks as a whole, is the same 5 s and may end it first on a busy
        // machine, naming the image it could not resolve.
        let fetch = format!("manifest 1 from 127.0.0.1:{port}/vm/disk did not succeed within 5 s");
        let whole = format!("{silent} could not be resolved and checked within 5 s (--timeout)");
        match args[0] {
            "mount" if err.contains(&whole) => one_clear_line(&err, &whole),
            _ => one_clear_line(&err, &fetch),
        }
    }
    // Through the daemon (its fetch_timeout is 5 s here): `vmdisk path` ends too.
    let daemon = Daemon::start(&scratch, "");
    let started = Instant::now();
    let out = daemon.vmdisk(&["path", &silent]);
    let took = started.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("path against a silent registry: {took:?}: {err}");
    assert!(
        !out.status.success() && took < Duration::from_secs(15),
        "{took:?}"
    );
    assert!(err.contains("did not succeed within 5 s"), "{err}");

    // A daemon that accepts and never answers: the node commands end at --timeout.
    let sock = scratch.path("silent.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().flatten() {
            held.push(conn);
        }
    });
    let manage = sock.to_str().unwrap();
    for command in [
        vec!["ls"],
        vec!["stats"],
        vec!["path", "r.example/x:1"],
        vec!["gc"],
    ] {
        let mut args = command.clone();
        args.extend(["--manage", manage, "--timeout", "3"]);
        let (err, ok, took) = timed_vmdisk(&args);
        assert!(
            !ok && took < Duration::from_secs(6),
            "{command:?} took {took:?}"
        );
        one_clear_line(&err, "vmdisk-snapshotter did not answer");
    }

    // Bad input: one clear line, nothing changed.
    let file = scratch.path("a-file");
    std::fs::write(&file, b"x").unwrap();
    let (err, ok, _) = timed_vmdisk(&["mount", "r.example/x:1", file.to_str().unwrap()]);
    assert!(!ok);
    one_clear_line(&err, "is not a directory");
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
    let (err, ok, _) = timed_vmdisk(&["convert", "r.example/x:1", "r.example/x:1"]);
    assert!(!ok);
    one_clear_line(&err, "would overwrite r.example/x:1");
    // The daemon refuses a configuration before it creates anything.
    let refuse = |toml: &str, what: &str| {
        let config = scratch.path("bad.toml");
        std::fs::write(&config, toml).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_vmdisk-snapshotter"))
            .arg("--config")
            .arg(&config)
            .current_dir(scratch.dir.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{toml}");
        one_clear_line(&err, what);
    };
    refuse("log_level = \"verbose\"\n", "\"verbose\" is not one of");
    refuse(
        "root = \"relative/root\"\n",
        "root relative/root is not an absolute path",
    );
    let long = format!("/tmp/{}/s.sock", "d".repeat(120));
    refuse(
        &format!(
            "root = \"{}\"\naddress = \"{long}\"\n",
            scratch.path("r").display()
        ),
        "longer than the 107 bytes",
    );
    assert!(
        !scratch.path("relative").exists() && !scratch.path("r").exists(),
        "a refused configuration created directories"
    );
    // --limit 0 means 0: every cached layer no mount uses is evicted.
    let out = daemon.vmdisk(&["gc", "--limit", "0"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A user who is not root is told so, not that the daemon is not running.
    let out = Command::new("setpriv")
        .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"])
        .arg(env!("CARGO_BIN_EXE_vmdisk"))
        .args(["ls", "--manage", daemon.manage.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    one_clear_line(
        &String::from_utf8_lossy(&out.stderr),
        "run this command as root",
    );
    // The shim's help needs no configuration.
    let out = Command::new(Path::new(env!("CARGO_BIN_EXE_containerd-shim-vmdisk-v2")))
        .arg("--help")
        .env("VMDISK_SHIM_CONFIG", "/nonexistent/shim.toml")
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("vmdisk.io/image")
    );
    // Registry flags only where a registry is spoken to.
    let (err, ok, _) = timed_vmdisk(&["ls", "--plain-http"]);
    assert!(
        !ok && err.contains("unexpected argument '--plain-http'"),
        "{err}"
    );
}

/// Long commands show their progress on stderr: a bar on a terminal (script(1) gives the
/// command one), a plain line every few seconds in a pipe, nothing with `--quiet`; stdout
/// holds the command's result alone. `vmdisk index` reads a 16 MiB gzip layer through a slow
/// proxy (a registry far away).
#[test]
fn long_commands_show_their_progress_on_a_terminal_and_as_lines_in_a_pipe() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let disk = scratch.path("disk.img");
    random_file(&disk, 16 << 20, 5);
    let layout = scratch.path("layout");
    oci_layout(&layout, &disk, "disk/disk.img", Layer::Tar, "amd64");
    skopeo_push(
        &layout,
        &format!("{}/vendor/gz:1", reg.host()),
        &["--dest-compress-format", "gzip"],
    );
    let slow = |delay_ms| {
        FaultProxy::start_with(
            reg.port,
            Faults {
                response_delay: Some(Duration::from_millis(delay_ms)),
                ..Faults::default()
            },
        )
    };
    let (far, near) = (slow(40), slow(4));
    let image = |proxy: &FaultProxy| format!("{}/vendor/gz:1", proxy.host());
    let to = |name: &str| format!("{}/indexes/{name}", reg.host());

    // In a pipe: lines every 5 s while it runs, one at the end; the JSON report alone on stdout.
    let started = Instant::now();
    let out = vmdisk(&["index", "--json", "--to", &to("pipe"), &image(&far)]);
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    eprintln!("index in a pipe, {took:?}:\n{stderr}");
    assert!(out.status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["spans"].as_u64().unwrap() > 0);
    let what = format!("indexing {}: ", image(&far));
    let periodic = stderr
        .lines()
        .filter(|l| l.starts_with(&what) && l.contains("%), ") && l.ends_with(" left"))
        .count();
    assert!(
        periodic as u64 >= took.as_secs() / 5 - 1 && periodic >= 1,
        "{periodic} progress lines in {took:?}:\n{stderr}"
    );
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with(&what) && l.contains(": done, ")),
        "no last line:\n{stderr}"
    );

    // --quiet: nothing but the result.
    let out = vmdisk(&[
        "index",
        "--quiet",
        "--json",
        "--to",
        &to("quiet"),
        &image(&near),
    ]);
    assert!(out.status.success());
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("indexing"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap();

    // On a terminal: a bar redrawn in place (escape sequences, bytes done of the total), then
    // the result.
    let command = format!(
        "{} index --to {} {}",
        env!("CARGO_BIN_EXE_vmdisk"),
        to("tty"),
        image(&near)
    );
    let tty = Command::new("script")
        .args(["-qfec", &command, "/dev/null"])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&tty.stdout).to_string();
    assert!(tty.status.success(), "{shown}");
    assert!(
        shown.contains(&format!("indexing {}", image(&near)))
            && shown.contains(" MiB/16.")
            && shown.contains("\u{1b}["),
        "no progress bar on a terminal:\n{shown:?}"
    );
    assert!(shown.contains("indexed "), "{shown:?}");
    assert!(
        !shown.lines().any(|l| l.contains("%), ")),
        "plain lines on a terminal:\n{shown:?}"
    );
}
