//! `vmdisk-snapshotter` against the real thing: the snapshots API with real overlay and bind
//! mounts (the ground of containerd's `snapshots/testsuite`), the remote-snapshot handshake,
//! and containerd 1.6 driven through CRI the way kubelet drives it.

use std::collections::HashMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tonic::Code;
use vmdisk::api::containerd::services::snapshots::v1 as pb;
use vmdisk::api::containerd::services::snapshots::v1::snapshots_client::SnapshotsClient;

use crate::fixtures::cri::{labels, mount_all, prepare_req, rt, Daemon};
use crate::fixtures::harness::Scratch;
use crate::fixtures::images::registry_with_images;

/// A synchronous snapshots client with mount helpers, for the API suite.
struct Suite {
    rt: tokio::runtime::Runtime,
    client: SnapshotsClient<tonic::transport::Channel>,
    mnt: PathBuf,
    base: PathBuf,
    mounted: Vec<PathBuf>,
    n: usize,
}

impl Suite {
    fn new(daemon: &Daemon, scratch: &Scratch) -> Self {
        let rt = rt();
        let client = rt.block_on(daemon.snapshots());
        Suite {
            rt,
            client,
            mnt: scratch.path("mnt"),
            base: daemon.root.join("snapshots"),
            mounted: Vec::new(),
            n: 0,
        }
    }

    fn prepare(
        &mut self,
        key: &str,
        parent: &str,
    ) -> Result<Vec<vmdisk::api::containerd::types::Mount>, tonic::Status> {
        let r = self
            .rt
            .block_on(self.client.prepare(prepare_req(key, parent, &[])))?;
        Ok(r.into_inner().mounts)
    }

    fn view(
        &mut self,
        key: &str,
        parent: &str,
    ) -> Result<Vec<vmdisk::api::containerd::types::Mount>, tonic::Status> {
        let r = self.rt.block_on(self.client.view(pb::ViewSnapshotRequest {
            snapshotter: "vmdisk".into(),
            key: key.into(),
            parent: parent.into(),
            labels: HashMap::new(),
        }))?;
        Ok(r.into_inner().mounts)
    }

    fn commit(&mut self, name: &str, key: &str, l: &[(&str, &str)]) -> Result<(), tonic::Status> {
        self.rt
            .block_on(self.client.commit(pb::CommitSnapshotRequest {
                snapshotter: "vmdisk".into(),
                name: name.into(),
                key: key.into(),
                labels: labels(l),
            }))?;
        Ok(())
    }

    fn remove(&mut self, key: &str) -> Result<(), tonic::Status> {
        self.rt
            .block_on(self.client.remove(pb::RemoveSnapshotRequest {
                snapshotter: "vmdisk".into(),
                key: key.into(),
            }))?;
        Ok(())
    }

    fn stat(&mut self, key: &str) -> Result<pb::Info, tonic::Status> {
        let r = self.rt.block_on(self.client.stat(pb::StatSnapshotRequest {
            snapshotter: "vmdisk".into(),
            key: key.into(),
        }))?;
        Ok(r.into_inner().info.unwrap())
    }

    fn list(&mut self, filters: &[&str]) -> Result<Vec<pb::Info>, tonic::Status> {
        self.rt.block_on(async {
            let mut stream = self
                .client
                .list(pb::ListSnapshotsRequest {
                    snapshotter: "vmdisk".into(),
                    filters: filters.iter().map(|s| s.to_string()).collect(),
                })
                .await?
                .into_inner();
            let mut out = Vec::new();
            while let Some(batch) = stream.message().await? {
                out.extend(batch.info);
            }
            Ok(out)
        })
    }

    /// Mounts `mounts` at a fresh directory and returns it.
    fn mount(&mut self, mounts: &[vmdisk::api::containerd::types::Mount]) -> PathBuf {
        self.n += 1;
        let target = self.mnt.join(self.n.to_string());
        std::fs::create_dir_all(&target).unwrap();
        mount_all(mounts, &target, &self.base);
        self.mounted.push(target.clone());
        target
    }

    fn unmount(&mut self, target: &Path) {
        assert!(
            crate::fixtures::cri::run_quiet("umount", &[target.to_str().unwrap()]),
            "umount {}",
            target.display()
        );
        self.mounted.retain(|m| m != target);
    }

    /// Prepare on `parent`, let `apply` change the files, commit as `name`.
    fn layer(&mut self, name: &str, parent: &str, apply: impl FnOnce(&Path)) {
        let key = format!("{name}-active");
        let m = self.prepare(&key, parent).unwrap();
        let dir = self.mount(&m);
        apply(&dir);
        self.unmount(&dir);
        self.commit(name, &key, &[]).unwrap();
    }

    /// Unmounts everything this suite mounted and removes every view.
    fn drop_views(&mut self) {
        for m in self.mounted.clone() {
            self.unmount(&m);
        }
        let views: Vec<String> = self
            .list(&["kind==View"])
            .unwrap()
            .into_iter()
            .map(|i| i.name)
            .collect();
        for v in views {
            self.remove(&v).unwrap();
        }
    }

    /// A read-only view of `parent`, mounted; returns the directory.
    fn look(&mut self, parent: &str) -> PathBuf {
        self.n += 1;
        let key = format!("look-{}", self.n);
        let m = self.view(&key, parent).unwrap();
        self.mount(&m)
    }
}

impl Drop for Suite {
    fn drop(&mut self) {
        for m in self.mounted.drain(..).rev() {
            crate::fixtures::cri::run_quiet("umount", &["-l", m.to_str().unwrap()]);
        }
    }
}

fn write(path: &Path, text: &str) {
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p).unwrap();
    }
    std::fs::write(path, text).unwrap();
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Basic, StatActive, StatCommitted, Transitivity, PrepareView, ViewReadonly, RootPermission,
/// Remove, RemoveIntermediateSnapshot, CloseTwice, Update, Walk, StatInWalk.
#[test]
fn snapshots_api_lifecycle() {
    let scratch = Scratch::new();
    let daemon = Daemon::start(&scratch, "");
    let mut s = Suite::new(&daemon, &scratch);

    // Basic + StatActive + RootPermission.
    let m = s.prepare("base-active", "").unwrap();
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].r#type, "bind");
    let info = s.stat("base-active").unwrap();
    assert_eq!(
        (info.name.as_str(), info.parent.as_str(), info.kind),
        ("base-active", "", pb::Kind::Active as i32)
    );
    let dir = s.mount(&m);
    assert_eq!(
        std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o755
    );
    write(&dir.join("foo"), "foo\n");
    write(&dir.join("a/b"), "in a\n");
    s.unmount(&dir);
    s.commit("base", "base-active", &[("kind", "base")])
        .unwrap();
    assert_eq!(s.stat("base-active").unwrap_err().code(), Code::NotFound);
    // StatCommitted.
    let info = s.stat("base").unwrap();
    assert_eq!(info.kind, pb::Kind::Committed as i32);
    assert_eq!(info.labels.get("kind").map(String::as_str), Some("base"));

    // Transitivity: base → mid → top; a view of top sees all three layers.
    s.layer("mid", "base", |d| {
        assert_eq!(read(&d.join("foo")), "foo\n");
        write(&d.join("bar"), "bar\n");
    });
    s.layer("top", "mid", |d| write(&d.join("baz"), "baz\n"));
    assert_eq!(s.stat("top").unwrap().parent, "mid");
    let v = s.look("top");
    for (f, t) in [
        ("foo", "foo\n"),
        ("a/b", "in a\n"),
        ("bar", "bar\n"),
        ("baz", "baz\n"),
    ] {
        assert_eq!(read(&v.join(f)), t);
    }
    // ViewReadonly.
    let err = std::fs::write(v.join("new"), "x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc_erofs()), "{err}");
    // PrepareView: a view of one parent is a read-only bind of it.
    let m = s.view("v1", "base").unwrap();
    assert_eq!(
        (
            m[0].r#type.as_str(),
            m[0].options.contains(&"ro".to_string())
        ),
        ("bind", true)
    );
    assert_eq!(s.stat("v1").unwrap().kind, pb::Kind::View as i32);
    assert_eq!(
        s.view("v1", "base").unwrap_err().code(),
        Code::AlreadyExists
    );
    assert_eq!(s.view("v2", "nope").unwrap_err().code(), Code::NotFound);
    assert_eq!(
        s.prepare("p-on-active", "v1").unwrap_err().code(),
        Code::FailedPrecondition
    );
    // Mounts of an existing snapshot equal what Prepare/View returned.
    let again =
        s.rt.block_on(s.client.mounts(pb::MountsRequest {
            snapshotter: "vmdisk".into(),
            key: "v1".into(),
        }))
        .unwrap()
        .into_inner()
        .mounts;
    assert_eq!(again, m);
    // Commit only from active.
    assert_eq!(
        s.commit("c", "v1", &[]).unwrap_err().code(),
        Code::FailedPrecondition
    );

    // Remove + RemoveIntermediateSnapshot + CloseTwice.
    for l in s.mounted.clone() {
        s.unmount(&l);
    }
    assert_eq!(
        s.remove("mid").unwrap_err().code(),
        Code::FailedPrecondition
    );
    s.drop_views();
    s.remove("top").unwrap();
    s.remove("mid").unwrap();
    assert_eq!(s.remove("mid").unwrap_err().code(), Code::NotFound);

    // Update: by path, whole set, unknown key; created stays, updated moves.
    let before = s.stat("base").unwrap();
    let update = |s: &mut Suite, l: &[(&str, &str)], paths: &[&str]| {
        s.rt.block_on(s.client.update(pb::UpdateSnapshotRequest {
            snapshotter: "vmdisk".into(),
            info: Some(pb::Info {
                name: "base".into(),
                labels: labels(l),
                ..Default::default()
            }),
            update_mask: Some(prost_types::FieldMask {
                paths: paths.iter().map(|p| p.to_string()).collect(),
            }),
        }))
    };
    let after = update(&mut s, &[("x", "1"), ("kind", "changed")], &["labels.x"])
        .unwrap()
        .into_inner()
        .info
        .unwrap();
    assert_eq!(after.labels, labels(&[("kind", "base"), ("x", "1")]));
    assert_eq!(after.created_at, before.created_at);
    assert_ne!(after.updated_at, before.updated_at);
    let after = update(&mut s, &[("only", "this")], &[])
        .unwrap()
        .into_inner()
        .info
        .unwrap();
    assert_eq!(after.labels, labels(&[("only", "this")]));
    assert_eq!(
        update(&mut s, &[], &["parent"]).unwrap_err().code(),
        Code::InvalidArgument
    );

    // Walk with filters, and StatInWalk.
    s.prepare("w1", "base").unwrap();
    s.view("w2", "base").unwrap();
    let names = |v: Vec<pb::Info>| {
        let mut n: Vec<String> = v.into_iter().map(|i| i.name).collect();
        n.sort();
        n
    };
    assert_eq!(names(s.list(&[]).unwrap()), ["base", "w1", "w2"]);
    assert_eq!(names(s.list(&["kind==active"]).unwrap()), ["w1"]);
    assert_eq!(names(s.list(&["parent==base,kind!=View"]).unwrap()), ["w1"]);
    assert_eq!(
        names(s.list(&["labels.only==this", "name==w2"]).unwrap()),
        ["base", "w2"]
    );
    assert_eq!(names(s.list(&[r#"labels."only""#]).unwrap()), ["base"]);
    assert_eq!(
        s.list(&["name=="]).unwrap_err().code(),
        Code::InvalidArgument
    );
    for info in s.list(&[]).unwrap() {
        assert_eq!(info, s.stat(&info.name).unwrap());
    }
    // Usage of an active snapshot is measured; of a committed one, frozen at commit.
    let usage = |s: &mut Suite, k: &str| {
        s.rt.block_on(s.client.usage(pb::UsageRequest {
            snapshotter: "vmdisk".into(),
            key: k.into(),
        }))
        .unwrap()
        .into_inner()
    };
    let u = usage(&mut s, "base");
    assert!(u.inodes >= 4 && u.size > 0, "{u:?}");
}

fn libc_erofs() -> i32 {
    30
}

/// LayerFileUpdate, RemoveDirectoryInLowerLayer, Chown, DirectoryPermissionOnCommit,
/// DeletedFilesInChildSnapshot, MoveFileFromLowerLayer, Rename: overlay semantics through the
/// mounts the snapshotter returns.
#[test]
fn snapshots_api_overlay_semantics() {
    let scratch = Scratch::new();
    let daemon = Daemon::start(&scratch, "");
    let mut s = Suite::new(&daemon, &scratch);
    s.layer("l1", "", |d| {
        write(&d.join("file"), "one\n");
        write(&d.join("dir/inner"), "inner\n");
        write(&d.join("moveme"), "moving\n");
        write(&d.join("gone"), "gone\n");
        std::fs::create_dir(d.join("private")).unwrap();
        std::fs::set_permissions(d.join("private"), std::fs::Permissions::from_mode(0o700))
            .unwrap();
        std::os::unix::fs::chown(d.join("file"), Some(1234), Some(5678)).unwrap();
    });
    s.layer("l2", "l1", |d| {
        write(&d.join("file"), "two\n");
        std::fs::remove_dir_all(d.join("dir")).unwrap();
        std::fs::rename(d.join("moveme"), d.join("moved")).unwrap();
        std::fs::remove_file(d.join("gone")).unwrap();
        std::fs::create_dir(d.join("newdir")).unwrap();
        write(&d.join("newdir/x"), "x\n");
        std::fs::rename(d.join("newdir"), d.join("renamed")).unwrap();
        std::os::unix::fs::chown(d.join("renamed"), Some(42), Some(43)).unwrap();
    });
    let v1 = s.look("l1");
    assert_eq!(read(&v1.join("file")), "one\n");
    let m = std::fs::metadata(v1.join("file")).unwrap();
    assert_eq!((m.uid(), m.gid()), (1234, 5678));
    assert_eq!(
        std::fs::metadata(v1.join("private"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o700
    );
    let v2 = s.look("l2");
    assert_eq!(read(&v2.join("file")), "two\n");
    assert!(!v2.join("dir").exists());
    assert!(!v2.join("moveme").exists());
    assert_eq!(read(&v2.join("moved")), "moving\n");
    assert!(!v2.join("gone").exists());
    assert_eq!(read(&v2.join("renamed/x")), "x\n");
    let m = std::fs::metadata(v2.join("renamed")).unwrap();
    assert_eq!((m.uid(), m.gid()), (42, 43));
    // The lower layer is untouched by the child's changes.
    assert_eq!(read(&v1.join("dir/inner")), "inner\n");
}

/// 128LayersMount: 128 layers, each adding a file; the top's view sees all of them.
#[test]
fn snapshots_api_128_layers() {
    let scratch = Scratch::new();
    let daemon = Daemon::start(&scratch, "");
    let mut s = Suite::new(&daemon, &scratch);
    let mut parent = String::new();
    for i in 0..128 {
        let name = format!("layer-{i}");
        s.layer(&name, &parent, |d| {
            write(&d.join(format!("f{i}")), &format!("{i}\n"))
        });
        parent = name;
    }
    let v = s.look(&parent);
    for i in 0..128 {
        assert_eq!(read(&v.join(format!("f{i}"))), format!("{i}\n"));
    }
}

fn bytes(proxy: &crate::fixtures::harness::FaultProxy) -> u64 {
    proxy.to_client.load(std::sync::atomic::Ordering::SeqCst)
}

/// The CRI flow kubelet drives: a lazily loadable containerDisk is pulled as a remote
/// snapshot for a small fraction of its bytes, KubeVirt's pattern reads `/disk` in full with
/// the original's digest, an ordinary image runs through the same snapshotter, and a re-pull
/// after removal fetches no disk bytes.
#[test]
fn cri_pull_is_lazy_and_kubevirt_reads_the_whole_disk() {
    use crate::fixtures::cri::{container_output, CriContainerd};
    use crate::fixtures::harness::{sha256_file, FaultProxy};
    let scratch = Scratch::new();
    let (reg, disk) = registry_with_images(&scratch, 384);
    let proxy = FaultProxy::start(reg.port, None);
    let daemon = Daemon::start(&scratch, "");
    let pause = format!("{}/pause:1", reg.host());
    let ctd = CriContainerd::start(&scratch, &daemon.socket, &pause, &[reg.port, proxy.port]);
    let image = format!("127.0.0.1:{}/disk:1", proxy.port);
    let disk_len = std::fs::metadata(&disk).unwrap().len();

    let before = bytes(&proxy);
    let (_, took) = ctd
        .pull(&image)
        .unwrap_or_else(|e| panic!("PullImage: {e}\n{}", daemon.log_text()));
    let pulled = bytes(&proxy) - before;
    eprintln!(
        "PullImage (lazy): {took:?}, {pulled} registry bytes for a {disk_len}-byte disk ({:.3}%)",
        pulled as f64 * 100.0 / disk_len as f64
    );
    assert!(pulled < disk_len / 100, "lazy pull moved {pulled} bytes");
    let disks = daemon.disks();
    assert_eq!(disks.len(), 1, "{disks:?}");
    assert!(
        disks[0].serving && disks[0].disk_path == "disk/disk.qcow2",
        "{:?}",
        disks[0]
    );
    let layer = disks[0].layer_digest.clone();
    assert_eq!(
        daemon.decisions().get("remote"),
        Some(&1),
        "{:?}",
        daemon.decisions()
    );
    // containerd records the layer's snapshot as the remote one we created.
    let out = ctd.ctr(&["-n", "k8s.io", "snapshots", "--snapshotter", "vmdisk", "ls"]);
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(listing.contains("Committed"), "{listing}");
    let s = rt();
    let remote = s.block_on(async {
        let mut c = daemon.snapshots().await;
        let mut stream = c
            .list(pb::ListSnapshotsRequest {
                snapshotter: "vmdisk".into(),
                filters: vec![r#"labels."containerd.io/snapshot/remote"==vmdisk"#.into()],
            })
            .await
            .unwrap()
            .into_inner();
        let mut n = Vec::new();
        while let Some(b) = stream.message().await.unwrap() {
            n.extend(b.info);
        }
        n
    });
    assert_eq!(remote.len(), 1);
    drop(s);

    // KubeVirt's pattern: the containerDisk as the container image, host busybox reading /disk.
    let logs = scratch.path("pod-logs");
    let sandbox = ctd.run_sandbox("vm", &logs);
    let id = ctd.start_container(
        &sandbox,
        "compute",
        &image,
        &["/busybox", "sha256sum", "/disk/disk.qcow2"],
    );
    assert_eq!(
        ctd.wait_exit(&id, std::time::Duration::from_secs(600)),
        0,
        "{:?}",
        container_output(&logs.join("compute.log"))
    );
    let out = container_output(&logs.join("compute.log"));
    let want = sha256_file(&disk);
    assert!(
        out.first()
            .is_some_and(|l| want.ends_with(l.split_whitespace().next().unwrap_or("-"))),
        "{out:?} vs {want}"
    );

    // An ordinary image through the same snapshotter.
    ctd.assert_echo(
        &sandbox,
        &format!("{}/busybox:1", reg.host()),
        "plain",
        "ordinary-ok",
        &logs,
    );
    let decisions = daemon.decisions();
    // The pause and busybox images share their one layer: one ordinary decision for both
    // (images that run a program, not disk images).
    assert!(
        decisions
            .get("ordinary:not_disk_image")
            .copied()
            .unwrap_or(0)
            >= 1,
        "{decisions:?}"
    );
    assert!(
        !decisions.keys().any(|k| k.starts_with("fallback")),
        "{decisions:?}"
    );

    // Removal and re-pull: the disk's bytes come from the cache. The complete layer's check
    // against its diff_id (which fetches the tar headers between chunks, never cached) is the
    // first server's to finish: a re-pull before its verdict would check it again.
    assert_eq!(crate::fixtures::images::wait_verified(&daemon), "verified");
    ctd.remove_sandbox(&sandbox.0);
    ctd.remove_image(&image);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !daemon.disks().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the remote snapshot was not removed: {:?}",
            daemon.disks()
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let before = bytes(&proxy);
    let (_, took) = ctd.pull(&image).unwrap();
    let repulled = bytes(&proxy) - before;
    let disks = daemon.disks();
    eprintln!(
        "re-pull after removal: {took:?}, {repulled} registry bytes; chunk bytes {}",
        disks[0].registry_bytes
    );
    assert_eq!(disks[0].layer_digest, layer);
    assert_eq!(disks[0].registry_bytes, 0);
    assert_eq!(disks[0].chunks_cached, disks[0].chunks, "{:?}", disks[0]);
    assert!(repulled < 16 << 10, "re-pull moved {repulled} bytes");
}

/// Daemon crash and restart while a container reads the disk: the reads complete with the
/// right bytes (the mount server keeps serving), and the restarted daemon adopts it.
/// With the daemon and its mount server gone and the registry unreachable, a restart
/// mounts the layer again from the cache before it accepts calls.
#[test]
fn daemon_restart_keeps_the_disk_readable() {
    use crate::fixtures::cri::{container_output, CriContainerd};
    use crate::fixtures::harness::sha256_file;
    let scratch = Scratch::new();
    let (reg, disk) = registry_with_images(&scratch, 256);
    let mut daemon = Daemon::start(&scratch, "");
    let pause = format!("{}/pause:1", reg.host());
    let ctd = CriContainerd::start(&scratch, &daemon.socket, &pause, &[reg.port]);
    let image = format!("{}/disk:1", reg.host());
    ctd.pull(&image).unwrap();
    let server = daemon.server_pids();
    assert_eq!(server.len(), 1);
    let logs = scratch.path("pod-logs");
    let sandbox = ctd.run_sandbox("vm", &logs);
    let script = "for i in 1 2 3; do /busybox sha256sum /disk/disk.qcow2; done";
    let id = ctd.start_container(
        &sandbox,
        "reader",
        &image,
        &["/busybox", "sh", "-c", script],
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    daemon.kill();
    std::thread::sleep(std::time::Duration::from_secs(1));
    daemon.restart();
    assert_eq!(ctd.wait_exit(&id, std::time::Duration::from_secs(600)), 0);
    let want = sha256_file(&disk);
    let out = container_output(&logs.join("reader.log"));
    assert_eq!(out.len(), 3, "{out:?}");
    for line in &out {
        assert!(
            want.ends_with(line.split_whitespace().next().unwrap()),
            "{line} vs {want}"
        );
    }
    assert_eq!(
        daemon.server_pids(),
        server,
        "the restarted daemon adopted the running server"
    );
    assert!(daemon
        .log_text()
        .contains("adopted the running mount server"));
    let disks = daemon.disks();
    assert!(disks[0].serving && disks[0].server_pid == server[0]);

    // Daemon and mount server gone (a node reboot, a crash of both), registry unreachable.
    ctd.remove_sandbox(&sandbox.0);
    daemon.kill();
    crate::fixtures::cri::run_quiet("kill", &["-KILL", &server[0].to_string()]);
    drop(reg);
    std::thread::sleep(std::time::Duration::from_millis(500));
    daemon.restart();
    let disks = daemon.disks();
    assert!(
        disks[0].serving && disks[0].server_pid != server[0],
        "{disks:?}"
    );
    // The disk was read in full, so every byte is local: a new container reads it offline.
    let sandbox = ctd.run_sandbox("vm2", &logs);
    let id = ctd.start_container(
        &sandbox,
        "again",
        &image,
        &["/busybox", "sha256sum", "/disk/disk.qcow2"],
    );
    assert_eq!(ctd.wait_exit(&id, std::time::Duration::from_secs(300)), 0);
    let out = container_output(&logs.join("again.log"));
    assert!(
        want.ends_with(out[0].split_whitespace().next().unwrap()),
        "{out:?}"
    );
}

/// A registry holding a qcow2 of `virtual` size with `data_mib` MiB of random data, published
/// with `vmdisk push` as `<name>:1` and as a gzip containerDisk `gz:1`: the registry, the disk.
fn small_images(
    scratch: &Scratch,
    name: &str,
    virtual_size: &str,
    data_mib: u64,
) -> (crate::fixtures::harness::Registry, PathBuf) {
    use crate::fixtures::harness::*;
    let reg = Registry::start(scratch);
    let disk = scratch.path(&format!("{name}.qcow2"));
    make_qcow2(&disk, virtual_size, &[(0, 1 << 20, 0x5a)]);
    write_random(&disk, 8 << 20, data_mib << 20, 5);
    vmdisk_ok(&[
        "push",
        disk.to_str().unwrap(),
        &format!("{}/{name}:1", reg.host()),
    ]);
    let gz = scratch.path("gz");
    oci_layout(
        &gz,
        &disk,
        &format!("disk/{name}.qcow2"),
        Layer::Gzip,
        "amd64",
    );
    skopeo_push(&gz, &format!("{}/gz:1", reg.host()), &[]);
    (reg, disk)
}

/// The remote-snapshot handshake without containerd: a disk layer becomes a committed remote
/// snapshot (AlreadyExists) that containerd's own lookup filter finds; unreachable registries,
/// malformed labels and ordinary layers get an ordinary active snapshot, each decision counted.
#[test]
fn prepare_decides_remote_or_ordinary_and_never_half() {
    use crate::fixtures::harness::*;
    let scratch = Scratch::new();
    let (reg, disk) = small_images(&scratch, "small", "64M", 4);
    let report = inspect_json(&format!("{}/small:1", reg.host()));
    let manifest = report["platforms"][0]["manifest"]
        .as_str()
        .unwrap()
        .to_string();
    let layer = report["platforms"][0]["layers"][0]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let gz_report = inspect_json(&format!("{}/gz:1", reg.host()));
    let metrics = scratch.path("metrics.sock");
    let daemon = Daemon::start(
        &scratch,
        &format!("[metrics]\naddress = \"unix:{}\"\n", metrics.display()),
    );
    let mut s = Suite::new(&daemon, &scratch);

    let cri = |image: &str, manifest: &str, layer: &str| -> Vec<(String, String)> {
        vec![
            (
                "containerd.io/snapshot.ref".into(),
                format!("chain-{layer}"),
            ),
            ("containerd.io/snapshot/cri.image-ref".into(), image.into()),
            (
                "containerd.io/snapshot/cri.manifest-digest".into(),
                manifest.into(),
            ),
            (
                "containerd.io/snapshot/cri.layer-digest".into(),
                layer.into(),
            ),
            (
                "containerd.io/snapshot/vmdisk.format".into(),
                "qcow2".into(),
            ),
        ]
    };
    let prepare = |s: &mut Suite, key: &str, l: Vec<(String, String)>| {
        let pairs: Vec<(&str, &str)> = l.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        s.rt.block_on(s.client.prepare(prepare_req(key, "", &pairs)))
    };

    // A disk layer: AlreadyExists, and the target is what containerd's lookup finds.
    let err = prepare(
        &mut s,
        "extract-1",
        cri(&format!("{}/small:1", reg.host()), &manifest, &layer),
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "{err}");
    // The pull fetched no chunk of the disk beyond the blob's first 256 KiB, which come with
    // the TOC (the disk's first chunks, kept), and mounted no ready-disk directory: that is
    // for a runtime that asks (`vmdisk path`).
    let pulled = &daemon.disks()[0];
    assert_eq!(
        (
            pulled.ready_dir.as_str(),
            pulled.chunks_cached < pulled.chunks
        ),
        ("", true),
        "{pulled:?}"
    );
    assert!(pulled.registry_bytes < 4096, "{pulled:?}");
    let target = format!("chain-{layer}");
    let found = s
        .list(&[&format!(
            r#"labels."containerd.io/snapshot.ref"=={target},parent=="""#
        )])
        .unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(
        (found[0].name.as_str(), found[0].kind),
        (target.as_str(), pb::Kind::Committed as i32)
    );
    assert_eq!(
        found[0]
            .labels
            .get("containerd.io/snapshot/remote")
            .map(String::as_str),
        Some("vmdisk")
    );
    assert_eq!(s.stat("extract-1").unwrap_err().code(), Code::NotFound);
    // A second pull of the same layer reuses it.
    let err = prepare(
        &mut s,
        "extract-2",
        cri(&format!("{}/small:1", reg.host()), &manifest, &layer),
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    // A view on it is a read-only bind of the FUSE mount; its disk equals the original.
    let v = s.look(&target);
    assert!(files_identical(&v.join("disk/small.qcow2"), &disk));
    let servers = daemon.server_pids();
    assert_eq!(servers.len(), 1);
    // The ready-disk directory: the disk as published, its raw view, its metadata, an alias.
    let image = format!("{}/small:1", reg.host());
    let handed = PathBuf::from(daemon.vmdisk_ok(&["path", &image]).trim());
    let disks = daemon.disks();
    assert_eq!(disks[0].snapshots.len(), 2, "{:?}", disks[0]);
    let ready = PathBuf::from(&disks[0].ready_dir);
    assert_eq!(handed, ready.join("small.qcow2"));
    assert_eq!(daemon.server_pids(), servers, "the pull's server made it");
    assert!(files_identical(&ready.join("small.qcow2"), &disk));
    let raw = scratch.path("small.raw");
    qemu_img_raw(&disk, &raw);
    assert!(
        files_identical(&ready.join("disk.raw"), &raw),
        "disk.raw differs from qemu-img's conversion"
    );
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ready.join("metadata.json")).unwrap()).unwrap();
    assert_eq!(
        (
            meta["format"].as_str(),
            meta["virtual_size"].as_u64(),
            meta["layer_digest"].as_str()
        ),
        (Some("qcow2"), Some(64 << 20), Some(layer.as_str())),
        "{meta}"
    );
    let alias = daemon
        .ready
        .join("by-name")
        .join(vmdisk::serve::ready::alias_name(&format!(
            "{}/small:1",
            reg.host()
        )));
    assert_eq!(std::fs::read_link(&alias).unwrap(), ready);

    // Unreachable registry, malformed labels, an ordinary layer: an ordinary active snapshot.
    // (The same manifest digest at a dead registry would be served: its manifest and config
    // were kept when they were verified. One this node never saw cannot be.)
    let dead = format!("127.0.0.1:{}/small:1", free_port());
    let unseen = vmdisk::oci::digest::Digest::of(b"a manifest this node never saw").to_string();
    let m = prepare(&mut s, "extract-dead", cri(&dead, &unseen, &layer))
        .unwrap()
        .into_inner()
        .mounts;
    assert_eq!(m[0].r#type, "bind");
    assert_eq!(
        s.stat("extract-dead").unwrap().kind,
        pb::Kind::Active as i32
    );
    prepare(
        &mut s,
        "extract-bad",
        cri(&format!("{}/small:1", reg.host()), &manifest, "sha256:zz"),
    )
    .unwrap();
    let gz_image = &gz_report["platforms"][0];
    let gz_layer = gz_image["layers"][0]["digest"].as_str().unwrap();
    let mut l = cri(
        &format!("{}/gz:1", reg.host()),
        gz_image["manifest"].as_str().unwrap(),
        gz_layer,
    );
    l.pop();
    prepare(&mut s, "extract-gz", l).unwrap();
    let d = daemon.decisions();
    for (k, n) in [
        ("remote", 1),
        ("reused", 1),
        ("fallback:registry_error", 1),
        ("fallback:malformed_labels", 1),
        ("ordinary:no_index", 1),
    ] {
        assert_eq!(d.get(k), Some(&n), "{k}: {d:?}");
    }

    // The same decisions on the metrics endpoint.
    let text = String::from_utf8(curl(&[
        "-sf",
        "--unix-socket",
        metrics.to_str().unwrap(),
        "http://localhost/metrics",
    ]))
    .unwrap();
    for line in [
        "vmdisk_prepare_decisions_total{decision=\"remote\",reason=\"\"} 1",
        "vmdisk_prepare_decisions_total{decision=\"fallback\",reason=\"registry_error\"} 1",
        "vmdisk_snapshots{kind=\"remote\"} 1",
        "vmdisk_remote_layers{state=\"serving\"} 1",
        "# TYPE vmdisk_registry_bytes counter",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing from:\n{text}"
        );
    }

    // Removing the remote snapshot and the disk kept by `vmdisk path` stops its server and
    // unmounts the layer.
    daemon.vmdisk_ok(&["rm", &image]);
    s.drop_views();
    s.remove(&target).unwrap();
    assert!(daemon.disks().is_empty());
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        !Path::new(&format!("/proc/{}", servers[0])).exists(),
        "mount server still running"
    );
    assert!(
        !ready.join("metadata.json").exists() && !alias.exists(),
        "ready directory left behind"
    );
}

/// A registry over HTTPS whose CA the node trusts (here the daemon's `SSL_CERT_FILE`): the
/// daemon reads the TLS roots once, at start, and hands them to each mount server it starts,
/// which checks the registry against them instead of reading the system's again. The roots file
/// is gone by the time the disk is asked for: both the daemon's own fetches and its server's
/// can only have used what the daemon read at start (as containerd does, a changed CA bundle
/// needs a restart).
#[test]
fn an_https_registry_is_checked_against_the_roots_the_daemon_read_at_start() {
    use crate::fixtures::harness::*;
    let scratch = Scratch::new();
    let (reg, disk) = small_images(&scratch, "tls", "64M", 4);
    let (front, ca) = reg.tls_front(&scratch);
    let roots = scratch.path("roots.pem");
    std::fs::copy(&ca, &roots).unwrap();
    // HTTPS for this loopback registry (plain HTTP is the default for loopback).
    crate::fixtures::cri::https_host(&scratch.path("vmdisk/hosts"), &front.host());
    // Those roots alone (a directory of none beside them).
    let no_dir = scratch.path("no-roots");
    std::fs::create_dir_all(&no_dir).unwrap();
    let daemon = Daemon::start_in_env(
        &scratch,
        "vmdisk",
        "",
        &[
            ("SSL_CERT_FILE", roots.to_str().unwrap()),
            ("SSL_CERT_DIR", no_dir.to_str().unwrap()),
        ],
    );
    std::fs::remove_file(&roots).unwrap();
    let image = format!("{}/tls:1", front.host());
    let out = daemon.vmdisk(&["path", &image]);
    assert!(
        out.status.success(),
        "vmdisk path: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        daemon.servers_log_text()
    );
    let path = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    assert!(files_identical(&path, &disk));
    // Every byte came from the HTTPS front (the image names no other registry); the blob's
    // first 256 KiB with the TOC, the rest as read.
    let d = &daemon.disks()[0];
    assert!(d.registry_bytes + (256 << 10) > 4 << 20, "{d:?}");
}

/// The node commands over the management API: `path` makes a disk ready without fetching it,
/// `path --raw` is qemu-img's raw conversion, `ls` shows it, `prefetch --wait` caches all of
/// it, `rm` unmounts it, `gc` evicts it, `stats` answers; a non-lazy image is a clear error.
#[test]
fn node_commands_make_disks_ready_and_clean_up() {
    use crate::fixtures::harness::*;
    let scratch = Scratch::new();
    let (reg, disk) = small_images(&scratch, "node", "256M", 32);
    let image = format!("{}/node:1", reg.host());
    let daemon = Daemon::start(&scratch, "");
    let cmd = |args: &[&str]| daemon.vmdisk(args);
    let ok = |args: &[&str]| daemon.vmdisk_ok(args);

    let path = PathBuf::from(ok(&["path", &image]).trim());
    assert_eq!(path.file_name().unwrap(), "node.qcow2");
    let d = &daemon.disks()[0];
    assert_eq!(d.snapshots, [format!("pin:{image}")]);
    assert!(
        d.chunks_cached * 10 < d.chunks,
        "`path` fetched {} of {} chunks",
        d.chunks_cached,
        d.chunks
    );
    assert!(files_identical(&path, &disk));
    let raw_path = PathBuf::from(ok(&["path", "--raw", &image]).trim());
    let raw = scratch.path("node.raw");
    qemu_img_raw(&disk, &raw);
    assert!(files_identical(&raw_path, &raw));
    let ls: serde_json::Value = serde_json::from_str(&ok(&["ls", "--json"])).unwrap();
    assert_eq!(ls[0]["raw"].as_str(), raw_path.to_str());
    assert_eq!(
        ls[0]["disk_size"].as_u64(),
        Some(std::fs::metadata(&disk).unwrap().len())
    );
    assert!(ok(&["ls"]).contains(&image));

    let out = ok(&["prefetch", "--wait", &image]);
    let d = &daemon.disks()[0];
    assert_eq!(d.chunks_cached, d.chunks, "{out}");
    let stats: serde_json::Value = serde_json::from_str(&ok(&["stats"])).unwrap();
    assert_eq!(stats["remote_layers"], 1);

    ok(&["rm", &image]);
    assert!(daemon.disks().is_empty());
    assert!(!path.exists(), "the ready directory is gone with the mount");
    let err = cmd(&["rm", &image]);
    assert!(!err.status.success());
    assert!(String::from_utf8_lossy(&err.stderr).contains("not a disk kept by"));
    let freed = ok(&["gc", "--limit", "1"]);
    assert!(!freed.starts_with("freed 0 "), "{freed}");

    // A qcow2 with a backing file (published by another tool): served as published, but
    // `--raw` says why there is no raw view.
    let overlay = qcow2_with_backing(scratch.dir.path());
    let layout = scratch.path("overlay-layout");
    oci_layout(&layout, &overlay, "disk/overlay.qcow2", Layer::Tar, "amd64");
    let backed = format!("{}/backed:1", reg.host());
    skopeo_push(
        &layout,
        &backed,
        &["--dest-compress", "--dest-compress-format", "zstd:chunked"],
    );
    let published = PathBuf::from(ok(&["path", &backed]).trim());
    assert!(files_identical(&published, &overlay));
    let err = cmd(&["path", "--raw", &backed]);
    assert!(!err.status.success());
    let text = String::from_utf8_lossy(&err.stderr);
    assert!(
        text.contains("no raw view") && text.contains("backing file"),
        "{text}"
    );

    let err = cmd(&["path", &format!("{}/gz:1", reg.host())]);
    assert!(!err.status.success());
    let text = String::from_utf8_lossy(&err.stderr);
    assert!(
        text.contains("no seekable index") && text.contains("vmdisk index"),
        "{text}"
    );
}

/// `containerd-shim-vmdisk-v2` through containerd 1.6's CRI, delegating to runc: a sandbox
/// with `vmdisk.io/image` gets the raw view's path in its bundle (bytes = qemu-img's raw
/// conversion); one without the annotation runs as with runc alone; an unknown image fails
/// the sandbox with a message naming it.
#[test]
fn shim_hands_the_runtime_a_ready_raw_disk() {
    use crate::fixtures::cri::CriContainerd;
    use crate::fixtures::harness::*;
    let scratch = Scratch::new();
    let (reg, disk) = registry_with_images(&scratch, 32);
    let daemon = Daemon::start(&scratch, "");
    let shim = PathBuf::from(env!("CARGO_BIN_EXE_containerd-shim-vmdisk-v2"));
    let shim_config = scratch.path("shim.toml");
    std::fs::write(
        &shim_config,
        format!(
            "manage_address = \"{}\"\n[runtimes.vmdisk]\ndelegate = \"io.containerd.runc.v2\"\nprovider = \"kata\"\n",
            daemon.manage.display()
        ),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        shim.parent().unwrap().display(),
        std::env::var("PATH").unwrap()
    );
    let ctd = CriContainerd::start_with(
        &scratch,
        &daemon.socket,
        &format!("{}/pause:1", reg.host()),
        &[reg.port],
        "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.vmdisk]\n  runtime_type = \"io.containerd.vmdisk.v2\"\n  pod_annotations = [\"vmdisk.io/*\"]\n",
        &[("PATH", path), ("VMDISK_SHIM_CONFIG", shim_config.display().to_string())],
    );
    let image = format!("{}/disk:1", reg.host());
    let logs = scratch.path("pod-logs");

    let vm = ctd
        .try_run_sandbox("vm", &logs, "vmdisk", &[("vmdisk.io/image", &image)])
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", ctd.log_text()));
    let spec = ctd.bundle_spec(&vm.0);
    let raw_path = spec["annotations"]["io.katacontainers.config.hypervisor.image"]
        .as_str()
        .unwrap_or_else(|| panic!("no image annotation in {}", spec["annotations"]))
        .to_string();
    assert!(raw_path.ends_with("/disk.raw"), "{raw_path}");
    let raw = scratch.path("disk.raw");
    qemu_img_raw(&disk, &raw);
    assert!(
        files_identical(Path::new(&raw_path), &raw),
        "{raw_path} differs from qemu-img's conversion"
    );
    // The delegate runs the pod: a container in it works as under runc.
    ctd.assert_echo(
        &vm,
        &format!("{}/busybox:1", reg.host()),
        "c",
        "in-vm-pod",
        &logs,
    );

    // Without the annotation the bundle is what runc alone gets.
    let plain = ctd.try_run_sandbox("plain", &logs, "vmdisk", &[]).unwrap();
    let runc = ctd.try_run_sandbox("runc", &logs, "", &[]).unwrap();
    let keys = |id: &str| {
        let spec = ctd.bundle_spec(id);
        let mut k: Vec<String> = spec["annotations"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        k.sort();
        k
    };
    assert_eq!(keys(&plain.0), keys(&runc.0));
    assert!(ctd.bundle_spec(&plain.0)["annotations"]
        .get("io.katacontainers.config.hypervisor.image")
        .is_none());

    // An image that does not exist fails the sandbox with a message kubelet can show.
    let missing = format!("{}/nothing:1", reg.host());
    let err = ctd
        .try_run_sandbox("bad", &logs, "vmdisk", &[("vmdisk.io/image", &missing)])
        .unwrap_err();
    assert!(
        err.message().contains(&missing) && err.message().contains("vmdisk"),
        "{err}"
    );
}

/// The snapshots API through containerd's proxy plugin (`ctr snapshots --snapshotter vmdisk`):
/// containerd's metadata layer namespaces keys and calls Prepare, Mounts, Commit, View,
/// Usage, Update (labels), List and Remove on vmdisk; files written through the returned
/// mounts are seen by the child.
#[test]
fn snapshots_api_through_containerds_proxy() {
    use crate::fixtures::cri::CriContainerd;
    let scratch = Scratch::new();
    let daemon = Daemon::start(&scratch, "");
    let ctd = CriContainerd::start(&scratch, &daemon.socket, "unused/pause:1", &[]);
    let ctr = |args: &[&str]| {
        let mut a = vec!["-n", "proxytest", "snapshots", "--snapshotter", "vmdisk"];
        a.extend_from_slice(args);
        let out = ctd.ctr(&a);
        assert!(
            out.status.success(),
            "ctr {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let mnt = scratch.path("m");
    std::fs::create_dir_all(&mnt).unwrap();
    let mount = |key: &str| {
        // `ctr snapshots mounts TARGET KEY` prints the mount command containerd would run.
        let cmd = ctr(&["mounts", mnt.to_str().unwrap(), key]);
        assert!(
            crate::fixtures::cri::run_quiet("sh", &["-c", cmd.trim()]),
            "{cmd}"
        );
    };
    let umount = || {
        assert!(crate::fixtures::cri::run_quiet(
            "umount",
            &[mnt.to_str().unwrap()]
        ))
    };

    ctr(&["prepare", "base-active"]);
    mount("base-active");
    write(&mnt.join("hello"), "from the base\n");
    umount();
    ctr(&["commit", "base", "base-active"]);
    ctr(&["prepare", "child", "base"]);
    mount("child");
    assert_eq!(read(&mnt.join("hello")), "from the base\n");
    write(&mnt.join("more"), "child\n");
    umount();
    ctr(&["label", "base", "team=vm"]);
    let info = ctr(&["info", "base"]);
    assert!(
        info.contains("\"team\": \"vm\"") && info.contains("Committed"),
        "{info}"
    );
    let usage = ctr(&["usage", "child"]);
    assert!(usage.contains("child"), "{usage}");
    let tree = ctr(&["ls"]);
    assert!(tree.contains("base") && tree.contains("child"), "{tree}");
    // What reached vmdisk: keys namespaced by containerd's metadata layer.
    let mut s = Suite::new(&daemon, &scratch);
    let names: Vec<String> = s.list(&[]).unwrap().into_iter().map(|i| i.name).collect();
    assert!(
        names.len() == 2 && names.iter().all(|n| n.starts_with("proxytest/")),
        "{names:?}"
    );
    drop(s);
    let out = ctd.ctr(&[
        "-n",
        "proxytest",
        "snapshots",
        "--snapshotter",
        "vmdisk",
        "rm",
        "base",
    ]);
    assert!(
        !out.status.success(),
        "a parent with a child must not be removable"
    );
    ctr(&["rm", "child"]);
    ctr(&["rm", "base"]);
    assert!(!ctr(&["ls"]).contains("base"));
}
