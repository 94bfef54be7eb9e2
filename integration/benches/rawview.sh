#!/usr/bin/env bash
# Raw-view reads of cached data (part of `make bench`): `disk.raw` of a qcow2 whose every chunk
# is cached, read through the daemon (the raw view is computed per read: no passthrough) after
# the page cache is dropped: sequentially in 1 MiB reads, and at random in 4 KiB reads with 1
# and 16 readers. With BASE_BIN=DIR, a directory holding an earlier build's `vmdisk` and
# `vmdisk-snapshotter`, the same figures for that build in the same run, on the same disk, the
# two builds measured in RAWVIEW_ROUNDS rounds (2) with the order alternating.
# RAWVIEW_MIB (default 1024) MiB of random data in a 2 GiB qcow2 at 64 KiB clusters.
set -euo pipefail
cd "$(dirname "$0")/../.."
NEW_BIN=${NEW_BIN:-$PWD/target/release}
BASE_BIN=${BASE_BIN:-}
MIB=${RAWVIEW_MIB:-1024}
source integration/lib/containerd.sh
bench_scratch rawview
start_registry "$B"

DISK=$B/disk.qcow2
qemu-img create -q -f qcow2 "$DISK" 2G
for i in $(seq 0 $((MIB / 256 - 1))); do
  head -c 256M /dev/urandom > "$B/piece"
  qemu-io -c "write -s $B/piece $((i * 256 + 64))M 256M" "$DISK" > /dev/null
done
rm -f "$B/piece"
"$NEW_BIN/vmdisk" push "$DISK" "$REG/vm/rawview:1" > /dev/null

# measure BIN NODE: "seq_MBps rand1_iops rand16_iops" for the build in BIN.
measure() {
  local bin=$1 node=$2 raw secs
  VMDISK=$bin/vmdisk SNAPSHOTTER=$bin/vmdisk-snapshotter start_node "$B" "$node"
  export VMDISK_MANAGE=$B/$node/manage.sock
  raw=$("$bin/vmdisk" path --raw "$REG/vm/rawview:1")
  "$bin/vmdisk" prefetch --quiet --wait "$REG/vm/rawview:1" > /dev/null
  # The whole disk once through the raw view, so its L2 tables are in the view's memory too.
  dd if="$raw" of=/dev/null bs=1M status=none
  sync; echo 3 > /proc/sys/vm/drop_caches
  secs=$( { /usr/bin/time -f %e dd if="$raw" of=/dev/null bs=1M iflag=direct status=none; } 2>&1 )
  local seq; seq=$(python3 -c "print(f'{2048 * 1.048576 / max($secs, 0.001):.0f}')")
  local iops=()
  for jobs in 1 16; do
    sync; echo 3 > /proc/sys/vm/drop_caches
    iops+=("$(fio --name=r --filename="$raw" --readonly --direct=1 --rw=randread --bs=4k --ioengine=psync \
      --numjobs="$jobs" --group_reporting --time_based --runtime=10 --output-format=json |
      python3 -c 'import json,sys; print(round(json.load(sys.stdin)["jobs"][0]["read"]["iops"]))')")
  done
  unset VMDISK_MANAGE
  stop_pids "${PIDS[-1]}"
  stop_mount_servers "$B"
  unmount_under "$B/$node"
  echo "$seq ${iops[0]} ${iops[1]}"
}

row() { printf '  %-34s %14s %16s %17s\n' "$@" | tee -a "$RESULTS"; }
{
  echo
  echo "raw view (disk.raw) of a fully cached 2 GiB qcow2 ($MIB MiB of data), read through the daemon, page cache dropped:"
} | tee -a "$RESULTS"
row build "1 MiB seq MB/s" "4 KiB rand IOPS" "16 readers IOPS"
if [ -z "$BASE_BIN" ]; then
  read -r N_SEQ N_R1 N_R16 <<< "$(measure "$NEW_BIN" new)"
  row "this build" "$N_SEQ" "$N_R1" "$N_R16"
  exit 0
fi
# Beside an earlier build: RAWVIEW_ROUNDS rounds (default 2), the order alternating (the build
# measured second has lost half its sequential figure in every run so far: the order, not the
# build), then each figure's ratio this build / the base over all rounds.
for round in $(seq "${RAWVIEW_ROUNDS:-2}"); do
  if [ $((round % 2)) = 1 ]; then order="new base"; else order="base new"; fi
  for which in $order; do
    if [ "$which" = new ]; then bin=$NEW_BIN label="this build"; else bin=$BASE_BIN label="base build"; fi
    read -r seq r1 r16 <<< "$(measure "$bin" "$which-$round")"
    row "round $round: $label" "$seq" "$r1" "$r16"
    echo "$which $seq $r1 $r16" >> "$B/rounds"
  done
done
python3 - "$B/rounds" <<'PY' | tee -a "$RESULTS"
import sys
sums = {}
for line in open(sys.argv[1]):
    which, *figures = line.split()
    sums.setdefault(which, [0.0, 0.0, 0.0])
    sums[which] = [a + float(b) for a, b in zip(sums[which], figures)]
ratios = [f"{n / max(b, 1e-9):.2f}" for n, b in zip(sums["new"], sums["base"])]
print(f"  {'this build / base, all rounds':34} {ratios[0]:>14} {ratios[1]:>16} {ratios[2]:>17}")
PY
