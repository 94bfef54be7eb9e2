#!/usr/bin/env bash
# `make bench`, part 5: the links. The registry is reached on loopback and through a shaped
# "cluster" link (examples/shaped-link.rs: 20 ms round trip, 200 Mbit/s, shared by all
# connections). The link is measured first (request round trip, one download's throughput).
# Then, on each link:
# - a cold full sequential read (`dd bs=4M`: the KubeVirt whole-disk checksum and
#   `vmdisk prefetch` case) of a random-data qcow2 through `vmdisk mount`, beside containerd's
#   full pull + unpack of the same disk as a gzip containerDisk (CRI PullImage, overlayfs) over
#   the same link, and the plain download of the lazy layer's blob;
# - random 1 MiB reads (fio, page-aligned offsets) of 1% of the same disk on a cold mount:
#   registry bytes beside the bytes read.
# Appends to scratch/bench/results.txt. Needs root (FUSE, containerd).
set -euo pipefail
cd "$(dirname "$0")/.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
CRI_PULL=${CRI_PULL:-$PWD/target/release/examples/cri-pull}
SIZE_MIB=${LINK_BENCH_MIB:-4096}
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
  grep -o " $B[^ ]*" /proc/self/mounts | sort -r | while read -r m; do umount -l "$m"; done
  rm -rf "$B"
}
trap 'status=$?; cleanup || true; exit $status' EXIT
source integration/containerd.sh

PORT=$(free_port)
mkdir -p "$B/registry"
printf 'version: 0.1\nlog: { level: info, formatter: text }\nstorage: { filesystem: { rootdirectory: %s }, delete: { enabled: true } }\nhttp: { addr: 127.0.0.1:%s }\n' "$B/registry" "$PORT" > "$B/registry.yml"
docker-registry serve "$B/registry.yml" > "$B/registry.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PORT/v2/" >/dev/null && break; sleep 0.1; done
SHAPED=$(free_port)
"$RELAY" "127.0.0.1:$SHAPED" "127.0.0.1:$PORT" "$RTT_MS" "$MBIT" > "$B/relay.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do grep -q listening "$B/relay.out" && break; sleep 0.05; done
mark() { wc -c < "$B/registry.log"; }
served_since() { tail -c +"$(($1 + 1))" "$B/registry.log" | { grep 'http.request.method=GET' || true; } | { grep -o 'http.response.written=[0-9]*' || true; } | cut -d= -f2 | awk '{s+=$1} END {printf "%d\n", s}'; }

# The disk: a qcow2 fully written with random data (file = virtual size), lazy and gzip.
DISK=$B/disk.qcow2
qemu-img create -q -f qcow2 "$DISK" "${SIZE_MIB}M"
for i in $(seq 0 $((SIZE_MIB / 256 - 1))); do
  head -c 256M /dev/urandom > "$B/piece"
  qemu-io -c "write -s $B/piece $((i * 256))M 256M" "$DISK" > /dev/null
done
rm -f "$B/piece"
DSIZE=$(stat -c %s "$DISK")
"$VMDISK" push "$DISK" "127.0.0.1:$PORT/bench/disk:lazy" > /dev/null
mkdir -p "$B/root/disk"
ln "$DISK" "$B/root/disk/disk.qcow2"
tar --owner=107 --group=107 -C "$B/root" -cf "$B/layer.tar" disk
rm -rf "$B/root"
python3 integration/tar-layout.py "$B/layout" "$B/layer.tar"
rm -f "$B/layer.tar"
skopeo copy --quiet --dest-tls-verify=false --dest-compress-format gzip "oci:$B/layout:latest" "docker://127.0.0.1:$PORT/bench/disk:gzip"
rm -rf "$B/layout"
LAYER=$(curl -s -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://127.0.0.1:$PORT/v2/bench/disk/manifests/lazy" | python3 -c 'import json,sys; print(json.load(sys.stdin)["layers"][0]["digest"])')
LSIZE=$(stat -c %s "$B/registry/docker/registry/v2/blobs/sha256/${LAYER:7:2}/${LAYER:7}/data")
now() { date +%s.%N; }
secs() { python3 -c "print(f'{$2 - $1:.2f}')"; }
mbs() { python3 -c "print(f'{$1 / 1e6 / max($2, 0.001):.1f}')"; }

# The link itself: median round trip of a small request, throughput of one download.
link_rtt() { for _ in 1 2 3 4 5; do curl -s -o /dev/null -w '%{time_total}\n' "http://$1/v2/"; done | sort -n | sed -n 3p | python3 -c 'import sys; print(f"{float(sys.stdin.read()) * 1000:.1f}")'; }
download() {  # download HOST -> "seconds"
  local t0; t0=$(now)
  curl -sf -o /dev/null "http://$1/v2/bench/disk/blobs/$LAYER"
  secs "$t0" "$(now)"
}
# A cold mount of the lazy image; runs CMD (with $MNT set) and prints "seconds registry_bytes".
lazy() {  # lazy HOST N CMD
  local t0 out m
  mkdir -p "$B/mnt$2"
  sync; echo 3 > /proc/sys/vm/drop_caches
  m=$(mark)
  "$VMDISK" mount --stats --cache "$B/cache$2" "$1/bench/disk:lazy" "$B/mnt$2" > "$B/mount$2.out" 2> "$B/mount$2.err" &
  local mpid=$!
  for _ in $(seq 3000); do grep -q '^ready' "$B/mount$2.out" && break; sleep 0.005; done
  t0=$(now)
  MNT=$B/mnt$2 bash -c "$3"
  out=$(secs "$t0" "$(now)")
  kill -INT $mpid; wait $mpid || true
  rm -rf "$B/cache$2"
  sleep 0.3   # the registry logs a request after answering it
  echo "$out $(served_since "$m")"
}
SEQ='dd if=$MNT/disk/disk.qcow2 of=/dev/null bs=4M status=none'
# 1% of the disk in 1 MiB reads at page-aligned random offsets (fio hints the kernel that
# access is random, so its read-ahead adds nothing).
RANDOM_READS=$(( (DSIZE / 100 + 1048575) / 1048576 ))
RND="fio --name=random --filename=\$MNT/disk/disk.qcow2 --rw=randread --bs=1M --blockalign=4k --io_size=${RANDOM_READS}M --randseed=7 --output-format=terse > /dev/null"
# containerd 1.6 (overlayfs) pulls and unpacks the gzip containerDisk through CRI.
full_pull() {  # full_pull HOST N -> "seconds registry_bytes"
  local out m
  start_containerd "$B/ctd$2" "$1" ""
  sync; echo 3 > /proc/sys/vm/drop_caches
  m=$(mark)
  out=$("$CRI_PULL" --address "$B/ctd$2/containerd.sock" "$1/bench/disk:gzip")
  sleep 0.3
  echo "$(echo "$out" | sed -E 's/.* in ([0-9.]+) s$/\1/') $(served_since "$m")"
  "$CRI_PULL" --address "$B/ctd$2/containerd.sock" --rm "$1/bench/disk:gzip" > /dev/null
}

LOOP=127.0.0.1:$PORT
CLUSTER=127.0.0.1:$SHAPED
LOOP_RTT=$(link_rtt "$LOOP")
CLUSTER_RTT=$(link_rtt "$CLUSTER")
LOOP_DL=$(download "$LOOP")
CLUSTER_DL=$(download "$CLUSTER")
read -r LOOP_SEQ LOOP_SEQ_BYTES < <(lazy "$LOOP" 1 "$SEQ")
read -r CLUSTER_SEQ CLUSTER_SEQ_BYTES < <(lazy "$CLUSTER" 2 "$SEQ")
read -r LOOP_FULL LOOP_FULL_BYTES < <(full_pull "$LOOP" 1)
read -r CLUSTER_FULL CLUSTER_FULL_BYTES < <(full_pull "$CLUSTER" 2)
read -r LOOP_RND LOOP_RND_BYTES < <(lazy "$LOOP" 3 "$RND")
read -r CLUSTER_RND CLUSTER_RND_BYTES < <(lazy "$CLUSTER" 4 "$RND")
READ_BYTES=$((RANDOM_READS * 1048576))
ratio() { python3 -c "print(f'{$1 / $2:.3f}')"; }

{
  echo
  echo "links: loopback, and 'cluster' = shaped-link ${RTT_MS} ms round trip, ${MBIT} Mbit/s ($((MBIT / 8)) MB/s), same run:"
  printf '  %-10s %16s %22s\n' link "request RTT ms" "one download MB/s"
  printf '  %-10s %16s %22s\n' loopback "$LOOP_RTT" "$(mbs "$LSIZE" "$LOOP_DL")"
  printf '  %-10s %16s %22s\n' cluster "$CLUSTER_RTT" "$(mbs "$LSIZE" "$CLUSTER_DL")"
  echo "cold full sequential read (dd bs=4M) of a $((DSIZE / 1048576)) MiB random-data qcow2 through vmdisk mount, beside"
  echo "containerd's full pull + unpack of the same disk as a gzip containerDisk over the same link, same run:"
  printf '  %-10s %-34s %10s %10s %16s\n' link method seconds "MB/s" "registry bytes"
  printf '  %-10s %-34s %10s %10s %16s\n' loopback "vmdisk mount, cold read" "$LOOP_SEQ" "$(mbs "$DSIZE" "$LOOP_SEQ")" "$LOOP_SEQ_BYTES"
  printf '  %-10s %-34s %10s %10s %16s\n' loopback "containerd pull + unpack (gzip)" "$LOOP_FULL" "$(mbs "$DSIZE" "$LOOP_FULL")" "$LOOP_FULL_BYTES"
  printf '  %-10s %-34s %10s %10s %16s\n' loopback "(download of the lazy layer blob)" "$LOOP_DL" "$(mbs "$LSIZE" "$LOOP_DL")" "$LSIZE"
  printf '  %-10s %-34s %10s %10s %16s\n' cluster "vmdisk mount, cold read" "$CLUSTER_SEQ" "$(mbs "$DSIZE" "$CLUSTER_SEQ")" "$CLUSTER_SEQ_BYTES"
  printf '  %-10s %-34s %10s %10s %16s\n' cluster "containerd pull + unpack (gzip)" "$CLUSTER_FULL" "$(mbs "$DSIZE" "$CLUSTER_FULL")" "$CLUSTER_FULL_BYTES"
  printf '  %-10s %-34s %10s %10s %16s\n' cluster "(download of the lazy layer blob)" "$CLUSTER_DL" "$(mbs "$LSIZE" "$CLUSTER_DL")" "$LSIZE"
  echo "random 1 MiB reads (fio, page-aligned offsets) of 1% of the disk ($RANDOM_READS reads, $READ_BYTES bytes), cold mount, same run:"
  printf '  %-10s %10s %16s %22s\n' link seconds "registry bytes" "registry bytes / read"
  printf '  %-10s %10s %16s %22s\n' loopback "$LOOP_RND" "$LOOP_RND_BYTES" "$(ratio "$LOOP_RND_BYTES" "$READ_BYTES")"
  printf '  %-10s %10s %16s %22s\n' cluster "$CLUSTER_RND" "$CLUSTER_RND_BYTES" "$(ratio "$CLUSTER_RND_BYTES" "$READ_BYTES")"
} | tee -a "$RESULTS"
