#!/usr/bin/env bash
# Prepare to ready (part of `make bench`): vmdisk's Prepare of a VM-disk layer — from
# containerd's call to the mounted layer, as the daemon logs it ("layer is served lazily",
# ms=) — for CRI pulls of PREPARE_PULLS (5) distinct images of an 8 GiB qcow2 (sparse: 4 MiB
# of random data each), each on a node with a cold cache, on the registry layout start_origin
# lays out ($LAYOUT: the API 80 ms away redirecting blobs to a blob host 10 ms away, by
# default). With BASE_BIN=DIR, a directory holding an earlier build's `vmdisk-snapshotter`, the
# same pulls for that build in the same run, the two builds measured in PREPARE_ROUNDS (2)
# rounds with the order alternating (a fresh node and containerd each time); the figures are
# the median of each build's pulls, with their range. After each pull, a cold 64 KiB read of the
# disk (what a guest's first read of a chunk waits for), and the peak RSS of the layer's mount
# server and of the daemon.
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

# measure BIN NODE: for each of the PULLS images pulled on a new node running BIN,
# "prepare_ms:miss_ms:server_rss_kib" — the Prepare time, a cold 64 KiB read of the pulled disk
# (a chunk no one fetched: 2 MiB before the qcow2 file's end, in its data), and the peak RSS of
# the layer's mount server after it —, then "daemon:<peak RSS KiB>".
measure() {
  local bin=$1 node=$2 i
  SNAPSHOTTER=$bin/vmdisk-snapshotter start_node "$B" "$node" "" "$B/$node-ctd/root"
  start_containerd "$B/$node-ctd" "$PULL" "$B/$node/vmdisk.sock"
  local misses=() rss=()
  for i in $(seq "$PULLS"); do
    "$CRI_PULL" --address "$B/$node-ctd/containerd.sock" "$PULL/bench/prepare-$i:1" > /dev/null
    local disk; disk=$(VMDISK_MANAGE=$B/$node/manage.sock "$VMDISK" path "$PULL/bench/prepare-$i:1")
    misses+=("$(python3 - "$disk" <<'PY'
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
at = (os.fstat(fd).st_size - (2 << 20)) // 65536 * 65536
t = time.perf_counter()
assert len(os.pread(fd, 65536, at)) == 65536
print(f"{(time.perf_counter() - t) * 1000:.1f}")
PY
)")
    local server; server=$(pgrep -n -f "serve-layer --config $B/$node/")
    rss+=("$(awk '/VmHWM/ {print $2}' "/proc/$server/status")")
  done
  local prepares; prepares=($(sed 's/\x1b\[[0-9;]*m//g' "$B/$node/vmdisk.log" | grep 'layer is served lazily' |
    grep -o ' ms=[0-9]*' | cut -d= -f2))
  for i in $(seq 0 $((PULLS - 1))); do echo "${prepares[$i]}:${misses[$i]}:${rss[$i]}"; done
  echo "daemon:$(awk '/VmHWM/ {print $2}' "/proc/${PIDS[-2]}/status")"
  stop_pids "${PIDS[-1]}" "${PIDS[-2]}"
  stop_mount_servers "$B/$node"
  unmount_under "$B/$node"
}

# summary FIELD ROWS...: "median (min-max)" of field FIELD (1: Prepare ms, 2: cold miss ms, 3: the
# mount server's peak RSS, KiB as MiB; daemon: the daemon's peak RSS, MiB) of the rows.
summary() {
  python3 - "$@" <<'PY'
import statistics as s, sys
field, rows = sys.argv[1], sys.argv[2:]
if field == "daemon":
    v = [int(r.split(":")[1]) / 1024 for r in rows if r.startswith("daemon:")]
else:
    v = [float(r.split(":")[int(field) - 1]) for r in rows if not r.startswith("daemon:")]
    v = [x / 1024 for x in v] if field == "3" else v
v.sort()
print(f"{s.median(v):.0f} ({v[0]:.0f}-{v[-1]:.0f})")
PY
}

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

row() {  # row NAME ROWS...
  local name=$1; shift
  printf '  %-44s %16s %16s %18s %18s\n' "$name" "$(summary 1 "$@")" "$(summary 2 "$@")" "$(summary 3 "$@")" "$(summary daemon "$@")"
}
{
  echo
  echo "vmdisk's Prepare of a VM-disk layer (classification to mounted), then a cold 64 KiB read of the disk; CRI pulls of $PULLS distinct 8 GiB images per round on a cold node, $ROUNDS rounds; $LAYOUT_TEXT. Median (range):"
  printf '  %-44s %16s %16s %18s %18s\n' build "Prepare ms" "cold miss ms" "server RSS MiB" "daemon RSS MiB"
  row "this build ($NEW_BIN)" "${NEW[@]}"
  [ -z "$BASE_BIN" ] || row "earlier build ($BASE_BIN)" "${BASE[@]}"
} | tee -a "$RESULTS"
