#!/usr/bin/env bash
# Snapshotter figures (part of `make bench`): CRI PullImage time and registry bytes for a VM
# disk, lazily through vmdisk-snapshotter vs. containerd's overlayfs full pull of the same disk
# as a gzip containerDisk, for a 1 GiB and an 8 GiB disk; then the same after image removal
# (re-pull). Each disk is fully written with random data (incompressible: the fair worst case
# for the full pull's transfer, as real images compress 2-3x). Both containerds run in one
# scratch directory against one loopback registry; registry bytes are summed from the
# registry's own request log. Needs ~45 GiB free for the 8 GiB case.
set -euo pipefail
cd "$(dirname "$0")/.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
SNAPSHOTTER=${SNAPSHOTTER:-$PWD/target/release/vmdisk-snapshotter}
CRI_PULL=${CRI_PULL:-$PWD/target/release/examples/cri-pull}
SIZES=${BENCH_PULL_GIB:-1 8}
mkdir -p scratch/bench
RESULTS=$PWD/scratch/bench/results.txt
B=$(mktemp -d "$PWD/scratch/bench-pull-XXXXXX")
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  wait 2>/dev/null || true
  stop_mount_servers "$B"
  grep -o " $B[^ ]*" /proc/self/mounts | sort -r | while read -r m; do umount -l "$m"; done
  [ -n "${BENCH_KEEP:-}" ] || rm -rf "$B"
}
trap 'status=$?; cleanup || true; exit $status' EXIT

PORT=$(free_port)
REG=127.0.0.1:$PORT
mkdir -p "$B/registry"
printf 'version: 0.1\nlog: { level: info, formatter: text }\nstorage: { filesystem: { rootdirectory: %s }, delete: { enabled: true } }\nhttp: { addr: %s }\n' "$B/registry" "$REG" > "$B/registry.yml"
docker-registry serve "$B/registry.yml" > "$B/registry.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do curl -sf "http://$REG/v2/" >/dev/null && break; sleep 0.1; done
mark() { wc -c < "$B/registry.log"; }
served_since() { tail -c +"$(($1 + 1))" "$B/registry.log" | { grep 'http.request.method=GET' || true; } | { grep -o 'http.response.written=[0-9]*' || true; } | cut -d= -f2 | awk '{s+=$1} END {printf "%d\n", s}'; }

source integration/containerd.sh

mkdir -p "$B/lazy"
cat > "$B/lazy/vmdisk.toml" <<TOML
root = "$B/lazy/vmdisk"
address = "$B/lazy/vmdisk.sock"
manage_address = "$B/lazy/manage.sock"
ready_dir = "$B/lazy/vmdisk/disks"
log_level = "info"
[registry]
hosts_dir = "$B/no-hosts.d"
TOML
"$SNAPSHOTTER" --config "$B/lazy/vmdisk.toml" 2> "$B/lazy/vmdisk.log" &
PIDS+=($!)
for _ in $(seq 100); do [ -S "$B/lazy/vmdisk.sock" ] && break; sleep 0.05; done
start_containerd "$B/lazy-ctd" "$REG" "$B/lazy/vmdisk.sock"
start_containerd "$B/full-ctd" "$REG" ""

# pull CONTAINERD_DIR IMAGE: prints "seconds registry_bytes"
pull() {
  local m; m=$(mark)
  local out; out=$("$CRI_PULL" --address "$B/$1/containerd.sock" "$2")
  sleep 0.3   # the registry logs a request after answering it
  echo "$(echo "$out" | sed -E 's/.* in ([0-9.]+) s$/\1/') $(served_since "$m")"
}
# How long the last lazy Prepare took in vmdisk (from containerd's call to the mounted layer).
prepare_ms() { sed 's/\x1b\[[0-9;]*m//g' "$B/lazy/vmdisk.log" | grep 'layer is served lazily' | tail -1 | grep -o ' ms=[0-9]*' | cut -d= -f2; }
remove() { "$CRI_PULL" --address "$B/$1/containerd.sock" --rm "$2" > /dev/null; }

ROWS=()
for GIB in $SIZES; do
  DISK=$B/disk-$GIB.qcow2
  qemu-img create -q -f qcow2 "$DISK" "${GIB}G"
  for i in $(seq 0 $((GIB * 4 - 1))); do
    head -c 256M /dev/urandom > "$B/piece"
    qemu-io -c "write -s $B/piece $((i * 256))M 256M" "$DISK" > /dev/null
  done
  rm -f "$B/piece"
  SIZE=$(stat -c %s "$DISK")
  "$VMDISK" push "$DISK" "$REG/bench/lazy-$GIB:1" > /dev/null
  mkdir -p "$B/root/disk" "$B/layout-$GIB"
  ln -f "$DISK" "$B/root/disk/disk.qcow2"
  tar --owner=107 --group=107 -C "$B/root" -cf "$B/layer.tar" disk
  rm -f "$B/root/disk/disk.qcow2"
  python3 integration/tar-layout.py "$B/layout-$GIB" "$B/layer.tar"
  skopeo copy --quiet --dest-tls-verify=false --dest-compress-format gzip "oci:$B/layout-$GIB:latest" "docker://$REG/bench/gzip-$GIB:1"
  rm -rf "$B/layout-$GIB"
  sync; echo 3 > /proc/sys/vm/drop_caches

  read -r L_SECS L_BYTES < <(pull lazy-ctd "$REG/bench/lazy-$GIB:1")
  L_MS=$(prepare_ms)
  remove lazy-ctd "$REG/bench/lazy-$GIB:1"
  read -r LR_SECS LR_BYTES < <(pull lazy-ctd "$REG/bench/lazy-$GIB:1")
  read -r F_SECS F_BYTES < <(pull full-ctd "$REG/bench/gzip-$GIB:1")
  remove full-ctd "$REG/bench/gzip-$GIB:1"
  read -r FR_SECS FR_BYTES < <(pull full-ctd "$REG/bench/gzip-$GIB:1")
  ROWS+=("$GIB $SIZE $L_SECS $L_BYTES $LR_SECS $LR_BYTES $F_SECS $F_BYTES $FR_SECS $FR_BYTES $L_MS")
  remove lazy-ctd "$REG/bench/lazy-$GIB:1"
  remove full-ctd "$REG/bench/gzip-$GIB:1"
  rm -f "$DISK"
done

{
  echo
  echo "CRI PullImage of a VM disk (qcow2 fully written with random data), loopback registry, same run:"
  printf '  %-6s %-38s %10s %16s %12s %16s\n' disk "snapshotter" "pull s" "registry bytes" "re-pull s" "re-pull bytes"
  for row in "${ROWS[@]}"; do
    read -r GIB SIZE L_SECS L_BYTES LR_SECS LR_BYTES F_SECS F_BYTES FR_SECS FR_BYTES L_MS <<< "$row"
    printf '  %-6s %-38s %10s %16s %12s %16s\n' "${GIB}G" "vmdisk (lazy, zstd:chunked)" "$L_SECS" "$L_BYTES" "$LR_SECS" "$LR_BYTES"
    printf '  %-6s %-38s %10s %16s %12s %16s\n' "" "overlayfs (full pull, gzip)" "$F_SECS" "$F_BYTES" "$FR_SECS" "$FR_BYTES"
    echo "         (disk file $SIZE bytes; lazy pull moved $(python3 -c "print(f'{$L_BYTES * 100 / $SIZE:.3f}')")% of it; vmdisk's Prepare, classification to mounted: $L_MS ms)"
  done
} | tee -a "$RESULTS"
