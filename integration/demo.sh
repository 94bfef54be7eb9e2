#!/usr/bin/env bash
# The main job on an embedded default: in a scratch directory, a registry on loopback,
# vmdisk-snapshotter and containerd 1.6 using it as the CRI snapshotter; a sample VM disk is
# generated, pushed as a lazily loadable containerDisk and pulled through CRI (as kubelet
# does): containerd gets a remote snapshot instead of downloading the disk. The ready disk
# path and the bytes fetched are printed. Needs root (FUSE, containerd).
# Usage: integration/demo.sh   (run by `make demo`; needs the packages `make deps` installs)
set -euo pipefail
cd "$(dirname "$0")/.."
VMDISK=${VMDISK:-target/release/vmdisk}
SNAPSHOTTER=${SNAPSHOTTER:-target/release/vmdisk-snapshotter}
CRI_PULL=${CRI_PULL:-target/release/examples/cri-pull}
mkdir -p scratch
SCRATCH=$(mktemp -d "$PWD/scratch/demo-XXXXXX")
PORT=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  wait 2>/dev/null || true
  stop_mount_servers "$SCRATCH"
  grep -o " $SCRATCH[^ ]*" /proc/self/mounts | sort -r | while read -r m; do umount -l "$m"; done
  true
}
trap 'status=$?; cleanup || true; exit $status' EXIT
source integration/containerd.sh

echo "== scratch directory: $SCRATCH"
mkdir -p "$SCRATCH/registry"
cat > "$SCRATCH/registry.yml" <<YML
version: 0.1
log: { level: error }
storage: { filesystem: { rootdirectory: $SCRATCH/registry } }
http: { addr: 127.0.0.1:$PORT }
YML
docker-registry serve "$SCRATCH/registry.yml" > "$SCRATCH/registry.log" 2>&1 &
PIDS+=($!)
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

echo "== vmdisk-snapshotter and containerd (CRI snapshotter = vmdisk) in $SCRATCH"
cat > "$SCRATCH/vmdisk.toml" <<TOML
root = "$SCRATCH/vmdisk"
address = "$SCRATCH/vmdisk.sock"
manage_address = "$SCRATCH/manage.sock"
ready_dir = "$SCRATCH/vmdisk/disks"
[registry]
hosts_dir = "$SCRATCH/no-hosts.d"
TOML
"$SNAPSHOTTER" --config "$SCRATCH/vmdisk.toml" 2> "$SCRATCH/vmdisk.log" &
PIDS+=($!)
for _ in $(seq 100); do [ -S "$SCRATCH/vmdisk.sock" ] && break; sleep 0.05; done
start_containerd "$SCRATCH/containerd" "127.0.0.1:$PORT" "$SCRATCH/vmdisk.sock"

echo "== CRI PullImage $REF (what kubelet does for a KubeVirt containerDisk)"
"$CRI_PULL" --address "$SCRATCH/containerd/containerd.sock" "$REF"
export VMDISK_MANAGE="$SCRATCH/manage.sock"
echo "== vmdisk ls: the disk is mounted lazily; only its qcow2 header and tables were fetched"
"$VMDISK" ls
DISK_PATH=$("$VMDISK" ls --json | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["path"])')
echo "== qemu-img info on the ready disk, then qemu reads 8 MiB of it"
qemu-img info "$DISK_PATH" | sed -n '1,4p'
qemu-io -r -f qcow2 -c "read -q 0 4M" -c "read -q 1G 4M" "$DISK_PATH"
sleep 1.2   # the mount server publishes its counters every second
"$VMDISK" ls --json > "$SCRATCH/ls.json"
python3 - "$SCRATCH/ls.json" "$(stat -c %s "$DISK")" <<'PY'
import json, sys
d, size = json.load(open(sys.argv[1]))[0], int(sys.argv[2])
print(f"== ready disk path: {d['path']}")
print(f"== raw view for Kata: {d['raw']}")
print(f"== fetched {d['registry_bytes']} bytes of the {size}-byte disk file "
      f"({d['registry_bytes'] * 100 / size:.1f}%); {d['chunks_cached']} of {d['chunks']} chunks cached")
PY
