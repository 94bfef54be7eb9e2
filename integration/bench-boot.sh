#!/usr/bin/env bash
# Boot figures (part of `make bench`): a Linux guest booted the way Kata boots it (qemu TCG,
# -kernel/-initrd, root=/dev/vda1, read-only raw virtio disk) from vmdisk's lazily loaded raw
# view (`vmdisk path --raw`), cold and warm, vs. the same disk after a full pull (containerd's
# overlayfs CRI pull of the gzip containerDisk, then booting the unpacked qcow2). The guest disk
# is 512 MiB with a 256 MiB file the boot never reads. Registry bytes come from the registry's
# request log. No KVM here: boot times are TCG times, the same for every row.
set -euo pipefail
cd "$(dirname "$0")/.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
SNAPSHOTTER=${SNAPSHOTTER:-$PWD/target/release/vmdisk-snapshotter}
CRI_PULL=${CRI_PULL:-$PWD/target/release/examples/cri-pull}
mkdir -p scratch/bench
RESULTS=$PWD/scratch/bench/results.txt
B=$(mktemp -d "$PWD/scratch/bench-boot-XXXXXX")
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  wait 2>/dev/null || true
  stop_mount_servers "$B"
  grep -o " $B[^ ]*" /proc/self/mounts | sort -r | while read -r m; do umount -l "$m"; done
  rm -rf "$B"
}
trap 'status=$?; cleanup || true; exit $status' EXIT
source integration/containerd.sh
now() { date +%s.%N; }
secs() { python3 -c "print(f'{$2 - $1:.1f}')"; }

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
REG=127.0.0.1:$PORT
mkdir -p "$B/registry"
printf 'version: 0.1\nlog: { level: info, formatter: text }\nstorage: { filesystem: { rootdirectory: %s } }\nhttp: { addr: %s }\n' "$B/registry" "$REG" > "$B/registry.yml"
docker-registry serve "$B/registry.yml" > "$B/registry.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do curl -sf "http://$REG/v2/" >/dev/null && break; sleep 0.1; done
mark() { wc -c < "$B/registry.log"; }
served_since() { tail -c +"$(($1 + 1))" "$B/registry.log" | { grep 'http.request.method=GET' || true; } | { grep -o 'http.response.written=[0-9]*' || true; } | cut -d= -f2 | awk '{s+=$1} END {printf "%d\n", s}'; }

# The guest disk (as in integration/boot.rs).
R=$B/guest-root
mkdir -p "$R"/{bin,sbin,proc,dev,run,sys,data}
cp /bin/busybox "$R/bin/"
for c in sh echo mount poweroff cat; do ln -s busybox "$R/bin/$c"; done
printf '#!/bin/sh\nmount -t proc proc /proc\necho BOOT-MARKER\npoweroff -f\n' > "$R/sbin/init"
chmod +x "$R/sbin/init"
head -c 256M /dev/urandom > "$R/data/pad.bin"
truncate -s 512M "$B/guest.raw"
echo 'start=2048, type=83' | sfdisk -q "$B/guest.raw"
mkfs.ext4 -q -d "$R" -E offset=1048576 "$B/guest.raw" 500M
qemu-img convert -O qcow2 "$B/guest.raw" "$B/guest.qcow2"
rm -rf "$B/guest.raw" "$R"
SIZE=$(stat -c %s "$B/guest.qcow2")
"$VMDISK" push "$B/guest.qcow2" "$REG/vm/guest:lazy" > /dev/null
mkdir -p "$B/root/disk"
cp "$B/guest.qcow2" "$B/root/disk/guest.qcow2"
tar --owner=107 --group=107 -C "$B/root" -cf "$B/layer.tar" disk
rm -rf "$B/root"
python3 integration/tar-layout.py "$B/layout" "$B/layer.tar"
skopeo copy --quiet --dest-tls-verify=false --dest-compress-format gzip "oci:$B/layout:latest" "docker://$REG/vm/guest:gzip"
rm -rf "$B/layout"

KERNEL=$(ls /boot/vmlinuz-* | sort | tail -1)
INITRD=/boot/initrd.img-${KERNEL#/boot/vmlinuz-}
boot() {  # boot DISK FORMAT: fails unless the guest printed its marker
  timeout 300 qemu-system-x86_64 -m 512 -nographic -no-reboot -kernel "$KERNEL" -initrd "$INITRD" \
    -append "root=/dev/vda1 console=ttyS0 ro quiet panic=-1" \
    -drive "file=$1,format=$2,if=virtio,readonly=on" 2>&1 | grep -aq BOOT-MARKER
}

cat > "$B/vmdisk.toml" <<TOML
root = "$B/vmdisk"
ready_dir = "$B/vmdisk/disks"
address = "$B/vmdisk.sock"
manage_address = "$B/manage.sock"
log_level = "warn"
[registry]
hosts_dir = "$B/no-hosts.d"
TOML
"$SNAPSHOTTER" --config "$B/vmdisk.toml" 2> "$B/vmdisk.log" &
PIDS+=($!)
for _ in $(seq 100); do [ -S "$B/manage.sock" ] && break; sleep 0.05; done
export VMDISK_MANAGE=$B/manage.sock
sync; echo 3 > /proc/sys/vm/drop_caches

# Cold: ready path, then boot; everything the boot reads is fetched on demand.
m=$(mark); t0=$(now)
RAW=$("$VMDISK" path --raw "$REG/vm/guest:lazy")
t1=$(now)
boot "$RAW" raw
t2=$(now); sleep 0.3
COLD_BYTES=$(served_since "$m"); COLD_READY=$(secs "$t0" "$t1"); COLD_TOTAL=$(secs "$t0" "$t2")
# Warm: the same node boots again, once the cold boot's background fetches have settled.
quiet=0; last=$(mark)
while [ $quiet -lt 2 ]; do sleep 1; cur=$(mark); if [ "$cur" = "$last" ]; then quiet=$((quiet + 1)); else quiet=0; fi; last=$cur; done
m=$(mark); t0=$(now)
boot "$RAW" raw
t1=$(now); sleep 0.3
WARM_BYTES=$(served_since "$m"); WARM_TOTAL=$(secs "$t0" "$t1")

# Baseline: containerd's overlayfs full pull of the gzip containerDisk, then boot the file.
start_containerd "$B/full-ctd" "$REG" ""
m=$(mark); t0=$(now)
"$CRI_PULL" --address "$B/full-ctd/containerd.sock" "$REG/vm/guest:gzip" > /dev/null
t1=$(now)
UNPACKED=$(find "$B/full-ctd/root/io.containerd.snapshotter.v1.overlayfs/snapshots" -name guest.qcow2 | head -1)
boot "$UNPACKED" qcow2
t2=$(now); sleep 0.3
FULL_BYTES=$(served_since "$m"); FULL_PULL=$(secs "$t0" "$t1"); FULL_TOTAL=$(secs "$t0" "$t2")

pct() { python3 -c "print(f'{$1 * 100 / $2:.2f}')"; }
{
  echo
  echo "VM boot (qemu TCG, Kata-style raw virtio root) from a ${SIZE}-byte qcow2 guest disk, same run:"
  printf '  %-48s %12s %12s %16s\n' path "ready s" "total s" "registry bytes"
  printf '  %-48s %12s %12s %16s\n' "vmdisk lazy raw view, cold (path + boot)" "$COLD_READY" "$COLD_TOTAL" "$COLD_BYTES ($(pct "$COLD_BYTES" "$SIZE")%)"
  printf '  %-48s %12s %12s %16s\n' "vmdisk lazy raw view, warm (boot again)" "0" "$WARM_TOTAL" "$WARM_BYTES"
  printf '  %-48s %12s %12s %16s\n' "overlayfs full pull (gzip) + boot of the qcow2" "$FULL_PULL" "$FULL_TOTAL" "$FULL_BYTES ($(pct "$FULL_BYTES" "$SIZE")%)"
} | tee -a "$RESULTS"
