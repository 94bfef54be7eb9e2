#!/usr/bin/env bash
# `make bench`: the figures the issues name, each beside its baseline from the same run.
# Publishing: push throughput and peak RSS of `vmdisk push` vs `skopeo copy` of the same disk
# as a gzip containerDisk; TOC bytes per GiB of disk by chunk size.
# Results are printed and written to scratch/bench/results.txt; docs/benchmarks.md records them.
set -euo pipefail
cd "$(dirname "$0")/../.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
mkdir -p scratch
B=$(mktemp -d "$PWD/scratch/bench-XXXXXX")
RESULTS=$PWD/scratch/bench/results.txt
mkdir -p "$(dirname "$RESULTS")"
source integration/lib/containerd.sh
PIDS=()
cleanup() { stop_pids "${PIDS[@]}"; wait 2>/dev/null || true; rm -rf "$B"; }
trap 'status=$?; cleanup || true; exit $status' EXIT

start_registry "$B"

# 4 GiB virtual qcow2, 1 GiB of random data in four scattered 256 MiB pieces.
DISK=$B/disk/bench.qcow2
mkdir -p "$B/disk"
qemu-img create -q -f qcow2 "$DISK" 4G
for i in 0 1 2 3; do
  head -c 256M /dev/urandom > "$B/piece"
  qemu-io -c "write -s $B/piece $((i * 1024 + 100))M 256M" "$DISK" > /dev/null
done
rm "$B/piece"
SIZE=$(stat -c %s "$DISK")
sync
echo "disk: $DISK, $SIZE bytes (4 GiB virtual, 1 GiB random data)" | tee "$RESULTS"

# timed CMD...: prints "seconds maxrss_kib"
timed() { /usr/bin/time -f '%e %M' -o "$B/time" "$@" > "$B/out" 2> "$B/err" || { cat "$B/err"; exit 1; }; cat "$B/time"; }

read -r V_SECS V_RSS < <(timed "$VMDISK" push "$DISK" "$REG/bench/vmdisk:1")

# Baseline: the same disk as a gzip containerDisk, pushed by skopeo from an OCI layout whose
# layer is an uncompressed tar (building the layout is not timed).
mkdir -p "$B/root/disk" "$B/layout"
ln "$DISK" "$B/root/disk/bench.qcow2"
tar --owner=107 --group=107 -C "$B/root" -cf "$B/layer.tar" disk
python3 packaging/oci-layout.py "$B/layout" "$B/layer.tar"
sync
read -r S_SECS S_RSS < <(timed skopeo copy --quiet --dest-tls-verify=false --dest-compress --dest-compress-format gzip "oci:$B/layout:latest" "docker://$REG/bench/skopeo:gzip")

# The registry's own ingest rate for the same number of bytes: one curl PATCH of the file.
LOC=$(curl -si -X POST "http://$REG/v2/bench/ceiling/blobs/uploads/" | tr -d '\r' | sed -n 's/^[Ll]ocation: //p')
read -r C_SECS C_RSS < <(timed curl -sf -o /dev/null -X PATCH -H 'Content-Type: application/octet-stream' -T "$DISK" "$LOC")

mbps() { python3 -c "print(f'{$SIZE / 1e6 / max($1, 0.001):.0f}')"; }
{
  echo
  echo "push of the disk file ($((SIZE / 1048576)) MiB), same registry on loopback, same run:"
  printf '  %-44s %8s %10s %14s\n' tool seconds "MB/s" "peak RSS MiB"
  printf '  %-44s %8s %10s %14s\n' "vmdisk push (zstd:chunked, 256 KiB chunks)" "$V_SECS" "$(mbps "$V_SECS")" "$((V_RSS / 1024))"
  printf '  %-44s %8s %10s %14s\n' "skopeo copy (gzip containerDisk)" "$S_SECS" "$(mbps "$S_SECS")" "$((S_RSS / 1024))"
  printf '  %-44s %8s %10s %14s\n' "(ceiling: curl PATCH of the raw file)" "$C_SECS" "$(mbps "$C_SECS")" "$((C_RSS / 1024))"
  echo
  echo "TOC size per GiB of disk file, by chunk size (zstd-compressed / JSON):"
} | tee -a "$RESULTS"
for cs in 64K 256K 1M 4M; do
  "$VMDISK" push --chunk-size "$cs" "$DISK" "$REG/bench/toc:$cs" > /dev/null
  "$VMDISK" inspect --json "$REG/bench/toc:$cs" > "$B/inspect.json"
  python3 - "$cs" "$SIZE" "$B/inspect.json" <<'PY' | tee -a "$RESULTS"
import json, sys
cs, size, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
layer = json.load(open(path))["platforms"][0]["layers"][0]
gib = size / 2**30
print(f"  chunk {cs:>5}: {layer['chunks']:6d} chunks, TOC {layer['toc_size'] / gib / 1024:8.1f} KiB/GiB compressed, {layer['toc_uncompressed_size'] / gib / 1024:8.1f} KiB/GiB JSON")
PY
done

integration/benches/engine.sh
integration/benches/ready.sh
integration/benches/pull.sh
integration/benches/prepare.sh
integration/benches/ordinary.sh
# The demo's boot and the fleet on the registry layout public registries have (the default), and
# beside it on a registry that serves blobs itself (the lab before): docs/registry.md#redirects.
integration/benches/fleet.sh
LAYOUT=itself integration/benches/fleet.sh
integration/benches/boot.sh
LAYOUT=itself integration/benches/boot.sh
integration/benches/link.sh
integration/benches/redirect.sh
integration/benches/index.sh
integration/benches/rawview.sh
integration/benches/signatures.sh
integration/benches/spans.sh
integration/benches/baddays.sh
integration/benches/peers.sh
# Plots of the fleet's and the peers' tables (SVG, beside the results; docs/benchmarks.md and
# docs/fleet.md show them, copied into docs/plots/).
integration/benches/plots.sh "$RESULTS" "$(dirname "$RESULTS")/plots"
