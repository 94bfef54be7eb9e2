#!/usr/bin/env bash
# Boot figures (part of `make bench`): a Linux guest booted the way Kata boots it (qemu TCG,
# -kernel/-initrd, root=/dev/vda1, read-only raw virtio disk) from vmdisk's lazily loaded raw
# view (`vmdisk path --raw`) from a registry laid out as $LAYOUT says (start_origin in
# integration/lib/containerd.sh: by default as public registries are, the API 80 ms away redirecting
# blobs to a blob host 10 ms away; LAYOUT=itself: a registry serving blobs itself behind the
# 20 ms cluster link):
# - cold, on a node that never saw the image, without a boot trace;
# - warm, the same node again;
# - cold on another fresh node after `vmdisk trace record --push` published a boot trace;
# - baseline: containerd's overlayfs full pull of the gzip containerDisk over the same link,
#   then a boot of the unpacked qcow2.
# The guest's own reads come from qemu's block statistics (QMP query-blockstats, read when the
# guest prints its marker); registry bytes from the registry's request log and the blob host's
# counts. The guest disk is
# BOOT_BENCH_GIB (default 2) GiB, padded with a random file the boot never reads. No KVM here:
# boot times are TCG times, the same for every row.
set -euo pipefail
cd "$(dirname "$0")/../.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
SNAPSHOTTER=${SNAPSHOTTER:-$PWD/target/release/vmdisk-snapshotter}
CRI_PULL=${CRI_PULL:-$PWD/target/release/examples/cri-pull}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
CDN=${CDN:-$PWD/target/release/examples/blob-cdn}
GIB=${BOOT_BENCH_GIB:-2}
source integration/lib/containerd.sh
bench_scratch boot
source integration/lib/guest.sh
start_origin "$B"
mark() { origin_mark "$B"; }
served_since() { origin_bytes_since "$B" "$1"; }

make_guest_disk "$B" "$GIB"
SIZE=$(stat -c %s "$B/guest.qcow2")
publish_lazy_and_gzip "$B/guest.qcow2" "$REG/vm/guest:lazy" "$REG/vm/guest:gzip"

write_boot_script "$B"

# Cold (or warm) boot on NODE from the origin: "ready_s boot_s guest_bytes registry_bytes".
lazy_boot() {  # lazy_boot NODE
  local m t0 t1 raw out
  sync; echo 3 > /proc/sys/vm/drop_caches
  m=$(mark); t0=$(now)
  raw=$(VMDISK_MANAGE=$B/$1/manage.sock "$VMDISK" path --raw "$PULL/vm/guest:lazy")
  t1=$(now)
  out=$("$B/boot.sh" "$raw" raw)
  echo "$(secs "$t0" "$t1") $out $(served_since "$m")"
}
settle() {  # waits until the registry log has been quiet for 2 s (background fetches done)
  local quiet=0 last cur
  last=$(mark)
  while [ $quiet -lt 2 ]; do sleep 1; cur=$(mark); if [ "$cur" = "$last" ]; then quiet=$((quiet + 1)); else quiet=0; fi; last=$cur; done
}

start_node "$B" a
read -r COLD_READY COLD_BOOT COLD_GUEST COLD_BYTES < <(lazy_boot a)
settle
read -r WARM_READY WARM_BOOT WARM_GUEST WARM_BYTES < <(lazy_boot a)

# The publisher records a boot once (qemu on the qcow2 file, on loopback) and publishes it.
"$VMDISK" trace record --cache "$B/recording-cache" --push "$REG/vm/guest:lazy" -- \
  sh -c 'exec "$0" "$VMDISK_DISK" qcow2' "$B/boot.sh" > "$B/trace.out" 2>&1 || { cat "$B/trace.out"; exit 1; }
TRACE_LINE=$(grep '^recorded' "$B/trace.out")

start_node "$B" b
read -r TRACED_READY TRACED_BOOT TRACED_GUEST TRACED_BYTES < <(lazy_boot b)

# Baseline: containerd's overlayfs full pull of the gzip containerDisk from the same origin.
start_containerd "$B/full-ctd" "$PULL" ""
sync; echo 3 > /proc/sys/vm/drop_caches
m=$(mark); t0=$(now)
"$CRI_PULL" --address "$B/full-ctd/containerd.sock" "$PULL/vm/guest:gzip" > /dev/null
t1=$(now)
FULL_BYTES=$(served_since "$m")
UNPACKED=$(find "$B/full-ctd/root/io.containerd.snapshotter.v1.overlayfs/snapshots" -name guest.qcow2 | head -1)
read -r FULL_BOOT FULL_GUEST < <("$B/boot.sh" "$UNPACKED" qcow2)
FULL_PULL=$(secs "$t0" "$t1")

x() { python3 -c "print(f'{$1 / max($2, 1):.2f}x')"; }
total() { python3 -c "print(f'{$1 + $2:.2f}')"; }
{
  echo
  echo "VM boot (qemu TCG, Kata-style raw virtio root) from a $((GIB))-GiB guest disk (qcow2 file $SIZE bytes), from a"
  echo "$LAYOUT_TEXT, same run; guest bytes = qemu's block statistics at the boot marker; registry bytes: the registry's and its blob host's:"
  printf '  %-46s %8s %8s %9s %14s %14s %10s\n' path "ready s" "boot s" "total s" "guest bytes" "registry bytes" "reg/guest"
  printf '  %-46s %8s %8s %9s %14s %14s %10s\n' "vmdisk raw view, cold, no trace" "$COLD_READY" "$COLD_BOOT" "$(total "$COLD_READY" "$COLD_BOOT")" "$COLD_GUEST" "$COLD_BYTES" "$(x "$COLD_BYTES" "$COLD_GUEST")"
  printf '  %-46s %8s %8s %9s %14s %14s %10s\n' "vmdisk raw view, warm (same node again)" "$WARM_READY" "$WARM_BOOT" "$(total "$WARM_READY" "$WARM_BOOT")" "$WARM_GUEST" "$WARM_BYTES" "-"
  printf '  %-46s %8s %8s %9s %14s %14s %10s\n' "vmdisk raw view, cold, published boot trace" "$TRACED_READY" "$TRACED_BOOT" "$(total "$TRACED_READY" "$TRACED_BOOT")" "$TRACED_GUEST" "$TRACED_BYTES" "$(x "$TRACED_BYTES" "$TRACED_GUEST")"
  printf '  %-46s %8s %8s %9s %14s %14s %10s\n' "containerd full pull (gzip) + boot of the qcow2" "$FULL_PULL" "$FULL_BOOT" "$(total "$FULL_PULL" "$FULL_BOOT")" "$FULL_GUEST" "$FULL_BYTES" "$(x "$FULL_BYTES" "$FULL_GUEST")"
  echo "  trace: $TRACE_LINE"
  echo "  cold boot with trace / warm boot: $(python3 -c "print(f'{$TRACED_BOOT / $WARM_BOOT:.2f}')"); without trace / warm: $(python3 -c "print(f'{$COLD_BOOT / $WARM_BOOT:.2f}')")"
} | tee -a "$RESULTS"
