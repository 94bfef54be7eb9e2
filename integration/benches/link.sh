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
#   registry bytes beside the bytes read (and, on loopback, by a reader that gives the kernel no
#   hint that it reads at random);
# - 16 parallel random 4 KiB readers (fio, O_DIRECT, LINK_READERS_READS (4096) reads in all) of a
#   cold mount through the cluster link: how busy they keep it (registry bytes per second
#   against its 25 MB/s). Each read misses a chunk no one fetched, so the link, not vmdisk,
#   should be the limit — and the link emulator must not be (cases::link tests it alone).
# Appends to scratch/bench/results.txt. Needs root (FUSE, containerd).
set -euo pipefail
cd "$(dirname "$0")/../.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
CRI_PULL=${CRI_PULL:-$PWD/target/release/examples/cri-pull}
SIZE_MIB=${LINK_BENCH_MIB:-4096}
source integration/lib/containerd.sh
bench_scratch link

start_registry "$B"
start_cluster_link "$B" "$REG"

# The disk: a qcow2 fully written with random data (file = virtual size), lazy and gzip.
DISK=$B/disk.qcow2
random_qcow2 "$DISK" "$SIZE_MIB"
DSIZE=$(stat -c %s "$DISK")
publish_lazy_and_gzip "$DISK" "$REG/bench/disk:lazy" "$REG/bench/disk:gzip"
LAYER=$(curl -s -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://$REG/v2/bench/disk/manifests/lazy" | python3 -c 'import json,sys; print(json.load(sys.stdin)["layers"][0]["digest"])')
LSIZE=$(stat -c %s "$B/registry/docker/registry/v2/blobs/sha256/${LAYER:7:2}/${LAYER:7}/data")
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
  echo "$out $(served_since "$m")"
}
SEQ='dd if=$MNT/disk/disk.qcow2 of=/dev/null bs=4M status=none'
# 1% of the disk in 1 MiB reads at page-aligned random offsets (fio hints the kernel that
# access is random, so its read-ahead adds nothing).
RANDOM_READS=$(( (DSIZE / 100 + 1048575) / 1048576 ))
RND="fio --name=random --filename=\$MNT/disk/disk.qcow2 --rw=randread --bs=1M --blockalign=4k --norandommap --io_size=${RANDOM_READS}M --randseed=7 --output-format=terse > /dev/null"
# containerd 1.6 (overlayfs) pulls and unpacks the gzip containerDisk through CRI.
full_pull() {  # full_pull HOST N -> "seconds registry_bytes"
  local out m
  start_containerd "$B/ctd$2" "$1" ""
  sync; echo 3 > /proc/sys/vm/drop_caches
  m=$(mark)
  out=$("$CRI_PULL" --address "$B/ctd$2/containerd.sock" "$1/bench/disk:gzip")
  echo "$(echo "$out" | sed -E 's/.* in ([0-9.]+) s$/\1/') $(served_since "$m")"
  "$CRI_PULL" --address "$B/ctd$2/containerd.sock" --rm "$1/bench/disk:gzip" > /dev/null
}

LOOP=$REG
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
# The same reads by a buffered reader that gives the kernel no hint (a guest's page cache, qemu's
# cache=writeback): the kernel's read-ahead comes on top.
read -r LOOP_NOHINT LOOP_NOHINT_BYTES < <(lazy "$LOOP" 6 "${RND/--name=random/--name=random --fadvise_hint=0}")
READ_BYTES=$((RANDOM_READS * 1048576))
READERS_READS=${LINK_READERS_READS:-4096}
R16="fio --name=readers --filename=\$MNT/disk/disk.qcow2 --rw=randread --bs=4k --direct=1 --numjobs=16 --io_size=$((READERS_READS / 16 * 4))k --randseed=11 --output-format=terse > /dev/null"
read -r CLUSTER_R16 CLUSTER_R16_BYTES < <(lazy "$CLUSTER" 5 "$R16")
ratio() { python3 -c "print(f'{$1 / $2:.3f}')"; }

{
  echo
  echo "links: loopback, and 'cluster' = shaped-link 20 ms round trip, 200 Mbit/s (25 MB/s), same run:"
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
  printf '  %-10s %10s %16s %22s\n' "loopback, no hint" "$LOOP_NOHINT" "$LOOP_NOHINT_BYTES" "$(ratio "$LOOP_NOHINT_BYTES" "$READ_BYTES")"
  echo "16 parallel random 4 KiB readers (fio, O_DIRECT, $READERS_READS reads) of a cold mount through the cluster link, same run:"
  printf '  %-10s %10s %16s %10s %16s\n' link seconds "registry bytes" "MB/s" "of the link"
  printf '  %-10s %10s %16s %10s %16s\n' cluster "$CLUSTER_R16" "$CLUSTER_R16_BYTES" "$(mbs "$CLUSTER_R16_BYTES" "$CLUSTER_R16")" \
    "$(python3 -c "print(f'{$CLUSTER_R16_BYTES / max($CLUSTER_R16, 0.001) / 25e6 * 100:.0f}%')")"
} | tee -a "$RESULTS"
