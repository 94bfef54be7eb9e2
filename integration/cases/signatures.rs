//! Signature policies with signatures the real tools write: `cosign` 3.1 (key pairs made here,
//! its default sigstore bundles and its older simple signing payloads) and `notation` 1.3
//! (a test certificate made here, JWS envelopes), both unpacked by `make deps`, against a
//! local registry, the daemon in front of containerd 1.6's CRI, and the CLI. What a policy
//! refuses never reaches a disk byte: the counting proxy in front of the registry sees a few
//! manifests and signatures, where one chunk of these disks is 256 KiB of random data.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::fixtures::cri::{CriContainerd, Daemon};
use crate::fixtures::harness::*;

/// The signing tools `make deps` unpacks (Debian's cosign and notation).
fn signer(tool: &str) -> PathBuf {
    unpacked("signers/usr/bin", tool)
}

/// Runs a signing tool with `home` as its home and configuration directory; its stdout.
fn sign_tool(tool: &str, home: &Path, args: &[&str]) -> String {
    let out = Command::new(signer(tool))
        .args(args)
        .env("HOME", home)
        .env("XDG_CONFIG_HOME", home.join("xdg"))
        .env("COSIGN_PASSWORD", "")
        .current_dir(home)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// `cosign sign` of `image` (by digest) with the key pair `key` (its `.key` file), offline.
fn cosign_sign(home: &Path, key: &str, image: &str, extra: &[&str]) {
    let key = format!("{key}.key");
    let mut args = vec![
        "sign",
        "--key",
        &key,
        "--tlog-upload=false",
        "--use-signing-config=false",
        "--allow-http-registry",
        "-y",
    ];
    args.extend_from_slice(extra);
    args.push(image);
    sign_tool("cosign", home, &args);
}

/// A 32 MiB qcow2 with 8 MiB of random data (seed `seed`) pushed as `image`; its digest.
fn push_disk(scratch: &Scratch, image: &str, seed: u64) -> (PathBuf, String) {
    let disk = scratch.path(&format!("disk-{seed}.qcow2"));
    make_qcow2(&disk, "32M", &[]);
    write_random(&disk, 1 << 20, 8 << 20, seed);
    let out = vmdisk_ok(&["push", disk.to_str().unwrap(), image]);
    (disk, last_line(&out))
}

/// `repo@digest` of `image` (`repo:tag`).
fn pinned(image: &str, digest: &str) -> String {
    format!("{}@{digest}", image.rsplit_once(':').unwrap().0)
}

#[test]
fn signed_disks_are_served_and_everything_else_is_refused_before_a_byte() {
    let scratch = Scratch::new();
    let home = scratch.path("signer");
    std::fs::create_dir_all(&home).unwrap();
    sign_tool(
        "cosign",
        &home,
        &["generate-key-pair", "--output-key-prefix", "trusted"],
    );
    sign_tool(
        "cosign",
        &home,
        &["generate-key-pair", "--output-key-prefix", "other"],
    );
    sign_tool(
        "notation",
        &home,
        &["cert", "generate-test", "--default", "vmdisk-test"],
    );

    let registry = Registry::start(&scratch);
    let counted = FaultProxy::counting(registry.port);
    let host = counted.host();
    let image = |name: &str| format!("{host}/{name}");

    // Signed with the trusted key, in cosign's bundle format and in its older format.
    let signed = image("vm/signed:1");
    let (signed_disk, signed_digest) = push_disk(&scratch, &signed, 1);
    cosign_sign(&home, "trusted", &pinned(&signed, &signed_digest), &[]);
    let legacy = image("vm/legacy:1");
    let (_, legacy_digest) = push_disk(&scratch, &legacy, 2);
    cosign_sign(
        &home,
        "trusted",
        &pinned(&legacy, &legacy_digest),
        &["--new-bundle-format=false"],
    );
    // Unsigned; signed by another key; signed, then the tag moved to other content; and a
    // signature of another digest copied beside this one (the referrers fallback tag).
    let unsigned = image("vm/unsigned:1");
    push_disk(&scratch, &unsigned, 3);
    let other_key = image("vm/otherkey:1");
    let (_, d) = push_disk(&scratch, &other_key, 4);
    cosign_sign(&home, "other", &pinned(&other_key, &d), &[]);
    let moved = image("vm/moved:1");
    let (_, d) = push_disk(&scratch, &moved, 5);
    cosign_sign(&home, "trusted", &pinned(&moved, &d), &[]);
    push_disk(&scratch, &moved, 6);
    let copied = image("vm/copied:1");
    let (_, first) = push_disk(&scratch, &image("vm/copied:first"), 7);
    cosign_sign(&home, "trusted", &pinned(&copied, &first), &[]);
    let (_, second) = push_disk(&scratch, &copied, 8);
    let fallback = |d: &str| registry.url(&format!("/v2/vm/copied/manifests/sha256-{}", &d[7..]));
    let index = curl(&[
        "-sf",
        "-H",
        "Accept: application/vnd.oci.image.index.v1+json",
        &fallback(&first),
    ]);
    let index_file = scratch.path("copied-index.json");
    std::fs::write(&index_file, &index).unwrap();
    curl(&[
        "-sf",
        "-X",
        "PUT",
        "-H",
        "Content-Type: application/vnd.oci.image.index.v1+json",
        "--data-binary",
        &format!("@{}", index_file.display()),
        &fallback(&second),
    ]);
    // notation: one signed, one not, both in repositories its trust policy covers strictly.
    let notary = image("notary/disk:1");
    let (notary_disk, d) = push_disk(&scratch, &notary, 9);
    sign_tool(
        "notation",
        &home,
        &["sign", "--insecure-registry", &pinned(&notary, &d)],
    );
    let notary_unsigned = image("notary/unsigned:1");
    push_disk(&scratch, &notary_unsigned, 10);

    // The node's policies: every repository of this registry needs the trusted cosign key,
    // but notary/*, which notation's trust policy covers.
    let policy = scratch.path("policy.json");
    let write_policy = |vm: &str| {
        std::fs::write(
            &policy,
            format!(
                r#"{{"default":[{{"type":"insecureAcceptAnything"}}],"transports":{{"docker":{{
                  "{host}":[{vm}],
                  "{host}/notary":[{{"type":"insecureAcceptAnything"}}]}}}}}}"#
            ),
        )
        .unwrap();
    };
    let trusted = format!(
        r#"{{"type":"sigstoreSigned","keyPath":"{}","signedIdentity":{{"type":"matchRepository"}}}}"#,
        home.join("trusted.pub").display()
    );
    write_policy(&trusted);
    let trust_policy = scratch.path("trustpolicy.json");
    std::fs::write(
        &trust_policy,
        format!(
            r#"{{"version":"1.0","trustPolicies":[
              {{"name":"vm","registryScopes":["{host}/notary/disk","{host}/notary/unsigned"],
                "signatureVerification":{{"level":"strict"}},"trustStores":["ca:vmdisk-test"],
                "trustedIdentities":["x509.subject: CN=vmdisk-test, O=Notary"]}},
              {{"name":"rest","registryScopes":["*"],"signatureVerification":{{"level":"skip"}}}}]}}"#
        ),
    )
    .unwrap();
    let index_repo = image("indexes");
    // (The daemon's configuration goes on inside its [registry] table.)
    let mut daemon = Daemon::start(
        &scratch,
        &format!(
            "index_repositories = [\"{index_repo}\"]\n[signatures]\npolicy = \"{}\"\nnotation_trust_policy = \"{}\"\nnotation_trust_store = \"{}\"\n",
            policy.display(),
            trust_policy.display(),
            home.join("xdg/notation/truststore").display(),
        ),
    );
    let pause = scratch.path("pause");
    crate::fixtures::cri::busybox_layout(&pause, &["/bin/sleep", "2147483647"]);
    let public = Registry::start(&scratch);
    skopeo_push(&pause, &format!("{}/pause:1", public.host()), &[]);
    let ctd = CriContainerd::start(
        &scratch,
        &daemon.socket,
        &format!("{}/pause:1", public.host()),
        &[public.port, counted.port],
    );

    // A refusal: fails, names the image, the policy entry and the reason, and moves no disk
    // byte (a few manifests and signature blobs: under one 256 KiB chunk).
    let refused = |what: &str, out: std::process::Output, why: &str, before: u64| {
        let text = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(
            !out.status.success(),
            "{what}: served {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(
            text.contains("refused by") && text.contains(why),
            "{what}: {text}"
        );
        let moved = counted.bytes_to_client() - before;
        assert!(moved < 64 << 10, "{what}: {moved} bytes moved");
    };

    // Signed: a CRI pull makes a remote snapshot, and the disk is served as published, through
    // the snapshotter and through `vmdisk path`; both cosign formats are accepted.
    ctd.pull(&signed)
        .unwrap_or_else(|e| panic!("PullImage {signed}: {e}\n{}", daemon.log_text()));
    assert_eq!(
        daemon.decisions().get("remote"),
        Some(&1),
        "{:?}",
        daemon.decisions()
    );
    let ready = daemon.vmdisk_ok(&["path", &signed]);
    assert!(files_identical(Path::new(ready.trim()), &signed_disk));
    daemon.vmdisk_ok(&["path", &legacy]);
    // The mount servers take the daemon's decisions from the cache: no signature fetched twice.
    assert!(
        !daemon
            .servers_log_text()
            .contains("accepted by the signature policy"),
        "a mount server checked signatures again"
    );
    ctd.pull(&notary)
        .unwrap_or_else(|e| panic!("PullImage {notary}: {e}\n{}", daemon.log_text()));
    let ready = daemon.vmdisk_ok(&["path", &notary]);
    assert!(files_identical(Path::new(ready.trim()), &notary_disk));

    // Refused, each with its reason, before any byte of its disk. (The disks served so far are
    // fetched whole in the background; those bytes are let finish before counting.)
    wait_until_quiet(|| counted.bytes_to_client());
    let before = counted.bytes_to_client();
    let e = ctd.pull(&unsigned).unwrap_err();
    assert!(
        e.message().contains("refused by") && e.message().contains("no cosign signature"),
        "the CRI pull of an unsigned image: {e}"
    );
    assert!(counted.bytes_to_client() - before < 64 << 10);
    assert_eq!(daemon.decisions().get("refused:policy"), Some(&1));
    assert_eq!(
        daemon.decisions().get("remote"),
        Some(&2),
        "nothing else was served"
    );
    for (what, reference, why) in [
        ("unsigned", &unsigned, "it has no cosign signature"),
        ("another key", &other_key, "not signed by the policy's key"),
        ("a moved tag", &moved, "it has no cosign signature"),
        (
            "a copied signature",
            &copied,
            &format!("it signs {first}, not {second}"),
        ),
        (
            "notation, unsigned",
            &notary_unsigned,
            "no notation signature of",
        ),
    ] {
        let before = counted.bytes_to_client();
        refused(what, daemon.vmdisk(&["path", reference]), why, before);
    }
    // The CLI's own policy, beside the daemon's: a policy that wants the other key refuses
    // what the daemon would serve (`path`), and `inspect` and `mount` refuse the same way.
    let other_policy = scratch.path("other-policy.json");
    std::fs::write(
        &other_policy,
        std::fs::read_to_string(&policy)
            .unwrap()
            .replace("trusted.pub", "other.pub"),
    )
    .unwrap();
    let other = other_policy.to_str().unwrap();
    let before = counted.bytes_to_client();
    refused(
        "path --policy",
        daemon.vmdisk(&["path", "--policy", other, &signed]),
        "not signed by the policy's key",
        before,
    );
    refused(
        "inspect --policy",
        vmdisk(&["inspect", "--policy", other, &signed]),
        "not signed by the policy's key",
        before,
    );
    let mnt = scratch.path("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    refused(
        "mount --policy",
        vmdisk(&[
            "mount",
            "--policy",
            other,
            "--cache",
            scratch.path("cli-cache").to_str().unwrap(),
            &signed,
            mnt.to_str().unwrap(),
        ]),
        "not signed by the policy's key",
        before,
    );
    // Both hold: what the command's policy accepts, the daemon's still refuses.
    let out = daemon.vmdisk(&["path", "--policy", other, &other_key]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && text.contains(&policy.display().to_string()),
        "{text}"
    );

    // A gzip disk image, signed, read through a seekable index: an index the policy does not
    // accept (here unsigned, in the image's own repository) is refused before a byte of it is
    // read, whatever it says; one signed with the trusted key (in the index repository) is
    // used.
    let gz = image("vm/gzip:1");
    let gz_disk = scratch.path("gzip.qcow2");
    make_qcow2(&gz_disk, "32M", &[]);
    write_random(&gz_disk, 1 << 20, 8 << 20, 11);
    let layout = scratch.path("gzip-layout");
    oci_layout(&layout, &gz_disk, "disk/gzip.qcow2", Layer::Gzip, "amd64");
    skopeo_push(&layout, &gz, &[]);
    let gz_digest = inspect_json(&gz)["digest"].as_str().unwrap().to_string();
    cosign_sign(&home, "trusted", &pinned(&gz, &gz_digest), &[]);
    vmdisk_ok(&["index", &gz]);
    // The disks served above may still be fetched whole in the background.
    wait_until_quiet(|| counted.bytes_to_client());
    let before = counted.bytes_to_client();
    refused(
        "an unsigned index",
        daemon.vmdisk(&["path", &gz]),
        "seekable index",
        before,
    );
    let published: serde_json::Value =
        serde_json::from_str(&vmdisk_ok(&["index", "--json", "--to", &index_repo, &gz])).unwrap();
    let artifact = published["artifact"].as_str().unwrap();
    cosign_sign(&home, "trusted", &format!("{index_repo}@{artifact}"), &[]);
    let ready = daemon.vmdisk_ok(&["path", &gz]);
    assert!(files_identical(Path::new(ready.trim()), &gz_disk));
    assert!(
        daemon.log_text().contains("refusing a seekable index"),
        "the own repository's unsigned index was not refused"
    );

    // Decisions are kept: after a restart the signed image is served without checking again;
    // a changed policy checks again (and here refuses).
    daemon.stop();
    daemon.restart();
    let log_before = daemon.log_text().len();
    daemon.vmdisk_ok(&["path", &signed]);
    let since = daemon.log_text()[log_before..].to_string();
    assert!(
        !since.contains("accepted by the signature policy"),
        "checked again after a restart: {since}"
    );
    write_policy(&trusted.replace("trusted.pub", "other.pub"));
    daemon.stop();
    daemon.restart();
    wait_until_quiet(|| counted.bytes_to_client());
    let before = counted.bytes_to_client();
    refused(
        "after the policy changed",
        daemon.vmdisk(&["path", &signed]),
        "not signed by the policy's key",
        before,
    );
}
