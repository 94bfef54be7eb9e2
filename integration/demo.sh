#!/usr/bin/env bash
# The main job on an embedded default: a registry on loopback in a scratch directory, a sample
# VM disk generated, pushed as a lazily loadable containerDisk, inspected, and mounted lazily:
# the ready disk path and the bytes fetched are printed. Needs root (FUSE).
# Usage: integration/demo.sh   (run by `make demo`; needs the packages `make deps` installs)
set -euo pipefail
cd "$(dirname "$0")/.."
VMDISK=${VMDISK:-target/release/vmdisk}
mkdir -p scratch
SCRATCH=$(mktemp -d "$PWD/scratch/demo-XXXXXX")
PORT=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
REGISTRY_PID=
MOUNT_PID=
cleanup() {
  [ -n "$MOUNT_PID" ] && kill -INT "$MOUNT_PID" 2>/dev/null
  [ -n "$REGISTRY_PID" ] && kill "$REGISTRY_PID" 2>/dev/null
  wait 2>/dev/null || true
  mountpoint -q "$SCRATCH/mnt" 2>/dev/null && umount -l "$SCRATCH/mnt"
  true
}
trap 'status=$?; cleanup || true; exit $status' EXIT

echo "== scratch directory: $SCRATCH"
mkdir -p "$SCRATCH/registry"
cat > "$SCRATCH/registry.yml" <<YML
version: 0.1
log: { level: error }
storage: { filesystem: { rootdirectory: $SCRATCH/registry } }
http: { addr: 127.0.0.1:$PORT }
YML
docker-registry serve "$SCRATCH/registry.yml" > "$SCRATCH/registry.log" 2>&1 &
REGISTRY_PID=$!
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PORT/v2/" >/dev/null && break; sleep 0.1; done
echo "== registry listening on 127.0.0.1:$PORT"

DISK="$SCRATCH/sample.qcow2"
qemu-img create -q -f qcow2 "$DISK" 2G
head -c 16M /dev/urandom > "$SCRATCH/random.bin"
qemu-io -c "write -P 0xab 0 4M" -c "write -s $SCRATCH/random.bin 1G 16M" -c "write -P 0xcd 1536M 2M" "$DISK" >/dev/null
rm "$SCRATCH/random.bin"
echo "== sample disk: $DISK ($(stat -c %s "$DISK") bytes, 2 GiB virtual)"

REF="127.0.0.1:$PORT/vm/sample:1"
echo "== vmdisk push $DISK $REF"
"$VMDISK" push "$DISK" "$REF"
echo "== vmdisk inspect $REF"
"$VMDISK" inspect "$REF"

echo "== vmdisk mount $REF $SCRATCH/mnt (cold cache in $SCRATCH/cache)"
mkdir -p "$SCRATCH/mnt"
"$VMDISK" mount --stats --cache "$SCRATCH/cache" "$REF" "$SCRATCH/mnt" > "$SCRATCH/mount.out" &
MOUNT_PID=$!
for _ in $(seq 300); do grep -q '^ready' "$SCRATCH/mount.out" && break; sleep 0.05; done
READY=$(grep '^ready' "$SCRATCH/mount.out")
echo "$READY"
DISK_PATH=$(echo "$READY" | sed -E 's/^ready: .* at (.*) \(.*$/\1/')
echo "== qemu-img info on the lazily loaded disk, then qemu reads 8 MiB of it"
qemu-img info "$DISK_PATH" | sed -n '1,4p'
qemu-io -r -f qcow2 -c "read -q 0 4M" -c "read -q 1G 4M" "$DISK_PATH"
kill -INT "$MOUNT_PID"; wait "$MOUNT_PID"; MOUNT_PID=
STATS=$(tail -1 "$SCRATCH/mount.out")
python3 - "$STATS" "$(stat -c %s "$DISK")" <<'PY'
import json, sys
s, size = json.loads(sys.argv[1]), int(sys.argv[2])
print("== ", end="")
print(f"fetched {s['bytes_fetched']} bytes in {s['fetch_requests']} range requests "
      f"({s['bytes_fetched'] * 100 / size:.1f}% of the {size}-byte disk file); "
      f"served {s['bytes_served']} bytes")
PY
echo "== ready disk path was: $DISK_PATH (unmounted now; the cache in $SCRATCH/cache keeps what was fetched)"
