#!/usr/bin/env bash
# Snapshotter figures (part of `make bench`): CRI PullImage time and registry bytes for a VM
# disk, lazily through vmdisk-snapshotter vs. containerd's overlayfs full pull of the same disk
# as a gzip containerDisk, for a 1 GiB and an 8 GiB disk; then the same after image removal
# (re-pull). Each disk is fully written with random data (incompressible: the fair worst case
# for the full pull's transfer, as real images compress 2-3x). Both containerds run in one
# scratch directory against one loopback registry; registry bytes are summed from the
# registry's own request log. Then the same lazy pulls over the shaped "cluster" link (20 ms,
# 200 Mbit/s) on a fresh node, beside the full pull over that link for the 1 GiB disk (the
# 8 GiB full pull would take six minutes there: it scales with bandwidth). Needs ~45 GiB free
# for the 8 GiB case.
set -euo pipefail
cd "$(dirname "$0")/../.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
SNAPSHOTTER=${SNAPSHOTTER:-$PWD/target/release/vmdisk-snapshotter}
CRI_PULL=${CRI_PULL:-$PWD/target/release/examples/cri-pull}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
SIZES=${BENCH_PULL_GIB:-1 8}
source integration/lib/containerd.sh
bench_scratch pull

start_registry "$B"

start_cluster_link "$B" "$REG"
start_node "$B" lazy "" "$B/lazy-ctd/root"
start_containerd "$B/lazy-ctd" "$REG" "$B/lazy/vmdisk.sock"
start_containerd "$B/full-ctd" "$REG" ""
start_node "$B" clusterlazy "" "$B/clusterlazy-ctd/root"
start_containerd "$B/clusterlazy-ctd" "$CLUSTER" "$B/clusterlazy/vmdisk.sock"
start_containerd "$B/clusterfull-ctd" "$CLUSTER" ""

# pull CONTAINERD_DIR IMAGE: prints "seconds registry_bytes"
pull() {
  local m; m=$(mark)
  local out; out=$("$CRI_PULL" --address "$B/$1/containerd.sock" "$2")
  echo "$(echo "$out" | sed -E 's/.* in ([0-9.]+) s$/\1/') $(served_since "$m")"
}
# How long the last lazy Prepare took in vmdisk (from containerd's call to the mounted layer).
prepare_ms() { sed 's/\x1b\[[0-9;]*m//g' "$B/${1:-lazy}/vmdisk.log" | grep 'layer is served lazily' | tail -1 | grep -o ' ms=[0-9]*' | cut -d= -f2; }
remove() { "$CRI_PULL" --address "$B/$1/containerd.sock" --rm "$2" > /dev/null; }

ROWS=()
for GIB in $SIZES; do
  DISK=$B/disk-$GIB.qcow2
  random_qcow2 "$DISK" "$((GIB * 1024))"
  SIZE=$(stat -c %s "$DISK")
  publish_lazy_and_gzip "$DISK" "$REG/bench/lazy-$GIB:1" "$REG/bench/gzip-$GIB:1"
  # The registry's data cold; the programs a node runs anyway (containerd, vmdisk) warm, as
  # on a node where they have run before.
  sync; echo 3 > /proc/sys/vm/drop_caches
  cat "$SNAPSHOTTER" "$(command -v containerd)" > /dev/null

  read -r L_SECS L_BYTES < <(pull lazy-ctd "$REG/bench/lazy-$GIB:1")
  L_MS=$(prepare_ms)
  remove lazy-ctd "$REG/bench/lazy-$GIB:1"
  read -r LR_SECS LR_BYTES < <(pull lazy-ctd "$REG/bench/lazy-$GIB:1")
  read -r F_SECS F_BYTES < <(pull full-ctd "$REG/bench/gzip-$GIB:1")
  remove full-ctd "$REG/bench/gzip-$GIB:1"
  read -r FR_SECS FR_BYTES < <(pull full-ctd "$REG/bench/gzip-$GIB:1")
  # The cluster link: lazy on a fresh node, and the full pull of the 1 GiB disk.
  read -r C_SECS C_BYTES < <(pull clusterlazy-ctd "$CLUSTER/bench/lazy-$GIB:1")
  C_MS=$(prepare_ms clusterlazy)
  CF_SECS=-
  if [ "$GIB" -le 1 ]; then
    read -r CF_SECS _ < <(pull clusterfull-ctd "$CLUSTER/bench/gzip-$GIB:1")
    remove clusterfull-ctd "$CLUSTER/bench/gzip-$GIB:1"
  fi
  remove clusterlazy-ctd "$CLUSTER/bench/lazy-$GIB:1"
  ROWS+=("$GIB $SIZE $L_SECS $L_BYTES $LR_SECS $LR_BYTES $F_SECS $F_BYTES $FR_SECS $FR_BYTES $L_MS $C_SECS $C_BYTES $C_MS $CF_SECS")
  remove lazy-ctd "$REG/bench/lazy-$GIB:1"
  remove full-ctd "$REG/bench/gzip-$GIB:1"
  rm -f "$DISK"
done

{
  echo
  echo "CRI PullImage of a VM disk (qcow2 fully written with random data), loopback registry, same run:"
  printf '  %-6s %-38s %10s %16s %12s %16s\n' disk "snapshotter" "pull s" "registry bytes" "re-pull s" "re-pull bytes"
  for row in "${ROWS[@]}"; do
    read -r GIB SIZE L_SECS L_BYTES LR_SECS LR_BYTES F_SECS F_BYTES FR_SECS FR_BYTES L_MS C_SECS C_BYTES C_MS CF_SECS <<< "$row"
    printf '  %-6s %-38s %10s %16s %12s %16s\n' "${GIB}G" "vmdisk (lazy, zstd:chunked)" "$L_SECS" "$L_BYTES" "$LR_SECS" "$LR_BYTES"
    printf '  %-6s %-38s %10s %16s %12s %16s\n' "" "overlayfs (full pull, gzip)" "$F_SECS" "$F_BYTES" "$FR_SECS" "$FR_BYTES"
    echo "         (disk file $SIZE bytes; lazy pull moved $(python3 -c "print(f'{$L_BYTES * 100 / $SIZE:.3f}')")% of it; vmdisk's Prepare, classification to mounted: $L_MS ms)"
    echo "         cluster link: lazy pull $C_SECS s, $C_BYTES registry bytes, vmdisk's Prepare $C_MS ms; full pull (gzip) $CF_SECS s"
  done
} | tee -a "$RESULTS"
