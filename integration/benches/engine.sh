#!/usr/bin/env bash
# `make bench`, part 2: the lazy disk engine (`vmdisk mount`), each figure beside its baseline
# from the same run. Appends to scratch/bench/results.txt. Needs root (FUSE, containerd).
set -euo pipefail
cd "$(dirname "$0")/../.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
source integration/lib/containerd.sh
bench_scratch engine

start_registry "$B"

# ---------------------------------------------------------------------------------------
# Cold boot-like access on a 2 GiB disk: qemu-img info, then 5% of the guest's clusters read
# at scattered offsets (seeded), through qemu's qcow2 driver.
DISK=$B/boot.qcow2
qemu-img create -q -f qcow2 "$DISK" 2G
for i in $(seq 0 15); do
  head -c 64M /dev/urandom > "$B/piece"
  qemu-io -c "write -s $B/piece $((i * 128))M 64M" "$DISK" > /dev/null
done
rm "$B/piece"
DSIZE=$(stat -c %s "$DISK")
boot_workload "$B/workload" 5
workload() {  # workload FORMAT TARGET
  qemu-img info -f "$1" "$2" > /dev/null
  qemu-io -r -f "$1" "$2" < "$B/workload" > /dev/null
}
"$VMDISK" push "$DISK" "$REG/bench/boot:1" > /dev/null
LAYER_SIZE=$(curl -s -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://$REG/v2/bench/boot/manifests/1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["layers"][0]["size"])')

# (a) vmdisk mount, cold cache.
sync; echo 3 > /proc/sys/vm/drop_caches
M=$(mark); T0=$(now)
mkdir -p "$B/mnt"
"$VMDISK" mount --stats --cache "$B/cache" "$REG/bench/boot:1" "$B/mnt" > "$B/mount.out" 2> "$B/mount.err" &
MPID=$!; PIDS+=($MPID)
for _ in $(seq 3000); do grep -q '^ready' "$B/mount.out" && break; sleep 0.005; done
READY_2G=$(secs "$T0" "$(now)")
workload qcow2 "$B/mnt/disk/boot.qcow2"
T1=$(now); LAZY_T=$(secs "$T0" "$T1"); LAZY_B=$(served_since "$M")
kill -INT $MPID; wait $MPID || true

# (b) full download: containerd pulls and unpacks the same image (overlayfs), then the
#     workload runs on the local file.
start_containerd "$B/ctd" "$REG" ""
sync; echo 3 > /proc/sys/vm/drop_caches
M=$(mark); T0=$(now)
ctr -a "$B/ctd/containerd.sock" images pull --plain-http "$REG/bench/boot:1" > /dev/null
mkdir -p "$B/mnt-ctd"
ctr -a "$B/ctd/containerd.sock" images mount "$REG/bench/boot:1" "$B/mnt-ctd" > /dev/null
workload qcow2 "$B/mnt-ctd/disk/boot.qcow2"
T1=$(now); FULL_T=$(secs "$T0" "$T1"); FULL_B=$(served_since "$M")
ctr -a "$B/ctd/containerd.sock" images unmount "$B/mnt-ctd" > /dev/null

# (c) nbdkit's curl plugin over an uncompressed copy of the disk (one blob, Range reads),
#     qemu over nbd://.
DIGEST=sha256:$(sha256sum "$DISK" | cut -d' ' -f1)
LOC=$(curl -si -X POST "http://$REG/v2/bench/raw/blobs/uploads/" | tr -d '\r' | sed -n 's/^[Ll]ocation: //p')
curl -sf -X PUT -H 'Content-Type: application/octet-stream' -T "$DISK" "$LOC&digest=$DIGEST" > /dev/null
NBD_PORT=$(free_port)
M=$(mark); T0=$(now)
nbdkit -f -r -p "$NBD_PORT" -i 127.0.0.1 curl "http://$REG/v2/bench/raw/blobs/$DIGEST" > "$B/nbdkit.log" 2>&1 &
NPID=$!; PIDS+=($NPID)
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$NBD_PORT) 2>/dev/null && break; sleep 0.05; done
workload qcow2 "nbd://127.0.0.1:$NBD_PORT"
T1=$(now); NBD_T=$(secs "$T0" "$T1"); NBD_B=$(served_since "$M")
kill $NPID; wait $NPID 2>/dev/null || true

pct() { python3 -c "print(f'{$1 * 100 / $2:.2f}')"; }
{
  echo
  echo "cold boot-like access, 2 GiB-virtual qcow2 ($((DSIZE >> 20)) MiB file, layer $((LAYER_SIZE >> 20)) MiB): qemu-img info + 5% of clusters (1638 x 64 KiB) at scattered offsets"
  printf '  %-52s %8s %14s %10s\n' method seconds "registry bytes" "% of file"
  printf '  %-52s %8s %14s %10s\n' "vmdisk mount (cold cache)" "$LAZY_T" "$LAZY_B" "$(pct "$LAZY_B" "$DSIZE")"
  printf '  %-52s %8s %14s %10s\n' "containerd pull + unpack (overlayfs), then local read" "$FULL_T" "$FULL_B" "$(pct "$FULL_B" "$DSIZE")"
  printf '  %-52s %8s %14s %10s\n' "nbdkit curl plugin over the raw file (nbd://)" "$NBD_T" "$NBD_B" "$(pct "$NBD_B" "$DSIZE")"
} | tee -a "$RESULTS"

# ---------------------------------------------------------------------------------------
# Warm reads: the disk fully cached, through the mount with and without passthrough, and the
# same file on local disk. Page cache dropped before each run.
mount_warm() {  # mount_warm EXTRA_FLAGS...
  "$VMDISK" mount --stats --cache "$B/cache" "$@" "$REG/bench/boot:1" "$B/mnt" > "$B/mount.out" 2> "$B/mount.err" &
  MPID=$!; PIDS+=($MPID)
  for _ in $(seq 600); do grep -q '^hydrated' "$B/mount.out" && break; sleep 0.1; done
}
# Reads use O_DIRECT, so they measure the I/O path (FUSE daemon, passthrough, or plain file)
# rather than page-cache and read-ahead effects (fadvise hints do not cross passthrough).
# This machine's disk is itself cached by its host, so every measurement first reads the
# cached data file once (same host-cache state for all) and drops the guest's page cache.
prime() { dd if="$DATA" of=/dev/null bs=4M status=none; sync; echo 3 > /proc/sys/vm/drop_caches; }
# Each figure is the median of three runs: single runs on this shared host vary by ±20%.
median3() { python3 -c 'import sys; v=sorted(float(x) for x in sys.argv[1:]); print(f"{v[1]:.0f}")' "$@"; }
seq_read_once() { prime; dd if="$1" of=/dev/null bs=1M iflag=direct 2>&1 | tail -1 | python3 -c 'import sys,re; l=sys.stdin.read(); b,s=re.search(r"^(\d+) bytes.*, ([\d.]+) s", l).groups(); print(f"{int(b)/float(s)/1e6:.0f}")'; }
rand_iops_once() { prime; fio --name=r --filename="$1" --readonly --rw=randread --bs=4k --ioengine=psync --direct=1 --runtime=5 --time_based --output-format=json 2>/dev/null | python3 -c 'import json,sys; print(int(json.load(sys.stdin)["jobs"][0]["read"]["iops"]))'; }
seq_read() { median3 "$(seq_read_once "$1")" "$(seq_read_once "$1")" "$(seq_read_once "$1")"; }
rand_iops() { median3 "$(rand_iops_once "$1")" "$(rand_iops_once "$1")" "$(rand_iops_once "$1")"; }

mount_warm --hydrate eager
DATA=$(ls "$B"/cache/layers/*/data/0 | head -1)
PT_SEQ=$(seq_read "$B/mnt/disk/boot.qcow2"); PT_IOPS=$(rand_iops "$B/mnt/disk/boot.qcow2")
kill -INT $MPID; wait $MPID || true
PT_CALLS=$(tail -1 "$B/mount.out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["read_calls"])')
mount_warm --hydrate eager --no-passthrough
NOPT_SEQ=$(seq_read "$B/mnt/disk/boot.qcow2"); NOPT_IOPS=$(rand_iops "$B/mnt/disk/boot.qcow2")
kill -INT $MPID; wait $MPID || true
# Baseline: the cache's own data file read directly (the same blocks the mount serves), so the
# ratio is the cost of the FUSE path alone.
LOCAL_SEQ=$(seq_read "$DATA"); LOCAL_IOPS=$(rand_iops "$DATA")
ratio() { python3 -c "print(f'{$1 / $2:.2f}')"; }
{
  echo
  echo "warm reads of the cached 2 GiB-virtual disk, O_DIRECT (guest page cache dropped, host cache primed, before each run; median of 3):"
  printf '  %-44s %14s %8s %16s %8s\n' "" "seq MB/s" ratio "rand 4K IOPS" ratio
  printf '  %-44s %14s %8s %16s %8s\n' "the cached file read directly (baseline)" "$LOCAL_SEQ" 1.00 "$LOCAL_IOPS" 1.00
  printf '  %-44s %14s %8s %16s %8s\n' "vmdisk mount, passthrough ($PT_CALLS daemon reads)" "$PT_SEQ" "$(ratio "$PT_SEQ" "$LOCAL_SEQ")" "$PT_IOPS" "$(ratio "$PT_IOPS" "$LOCAL_IOPS")"
  printf '  %-44s %14s %8s %16s %8s\n' "vmdisk mount, no passthrough" "$NOPT_SEQ" "$(ratio "$NOPT_SEQ" "$LOCAL_SEQ")" "$NOPT_IOPS" "$(ratio "$NOPT_IOPS" "$LOCAL_IOPS")"
} | tee -a "$RESULTS"

# ---------------------------------------------------------------------------------------
# Peak RSS of the mount serving a 10 GiB and a 50 GiB disk: whole disk hydrated and read
# through the daemon (no passthrough, so every read is served by it). Sparse raw disks with
# 8 x 64 MiB of random data spread over them; each run of zeros is one chunk of up to 256 MiB,
# so the TOC (2 048 chunks of data and the runs) and the data fetched do not grow with the disk,
# the zeros checked do.
RSS_ROWS=()
for GIB in 10 50; do
  BIG=$B/big.raw
  truncate -s "${GIB}G" "$BIG"
  printf '\x55\xaa' | dd of="$BIG" bs=1 seek=510 conv=notrunc status=none
  for i in $(seq 0 7); do head -c 64M /dev/urandom | dd of="$BIG" bs=1M seek=$((i * GIB * 128 + 1)) conv=notrunc status=none; done
  "$VMDISK" push "$BIG" "$REG/bench/big$GIB:1" > /dev/null
  CHUNKS=$("$VMDISK" inspect --json "$REG/bench/big$GIB:1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["platforms"][0]["layers"][0]["chunks"])')
  rm -f "$BIG"
  T0=$(now)
  "$VMDISK" mount --stats --cache "$B/cache-big" --hydrate eager --no-passthrough "$REG/bench/big$GIB:1" "$B/mnt" > "$B/mount.out" 2> "$B/mount.err" &
  MPID=$!; PIDS+=($MPID)
  for _ in $(seq 3000); do grep -q '^ready' "$B/mount.out" && break; sleep 0.005; done
  READY=$(secs "$T0" "$(now)")
  for _ in $(seq 6000); do grep -q '^hydrated' "$B/mount.out" && break; sleep 0.1; done
  sync; echo 3 > /proc/sys/vm/drop_caches
  dd if="$B/mnt/disk/big.raw" of=/dev/null bs=1M status=none
  RSS=$(awk '/VmHWM/ {print int($2 / 1024)}' /proc/$MPID/status)
  kill -INT $MPID; wait $MPID || true
  rm -rf "$B/cache-big"
  RSS_ROWS+=("$GIB $CHUNKS $RSS $READY")
done
{
  echo
  echo "vmdisk mount serving a sparse raw disk (hydrated and read in full through the daemon):"
  printf '  %-8s %8s %14s %22s\n' disk chunks "peak RSS MiB" "start to ready (s)"
  for row in "${RSS_ROWS[@]}"; do
    read -r GIB CHUNKS RSS READY <<< "$row"
    printf '  %-8s %8s %14s %22s\n' "${GIB} GiB" "$CHUNKS" "$RSS" "$READY"
  done
  echo "time from starting vmdisk mount (cold cache: manifest, TOC, cache set-up) to the disk being ready: 2 GiB qcow2 ${READY_2G} s"
} | tee -a "$RESULTS"
