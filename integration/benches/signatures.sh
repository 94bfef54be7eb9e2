#!/usr/bin/env bash
# `make bench` (issue 26): what a signature policy adds to a cold ready time. `vmdisk mount`
# of a cosign-signed disk over the shaped cluster link (20 ms round trip, 200 Mbit/s), fresh
# cache each run, without a policy and with a containers-policy.json that requires the
# signature; medians of 5 runs of each, interleaved, beside the link's measured round trip.
# Needs `make deps` (cosign in target/deps/signers) and the release build with the shaped-link
# example.
set -euo pipefail
cd "$(dirname "$0")/../.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
RELAY=$PWD/target/release/examples/shaped-link
COSIGN=$PWD/target/deps/signers/usr/bin/cosign
[ -x "$COSIGN" ] || { echo "bench-signatures: $COSIGN is missing (make deps)" >&2; exit 1; }
source integration/lib/containerd.sh
bench_scratch sig
start_registry "$B"
start_cluster_link "$B" "$REG"

# 1 GiB virtual qcow2 with 64 MiB of random data, pushed in vmdisk's layout and signed.
DISK=$B/disk.qcow2
qemu-img create -q -f qcow2 "$DISK" 1G
head -c 64M /dev/urandom > "$B/piece"
qemu-io -c "write -s $B/piece 0 64M" "$DISK" > /dev/null
rm "$B/piece"
DIGEST=$("$VMDISK" push "$DISK" "$REG/bench/signed:1" 2>/dev/null | tail -n 1)
(cd "$B" && HOME=$B COSIGN_PASSWORD= "$COSIGN" generate-key-pair > /dev/null 2>&1 &&
  HOME=$B COSIGN_PASSWORD= "$COSIGN" sign --key cosign.key --tlog-upload=false \
    --use-signing-config=false --allow-http-registry -y "$REG/bench/signed@$DIGEST" > /dev/null 2>&1)
printf '{"default":[{"type":"reject"}],"transports":{"docker":{"%s/bench":[{"type":"sigstoreSigned","keyPath":"%s","signedIdentity":{"type":"matchRepository"}}]}}}\n' \
  "$CLUSTER" "$B/cosign.pub" > "$B/policy.json"

# ready_ms [ARGS...]: milliseconds from `vmdisk mount` to its "ready:" line, fresh cache.
ready_ms() {
  rm -rf "$B/cache"; mkdir -p "$B/mnt"
  local t0; t0=$(date +%s%N)
  "$VMDISK" mount "$@" --cache "$B/cache" "$CLUSTER/bench/signed:1" "$B/mnt" > "$B/mount.out" 2> "$B/mount.err" &
  local pid=$!
  for _ in $(seq 6000); do grep -q '^ready' "$B/mount.out" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || { cat "$B/mount.err" >&2; exit 1; }; sleep 0.002; done
  local t1; t1=$(date +%s%N)
  kill -INT "$pid"; wait "$pid" || true
  echo $(((t1 - t0) / 1000000))
}
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
PLAIN=(); SIGNED=()
for _ in 1 2 3 4 5; do
  PLAIN+=("$(ready_ms)")
  SIGNED+=("$(ready_ms --policy "$B/policy.json")")
done
RTT=$(for _ in 1 2 3 4 5; do curl -s -o /dev/null -w '%{time_total}\n' "http://$CLUSTER/v2/"; done | median)
P=$(printf '%s\n' "${PLAIN[@]}" | median)
S=$(printf '%s\n' "${SIGNED[@]}" | median)
{
  echo
  echo "signature policy: cold ready of a cosign-signed disk (vmdisk mount, fresh cache) over the cluster link, median of 5:"
  echo "  no policy:                        ${P} ms   (runs: ${PLAIN[*]})"
  echo "  containers-policy sigstoreSigned: ${S} ms   (runs: ${SIGNED[*]})"
  python3 -c "print(f'  added: {$S - $P} ms = {($S - $P) / 1000 / $RTT:.2f} round trips (round trip {$RTT * 1000:.1f} ms)')"
} | tee -a "$RESULTS"
