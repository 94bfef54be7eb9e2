#!/usr/bin/env bash
# `make bench`, part 5: the links. The registry is reached on loopback and through a shaped
# "cluster" link (examples/shaped-link.rs: 20 ms round trip, 200 Mbit/s, shared by all
# connections). The link is measured first (request round trip, one download's throughput);
# then, on each link, a cold sequential read (`dd bs=4M`, the KubeVirt whole-disk checksum and
# `vmdisk prefetch` case) of a random-data qcow2 through `vmdisk mount`, beside the plain
# download of the same layer blob over the same link (the floor of any full pull).
# Appends to scratch/bench/results.txt. Needs root (FUSE).
set -euo pipefail
cd "$(dirname "$0")/.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
SIZE_MIB=${LINK_BENCH_MIB:-512}
RTT_MS=20
MBIT=200
mkdir -p scratch/bench
B=$(mktemp -d "$PWD/scratch/bench-link-XXXXXX")
RESULTS=$PWD/scratch/bench/results.txt
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PIDS=()
cleanup() {
  for m in "$B"/mnt*; do mountpoint -q "$m" 2>/dev/null && umount -l "$m"; done
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$B"
}
trap 'status=$?; cleanup || true; exit $status' EXIT

PORT=$(free_port)
mkdir -p "$B/registry"
printf 'version: 0.1\nlog: { level: error }\nstorage: { filesystem: { rootdirectory: %s } }\nhttp: { addr: 127.0.0.1:%s }\n' "$B/registry" "$PORT" > "$B/registry.yml"
docker-registry serve "$B/registry.yml" > "$B/registry.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PORT/v2/" >/dev/null && break; sleep 0.1; done
SHAPED=$(free_port)
"$RELAY" "127.0.0.1:$SHAPED" "127.0.0.1:$PORT" "$RTT_MS" "$MBIT" > "$B/relay.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do grep -q listening "$B/relay.out" && break; sleep 0.05; done

DISK=$B/seq.qcow2
qemu-img create -q -f qcow2 "$DISK" "$((SIZE_MIB * 2))M"
head -c "${SIZE_MIB}M" /dev/urandom > "$B/piece"
qemu-io -c "write -s $B/piece 0 ${SIZE_MIB}M" "$DISK" > /dev/null
rm "$B/piece"
DSIZE=$(stat -c %s "$DISK")
"$VMDISK" push "$DISK" "127.0.0.1:$PORT/bench/seq:1" > /dev/null
LAYER=$(curl -s -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://127.0.0.1:$PORT/v2/bench/seq/manifests/1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["layers"][0]["digest"])')
now() { date +%s.%N; }
secs() { python3 -c "print(f'{$2 - $1:.2f}')"; }
mbs() { python3 -c "print(f'{$1 / 1e6 / max($2, 0.001):.1f}')"; }

# The link itself: median round trip of a small request, throughput of one download.
link_rtt() { for _ in 1 2 3 4 5; do curl -s -o /dev/null -w '%{time_total}\n' "http://$1/v2/"; done | sort -n | sed -n 3p | python3 -c 'import sys; print(f"{float(sys.stdin.read()) * 1000:.1f}")'; }
# A full download of the layer blob (what any full pull fetches, before unpacking).
download() {  # download HOST -> "seconds"
  local t0; t0=$(now)
  curl -sf -o /dev/null "http://$1/v2/bench/seq/blobs/$LAYER"
  secs "$t0" "$(now)"
}
# A cold sequential read of the whole disk file through `vmdisk mount`.
lazy_read() {  # lazy_read HOST N -> "seconds registry_bytes"
  local t0 out
  mkdir -p "$B/mnt$2"
  sync; echo 3 > /proc/sys/vm/drop_caches
  "$VMDISK" mount --stats --cache "$B/cache$2" "$1/bench/seq:1" "$B/mnt$2" > "$B/mount$2.out" 2> "$B/mount$2.err" &
  local mpid=$!
  for _ in $(seq 3000); do grep -q '^ready' "$B/mount$2.out" && break; sleep 0.005; done
  t0=$(now)
  dd if="$B/mnt$2/disk/seq.qcow2" of=/dev/null bs=4M status=none
  out=$(secs "$t0" "$(now)")
  kill -INT $mpid; wait $mpid || true
  echo "$out $(tail -1 "$B/mount$2.out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes_fetched"])')"
}

LOOP_RTT=$(link_rtt "127.0.0.1:$PORT")
CLUSTER_RTT=$(link_rtt "127.0.0.1:$SHAPED")
LOOP_DL=$(download "127.0.0.1:$PORT")
CLUSTER_DL=$(download "127.0.0.1:$SHAPED")
read -r LOOP_LAZY LOOP_BYTES < <(lazy_read "127.0.0.1:$PORT" 1)
read -r CLUSTER_LAZY CLUSTER_BYTES < <(lazy_read "127.0.0.1:$SHAPED" 2)
LSIZE=$(stat -c %s "$B/registry/docker/registry/v2/blobs/sha256/${LAYER:7:2}/${LAYER:7}/data")

{
  echo
  echo "links: loopback, and 'cluster' = shaped-link ${RTT_MS} ms round trip, ${MBIT} Mbit/s ($((MBIT / 8)) MB/s), same run:"
  printf '  %-12s %18s %28s\n' link "request RTT ms" "one download MB/s"
  printf '  %-12s %18s %28s\n' loopback "$LOOP_RTT" "$(mbs "$LSIZE" "$LOOP_DL")"
  printf '  %-12s %18s %28s\n' cluster "$CLUSTER_RTT" "$(mbs "$LSIZE" "$CLUSTER_DL")"
  echo "cold sequential read (dd bs=4M) of a $((DSIZE / 1048576)) MiB random-data qcow2 through vmdisk mount,"
  echo "beside the download of the same layer blob ($((LSIZE / 1048576)) MiB) over the same link, same run:"
  printf '  %-12s %24s %16s %24s %16s\n' link "vmdisk mount read s" "MB/s" "blob download s" "MB/s"
  printf '  %-12s %24s %16s %24s %16s\n' loopback "$LOOP_LAZY" "$(mbs "$DSIZE" "$LOOP_LAZY")" "$LOOP_DL" "$(mbs "$LSIZE" "$LOOP_DL")"
  printf '  %-12s %24s %16s %24s %16s\n' cluster "$CLUSTER_LAZY" "$(mbs "$DSIZE" "$CLUSTER_LAZY")" "$CLUSTER_DL" "$(mbs "$LSIZE" "$CLUSTER_DL")"
  echo "  registry bytes for the lazy read: loopback $LOOP_BYTES, cluster $CLUSTER_BYTES (layer $LSIZE)"
} | tee -a "$RESULTS"
