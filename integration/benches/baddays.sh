#!/usr/bin/env bash
# `make bench`, a node's bad days: what checking the cache costs warm reads, what background
# hydration (the daemon's default) costs a boot on the cluster link, how fast the node's
# control plane answers while 16 disks are read by 64 readers, what a reboot with a big cache
# costs a boot, and the memory a full cache disk costs with 16 disks. Each figure beside its baseline
# from the same run; BASE_BIN (a directory with an earlier build's `vmdisk`) adds that build's
# warm reads. Appends to scratch/bench/results.txt. Needs root (FUSE).
set -euo pipefail
cd "$(dirname "$0")/../.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
SNAPSHOTTER=${SNAPSHOTTER:-$PWD/target/release/vmdisk-snapshotter}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
PARTS=${BADDAYS_PARTS:-warm boot control restart memory replace crash}
part() { [[ " $PARTS " == *" $1 "* ]]; }
source integration/lib/containerd.sh
bench_scratch baddays
start_registry "$B"

median3() { python3 -c 'import sys; v=sorted(float(x) for x in sys.argv[1:]); print(f"{v[1]:.0f}")' "$@"; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
seq_mbps() { dd if="$1" of=/dev/null bs=1M iflag=direct 2>&1 | tail -1 | python3 -c 'import sys,re; l=sys.stdin.read(); b,s=re.search(r"^(\d+) bytes.*, ([\d.]+) s", l).groups(); print(f"{int(b)/float(s)/1e6:.0f}")'; }
rand_iops() { fio --name=r --filename="$1" --readonly --rw=randread --bs=4k --ioengine=psync --direct=1 --runtime=5 --time_based --output-format=json 2>/dev/null | python3 -c 'import json,sys; print(int(json.load(sys.stdin)["jobs"][0]["read"]["iops"]))'; }

# ---------------------------------------------------------------------------------------
# Warm reads of a fully cached 1 GiB disk by a new mount process (a restart: nothing checked
# yet), O_DIRECT. "first" is the first sequential read after the mount is ready (it checks
# every chunk it reads, unless the background pass got there first); then the median of three
# more, and random 4 KiB IOPS (median of 3 x 5 s).
if part warm; then
head -c 1G /dev/urandom > "$B/warm.raw"
"$VMDISK" push --format raw "$B/warm.raw" "$REG/bench/warm:1" > /dev/null
rm "$B/warm.raw"
mkdir -p "$B/mnt"
"$VMDISK" mount --cache "$B/cache" --hydrate eager "$REG/bench/warm:1" "$B/mnt" > "$B/mount.out" 2>&1 &
MPID=$!; PIDS+=($MPID)
for _ in $(seq 600); do grep -q '^hydrated' "$B/mount.out" && break; sleep 0.1; done
kill -INT $MPID; wait $MPID || true
WARM_ROWS=()
warm() {  # warm LABEL BINARY FLAGS...
  local label=$1 bin=$2 first s1 s2 s3 i1 i2 i3; shift 2
  drop
  "$bin" mount --cache "$B/cache" "$@" "$REG/bench/warm:1" "$B/mnt" > "$B/mount.out" 2>&1 &
  MPID=$!; PIDS+=($MPID)
  for _ in $(seq 600); do grep -q '^ready' "$B/mount.out" && break; sleep 0.01; done
  first=$(seq_mbps "$B/mnt/disk/warm.raw")
  drop; s1=$(seq_mbps "$B/mnt/disk/warm.raw"); drop; s2=$(seq_mbps "$B/mnt/disk/warm.raw"); drop; s3=$(seq_mbps "$B/mnt/disk/warm.raw")
  drop; i1=$(rand_iops "$B/mnt/disk/warm.raw"); drop; i2=$(rand_iops "$B/mnt/disk/warm.raw"); drop; i3=$(rand_iops "$B/mnt/disk/warm.raw")
  kill -INT $MPID; wait $MPID || true
  WARM_ROWS+=("$label|$first|$(median3 "$s1" "$s2" "$s3")|$(median3 "$i1" "$i2" "$i3")")
}
if [ -n "${BASE_BIN:-}" ]; then
  warm "before: no check, no passthrough" "$BASE_BIN/vmdisk" --no-passthrough
  warm "before: no check, passthrough" "$BASE_BIN/vmdisk"
fi
warm "checked, no passthrough" "$VMDISK" --no-passthrough
warm "checked, passthrough" "$VMDISK"
{
  echo
  echo "warm reads of a cached 1 GiB disk by a new mount process, O_DIRECT, page cache dropped before each:"
  printf '  %-40s %16s %16s %16s\n' "" "first seq MB/s" "seq MB/s (med)" "rand 4K IOPS"
  for row in "${WARM_ROWS[@]}"; do
    IFS='|' read -r label first s iops <<< "$row"
    printf '  %-40s %16s %16s %16s\n' "$label" "$first" "$s" "$iops"
  done
} | tee -a "$RESULTS"

fi
# ---------------------------------------------------------------------------------------
# A boot-like read set over the cluster link (20 ms, 200 Mbit/s), on a fresh cache each time:
# time to ready, the boot set (qemu-img info + 1% of a 2 GiB qcow2's clusters, 327 x 64 KiB,
# scattered) and the registry bytes when the boot set is done, with `--hydrate background`
# (the daemon's default) and `--hydrate off`; then how long until background hydration has the
# whole disk.
if part boot; then
start_cluster_link "$B" "$REG"
DISK=$B/boot.qcow2
qemu-img create -q -f qcow2 "$DISK" 2G
for i in $(seq 0 7); do
  head -c 64M /dev/urandom > "$B/piece"
  qemu-io -c "write -s $B/piece $((i * 256))M 64M" "$DISK" > /dev/null
done
rm "$B/piece"
"$VMDISK" push "$DISK" "$REG/bench/hboot:1" > /dev/null
boot_workload "$B/workload" 1
BOOT_ROWS=()
boot() {  # boot MODE
  local m t0 t1 t2 ready bootset bytes whole=-
  rm -rf "$B/cache-h"; drop
  m=$(mark); t0=$(now)
  "$VMDISK" mount --cache "$B/cache-h" --hydrate "$1" "$CLUSTER/bench/hboot:1" "$B/mnt" > "$B/mount.out" 2>&1 &
  MPID=$!; PIDS+=($MPID)
  for _ in $(seq 3000); do grep -q '^ready' "$B/mount.out" && break; sleep 0.005; done
  t1=$(now); ready=$(secs "$t0" "$t1")
  qemu-img info -f qcow2 "$B/mnt/disk/boot.qcow2" > /dev/null
  qemu-io -r -f qcow2 "$B/mnt/disk/boot.qcow2" < "$B/workload" > /dev/null
  t2=$(now); bootset=$(secs "$t1" "$t2"); bytes=$(served_since "$m")
  if [ "$1" = background ]; then
    for _ in $(seq 1200); do grep -q '^hydrated' "$B/mount.out" && break; sleep 0.1; done
    whole=$(secs "$t0" "$(now)")
  fi
  kill -INT $MPID; wait $MPID || true
  BOOT_ROWS+=("$1|$ready|$bootset|$bytes|$whole")
}
for round in 1 2 3; do boot off; boot background; done
{
  echo
  echo "a boot set on the cluster link (20 ms, 200 Mbit/s), 2 GiB-virtual qcow2 with 512 MiB of random data, fresh cache each run (3 runs each, in turn):"
  printf '  %-22s %10s %14s %22s %24s\n' "--hydrate" "ready s" "boot set s" "registry bytes by then" "whole disk cached at s"
  for row in "${BOOT_ROWS[@]}"; do
    IFS='|' read -r mode ready bootset bytes whole <<< "$row"
    printf '  %-22s %10s %14s %22s %24s\n' "$mode" "$ready" "$bootset" "$bytes" "$whole"
  done
} | tee -a "$RESULTS"

fi
# ---------------------------------------------------------------------------------------
# The control plane under load: a daemon serving 16 disks (64 MiB of random data each,
# `vmdisk path`), idle, then while 64 readers (4 per disk, random 64 KiB reads) read them;
# `vmdisk ls`, `vmdisk stats` and /metrics timed from the CLI, then from a long-lived client.
# Once per `control_priority` in CONTROL_PRIORITIES (default: 0 and 5), each a node of its own.
if part control; then
# control NODE PRIORITY: a node whose daemon runs PRIORITY nice levels above its servers
# (`control_priority`; 0: one priority), 16 disks, 64 readers for 64 s; the CLI asks alone for
# the first 30 s, the long-lived client alone for the next 30 (one load generator at a time:
# the client's calls, at its pace, would take the CPU the CLI's processes need to start).
for i in $(seq 1 16); do
  head -c 64M /dev/urandom > "$B/d.raw"
  "$VMDISK" push --format raw "$B/d.raw" "$REG/bench/load$i:1" > /dev/null
done
rm -f "$B/d.raw"
ask_times() {  # ask_times SECONDS OUT: times of ls, stats and a scrape, every 0.1 s; and of
  # `vmdisk --version`, which asks nothing: what starting the CLI costs on the loaded machine
  local end=$(( $(date +%s) + $1 )) t0 t1
  : > "$2"
  while [ "$(date +%s)" -lt "$end" ]; do
    for what in version ls stats metrics; do
      t0=$EPOCHREALTIME
      case $what in
        version) "$VMDISK" --version > /dev/null ;;
        ls) "$VMDISK" ls > /dev/null ;;
        stats) "$VMDISK" stats > /dev/null ;;
        metrics) curl -sf --unix-socket "$N/metrics.sock" http://localhost/metrics > /dev/null ;;
      esac
      t1=$EPOCHREALTIME
      echo "$what $t0 $t1" >> "$2"
    done
    sleep 0.1
  done
}
PROBE=${PROBE:-$PWD/target/release/examples/control-probe}
control() {
  local node=$1 priority=$2 d r
  N=$B/$node
  NODE_TOP="control_priority = $priority" NODE_HYDRATE=background start_node "$B" "$node" "[metrics]
address = \"unix:$N/metrics.sock\""
  export VMDISK_MANAGE=$N/manage.sock
  local disks=()
  for i in $(seq 1 16); do disks+=("$("$VMDISK" path "$REG/bench/load$i:1")"); done
  ask_times 5 "$N/idle.times"
  "$PROBE" "$N/manage.sock" "$N/metrics.sock" 5 > "$N/idle.probe"
  local readers=()
  for d in "${disks[@]}"; do
    for r in 1 2 3 4; do
      fio --name=r --filename="$d" --readonly --rw=randread --bs=64k --ioengine=psync --direct=1 --runtime=64 --time_based --output-format=json > "$N/fio-$r-$(basename "$(dirname "$d")").json" 2>/dev/null &
      readers+=($!)
    done
  done
  sleep 2
  ask_times 30 "$N/load.times"
  "$PROBE" "$N/manage.sock" "$N/metrics.sock" 30 > "$N/load.probe"
  for p in "${readers[@]}"; do wait "$p" || true; done
  python3 - "$N/idle.times" "$N/load.times" "$N/idle.probe" "$N/load.probe" "$priority" <<'PY' | tee -a "$RESULTS"
import sys
def pcts(path):
    by = {}
    for line in open(path):
        what, t0, t1 = line.split()
        by.setdefault(what, []).append(float(t1) - float(t0))
    out = {}
    for what, v in by.items():
        v.sort()
        out[what] = (len(v), v[len(v) // 2], v[min(len(v) - 1, int(len(v) * 0.99))], v[-1])
    return out
idle, load = pcts(sys.argv[1]), pcts(sys.argv[2])
print()
print(f"the control plane (control_priority = {sys.argv[5]}) with 16 disks served, idle and while 64 readers (4 per disk, random 64 KiB, O_DIRECT) read them")
print("(version: `vmdisk --version`, which asks nothing: the cost of starting the CLI on that machine):")
print(f"  {'':10} {'idle n':>7} {'p50 ms':>8} {'p99 ms':>8} {'load n':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
for what in ("version", "ls", "stats", "metrics"):
    i, l = idle[what], load[what]
    print(f"  {what:10} {i[0]:7d} {i[1]*1000:8.0f} {i[2]*1000:8.0f} {l[0]:7d} {l[1]*1000:8.0f} {l[2]*1000:8.0f} {l[3]*1000:8.0f}")
# The long-lived client's lines: NAME COUNT P50 P99 MAX FAILED (ms).
probe = [{l.split()[0]: l.split()[1:] for l in open(p)} for p in sys.argv[3:5]]
print("the same from a long-lived client (examples/control-probe.rs: one connection, no process start), after the CLI:")
for what in ("ls", "stats", "metrics"):
    (n, p50, p99, _, f), (ln, lp50, lp99, lmax, lf) = probe[0][what], probe[1][what]
    print(f"  {what + ' (client)':16} {n:>7} {p50:>8} {p99:>8} {ln:>7} {lp50:>8} {lp99:>8} {lmax:>8}  failed {int(f) + int(lf)}")
PY
  stop_pids "${PIDS[-1]}"
  stop_mount_servers "$N"
  unmount_under "$N"
}
for p in ${CONTROL_PRIORITIES:-0 5}; do control "node-p$p" "$p"; done
fi
# ---------------------------------------------------------------------------------------
# A reboot with a big cache: 8 disks of RESTART_GIB (2) GiB of random data, all cached; then
# every disk mounted again at once (new processes: nothing checked yet) and one disk's boot
# read set (400 scattered 64 KiB O_DIRECT reads, fio, the same offsets each time) timed while
# the others' chunks are re-verified in the background, beside the same read set with that
# disk mounted alone (nothing else to re-verify); then the time until every cached chunk is
# checked and the rate that makes. BASE_BIN adds the build before (each mount hashing its
# whole layer at once, at the disk's speed). The page cache is dropped before each round.
if part restart; then
GIB=${RESTART_GIB:-2}
for i in $(seq 1 8); do
  head -c "${GIB}G" /dev/urandom > "$B/r.raw"
  "$VMDISK" push --format raw "$B/r.raw" "$REG/bench/restart$i:1" > /dev/null
done
rm -f "$B/r.raw"
RCACHE=$B/cache-restart
for i in $(seq 1 8); do
  mkdir -p "$B/mr$i"
  "$VMDISK" mount --cache "$RCACHE" --hydrate eager "$REG/bench/restart$i:1" "$B/mr$i" > "$B/r$i.out" 2>&1 &
  MPID=$!; PIDS+=($MPID)
  for _ in $(seq 3000); do grep -q '^hydrated' "$B/r$i.out" && break; sleep 0.1; done
  kill -INT $MPID; wait $MPID || true
done
bootset_ms() {
  fio --name=boot --filename="$1" --readonly --rw=randread --bs=64k --number_ios=400 --randrepeat=1 \
    --randseed=7 --ioengine=psync --direct=1 --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["read"]["runtime"])'
}
RESTART_ROWS=()
restart() {  # restart LABEL BINARY DISKS: DISKS (1 or 8) mounted at once, then the boot set
  local label=$1 bin=$2 n=$3 pids=() t0 boot all=- rate=-
  drop
  t0=$(now)
  for i in $(seq 1 "$n"); do
    "$bin" mount --cache "$RCACHE" "$REG/bench/restart$i:1" "$B/mr$i" > "$B/r$i.out" 2>&1 &
    pids+=($!); PIDS+=($!)
  done
  for i in $(seq 1 "$n"); do
    for _ in $(seq 3000); do grep -q '^ready' "$B/r$i.out" && break; sleep 0.01; done
  done
  boot=$(bootset_ms "$B/mr1/disk/r.raw")
  if [ "$n" -gt 1 ]; then
    # Every mount says `checked:` once its cached chunks are all checked.
    for _ in $(seq 6000); do
      [ "$(cat "$B"/r[1-8].out | grep -c '^checked: ')" -ge "$n" ] && break; sleep 0.1
    done
    all=$(secs "$t0" "$(now)")
    rate=$(python3 -c "print(f'{8 * $GIB * 1073.741824 / $all:.0f}')")
  fi
  for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" || true; done
  RESTART_ROWS+=("$label|$boot|$all|$rate")
}
for round in 1 2; do
  restart "alone (nothing else to re-verify)" "$VMDISK" 1
  restart "8 disks re-verified" "$VMDISK" 8
  if [ -n "${BASE_BIN:-}" ]; then restart "before: 8 disks, each hashed at once" "$BASE_BIN/vmdisk" 8; fi
done
{
  echo
  echo "a reboot with $((8 * GIB)) GiB cached over 8 disks (random data), page cache dropped; one disk's boot set (400 x 64 KiB scattered, O_DIRECT)"
  local_dev=$(basename "$(df --output=source "$B" | tail -1)")
  echo "while the node re-verifies its cache (verify_rate 128 MB/s, idle I/O class; the cache disk's scheduler: $(cat "/sys/class/block/$local_dev/queue/scheduler" "/sys/class/block/$local_dev/../queue/scheduler" 2>/dev/null | head -1)):"
  printf '  %-40s %12s %26s %20s\n' "" "boot set ms" "all cached bytes checked s" "re-verify MB/s"
  for row in "${RESTART_ROWS[@]}"; do
    IFS='|' read -r label boot all rate <<< "$row"
    printf '  %-40s %12s %26s %20s\n' "$label" "$boot" "$all" "$rate"
  done
} | tee -a "$RESULTS"
rm -rf "$RCACHE"
fi
# ---------------------------------------------------------------------------------------
# The memory a full cache disk costs: a daemon serving 16 disks (64 MiB of random data each,
# `vmdisk path`) from a cache on a 16 MiB tmpfs, all 16 read at once in order; the most that
# `vmdisk ls` says they hold in memory together, and the most the mount servers' RSS adds up to
# (BASE_BIN: the build before, whose servers held up to 96 MiB each).
if part memory; then
for i in $(seq 1 16); do
  head -c 64M /dev/urandom > "$B/m.raw"
  "$VMDISK" push --format raw "$B/m.raw" "$REG/bench/mem$i:1" > /dev/null
done
rm -f "$B/m.raw"
MEMORY_ROWS=()
memory() {  # memory LABEL SNAPSHOTTER VMDISK-CLI EXTRA-CACHE-CONFIG
  local label=$1 node=node-mem-$RANDOM held=0 rss=0 readers=() h r
  local N=$B/$node
  mkdir -p "$N/cache"
  mount -t tmpfs -o size=16m tmpfs "$N/cache"
  SNAPSHOTTER=$2 start_node "$B" "$node" "dir = \"$N/cache\"
$4"
  local disks=()
  for i in $(seq 1 16); do disks+=("$(VMDISK_MANAGE=$N/manage.sock "$3" path "$REG/bench/mem$i:1")"); done
  for d in "${disks[@]}"; do dd if="$d" of=/dev/null bs=1M 2>/dev/null & readers+=($!); done
  alive() { for p in "${readers[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
  while alive; do
    h=$(VMDISK_MANAGE=$N/manage.sock "$3" ls --json 2>/dev/null | python3 -c 'import json,sys; print(sum(d.get("memory_held", 0) for d in json.load(sys.stdin)))' 2>/dev/null || echo 0)
    r=$(ps -o rss= -C vmdisk-snapshotter | awk '{s += $1} END {print s * 1024}')
    [ "$h" -gt "$held" ] && held=$h
    [ "$r" -gt "$rss" ] && rss=$r
    sleep 0.2
  done
  for p in "${readers[@]}"; do wait "$p" || true; done
  stop_pids "${PIDS[-1]}"
  stop_mount_servers "$N"
  unmount_under "$N"
  MEMORY_ROWS+=("$label|$((held >> 20))|$((rss >> 20))")
}
memory "memory_budget 256M (default)" "$SNAPSHOTTER" "$VMDISK" ""
memory "memory_budget 64M" "$SNAPSHOTTER" "$VMDISK" 'memory_budget = "64M"'
if [ -n "${BASE_BIN:-}" ]; then memory "before: 96 MiB per layer" "$BASE_BIN/vmdisk-snapshotter" "$BASE_BIN/vmdisk" ""; fi
{
  echo
  echo "16 disks (64 MiB of random data each) read at once in order from a cache on a 16 MiB tmpfs (no room): the most held in memory"
  printf '  %-34s %28s %34s\n' "" "held (vmdisk ls), MiB" "all processes' RSS (daemon and servers), MiB"
  for row in "${MEMORY_ROWS[@]}"; do
    IFS='|' read -r label held rss <<< "$row"
    printf '  %-34s %28s %34s\n' "$label" "$held" "$rss"
  done
} | tee -a "$RESULTS"
fi
# ---------------------------------------------------------------------------------------
# The DaemonSet's pod replaced under a read disk (containerd 1.7 and 2.x, the pod spec run as
# kubelet runs it, every process of the pod's cgroup killed, the pod run again): the longest
# wait of a reader holding the raw view open, its errors and wrong reads, as the integration
# test measures them (`daemonset::the_shipped_daemonset_serves_a_kubevirt_pod_on_containerd_*`).
if part replace; then
{
  echo
  echo "the DaemonSet's pod replaced while a reader holds a disk's raw view open (1 MiB reads in order) and qemu-img compares it:"
  cargo nextest run --locked --test integration -E 'test(/^cases::daemonset::/)' --no-capture 2>&1 |
    grep -E "pod replaced in|the pod's replacement: the reader saw|the server's crash: the reader saw" | sed 's/^/  /'
} | tee -a "$RESULTS"
fi
# ---------------------------------------------------------------------------------------
# A mount server killed under a read disk (SIGKILL twice in a row, with passthrough opens, and
# by the OOM killer at its cgroup's memory limit): the longest wait of a reader across the
# takeover, its errors and wrong reads, as the integration tests measure them (`crash::`).
if part crash; then
{
  echo
  echo "a mount server killed while a reader holds the disk open (1 MiB reads; qemu-img compares it): its successor takes the FUSE connections over"
  cargo nextest run --locked --test integration -E 'test(/^cases::crash::/)' --no-capture 2>&1 |
    grep -E "the reader saw" | sed 's/^/  /'
} | tee -a "$RESULTS"
fi
