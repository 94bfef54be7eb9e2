//! A real VM boots from the ready raw view the way Kata boots its guest image: qemu with
//! `-kernel`, `-initrd`, `root=/dev/vda1` and the raw view as a read-only virtio disk (TCG, no
//! KVM). The guest disk is built from Debian packages (busybox, a kernel's initramfs), padded
//! with data a boot never reads, published with `vmdisk push` and fetched lazily.

use std::path::PathBuf;

use crate::fixtures::cri::Daemon;
use crate::fixtures::guest::{boot, bootable_qcow2};
use crate::fixtures::harness::*;

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
