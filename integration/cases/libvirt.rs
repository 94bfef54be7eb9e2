//! Peer pods on libvirt, for real: Debian's libvirt daemon (qemu under TCG) does what the
//! peer-pod libvirt provider (cloud-api-adaptor) does with a pool and a base volume, with
//! vmdisk's `volumes/` directory as that pool. The provider's steps are done with `virsh`:
//! find the base volume by name in the pool, create the pod VM's root volume in the same pool
//! as a qcow2 whose backing file is the base volume's path, define a domain on it and boot;
//! then a second pod VM from the same base.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::fixtures::cri::Daemon;
use crate::fixtures::guest::{bootable_qcow2, kernel};
use crate::fixtures::harness::*;

/// `virsh -c qemu:///system ARGS`: its stdout, or a panic with its stderr.
fn virsh(args: &[&str]) -> String {
    let out = Command::new("virsh")
        .args(["-c", "qemu:///system"])
        .args(args)
        .output()
        .expect("run virsh");
    assert!(
        out.status.success(),
        "virsh {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn virsh_quiet(args: &[&str]) {
    let _ = Command::new("virsh")
        .args(["-c", "qemu:///system"])
        .args(args)
        .output();
}

/// The libvirt daemons (virtlogd and the monolithic libvirtd of Debian 12), started if they
/// are not running; what this test defined is removed when it ends.
struct Libvirt {
    domains: Vec<String>,
    pools: Vec<String>,
    /// The daemons this test started (stopped at the end).
    started: Vec<&'static str>,
}

impl Libvirt {
    fn start() -> Self {
        require("virsh");
        require("libvirtd");
        require("virtlogd");
        let answers = || {
            Command::new("virsh")
                .args(["-c", "qemu:///system", "version"])
                .output()
                .is_ok_and(|o| o.status.success())
        };
        let running = |daemon: &str| {
            Command::new("pgrep")
                .args(["-x", daemon])
                .output()
                .is_ok_and(|o| o.status.success())
        };
        // Started as they are found missing: a daemon that was exiting (stopped by an earlier
        // run) is started again once it is gone.
        let mut started = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !answers() {
            for daemon in ["virtlogd", "libvirtd"] {
                if !running(daemon) {
                    run(daemon, &["-d"]);
                    if !started.contains(&daemon) {
                        started.push(daemon);
                    }
                }
            }
            assert!(Instant::now() < deadline, "libvirtd did not start");
            std::thread::sleep(Duration::from_millis(200));
        }
        // `virsh start` needs virtlogd even where libvirtd already ran.
        if !running("virtlogd") {
            run("virtlogd", &["-d"]);
            started.push("virtlogd");
        }
        Libvirt {
            domains: Vec::new(),
            pools: Vec::new(),
            started,
        }
    }

    /// Defines and starts a `dir` pool named `name` over `dir`.
    fn dir_pool(&mut self, name: &str, dir: &Path) {
        virsh_quiet(&["pool-destroy", name]);
        virsh_quiet(&["pool-undefine", name]);
        virsh(&[
            "pool-define-as",
            name,
            "dir",
            "--target",
            dir.to_str().unwrap(),
        ]);
        self.pools.push(name.to_string());
        virsh(&["pool-start", name]);
    }

    /// Defines domain `name` booting the host's kernel with root volume `volume` of `pool`
    /// (virtio, read-write: a pod VM's root disk), its console in `log`, and starts it.
    fn boot(&mut self, name: &str, pool: &str, volume: &str, log: &Path, dir: &Path) {
        let (kernel, initrd) = kernel();
        let xml = format!(
            "<domain type='qemu'><name>{name}</name><memory unit='MiB'>256</memory><vcpu>1</vcpu>\
             <os><type arch='x86_64' machine='pc'>hvm</type><kernel>{}</kernel><initrd>{}</initrd>\
             <cmdline>console=ttyS0 root=/dev/vda1 ro panic=-1 quiet</cmdline></os>\
             <features><acpi/></features>\
             <on_poweroff>destroy</on_poweroff><on_reboot>destroy</on_reboot><on_crash>destroy</on_crash>\
             <devices><disk type='volume' device='disk'><driver name='qemu' type='qcow2'/>\
             <source pool='{pool}' volume='{volume}'/><target dev='vda' bus='virtio'/></disk>\
             <serial type='file'><source path='{log}'/><target port='0'/></serial>\
             <console type='file'><source path='{log}'/><target type='serial' port='0'/></console>\
             </devices></domain>",
            kernel.display(),
            initrd.display(),
            log = log.display(),
        );
        let file = dir.join(format!("{name}.xml"));
        std::fs::write(&file, xml).unwrap();
        virsh_quiet(&["destroy", name]);
        virsh_quiet(&["undefine", name]);
        virsh(&["define", file.to_str().unwrap()]);
        self.domains.push(name.to_string());
        virsh(&["start", name]);
    }

    /// Waits until domain `name` is shut off (its init powers off after the marker).
    fn wait_shut_off(&self, name: &str, log: &Path) -> String {
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let state = virsh(&["domstate", name]);
            if state.trim().starts_with("shut off") {
                return std::fs::read_to_string(log).unwrap_or_default();
            }
            assert!(
                Instant::now() < deadline,
                "domain {name} still {} after 300 s: {}",
                state.trim(),
                std::fs::read_to_string(log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Drop for Libvirt {
    fn drop(&mut self) {
        for d in &self.domains {
            virsh_quiet(&["destroy", d]);
            virsh_quiet(&["undefine", d]);
        }
        for p in &self.pools {
            virsh_quiet(&["pool-destroy", p]);
            virsh_quiet(&["pool-undefine", p]);
        }
        for daemon in self.started.iter().rev() {
            let _ = Command::new("pkill").args(["-x", daemon]).status();
        }
    }
}

/// Makes `path` and every directory above it traversable by others (qemu runs as
/// libvirt-qemu; the scratch directory is private).
fn open_up(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    for dir in path.ancestors() {
        if dir == Path::new("/") {
            break;
        }
        let mode = std::fs::metadata(dir).unwrap().permissions().mode();
        if mode & 0o001 == 0 {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o011)).unwrap();
        }
    }
}

#[test]
fn pod_vms_boot_under_libvirt_from_a_lazily_served_base_volume() {
    let scratch = Scratch::new();
    let reg = Registry::start(&scratch);
    let proxy = FaultProxy::counting(reg.port);
    let qcow2 = bootable_qcow2(scratch.dir.path(), 128);
    vmdisk_ok(&[
        "push",
        qcow2.to_str().unwrap(),
        &format!("{}/peerpods/podvm:v1", reg.host()),
    ]);
    let size = std::fs::metadata(&qcow2).unwrap().len();
    let reference = format!("{}/peerpods/podvm:v1", proxy.host());
    // Hydration off: what each boot fetches is counted, and a second boot must fetch nothing
    // (background hydration, the default, would fetch the rest meanwhile).
    let daemon = Daemon::start(&scratch, "[cache]\nhydrate = \"off\"\n");
    let bytes = || proxy.bytes_to_client();

    // The node (here: the libvirt host) makes the disk ready by reference; its volume name
    // is stable: the reference with `/` as `_` and `:` as `+`.
    let path = daemon.vmdisk_ok(&["path", &reference]);
    let ready = daemon.ready.clone();
    let volumes = ready.join("volumes");
    let base_volume = format!("127.0.0.1+{}_peerpods_podvm+v1.qcow2", proxy.port);
    let volume = daemon.vmdisk_ok(&["path", "--volume", &reference]);
    assert_eq!(Path::new(volume.trim()), volumes.join(&base_volume));
    assert!(
        volumes.join(&base_volume).exists(),
        "{} has no {base_volume} (path {path})",
        volumes.display()
    );
    // libvirt-qemu (group kvm, vmdisk's vmm_group) passes the scratch directory; vmdisk's
    // own directories let the group in and nobody else.
    open_up(scratch.dir.path());
    let mut libvirt = Libvirt::start();
    // LIBVIRT_POOL: a dir pool over vmdisk's volumes directory. The provider creates the pod
    // VMs' root volumes in the same pool as the base.
    let pool = format!("vmdisk-it-{}", reg.port);
    libvirt.dir_pool(&pool, &volumes);
    virsh(&["pool-refresh", &pool]);
    let listed = virsh(&["vol-list", &pool]);
    assert!(listed.contains(&base_volume), "vol-list {pool}: {listed}");
    // LIBVIRT_VOL_NAME: the provider looks the base up by name and uses its path.
    let base_path = virsh(&["vol-path", "--pool", &pool, &base_volume]);
    let base_path = base_path.trim();
    let capacity = virsh(&["vol-info", "--pool", &pool, &base_volume, "--bytes"]);
    assert!(capacity.contains("Capacity:"), "{capacity}");

    let mut fetched = Vec::new();
    for vm in ["podvm-1", "podvm-2"] {
        let root = format!("{vm}-{}-root.qcow2", reg.port);
        // What the previous boot started (read-ahead) is not this boot's.
        wait_until_quiet(bytes);
        let before = bytes();
        virsh(&[
            "vol-create-as",
            &pool,
            &root,
            "1G",
            "--format",
            "qcow2",
            "--backing-vol",
            base_path,
            "--backing-vol-format",
            "qcow2",
        ]);
        let info = run(
            "qemu-img",
            &["info", "-U", volumes.join(&root).to_str().unwrap()],
        );
        let info = String::from_utf8_lossy(&info);
        assert!(info.contains(base_path), "{info}");
        let log = scratch.path(&format!("{vm}.log"));
        open_up(log.parent().unwrap());
        let name = format!("{vm}-{}", reg.port);
        libvirt.boot(&name, &pool, &root, &log, scratch.dir.path());
        let console = libvirt.wait_shut_off(&name, &log);
        assert!(
            console.contains("BOOT-MARKER"),
            "{vm} did not boot from {root} backed by {base_path}:\n{console}"
        );
        fetched.push(bytes() - before);
        eprintln!(
            "{vm}: booted under libvirt; {} registry bytes for its boot (base qcow2 {size} bytes)",
            bytes() - before
        );
        virsh(&["vol-delete", "--pool", &pool, &root]);
    }
    assert!(
        fetched[0] > 0 && fetched[0] < size / 2,
        "the first pod VM fetched {} of {size} bytes",
        fetched[0]
    );
    assert_eq!(fetched[1], 0, "the second pod VM reads only local data");
    // The base volume is still vmdisk's link, and the disk still reads as published.
    let served = PathBuf::from(path.trim());
    assert_eq!(sha256_file(&served), sha256_file(&qcow2));
}
