#!/usr/bin/env bash
# `make bench`: the span size of `vmdisk index`, chosen by measurement. The boot bench's guest
# (BOOT_BENCH_GIB, default 2 GiB: a partitioned ext4 disk padded with random data) published as
# a gzip containerDisk, indexed at each span size (SPANS, default 256K 512K 1M 2M 4M; each index
# beside its own copy of the image), then on fresh nodes over the shaped cluster link (20 ms,
# 200 Mbit/s):
# - a cold boot (qemu TCG, Kata-style raw view): ready + boot seconds and registry bytes;
# - 1% of the disk file in random 64 KiB reads (fio, O_DIRECT, one reader): seconds, blob GETs;
# - the whole disk file read in order (dd bs=4M): seconds;
# and the index's and windows' sizes. The default span is the one with the lowest total time.
# Appends to scratch/bench/results.txt. Needs root (FUSE, qemu).
set -euo pipefail
cd "$(dirname "$0")/../.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
SNAPSHOTTER=${SNAPSHOTTER:-$PWD/target/release/vmdisk-snapshotter}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
GIB=${BOOT_BENCH_GIB:-2}
SPANS=${SPANS:-256K 512K 1M 2M 4M}
source integration/lib/containerd.sh
bench_scratch spans
source integration/lib/guest.sh
start_registry "$B"
start_cluster_link "$B" "$REG"
blob_gets_since() {
  tail -c +"$(($2 + 1))" "$1/registry.log" | grep 'http.request.method=GET' | grep -c '/blobs/sha256:' || true
}

make_guest_disk "$B" "$GIB"
SIZE=$(stat -c %s "$B/guest.qcow2")
publish_lazy_and_gzip "$B/guest.qcow2" "$REG/vm/guest:lazy" "$REG/vm/guest:gzip"
write_boot_script "$B"

n=0
fresh() {  # fresh: a node with a cold cache; sets MANAGE
  n=$((n + 1))
  start_node "$B" "node$n"
  MANAGE=$B/node$n/manage.sock
  sync; echo 3 > /proc/sys/vm/drop_caches
}
ROWS=()
for span in $SPANS; do
  repo=span-${span,,}
  skopeo copy --quiet --src-tls-verify=false --dest-tls-verify=false "docker://$REG/vm/guest:gzip" "docker://$REG/$repo/guest:gzip"
  "$VMDISK" index --json --span "$span" "$REG/$repo/guest:gzip" > "$B/index-$span.json"
  image=$CLUSTER/$repo/guest:gzip
  # A cold boot.
  fresh
  m=$(registry_mark "$B"); t0=$(now)
  raw=$(VMDISK_MANAGE=$MANAGE "$VMDISK" path --raw "$image")
  ready=$(secs "$t0" "$(now)")
  read -r boot _ < <("$B/boot.sh" "$raw" raw)
  boot_bytes=$(registry_bytes_since "$B" "$m")
  # 1% of the disk file in random 64 KiB reads.
  fresh
  file=$(VMDISK_MANAGE=$MANAGE "$VMDISK" path "$image")
  m=$(registry_mark "$B"); t0=$(now)
  fio --name=r64 --filename="$file" --readonly --direct=1 --rw=randread --bs=64k --ioengine=psync \
    --io_size=$((SIZE / 100 / 65536 * 65536)) --randseed=11 --output-format=terse > /dev/null
  r64=$(secs "$t0" "$(now)"); r64g=$(blob_gets_since "$B" "$m"); r64b=$(registry_bytes_since "$B" "$m")
  # The whole file in order.
  fresh
  file=$(VMDISK_MANAGE=$MANAGE "$VMDISK" path "$image")
  t0=$(now); dd if="$file" of=/dev/null bs=4M status=none; full=$(secs "$t0" "$(now)")
  ROWS+=("$span $(json "$B/index-$span.json" index_size) $(json "$B/index-$span.json" windows_size) $ready $boot $boot_bytes $r64 $r64g $r64b $full")
  echo "span $span: ${ROWS[-1]}" >&2
  stop_mount_servers "$B"
done

{
  echo
  echo "Span size of vmdisk index ($GIB GiB guest, qcow2 file $SIZE bytes, gzip containerDisk; cluster link; fresh nodes):"
  printf '%s\n' "${ROWS[@]}" | python3 -c '
import sys
rows = [l.split() for l in sys.stdin]
heads = ["span", "index KB", "windows MB", "ready s", "boot s", "boot MB", "1% 64K s", "GETs", "64K MB", "full s", "total s"]
print("  " + " ".join(f"{h:>10}" for h in heads))
best = None
for r in rows:
    span, isz, wsz, ready, boot, bb, r64, g, rb, full = r
    total = float(ready) + float(boot) + float(r64) + float(full)
    if best is None or total < best[1]:
        best = (span, total)
    cells = [span, f"{int(isz) / 1e3:.0f}", f"{int(wsz) / 1e6:.1f}", ready, boot, f"{int(bb) / 1e6:.1f}", r64, g, f"{int(rb) / 1e6:.1f}", full, f"{total:.2f}"]
    print("  " + " ".join(f"{c:>10}" for c in cells))
print(f"  lowest total: {best[0]} spans ({best[1]:.2f} s)")
'
} | tee -a "$RESULTS"
