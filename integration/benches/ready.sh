#!/usr/bin/env bash
# `make bench`: time from starting `vmdisk mount` to the disk being ready, by the disk's size.
# Sparse raw disks of 8, 64 and 256 GiB, each with the same 12 MiB of data (4 MiB at the
# start, the middle and the end), published by `vmdisk push` (a run of zeros is one chunk of up
# to 64 MiB, holes are not read); each mounted cold (fresh cache) and warm (the same cache
# again) three times, the sizes interleaved; medians and the spread. With BASE_BIN=DIR (a
# release build before), that build's push and mount of the 8 GiB disk beside it (its push
# reads every zero: about 50 s per 8 GiB). Appends to scratch/bench/results.txt. Root (FUSE).
set -euo pipefail
cd "$(dirname "$0")/../.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
source integration/lib/containerd.sh
bench_scratch ready
start_registry "$B"
mkdir -p "$B/mnt"

# ready_once BIN REF CACHE: seconds from starting the mount to its ready line.
ready_once() {
  local t0 t1 pid
  t0=$(now)
  "$1" mount --cache "$3" "$2" "$B/mnt" > "$B/mount.out" 2> "$B/mount.err" &
  pid=$!
  for _ in $(seq 10000); do grep -q '^ready' "$B/mount.out" && break; sleep 0.002; done
  t1=$(now)
  grep -q '^ready' "$B/mount.out" || { cat "$B/mount.err" >&2; exit 1; }
  kill -INT "$pid"; wait "$pid" || true
  secs3 "$t0" "$t1"
}
secs3() { python3 -c "print(f'{$2 - $1:.3f}')"; }
stats3() { python3 -c 'import sys, statistics as s; v = sorted(map(float, sys.argv[1:])); print(f"{s.median(v):.3f} ({v[0]:.3f}-{v[-1]:.3f})")' "$@"; }

declare -A COLD WARM TOC PUSH
SIZES="8 64 256"
BINS=(new)
[ -n "${BASE_BIN:-}" ] && BINS+=(base)
for GIB in $SIZES; do
  DISK=$B/sparse.raw
  truncate -s "${GIB}G" "$DISK"
  head -c 4M /dev/urandom > "$B/data"
  for AT in 0 $((GIB * 512)) $((GIB * 1024 - 4)); do
    dd if="$B/data" of="$DISK" bs=1M seek="$AT" conv=notrunc status=none
  done
  for BIN in "${BINS[@]}"; do
    [ "$BIN" = base ] && [ "$GIB" != 8 ] && continue
    EXE=$VMDISK; [ "$BIN" = base ] && EXE=$BASE_BIN/vmdisk
    T0=$(now)
    "$EXE" push --format raw "$DISK" "$REG/bench/sparse$GIB:$BIN" > /dev/null 2>&1
    PUSH[$BIN$GIB]=$(secs "$T0" "$(now)")
    "$VMDISK" inspect --json "$REG/bench/sparse$GIB:$BIN" > "$B/inspect.json"
    TOC[$BIN$GIB]=$(python3 -c 'import json,sys; l = json.load(open(sys.argv[1]))["platforms"][0]["layers"][0]; print(l["chunks"], l["toc_size"])' "$B/inspect.json")
  done
  rm -f "$DISK"
done
for ROUND in 1 2 3; do
  for GIB in $SIZES; do
    for BIN in "${BINS[@]}"; do
      [ "$BIN" = base ] && [ "$GIB" != 8 ] && continue
      EXE=$VMDISK; [ "$BIN" = base ] && EXE=$BASE_BIN/vmdisk
      rm -rf "$B/cache"
      COLD[$BIN$GIB]+=" $(ready_once "$EXE" "$REG/bench/sparse$GIB:$BIN" "$B/cache")"
      WARM[$BIN$GIB]+=" $(ready_once "$EXE" "$REG/bench/sparse$GIB:$BIN" "$B/cache")"
    done
  done
done
rm -rf "$B/cache"
{
  echo
  echo "start to ready of vmdisk mount, sparse raw disks with 12 MiB of data, medians of 3 (range):"
  printf '  %-22s %8s %10s %9s %22s %22s\n' "disk, build" chunks "TOC bytes" "push s" "cold ready s" "warm ready s"
  for GIB in $SIZES; do
    for BIN in "${BINS[@]}"; do
      [ "$BIN" = base ] && [ "$GIB" != 8 ] && continue
      read -r CHUNKS TOCB <<< "${TOC[$BIN$GIB]}"
      printf '  %-22s %8s %10s %9s %22s %22s\n' "$GIB GiB, $([ "$BIN" = base ] && echo before || echo this build)" "$CHUNKS" "$TOCB" "${PUSH[$BIN$GIB]}" \
        "$(stats3 ${COLD[$BIN$GIB]})" "$(stats3 ${WARM[$BIN$GIB]})"
    done
  done
} | tee -a "$RESULTS"
