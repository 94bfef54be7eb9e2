#!/usr/bin/env bash
# Seekable-index figures (part of `make bench`), for the boot guest disk of BOOT_BENCH_GIB
# (default 2) GiB published as KubeVirt users publish it today (a gzip containerDisk pushed by
# skopeo) and, for comparison, with `vmdisk push` (zstd:chunked):
# - the index's size and its windows blob's (% of the tar stream) and build time by span size;
# - `vmdisk index` throughput (fetching the blob, inflating, hashing, publishing) beside
#   `curl | gunzip` of the same blob alone;
# - CRI PullImage over the shaped "cluster" link (20 ms, 200 Mbit/s): lazily through the
#   index vs containerd's overlayfs full pull;
# - a cold boot (qemu TCG, Kata-style raw view) over the cluster link on fresh nodes, through
#   the index vs through the zstd:chunked layout: time and registry bytes.
set -euo pipefail
cd "$(dirname "$0")/../.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
SNAPSHOTTER=${SNAPSHOTTER:-$PWD/target/release/vmdisk-snapshotter}
CRI_PULL=${CRI_PULL:-$PWD/target/release/examples/cri-pull}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
GIB=${BOOT_BENCH_GIB:-2}
source integration/lib/containerd.sh
bench_scratch index
source integration/lib/guest.sh
start_registry "$B"
start_cluster_link "$B" "$REG"

make_guest_disk "$B" "$GIB"
SIZE=$(stat -c %s "$B/guest.qcow2")
publish_lazy_and_gzip "$B/guest.qcow2" "$REG/vm/guest:lazy" "$REG/vm/guest:gzip"
write_boot_script "$B"

# Index size and time by span size (each into its own repository), then the default span
# beside the image: the one the nodes find.
ROWS=()
for span in 4M 2M 1M 512K 256K; do
  sync; echo 3 > /proc/sys/vm/drop_caches
  t0=$(now)
  if [ "$span" = 256K ]; then to=(); else to=(--to "$REG/indexes/span-${span,,}"); fi
  "$VMDISK" index --json --span "$span" "${to[@]}" "$REG/vm/guest:gzip" > "$B/index-$span.json"
  t1=$(now)
  ROWS+=("$span $(json "$B/index-$span.json" spans) $(json "$B/index-$span.json" index_size) $(json "$B/index-$span.json" windows_size) $(json "$B/index-$span.json" stream_size) $(secs "$t0" "$t1")")
done
LAYER=$(json "$B/index-256K.json" layer)
LAYER_SIZE=$(json "$B/index-256K.json" layer_size)
sync; echo 3 > /proc/sys/vm/drop_caches
t0=$(now)
curl -sf "http://$REG/v2/vm/guest/blobs/$LAYER" | gunzip -c > /dev/null
t1=$(now)
GUNZIP_S=$(secs "$t0" "$t1")

# CRI PullImage over the cluster link: through the index on a fresh node, and the full pull.
start_node "$B" pull "" "$B/pull-ctd/root"
start_containerd "$B/pull-ctd" "$CLUSTER" "$B/pull/vmdisk.sock"
start_containerd "$B/full-ctd" "$CLUSTER" ""
sync; echo 3 > /proc/sys/vm/drop_caches
cat "$SNAPSHOTTER" "$(command -v containerd)" > /dev/null
pull() {  # pull CONTAINERD_DIR IMAGE: "seconds registry_bytes"
  local m out; m=$(mark)
  out=$("$CRI_PULL" --address "$B/$1/containerd.sock" "$2")
  echo "$(echo "$out" | sed -E 's/.* in ([0-9.]+) s$/\1/') $(served_since "$m")"
}
read -r LP_SECS LP_BYTES < <(pull pull-ctd "$CLUSTER/vm/guest:gzip")
grep -q 'layer is served lazily' "$B/pull/vmdisk.log" || { echo "the indexed pull was not lazy"; tail "$B/pull/vmdisk.log"; exit 1; }
read -r FP_SECS FP_BYTES < <(pull full-ctd "$CLUSTER/vm/guest:gzip")

# Cold boots on fresh nodes: through the index, and through the zstd:chunked layout.
lazy_boot() {  # lazy_boot NODE IMAGE: "ready_s boot_s guest_bytes registry_bytes"
  local m t0 t1 raw out
  sync; echo 3 > /proc/sys/vm/drop_caches
  m=$(mark); t0=$(now)
  raw=$(VMDISK_MANAGE=$B/$1/manage.sock "$VMDISK" path --raw "$2")
  t1=$(now)
  out=$("$B/boot.sh" "$raw" raw)
  echo "$(secs "$t0" "$t1") $out $(served_since "$m")"
}
start_node "$B" indexed
read -r I_READY I_BOOT I_GUEST I_BYTES < <(lazy_boot indexed "$CLUSTER/vm/guest:gzip")
start_node "$B" chunked
read -r Z_READY Z_BOOT Z_GUEST Z_BYTES < <(lazy_boot chunked "$CLUSTER/vm/guest:lazy")

pct() { python3 -c "print(f'{$1 * 100 / $2:.2f}%')"; }
mbps() { python3 -c "print(f'{$1 / 1e6 / max($2, 0.001):.0f}')"; }
total() { python3 -c "print(f'{$1 + $2:.2f}')"; }
{
  echo
  echo "Seekable index of a gzip containerDisk ($GIB GiB guest, qcow2 file $SIZE bytes, gzip layer $LAYER_SIZE bytes), same run:"
  printf '  %-8s %8s %12s %10s %14s %10s %10s\n' span spans "index bytes" "% stream" "windows bytes" "% stream" "index s"
  for row in "${ROWS[@]}"; do
    read -r SPAN SPANS ISIZE WSIZE STREAM ISECS <<< "$row"
    printf '  %-8s %8s %12s %10s %14s %10s %10s\n' "$SPAN" "$SPANS" "$ISIZE" "$(pct "$ISIZE" "$STREAM")" "$WSIZE" "$(pct "$WSIZE" "$STREAM")" "$ISECS"
  done
  read -r _ _ _ _ STREAM ISECS <<< "${ROWS[4]}"
  echo "  vmdisk index (256K spans, registry to published index): $(mbps "$STREAM" "$ISECS") MB/s of tar stream;"
  echo "  curl | gunzip of the same blob alone: $GUNZIP_S s, $(mbps "$STREAM" "$GUNZIP_S") MB/s"
  echo "CRI PullImage over the cluster link (20 ms, 200 Mbit/s):"
  echo "  vmdisk through the index: $LP_SECS s, $LP_BYTES registry bytes; overlayfs full pull: $FP_SECS s, $FP_BYTES registry bytes"
  echo "Cold boot (qemu TCG, raw view) over the cluster link on fresh nodes:"
  printf '  %-34s %8s %8s %9s %14s %14s\n' layout "ready s" "boot s" "total s" "guest bytes" "registry bytes"
  printf '  %-34s %8s %8s %9s %14s %14s\n' "gzip + seekable index (256K spans)" "$I_READY" "$I_BOOT" "$(total "$I_READY" "$I_BOOT")" "$I_GUEST" "$I_BYTES"
  printf '  %-34s %8s %8s %9s %14s %14s\n' "zstd:chunked (256K chunks)" "$Z_READY" "$Z_BOOT" "$(total "$Z_READY" "$Z_BOOT")" "$Z_GUEST" "$Z_BYTES"
} | tee -a "$RESULTS"
