#!/usr/bin/env bash
# The main job on an embedded default: a registry on loopback in a scratch directory, a sample
# VM disk generated, pushed as a lazily loadable containerDisk and inspected.
# Usage: integration/demo.sh   (run by `make demo`; needs the packages `make deps` installs)
set -euo pipefail
cd "$(dirname "$0")/.."
VMDISK=${VMDISK:-target/release/vmdisk}
mkdir -p scratch
SCRATCH=$(mktemp -d "$PWD/scratch/demo-XXXXXX")
PORT=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
REGISTRY_PID=
cleanup() { [ -n "$REGISTRY_PID" ] && kill "$REGISTRY_PID" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT

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
