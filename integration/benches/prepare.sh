#!/usr/bin/env bash
# Prepare to ready (part of `make bench`): vmdisk's Prepare of a VM-disk layer — from
# containerd's call to the mounted layer, as the daemon logs it ("layer is served lazily",
# ms=) — for CRI pulls of PREPARE_PULLS (5) distinct images of an 8 GiB qcow2 (sparse: 4 MiB
# of random data each), each on a node with a cold cache, on the registry layout start_origin
# lays out ($LAYOUT: the API 80 ms away redirecting blobs to a blob host 10 ms away, by
# default). With BASE_BIN=DIR, a directory holding an earlier build's `vmdisk-snapshotter`, the
# same pulls for that build in the same run, the two builds measured in PREPARE_ROUNDS (2)
# rounds with the order alternating (a fresh node and containerd each time); the figures are
# the median of each build's pulls, with their range.
set -euo pipefail
cd "$(dirname "$0")/../.."
NEW_BIN=${NEW_BIN:-$PWD/target/release}
BASE_BIN=${BASE_BIN:-}
VMDISK=${VMDISK:-$NEW_BIN/vmdisk}
CRI_PULL=${CRI_PULL:-$PWD/target/release/examples/cri-pull}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
CDN=${CDN:-$PWD/target/release/examples/blob-cdn}
PULLS=${PREPARE_PULLS:-5}
ROUNDS=${PREPARE_ROUNDS:-2}
source integration/lib/containerd.sh
bench_scratch prepare
start_origin "$B"

for i in $(seq "$PULLS"); do
  qemu-img create -q -f qcow2 "$B/disk-$i.qcow2" 8G
  head -c 4M /dev/urandom > "$B/piece"
  qemu-io -c "write -s $B/piece $((i * 512))M 4M" "$B/disk-$i.qcow2" > /dev/null
  "$VMDISK" push "$B/disk-$i.qcow2" "$REG/bench/prepare-$i:1" > /dev/null
  rm -f "$B/disk-$i.qcow2" "$B/piece"
done

# measure BIN NODE: the Prepare times (ms) of the PULLS images on a new node running BIN.
measure() {
  local bin=$1 node=$2
  SNAPSHOTTER=$bin/vmdisk-snapshotter start_node "$B" "$node" "" "$B/$node-ctd/root"
  start_containerd "$B/$node-ctd" "$PULL" "$B/$node/vmdisk.sock"
  for i in $(seq "$PULLS"); do
    "$CRI_PULL" --address "$B/$node-ctd/containerd.sock" "$PULL/bench/prepare-$i:1" > /dev/null
  done
  sed 's/\x1b\[[0-9;]*m//g' "$B/$node/vmdisk.log" | grep 'layer is served lazily' |
    grep -o ' ms=[0-9]*' | cut -d= -f2 | tr '\n' ' '
  kill "${PIDS[-1]}" "${PIDS[-2]}" 2>/dev/null; wait "${PIDS[-1]}" "${PIDS[-2]}" 2>/dev/null || true
  stop_mount_servers "$B/$node"
  unmount_under "$B/$node"
}

# summary TIMES...: "median (min-max)" of the times.
summary() { python3 -c 'import sys, statistics as s; v = sorted(map(int, sys.argv[1:])); print(f"{s.median(v):.0f} ({v[0]}-{v[-1]})")' "$@"; }

NEW=() BASE=()
for round in $(seq "$ROUNDS"); do
  if [ -n "$BASE_BIN" ] && [ $((round % 2)) -eq 1 ]; then
    BASE+=($(measure "$BASE_BIN" "base-$round"))
    NEW+=($(measure "$NEW_BIN" "new-$round"))
  else
    NEW+=($(measure "$NEW_BIN" "new-$round"))
    [ -z "$BASE_BIN" ] || BASE+=($(measure "$BASE_BIN" "base-$round"))
  fi
done

{
  echo
  echo "vmdisk's Prepare of a VM-disk layer (classification to mounted), ms, CRI pulls of $PULLS distinct 8 GiB images per round on a cold node, $ROUNDS rounds; $LAYOUT_TEXT:"
  printf '  %-40s %18s %8s\n' build "median (range)" pulls
  printf '  %-40s %18s %8s\n' "this build ($NEW_BIN)" "$(summary "${NEW[@]}")" "${#NEW[@]}"
  [ -z "$BASE_BIN" ] || printf '  %-40s %18s %8s\n' "earlier build ($BASE_BIN)" "$(summary "${BASE[@]}")" "${#BASE[@]}"
} | tee -a "$RESULTS"
