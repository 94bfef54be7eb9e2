# Sourced by benches/boot.sh and demo.sh: the bootable test guest and its boot.
#
# make_guest_disk DIR GIB: DIR/guest.qcow2, a GIB-GiB partitioned ext4 disk with a busybox init
#   that prints BOOT-MARKER and stays up, padded with a random file the boot never reads.
# write_boot_script DIR: DIR/boot.sh DISK FORMAT boots the guest the way Kata does (qemu TCG,
#   -kernel/-initrd from the host, root=/dev/vda1, read-only virtio disk), waits for the marker
#   and prints "seconds guest_read_bytes" (qemu's block statistics at that moment, over QMP).

make_guest_disk() {
  local dir=$1 gib=$2 r=$1/guest-root
  mkdir -p "$r"/{bin,sbin,proc,dev,run,sys,data}
  cp /bin/busybox "$r/bin/"
  for c in sh echo mount sleep cat; do ln -s busybox "$r/bin/$c"; done
  # The guest stays up after its marker so that its block statistics can be read.
  printf '#!/bin/sh\nmount -t proc proc /proc\necho BOOT-MARKER\nexec sleep 100000\n' > "$r/sbin/init"
  chmod +x "$r/sbin/init"
  head -c "$((gib * 1024 - 512))M" /dev/urandom > "$r/data/pad.bin"
  truncate -s "${gib}G" "$dir/guest.raw"
  echo 'start=2048, type=83' | sfdisk -q "$dir/guest.raw"
  mkfs.ext4 -q -d "$r" -E offset=1048576 "$dir/guest.raw" "$((gib * 1024 - 2))M"
  qemu-img convert -O qcow2 "$dir/guest.raw" "$dir/guest.qcow2"
  rm -rf "$dir/guest.raw" "$r"
}

write_boot_script() {
  local dir=$1 kernel initrd
  kernel=$(ls /boot/vmlinuz-* | sort | tail -1)
  initrd=/boot/initrd.img-${kernel#/boot/vmlinuz-}
  cat > "$dir/boot.sh" <<SH
#!/usr/bin/env bash
set -euo pipefail
run=\$(mktemp -d "$dir/boot-XXXXXX")
t0=\$(date +%s.%N)
qemu-system-x86_64 -m 512 -display none -no-reboot -serial "file:\$run/serial" \\
  -qmp "unix:\$run/qmp,server=on,wait=off" -kernel "$kernel" -initrd "$initrd" \\
  -append "root=/dev/vda1 console=ttyS0 ro quiet panic=-1" \\
  -drive "file=\$1,format=\$2,if=virtio,readonly=on" &
qpid=\$!
for _ in \$(seq 6000); do grep -aq BOOT-MARKER "\$run/serial" 2>/dev/null && break; kill -0 \$qpid 2>/dev/null || break; sleep 0.05; done
grep -aq BOOT-MARKER "\$run/serial" || { echo "no boot marker" >&2; cat "\$run/serial" >&2; kill \$qpid 2>/dev/null; exit 1; }
t1=\$(date +%s.%N)
read_bytes=\$(python3 - "\$run/qmp" <<'PY'
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rw")
json.loads(f.readline())
def call(cmd):
    f.write(json.dumps({"execute": cmd}) + "\n")
    f.flush()
    while True:
        r = json.loads(f.readline())
        if "return" in r or "error" in r:
            return r
call("qmp_capabilities")
print(sum(d["stats"]["rd_bytes"] for d in call("query-blockstats")["return"]))
call("quit")
PY
)
wait \$qpid || true
rm -rf "\$run"
python3 -c "print(f'{\$t1 - \$t0:.2f} \$read_bytes')"
SH
  chmod +x "$dir/boot.sh"
}
