//! A real VM boots from the ready raw view the way Kata boots its guest image: qemu with
//! `-kernel`, `-initrd`, `root=/dev/vda1` and the raw view as a read-only virtio disk (TCG, no
//! KVM). The guest disk is built from Debian packages (busybox, a kernel's initramfs), padded
//! with data a boot never reads, published with `vmdisk push` and fetched lazily.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cri::Daemon;
use crate::harness::*;

/// The host's kernel and initramfs (package linux-image-amd64).
pub fn kernel() -> (PathBuf, PathBuf) {
    let mut kernels: Vec<PathBuf> = std::fs::read_dir("/boot")
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("vmlinuz-")
        })
        .collect();
    kernels.sort();
    let kernel = kernels
        .pop()
        .expect("no /boot/vmlinuz-*: run `make deps` (linux-image-amd64)");
    let version = kernel
        .file_name()
        .unwrap()
        .to_string_lossy()
        .trim_start_matches("vmlinuz-")
        .to_string();
    let initrd = PathBuf::from(format!("/boot/initrd.img-{version}"));
    assert!(initrd.exists(), "{} is missing", initrd.display());
    (kernel, initrd)
}

/// A partitioned raw disk (512 MiB, ext4 at 1 MiB) whose init prints BOOT-MARKER and powers
/// off, with `pad_mib` of random data in a file the boot never reads; returned as qcow2.
pub fn bootable_qcow2(dir: &Path, pad_mib: u64) -> PathBuf {
    let root = dir.join("guest-root");
    // dev, run and sys: the initramfs moves its mounts there before switching root.
    for d in ["bin", "sbin", "proc", "dev", "run", "sys", "data"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    for c in ["sh", "echo", "mount", "poweroff", "cat"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(c)).unwrap();
    }
    std::fs::write(
        root.join("sbin/init"),
        "#!/bin/sh\nmount -t proc proc /proc\necho BOOT-MARKER\npoweroff -f\n",
    )
    .unwrap();
    run("chmod", &["+x", root.join("sbin/init").to_str().unwrap()]);
    random_file(&root.join("data/pad.bin"), pad_mib << 20, 99);
    let raw = dir.join("guest.raw");
    run("truncate", &["-s", "512M", raw.to_str().unwrap()]);
    let sfdisk = Command::new("sfdisk")
        .args(["-q", raw.to_str().unwrap()])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin
                .take()
                .unwrap()
                .write_all(b"start=2048, type=83\n")?;
            c.wait()
        })
        .expect("run sfdisk (package fdisk)");
    assert!(sfdisk.success());
    run(
        "mkfs.ext4",
        &[
            "-q",
            "-d",
            root.to_str().unwrap(),
            "-E",
            "offset=1048576",
            raw.to_str().unwrap(),
            "500M",
        ],
    );
    let qcow2 = dir.join("guest.qcow2");
    run(
        "qemu-img",
        &[
            "convert",
            "-O",
            "qcow2",
            raw.to_str().unwrap(),
            qcow2.to_str().unwrap(),
        ],
    );
    std::fs::remove_file(raw).unwrap();
    std::fs::remove_dir_all(root).unwrap();
    qcow2
}

/// Boots `disk` (raw) as Kata does; returns the console output.
pub fn boot(disk: &Path) -> String {
    require("qemu-system-x86_64");
    let (kernel, initrd) = kernel();
    let out = Command::new("timeout")
        .args([
            "300",
            "qemu-system-x86_64",
            "-m",
            "512",
            "-nographic",
            "-no-reboot",
        ])
        .arg("-kernel")
        .arg(&kernel)
        .arg("-initrd")
        .arg(&initrd)
        .args(["-append", "root=/dev/vda1 console=ttyS0 ro quiet panic=-1"])
        .arg("-drive")
        .arg(format!(
            "file={},format=raw,if=virtio,readonly=on",
            disk.display()
        ))
        .output()
        .expect("run qemu-system-x86_64");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn a_vm_boots_from_the_lazily_loaded_raw_view() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let proxy = FaultProxy::start(reg.port, None);
    let qcow2 = bootable_qcow2(scratch.dir.path(), 256);
    let image = format!("127.0.0.1:{}/vm/guest:1", proxy.port);
    vmdisk_ok(&[
        "push",
        qcow2.to_str().unwrap(),
        &format!("{}/vm/guest:1", reg.host()),
    ]);
    let size = std::fs::metadata(&qcow2).unwrap().len();
    // Hydration off: what each boot fetches is counted, and a second boot must fetch nothing
    // (background hydration, the default, would fetch the rest meanwhile).
    let daemon = Daemon::start(&scratch, "[cache]\nhydrate = \"off\"\n");
    let bytes = || proxy.to_client.load(std::sync::atomic::Ordering::SeqCst);

    let before = bytes();
    let out = vmdisk_ok(&[
        "path",
        "--raw",
        "--manage",
        daemon.manage.to_str().unwrap(),
        &image,
    ]);
    let raw = PathBuf::from(out.trim());
    let console = boot(&raw);
    let cold = bytes() - before;
    assert!(
        console.contains("BOOT-MARKER"),
        "the VM did not boot from {}:\n{console}",
        raw.display()
    );
    eprintln!(
        "cold boot from the lazy raw view: {cold} registry bytes for a {size}-byte qcow2 ({:.1}%)",
        cold as f64 * 100.0 / size as f64
    );
    assert!(cold < size / 2, "the boot fetched {cold} of {size} bytes");

    // A warm boot on the same node reads only local data. Read-ahead started by the cold boot
    // may still be in flight on a busy machine.
    wait_until_quiet(bytes);
    let before = bytes();
    assert!(boot(&raw).contains("BOOT-MARKER"));
    let warm = bytes() - before;
    eprintln!("warm boot: {warm} registry bytes");
    assert_eq!(warm, 0);
}
