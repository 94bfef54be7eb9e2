#!/usr/bin/env bash
# A fleet booting one disk at once through the caches users run (part of `make bench`): N nodes
# (`vmdisk mount` processes, each with its own cache) read the same boot set — 100 scattered
# 64 KiB reads of a qcow2 holding FLEET_MIB (256) MiB of random data — at the same moment, the
# origin registry behind the shaped cluster link (20 ms, 200 Mbit/s), through:
#   none        no mirror: every node asks the origin;
#   dist-first  CNCF distribution in pull-through mode as the hosts.toml mirror, fresh nodes
#               (their first sight of such a cache);
#   dist-known  the same, nodes that have noted the mirror as a pull-through cache (what a node
#               keeps in <cache>/mirrors after its first sight).
# For each: the origin's body bytes, blob GETs and manifest requests (its request log: what
# each added node costs it besides the disk's bytes), and the nodes' boot-set
# times (p50, slowest). FLEET_NODES ("1 10"), FLEET_MODES, BASE_BIN (another build's vmdisk,
# run as a fourth mode "before" through the mirror).
set -euo pipefail
cd "$(dirname "$0")/.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
MIB=${FLEET_MIB:-256}
source integration/containerd.sh
bench_scratch fleet
start_registry "$B"
ORIGIN=$REG
start_cluster_link "$B" "$ORIGIN"
random_qcow2 "$B/fleet.qcow2" "$MIB"
"$VMDISK" push "$B/fleet.qcow2" "$ORIGIN/vm/fleet:1" > /dev/null
python3 - "$B/reads" "$MIB" <<'PY'
import random, sys
random.seed(7)
with open(sys.argv[1], "w") as f:
    for o in random.sample(range((int(sys.argv[2]) << 20) // 65536), 100):
        f.write(f"{o * 65536}\n")
PY

# mirror DIR: a fresh pull-through cache of the origin (through the link); sets MPORT.
mirror() {
  MPORT=$(free_port)
  mkdir -p "$1/storage"
  printf 'version: 0.1\nlog: { level: error }\nstorage: { filesystem: { rootdirectory: %s } }\nhttp: { addr: 127.0.0.1:%s }\nproxy: { remoteurl: "http://%s" }\n' "$1/storage" "$MPORT" "$CLUSTER" > "$1/mirror.yml"
  docker-registry serve "$1/mirror.yml" > "$1/mirror.log" 2>&1 &
  PIDS+=($!)
  MIRROR_PID=$!
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$MPORT/v2/" > /dev/null && break; sleep 0.1; done
}

# run MODE N: prints "MODE N origin_bytes blob_gets p50_s slowest_s failed"
run() {
  local mode=$1 n=$2 dir=$B/run-$1-$2 bin=$VMDISK
  [ "$mode" = before ] && bin=$BASE_BIN/vmdisk
  mkdir -p "$dir/hosts"
  if [ "$mode" != none ]; then
    mirror "$dir"
    mkdir -p "$dir/hosts/$CLUSTER"
    printf 'server = "http://%s"\n[host."http://127.0.0.1:%s"]\n  capabilities = ["pull", "resolve"]\n' "$CLUSTER" "$MPORT" > "$dir/hosts/$CLUSTER/hosts.toml"
  fi
  local m; m=$(registry_mark "$B")
  for i in $(seq "$n"); do
    local d=$dir/node$i
    mkdir -p "$d/mnt" "$d/cache"
    [ "$mode" != dist-known ] || echo "http://127.0.0.1:$MPORT" > "$d/cache/mirrors"
    (
      t0=$(now)
      "$bin" mount --cache "$d/cache" --hosts-dir "$dir/hosts" --timeout 300 "$CLUSTER/vm/fleet:1" "$d/mnt" > "$d/mount.out" 2> "$d/mount.log" &
      echo $! > "$d/pid"
      for _ in $(seq 6000); do [ -e "$d/mnt/disk/fleet.qcow2" ] && break; sleep 0.05; done
      if python3 -c '
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
for line in open(sys.argv[2]):
    os.pread(fd, 65536, int(line))' "$d/mnt/disk/fleet.qcow2" "$B/reads" 2>> "$d/mount.log"; then
        secs "$t0" "$(now)" > "$d/time"
      else
        echo failed > "$d/time"
      fi
    ) &
  done
  for i in $(seq "$n"); do while [ ! -s "$dir/node$i/time" ]; do sleep 0.2; done; done
  # A mirror that started filling the blob keeps fetching it after the nodes are done: wait
  # (at most 2 minutes) until it holds it, so what it cost the origin is counted.
  if [ "$mode" != none ] && [ -n "$(find "$dir/storage" -path '*/_uploads/*' -name data 2>/dev/null)" ]; then
    for _ in $(seq 600); do
      [ -z "$(find "$dir/storage" -path '*/_uploads/*' -name data 2>/dev/null)" ] && break
      sleep 0.2
    done
  fi
  local bytes gets; bytes=$(registry_bytes_since "$B" "$m")
  gets=$(tail -c +"$((m + 1))" "$B/registry.log" | { grep -c 'GET /v2/vm/fleet/blobs' || true; })
  manifests=$(tail -c +"$((m + 1))" "$B/registry.log" | { grep -Ec '"(GET|HEAD) /v2/vm/fleet/manifests' || true; })
  for i in $(seq "$n"); do kill -INT "$(cat "$dir/node$i/pid")" 2>/dev/null || true; done
  [ "$mode" = none ] || kill "$MIRROR_PID" 2>/dev/null || true
  sleep 1
  python3 - "$mode" "$n" "$bytes" "$gets" "$dir" "$manifests" <<'PY'
import glob, sys
mode, n, nbytes, gets, d, manifests = sys.argv[1:]
t = [open(f).read().strip() for f in glob.glob(d + "/node*/time")]
ok = sorted(float(x) for x in t if x != "failed")
p50 = ok[len(ok) // 2] if ok else float("nan")
print(f"{mode} {n} {nbytes} {gets} {manifests} {p50:.2f} {ok[-1] if ok else float('nan'):.2f} {len(t) - len(ok)}")
PY
}

MODES=${FLEET_MODES:-none dist-first dist-known}
[ -z "${BASE_BIN:-}" ] || MODES="$MODES before"
ROWS=()
for N in ${FLEET_NODES:-1 10}; do
  for MODE in $MODES; do
    ROWS+=("$(run "$MODE" "$N")")
  done
done
{
  echo
  echo "A fleet booting one disk at once ($MIB MiB of random data, 100 scattered 64 KiB reads per node), origin behind the cluster link (20 ms, 200 Mbit/s), same run:"
  printf '  %-11s %6s %16s %10s %14s %8s %10s %7s\n' mirror nodes "origin bytes" "blob GETs" "manifest reqs" "p50 s" "slowest s" failed
  for row in "${ROWS[@]}"; do
    read -r MODE N BYTES GETS MANIFESTS P50 MAX FAILED <<< "$row"
    printf '  %-11s %6s %16s %10s %14s %8s %10s %7s\n' "$MODE" "$N" "$BYTES" "$GETS" "$MANIFESTS" "$P50" "$MAX" "$FAILED"
  done
} | tee -a "$RESULTS"
