#!/usr/bin/env bash
# The main job on an embedded default: boot a VM from a multi-GiB disk published in a registry
# laid out as public registries are — its API 80 ms away, answering blob GETs with a redirect to
# a blob host (a CDN) 10 ms away, 200 Mbit/s each (LAYOUT=itself: a registry serving blobs
# itself behind a 20 ms link, as the lab was before) — once lazily through vmdisk and once after
# the full pull every node does today, and compare the two.
#
# In a scratch directory: a registry on loopback behind the links, a bootable Linux guest disk
# (DEMO_GIB, default 2 GiB, padded with data the boot never reads) published both ways —
# `vmdisk push` (lazy) and a gzip containerDisk (what KubeVirt users publish today). Then:
# - lazy: containerd 1.6 with vmdisk-snapshotter as its CRI snapshotter pulls the image through
#   CRI (as kubelet does) and gets a remote snapshot; the guest boots from the ready raw view
#   (`vmdisk path --raw`, what Kata boots) while chunks are fetched as it reads them;
# - full: containerd with its overlayfs snapshotter pulls and unpacks the gzip image, then the
#   guest boots from the unpacked file.
# The scratch directory (about 6.5 GB: the disks, the registry, both nodes) is removed at the
# end, kept with DEMO_KEEP set. Needs root (FUSE, containerd) and the packages `make demo`
# installs.
set -euo pipefail
cd "$(dirname "$0")/.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
SNAPSHOTTER=${SNAPSHOTTER:-$PWD/target/release/vmdisk-snapshotter}
CRI_PULL=${CRI_PULL:-$PWD/target/release/examples/cri-pull}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
CDN=${CDN:-$PWD/target/release/examples/blob-cdn}
LAB=${LAB:-$PWD/target/release/examples/lab}
GIB=${DEMO_GIB:-2}
mkdir -p scratch
S=$(mktemp -d "$PWD/scratch/demo-XXXXXX")
PIDS=()
PROGRESS=
# boot_requests: the requests the registry's API and its blob host were asked so far.
boot_requests() { echo $(($(cdn_count registry_blob_requests) + $(cdn_count registry_other_requests) + $(cdn_count blob_requests))); }
cleanup() {
  [ -n "$PROGRESS" ] && kill "$PROGRESS" 2>/dev/null
  pkill -f "qemu-system-x86_64 .*$S" 2>/dev/null || true
  stop_pids "${PIDS[@]}"
  wait 2>/dev/null || true
  stop_mount_servers "$S"
  unmount_under "$S"
  [ -n "${DEMO_KEEP:-}" ] || rm -rf "$S"
}
trap 'status=$?; cleanup || true; exit $status' EXIT
source integration/lib/containerd.sh
source integration/lib/guest.sh
secs() { python3 -c "print(f'{$2 - $1:.1f}')"; }
mb() { python3 -c "print(f'{$1 / 1e6:.1f} MB')"; }
# progress_while LABEL TOTAL COMMAND: prints, every second until stopped, the bytes COMMAND
# reports so far (a progress line for the slow parts).
progress_while() {
  local t0; t0=$(now)
  while sleep 1; do
    printf '\r   %s: %s of %s after %s s ' "$1" "$(mb "$($3)")" "$(mb "$2")" "$(secs "$t0" "$(now)")"
  done
}
progress_start() { progress_while "$@" 2> /dev/null & PROGRESS=$!; }
progress_stop() { kill "$PROGRESS" 2>/dev/null; wait "$PROGRESS" 2>/dev/null || true; PROGRESS=; printf '\r\033[K'; }
# What the lazy node fetched so far (the registry and the blob host count each request as it
# completes).
LAZY_MARK=0:0
lazy_fetched() { origin_bytes_since "$S" "$LAZY_MARK"; }
# What the full pull downloaded so far (containerd's content store, partial downloads included).
full_fetched() { local n; n=$(du -sb "$S/node2-ctd/root/io.containerd.content.v1.content" 2>/dev/null | cut -f1); echo "${n:-0}"; }

echo "== scratch directory: $S (removed at the end; DEMO_KEEP=1 keeps it)"
start_origin "$S"
echo "== registry on $REG, pulled from $PULL: $LAYOUT_TEXT"
echo "== building a ${GIB} GiB bootable guest disk (Linux kernel from the host, busybox init on ext4)"
make_guest_disk "$S" "$GIB"
SIZE=$(stat -c %s "$S/guest.qcow2")
write_boot_script "$S"
echo "== publishing it lazily (vmdisk push) and as a gzip containerDisk (skopeo), $(mb "$SIZE") each"
publish_lazy_and_gzip "$S/guest.qcow2" "$REG/vm/guest:lazy" "$REG/vm/guest:gzip"

echo "== node 1: containerd 1.6 + vmdisk-snapshotter; CRI PullImage $PULL/vm/guest:lazy"
start_node "$S" node1 "" "$S/node1-ctd/root"
start_containerd "$S/node1-ctd" "$PULL" "$S/node1/vmdisk.sock"
export VMDISK_MANAGE=$S/node1/manage.sock
sync; echo 3 > /proc/sys/vm/drop_caches
m=$(origin_mark "$S"); LAZY_MARK=$m; t0=$(now)
[ "$LAYOUT" != redirect ] || asked=$(($(cdn_count registry_blob_requests) + $(cdn_count registry_other_requests)))
"$CRI_PULL" --address "$S/node1-ctd/containerd.sock" "$PULL/vm/guest:lazy" | sed 's/^/   /'
RAW=$("$VMDISK" path --raw "$PULL/vm/guest:lazy")
t1=$(now)
echo "   ready: $RAW"
echo "== booting the guest from the lazily loaded raw view"
boot_mark=$(origin_mark "$S")
[ "$LAYOUT" != redirect ] || boot_asked=$(boot_requests)
progress_start "lazy boot" "$SIZE" lazy_fetched
read -r L_BOOT L_GUEST < <("$S/boot.sh" "$RAW" raw)
progress_stop
t2=$(now)
L_BYTES=$(origin_bytes_since "$S" "$m")
BOOT_BYTES=$(origin_bytes_since "$S" "$boot_mark")
BOOT_ASKED=-
[ "$LAYOUT" != redirect ] || BOOT_ASKED=$(($(boot_requests) - boot_asked))
L_ASKED=-
[ "$LAYOUT" != redirect ] || L_ASKED=$(($(cdn_count registry_blob_requests) + $(cdn_count registry_other_requests) - asked))
L_READY=$(secs "$t0" "$t1"); L_TOTAL=$(secs "$t0" "$t2")
echo "   booted (BOOT-MARKER) after ${L_TOTAL} s; the guest read $(mb "$L_GUEST")"
"$VMDISK" ls | sed 's/^/   /'

echo "== node 2: containerd 1.6 with overlayfs; CRI PullImage $PULL/vm/guest:gzip (today's full pull)"
start_containerd "$S/node2-ctd" "$PULL" ""
sync; echo 3 > /proc/sys/vm/drop_caches
m=$(origin_mark "$S"); t0=$(now)
progress_start "full pull" "$SIZE" full_fetched
"$CRI_PULL" --address "$S/node2-ctd/containerd.sock" "$PULL/vm/guest:gzip" > "$S/full-pull.out"
progress_stop
sed 's/^/   /' "$S/full-pull.out"
t1=$(now)
UNPACKED=$(find "$S/node2-ctd/root/io.containerd.snapshotter.v1.overlayfs/snapshots" -name guest.qcow2 | head -1)
echo "== booting the guest from the unpacked disk"
read -r F_BOOT F_GUEST < <("$S/boot.sh" "$UNPACKED" qcow2)
t2=$(now)
F_BYTES=$(origin_bytes_since "$S" "$m")
F_READY=$(secs "$t0" "$t1"); F_TOTAL=$(secs "$t0" "$t2")

echo
echo "== a ${GIB} GiB VM disk from a $LAYOUT_TEXT, from PullImage to a booted guest:"
printf '   %-34s %12s %16s %20s\n' "" "disk ready" "booted guest" "from the registry"
printf '   %-34s %10s s %14s s %20s\n' "vmdisk (lazy, raw view for Kata)" "$L_READY" "$L_TOTAL" "$(mb "$L_BYTES")"
printf '   %-34s %10s s %14s s %20s\n' "full pull + unpack (overlayfs)" "$F_READY" "$F_TOTAL" "$(mb "$F_BYTES")"
echo "   (the guest itself read $(mb "$L_GUEST"); boots run under TCG, without KVM, on both rows)"
[ "$L_ASKED" = - ] || echo "   (the lazy node asked the registry's API $L_ASKED times: each blob's redirect once; every chunk came from the blob host)"
[ "$BOOT_ASKED" = - ] || echo "   (the lazy boot itself: $BOOT_ASKED requests to the registry and its blob host, $(mb "$BOOT_BYTES") fetched for the $(mb "$L_GUEST") the guest read, $(python3 -c "print(f'{$BOOT_BYTES / max($L_GUEST, 1):.2f}')")x)"
