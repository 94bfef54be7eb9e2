#!/usr/bin/env bash
# `make bench`: registries as the internet runs them (docs/registry.md#redirects). A 512 MiB
# random-data qcow2 is read cold through `vmdisk mount` (hydration off), 100 reads of 64 KiB at
# seeded random offsets, one at a time, on two layouts, same run:
#   redirect  the registry's API behind an 80 ms link, redirecting blob GETs to a blob host
#             (signed, expiring URLs; examples/blob-cdn.rs) behind a 10 ms link: what Docker
#             Hub, quay.io, ghcr.io, ECR, GAR and ACR are to a node near a CDN edge;
#   itself    the same registry serving blobs itself behind the 80 ms link (the lab before).
# Beside them, the blob host's own answer to what a miss needs: a chunk's range (256 KiB) asked
# of it directly with curl over one connection, 100 times. Per layout: read p50, p99,
# registry requests (blob GETs and others) for the mount and the reads, bytes fetched.
# Appends to scratch/bench/results.txt. Needs root (FUSE).
set -euo pipefail
cd "$(dirname "$0")/../.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
CDN=${CDN:-$PWD/target/release/examples/blob-cdn}
source integration/lib/containerd.sh
bench_scratch redirect

start_internet_registry "$B"
ITSELF=127.0.0.1:$(free_port)
"$RELAY" "$ITSELF" "$REG" "${API_RTT:-80}" "${LINK_MBIT:-200}" > "$B/itself-link.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do grep -q listening "$B/itself-link.out" && break; sleep 0.05; done
random_qcow2 "$B/disk.qcow2" 512
"$VMDISK" push "$B/disk.qcow2" "$REG/bench/cdn:1" > /dev/null

# reads MNT_DISK ORIGINAL: 100 timed 64 KiB reads, each checked; prints "p50_ms p99_ms".
reads() {
  python3 - "$1" "$2" <<'PY'
import os, random, sys, time
random.seed(11)
fd, orig = os.open(sys.argv[1], os.O_RDONLY), os.open(sys.argv[2], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
size = os.fstat(orig).st_size
times = []
for _ in range(100):
    at = random.randrange(0, size - 65536) // 4096 * 4096
    t = time.monotonic()
    got = os.pread(fd, 65536, at)
    times.append(time.monotonic() - t)
    if got != os.pread(orig, 65536, at):
        sys.exit(f"wrong bytes at {at}")
times.sort()
print(f"{times[49] * 1000:.1f} {times[98] * 1000:.1f}")
PY
}
# layout NAME HOST: a cold mount of HOST/bench/cdn:1 and the reads; prints "p50 p99 fetched
# requests".
layout() {
  local mnt=$B/mnt-$1
  mkdir -p "$mnt"
  sync; echo 3 > /proc/sys/vm/drop_caches
  "$VMDISK" mount --stats --cache "$B/cache-$1" "$2/bench/cdn:1" "$mnt" > "$B/mount-$1.out" 2> "$B/mount-$1.err" &
  local mpid=$!
  for _ in $(seq 3000); do grep -q '^ready' "$B/mount-$1.out" && break; sleep 0.005; done
  local disk; disk=$(sed -n 's/^ready: .* at \(.*\) ([0-9]* of .*$/\1/p' "$B/mount-$1.out" | head -1)
  reads "$disk" "$B/disk.qcow2" > "$B/reads-$1"
  read -r p50 p99 < "$B/reads-$1"
  # (A file just closed can still be held a moment: signal again until it has gone.)
  while kill -INT $mpid 2>/dev/null; do sleep 0.5; done
  wait $mpid || true
  local stats; stats=$(tail -1 "$B/mount-$1.out")
  echo "$p50 $p99 $(echo "$stats" | python3 -c 'import json,sys; s=json.load(sys.stdin); print(s["bytes_fetched"], s["fetch_requests"])')"
}

before_blob=$(cdn_count registry_blob_requests)
before_other=$(cdn_count registry_other_requests)
read -r R_P50 R_P99 R_BYTES R_FETCHES < <(layout redirect "$API")
R_BLOB_GETS=$(($(cdn_count registry_blob_requests) - before_blob))
R_OTHER=$(($(cdn_count registry_other_requests) - before_other))
m=$(registry_mark "$B")
read -r I_P50 I_P99 I_BYTES I_FETCHES < <(layout itself "$ITSELF")
tail -c +"$((m + 1))" "$B/registry.log" | grep -o '"[A-Z]* /v2/[^ ]*' > "$B/itself-requests" || true
I_BLOB_GETS=$(grep -c '"GET /v2/.*/blobs/sha256:' "$B/itself-requests" || true)
I_OTHER=$(( $(wc -l < "$B/itself-requests") - I_BLOB_GETS ))
# The blob host's own answer to what a miss needs: one chunk's range (256 KiB, the chunk size
# `vmdisk push` writes).
RANGE=262144
LAYER=$(curl -s -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://$REG/v2/bench/cdn/manifests/1" | python3 -c 'import json,sys; print(max(json.load(sys.stdin)["layers"], key=lambda l: l["size"])["digest"])')
# The signed URL the front redirects the layer to, then 100 ranges of it asked with curl over one
# connection (a curl config of 100 transfers).
SIGNED=$(curl -s -o /dev/null -w '%{redirect_url}' "http://$API/v2/bench/cdn/blobs/$LAYER")
python3 - "$SIGNED" "$(stat -c %s "$B/registry/docker/registry/v2/blobs/sha256/${LAYER:7:2}/${LAYER:7}/data")" "$RANGE" > "$B/curl.cfg" <<'PY'
import random, sys
url, blob, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
random.seed(3)
for i in range(100):
    at = random.randrange(0, blob - size)
    if i:
        print("next")
    print(f'url = "{url}"\nrange = "{at}-{at + size - 1}"\noutput = "/dev/null"\nwrite-out = "%{{http_code}} %{{size_download}} %{{time_total}}\\n"')
PY
curl -s --config "$B/curl.cfg" > "$B/curl.out"
read -r H_P50 H_P99 < <(python3 - "$B/curl.out" "$RANGE" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1])]
assert all(r[0] == "206" and int(r[1]) == int(sys.argv[2]) for r in rows), rows[:3]
times = sorted(float(r[2]) for r in rows)
print(f"{times[49] * 1000:.1f} {times[98] * 1000:.1f}")
PY
)
ratio() { python3 -c "print(f'{$1 / $2:.2f}')"; }
{
  echo
  echo "registries as the internet runs them: 100 cold 64 KiB reads, one at a time, of a 512 MiB random-data qcow2 through vmdisk mount (hydration off), same run;"
  echo "redirect = the registry's API behind an 80 ms link redirecting blobs to a blob host behind a 10 ms link (signed URLs, examples/blob-cdn.rs); itself = the same registry serving blobs behind the 80 ms link; 200 Mbit/s each:"
  printf '  %-44s %8s %8s %10s %12s %14s\n' layout "p50 ms" "p99 ms" "x blob host" "blob GETs" "other requests"
  printf '  %-44s %8s %8s %10s %12s %14s\n' "redirect (API 80 ms, blob host 10 ms)" "$R_P50" "$R_P99" "$(ratio "$R_P50" "$H_P50")" "$R_BLOB_GETS" "$R_OTHER"
  printf '  %-44s %8s %8s %10s %12s %14s\n' "registry serves blobs itself (80 ms)" "$I_P50" "$I_P99" "$(ratio "$I_P50" "$H_P50")" "$I_BLOB_GETS" "$I_OTHER"
  printf '  %-44s %8s %8s %10s %12s %14s\n' "(the blob host's own answer, 256 KiB, curl)" "$H_P50" "$H_P99" "1.00" "-" "-"
  echo "  bytes fetched: redirect $R_BYTES in $R_FETCHES requests, itself $I_BYTES in $I_FETCHES"
} | tee -a "$RESULTS"
