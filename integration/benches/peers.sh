#!/usr/bin/env bash
# `make bench`, the peers: vmdisk beside the other lazy-pulling snapshotters on the same disk,
# the same images where the formats allow, the same registry laid out as public registries run
# (its API 80 ms away answering blob GETs with a redirect to a signed URL on a blob host 10 ms
# away, 200 Mbit/s each: start_internet_registry), the same containerd 1.6 (CRI PullImage, as
# kubelet pulls), in the same run:
# - SOCI 0.16 (integration/deps/peers/: its library by module version, our brief main) on the gzip
#   containerDisk it converts (`soci-convert`, as `soci convert`: a SOCI index manifest v2 with
#   4 MiB spans in an image index beside the image, pushed as a new tag);
#   and its parallel pull-and-unpack mode on the gzip image with no index, the whole-image
#   baseline SOCI offers for images it cannot load lazily;
# - nydus: nydus-snapshotter 0.16 (its own containerd-nydus-grpc, by module version) starting
#   nydusd (crates.io nydus-rs) per image, FUSE, its shipped nydusd configuration (blob cache,
#   1 MiB read amplification), on a RAFS v6 image of the gzip image made by nydus's own builder
#   (`nydus-convert`: nydus-image through the snapshotter's converter library, as
#   `nerdctl image convert --nydus`);
# - stargz-snapshotter 0.19 (integration/deps/peers/, the same way) on an eStargz image of the same
#   disk (4 MiB chunks, as its writer writes them), as it ships (FUSE passthrough off) and with
#   its passthrough on (`[fuse] passthrough = true`, what a user after speed turns on);
# - vmdisk on the gzip image through `vmdisk index`, on the eStargz image, and on its own
#   layout (`vmdisk push`, 256 KiB chunks, and 128 KiB chunks for disks read at random);
# - containerd's overlayfs full pull of the gzip image: the floor for bytes moved at the pull.
# Rows: PullImage → ready; registry bytes within 10 s of the pull's start (background fetch off,
# then on); 1% of the disk file in random 64 KiB reads (one reader: seconds, blob GETs at the
# registry and the blob host, and those at the far registry alone); one
# cold 4 KiB read (median of 40, ms); 1% in random 4 KiB reads by 16 readers (seconds, bytes);
# the whole file in order (dd bs=4M, MB/s; a full pull's includes its pull); warm re-reads
# (two, page cache dropped before each: the second is the row, the first is shown beside it).
# Every row: a fresh node (containerd and snapshotter state, empty caches, page cache dropped)
# per measurement, PEERS_BENCH_RUNS runs (default 3, medians printed with the range;
# PEERS_BENCH_ONLY="label ..." measures only those rows), bytes and
# requests counted at the registry and its blob host. Background fetch off (SOCI
# `[background_fetch] disable`, stargz `no_background_fetch`, nydus `fs_prefetch.enable = false`,
# vmdisk `hydrate = "off"`) except in the row that says "on".
# The peers' versions are printed with the table (target/deps/peers/versions).
# Runs in a private mount namespace (SOCI's tools keep state in /var/lib/soci-snapshotter-grpc,
# bound to a scratch directory there). Appends to scratch/bench/results.txt. Needs root.
# PEERS_BENCH_LAYOUT=itself: the registry serving blobs itself behind the cluster link (20 ms),
# as the lab was before (start_origin).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${VMDISK_PEERS_NS:-}" ]; then
  mkdir -p /var/lib/soci-snapshotter-grpc
  exec env VMDISK_PEERS_NS=1 unshare --mount --propagation private "$0" "$@"
fi
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
SNAPSHOTTER=${SNAPSHOTTER:-$PWD/target/release/vmdisk-snapshotter}
CRI_PULL=${CRI_PULL:-$PWD/target/release/examples/cri-pull}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
CDN=${CDN:-$PWD/target/release/examples/blob-cdn}
ESTARGZ_LAYOUT=${ESTARGZ_LAYOUT:-$PWD/target/release/examples/estargz-layout}
DEPS=$PWD/target/deps
GIB=${PEERS_BENCH_GIB:-2}
RUNS=${PEERS_BENCH_RUNS:-3}
ONLY=${PEERS_BENCH_ONLY:-}
source integration/lib/containerd.sh
bench_scratch peers
# SOCI's state directory is bound over a system path in this namespace.
bench_cleanup_first() {
  while mountpoint -q /var/lib/soci-snapshotter-grpc; do umount -l /var/lib/soci-snapshotter-grpc; done
}

# The peers' binaries, built from the Go module proxy by module version.
PEERS=$DEPS/peers
[ -x "$PEERS/soci-snapshotter-grpc" ] && [ -x "$PEERS/containerd-stargz-grpc" ] &&
  [ -x "$PEERS/containerd-nydus-grpc" ] && [ -x "$PEERS/nydus-rs/bin/nydusd" ] &&
  [ "$(cat "$PEERS/built-from" 2> /dev/null)" = "$(cat integration/deps/peers/*/go.sum | sha256sum | cut -d' ' -f1)" ] ||
  integration/deps/peers/build.sh "$PEERS" > /dev/null
VERSIONS=$(tr '\n' ' ' < "$PEERS/versions")

# The registry: published to on loopback ($REG), pulled from as public registries serve it
# ($PULL; PEERS_BENCH_LAYOUT=itself for the registry serving blobs itself).
LAYOUT=${PEERS_BENCH_LAYOUT:-redirect} start_origin "$B"
# Registry bytes (GET bodies, the blob host's included) since a mark, and blob GETs: at the
# registry and its blob host together, and at the registry alone (each one a round trip to the
# far API: what a client that keeps the redirect's URL saves).
mark() { echo "$(origin_mark "$B"):$(blob_gets):$(registry_blob_gets)"; }
served_since() { origin_bytes_since "$B" "${1%:*:*}"; }
blob_gets_since() { local m=${1%:*}; echo $(($(blob_gets) - ${m##*:})); }
registry_blob_gets_since() { echo $(($(registry_blob_gets) - ${1##*:})); }
blob_gets() {
  if [ -n "${CDN_STATS:-}" ]; then
    echo $(($(cdn_count blob_requests) + $(cdn_count registry_blob_requests)))
  else
    registry_blob_gets
  fi
}
registry_blob_gets() {
  if [ -n "${CDN_STATS:-}" ]; then
    cdn_count registry_blob_requests
  else
    sleep 0.3
    { grep 'http.request.method=GET' "$B/registry.log" || true; } | grep -c '/blobs/sha256:' || true
  fi
}

# The disk: 2 GiB virtual qcow2, half of it random data in 64 MiB pieces at every other
# 128 MiB, published as a gzip containerDisk (skopeo), vmdisk's own layout and eStargz.
DISK=$B/disk.qcow2
qemu-img create -q -f qcow2 "$DISK" "${GIB}G"
for i in $(seq 0 $((GIB * 8 - 1))); do
  head -c 64M /dev/urandom > "$B/piece"
  qemu-io -c "write -s $B/piece $((i * 128))M 64M" "$DISK" > /dev/null
done
rm "$B/piece"
DSIZE=$(stat -c %s "$DISK")
publish_lazy_and_gzip "$DISK" "$REG/peers/disk:lazy" "$REG/peers/disk:gzip"
# The own layout again with 128 KiB chunks: what a disk read at random in small blocks is
# published with (each cold read fetches a chunk).
"$VMDISK" push --chunk-size 128K "$DISK" "$REG/peers/disk:lazy128k" > /dev/null
"$ESTARGZ_LAYOUT" "$B/estargz" "$DISK" disk/disk.qcow2
skopeo copy --quiet --dest-tls-verify=false "oci:$B/estargz:latest" "docker://$REG/peers/disk:estargz"
rm -rf "$B/estargz"
# chain_id TAG: the snapshot of the image's top layer (its chain ID; a one-layer image's is its
# layer's diff_id).
chain_id() {
  curl -sf "http://$REG/v2/peers/disk/blobs/$(curl -sf -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://$REG/v2/peers/disk/manifests/$1" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["config"]["digest"])')" | python3 -c '
import hashlib, json, sys
chain = None
for diff in json.load(sys.stdin)["rootfs"]["diff_ids"]:
    chain = diff if chain is None else "sha256:" + hashlib.sha256(f"{chain} {diff}".encode()).hexdigest()
print(chain)'
}

timed() { /usr/bin/time -f '%e %M' -o "$B/time" "$@" > "$B/out" 2> "$B/err" || { cat "$B/out" "$B/err"; exit 1; }; cat "$B/time"; }

# The indexes, each built as its users build it. SOCI: the image pulled into a containerd,
# converted (`soci-convert`: an index manifest v2, 4 MiB spans, its default) and pushed as a
# new tag; then `vmdisk index` (straight from the registry), a referrer of the unchanged image.
mkdir -p "$B/soci-lib"
mount --bind "$B/soci-lib" /var/lib/soci-snapshotter-grpc
start_containerd "$B/indexer" "$REG" ""
t0=$(now)
ctr -a "$B/indexer/containerd.sock" images pull --plain-http "$REG/peers/disk:gzip" > /dev/null
"$PEERS/soci-convert" --address "$B/indexer/containerd.sock" --root "$B/soci-lib" \
  "$REG/peers/disk:gzip" "$REG/peers/disk:soci" > "$B/soci-convert.out"
ctr -a "$B/indexer/containerd.sock" images push --plain-http "$REG/peers/disk:soci" > /dev/null
SOCI_INDEX_S=$(secs "$t0" "$(now)")
# nydus: the same pulled image converted by nydus's builder (RAFS v6, its defaults) and pushed.
mkdir -p "$B/nydus-work"
t0=$(now)
"$PEERS/nydus-convert" --address "$B/indexer/containerd.sock" --builder "$PEERS/nydus-rs/bin/nydus-image" \
  --work-dir "$B/nydus-work" "$REG/peers/disk:gzip" "$REG/peers/disk:nydus" > /dev/null
ctr -a "$B/indexer/containerd.sock" images push --plain-http "$REG/peers/disk:nydus" > /dev/null
NYDUS_CONVERT_S=$(secs "$t0" "$(now)")
rm -rf "$B/nydus-work"
read -r VI_S VI_RSS < <(timed "$VMDISK" index "$REG/peers/disk:gzip")
GZ_DIGEST=$(skopeo inspect --raw --tls-verify=false "docker://$REG/peers/disk:gzip" | sha256sum | cut -d' ' -f1)
referrers=$(curl -sf -H 'Accept: application/vnd.oci.image.index.v1+json' "http://$REG/v2/peers/disk/manifests/sha256-$GZ_DIGEST" |
  python3 -c 'import json,sys; print(" ".join(sorted(m.get("artifactType", "?") for m in json.load(sys.stdin)["manifests"])))')
echo "referrers of the gzip image: $referrers" >&2
case "$referrers" in *vmdisk*) ;; *) echo "vmdisk's index should be a referrer of the gzip image"; exit 1 ;; esac
soci_kinds=$(curl -sf -H 'Accept: application/vnd.oci.image.index.v1+json' "http://$REG/v2/peers/disk/manifests/soci" |
  python3 -c 'import json,sys; print(" ".join(sorted(m.get("artifactType", m["mediaType"]) for m in json.load(sys.stdin)["manifests"])))')
echo "the SOCI image's index holds: $soci_kinds" >&2
case "$soci_kinds" in *soci*) ;; *) echo "the converted image should hold a SOCI index manifest"; exit 1 ;; esac

# nydusd raises its open-file limit to 1 000 000 at start, as root on a node may; where the
# hard limit cannot be raised (a container without CAP_SYS_RESOURCE, as this bench's machine)
# it is started with `--rlimit-nofile 0` (keep the limit) instead of failing.
NYDUSD=$PEERS/nydus-rs/bin/nydusd
if ! prlimit --nofile=1000000:1000000 true 2> /dev/null; then
  printf '#!/bin/sh\nexec %s "$@" --rlimit-nofile 0\n' "$NYDUSD" > "$B/nydusd"
  chmod +x "$B/nydusd"
  NYDUSD=$B/nydusd
fi

# A fresh node: containerd 1.6 pulling through SNAPSHOTTER (soci, stargz, nydus, vmdisk or
# overlayfs) into DIR, background fetch BACKGROUND (off or on), plain http to the registry.
node() {  # node DIR SNAPSHOTTER BACKGROUND
  local dir=$1 kind=$2 bg=$3 sock="" name=$2
  mkdir -p "$dir"
  case "$kind" in
    soci|soci-parallel)
      mkdir -p "$dir/soci-lib"
      mount --bind "$dir/soci-lib" /var/lib/soci-snapshotter-grpc
      {
        printf '[content_store]\ntype = "containerd"\ncontainerd_address = "%s"\n' "$dir/containerd.sock"
        [ "$bg" = on ] || printf '[background_fetch]\ndisable = true\n'
        [ "$kind" = soci ] || printf '[pull_modes.parallel_pull_unpack]\nenable = true\n'
      } > "$dir/soci.toml"
      SSL_CERT_FILE=$B/tls/ca.pem "$PEERS/soci-snapshotter-grpc" --address "$dir/sn.sock" --root "$dir/soci" \
        --config "$dir/soci.toml" --log-level warn > "$dir/sn.log" 2>&1 &
      PIDS+=($!); sock=$dir/sn.sock ;;
    stargz|stargz-passthrough)
      {
        printf 'no_background_fetch = %s\n[[resolver.host."%s".mirrors]]\nhost = "%s"\ninsecure = true\n' \
          "$([ "$bg" = on ] && echo false || echo true)" "$PULL" "$PULL"
        [ "$kind" = stargz ] || printf '[fuse]\npassthrough = true\n'
      } > "$dir/stargz.toml"
      "$PEERS/containerd-stargz-grpc" --address "$dir/sn.sock" --root "$dir/stargz" --config "$dir/stargz.toml" --log-level warn > "$dir/sn.log" 2>&1 &
      PIDS+=($!); sock=$dir/sn.sock ;;
    nydus)
      # nydus-snapshotter's shipped fusedev configuration (misc/snapshotter): a nydusd per
      # image, its blob cache, 1 MiB read amplification, the whole image prefetched ("on"),
      # or nothing prefetched ("off"); plain http to the registry. Left out: its cgroup for
      # nydusd (no memory limit by default) and its system socket and metrics.
      cat > "$dir/nydusd.json" <<JSON
{"device": {"backend": {"type": "registry", "config": {"scheme": "http", "timeout": 5, "connect_timeout": 5, "retry_limit": 2}},
            "cache": {"type": "blobcache"}},
 "mode": "direct", "digest_validate": false, "iostats_files": false, "enable_xattr": true, "amplify_io": 1048576,
 "fs_prefetch": {"enable": $([ "$bg" = on ] && echo true || echo false), "threads_count": 8, "merging_size": 1048576, "prefetch_all": true}}
JSON
      cat > "$dir/nydus.toml" <<TOML
version = 1
root = "$dir/nydus"
address = "$dir/sn.sock"
daemon_mode = "dedicated"
[system]
enable = false
[daemon]
nydusd_config = "$dir/nydusd.json"
nydusd_path = "$NYDUSD"
nydusimage_path = "$PEERS/nydus-rs/bin/nydus-image"
fs_driver = "fusedev"
recover_policy = "failover"
failover_policy = "resend"
threads_number = 4
[cgroup]
enable = false
[log]
level = "warn"
log_to_stdout = true
[metrics]
address = ""
TOML
      "$PEERS/containerd-nydus-grpc" --config "$dir/nydus.toml" > "$dir/sn.log" 2>&1 &
      PIDS+=($!); sock=$dir/sn.sock ;;
    vmdisk)
      local hydrate=off
      [ "$bg" = on ] && hydrate=background
      NODE_HYDRATE=$hydrate start_node "$dir" vmdisk "" "$dir/root"
      sock=$dir/vmdisk/vmdisk.sock ;;
    overlayfs) ;;
  esac
  [ -z "$sock" ] || for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
  start_containerd "$dir" "$PULL" "$sock" "$name"
  NODE_SNAPSHOTTER=$name
}

# Pulls IMAGE on the node in DIR and mounts its top layer's snapshot read-only at DIR/mnt; sets
# PULL_S (PullImage seconds), MARK (the registry's mark before the pull), PULL_T0, FILE.
pull_and_mount() {  # pull_and_mount DIR IMAGE CHAIN_ID
  local dir=$1 out
  sync; echo 3 > /proc/sys/vm/drop_caches
  MARK=$(mark); PULL_T0=$(now)
  out=$("$CRI_PULL" --address "$dir/containerd.sock" "$2")
  PULL_S=$(echo "$out" | sed -E 's/.* in ([0-9.]+) s$/\1/')
  mkdir -p "$dir/mnt"
  ctr -a "$dir/containerd.sock" -n k8s.io snapshots --snapshotter "$NODE_SNAPSHOTTER" view --mounts bench-view "$3" |
    python3 -c '
import json, subprocess, sys
for m in json.load(sys.stdin):
    m = {k.lower(): v for k, v in m.items()}
    opts = ",".join(m.get("options") or [])
    subprocess.run(["mount", "-t", m["type"], "-o", opts, m["source"], sys.argv[1]], check=True)
' "$dir/mnt"
  FILE=$dir/mnt/disk/disk.qcow2
  [ -f "$FILE" ] || { echo "no disk in the $NODE_SNAPSHOTTER view"; ls -la "$dir/mnt"; tail "$dir"/*.log; exit 1; }
}
# Whether KIND pulls the whole image before the container starts (no lazy loading).
whole_pull() { [ "$1" = overlayfs ] || [ "$1" = soci-parallel ]; }
lazy_check() {  # lazy_check DIR KIND: the layer is served by a FUSE mount under the node
  mountpoint -q "$1/mnt" || { echo "$2: nothing mounted"; exit 1; }
  if ! whole_pull "$2" && ! grep -q " fuse" <(grep -F "$1" /proc/self/mounts); then
    echo "$2: the layer is not served lazily (no FUSE mount under the node): a full pull"; tail -n 20 "$1"/*.log; exit 1
  fi
}
# stop_node DIR: the node's snapshotter and containerd first, then what outlives them by design
# (vmdisk's mount servers, nydusd): stopped the other way round, the vmdisk daemon started a
# successor for each mount server stopped under it (it keeps a mounted layer served), which then
# went on hydrating (the "bg on" node's) through the next node's measurements.
stop_node() {
  unmount_under "$1"
  local p mine=()
  for p in "${PIDS[@]}"; do
    if { tr '\0' ' ' < "/proc/$p/cmdline"; } 2> /dev/null | grep -qF -- "$1/"; then mine+=("$p"); fi
  done
  stop_pids "${mine[@]}"
  stop_mount_servers "$1"
  pkill -KILL -f "nydusd .*$1/" 2> /dev/null || true
  unmount_under "$1"
  ! pgrep -f -- "$1/" > /dev/null || { echo "still running under $1:"; pgrep -af -- "$1/"; exit 1; }
  if [ -d "$1/soci-lib" ]; then umount -l /var/lib/soci-snapshotter-grpc; fi
  # The logs stay (small), for reading what a node did.
  mkdir -p "$B/logs/${1##*/}"; find "$1" -name '*.log' -size -10M -exec cp {} "$B/logs/${1##*/}/" \;
  rm -rf "$1"  # each node holds up to two copies of the disk: a whole run's would not fit
}
until_10s() { python3 -c "import time; time.sleep(max(0.0, 10 - (time.time() - $PULL_T0)))"; }

# measure LABEL KIND IMAGE CHAIN_ID RUN: appends one line of figures for LABEL (KIND on IMAGE)
# to $B/figures: label ready_s bytes_10s bytes_10s_bg r64_s r64_gets miss_ms r4_s r4_bytes
# full_MBps warm_s warm_bytes first_warm_s r64_registry_gets.
measure() {
  local label=$1 kind=$2 image=$3 diff=$4 run=$5 d m t0
  local ready bytes10 bg r64 r64g r64r miss r4 r4b full warm warmb
  [ -z "$ONLY" ] || [[ " $ONLY " == *" $label "* ]] || return 0
  d=$B/run$run-$label-pull; node "$d" "$kind" off; pull_and_mount "$d" "$image" "$diff"; lazy_check "$d" "$kind"
  ready=$PULL_S; until_10s; bytes10=$(served_since "$MARK")
  # 1% of the file in random 64 KiB reads, one reader: seconds and blob requests.
  m=$(mark); t0=$(now)
  fio --name=r64 --filename="$FILE" --readonly --direct=1 --rw=randread --bs=64k --ioengine=psync \
    --io_size=$((DSIZE / 100 / 65536 * 65536)) --randseed=11 --output-format=terse > /dev/null
  r64=$(secs "$t0" "$(now)"); r64g=$(blob_gets_since "$m"); r64r=$(registry_blob_gets_since "$m")
  stop_node "$d"
  # Background fetch on: bytes within 10 s of the pull.
  if whole_pull "$kind"; then
    bg=$bytes10
  else
    d=$B/run$run-$label-bg; node "$d" "$kind" on; pull_and_mount "$d" "$image" "$diff"
    until_10s; bg=$(served_since "$MARK")
    stop_node "$d"
  fi
  # One cold 4 KiB read at a time (O_DIRECT, 40 random offsets): the median's milliseconds.
  d=$B/run$run-$label-r4; node "$d" "$kind" off; pull_and_mount "$d" "$image" "$diff"; until_10s
  miss=$(python3 - "$FILE" <<'PY'
import mmap, os, random, statistics, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)
size = os.fstat(fd).st_size
buf = mmap.mmap(-1, 4096)
random.seed(5)
took = []
for _ in range(40):
    offset = random.randrange(0, size - 4096) // 4096 * 4096
    t = time.monotonic()
    os.preadv(fd, [buf], offset)
    took.append((time.monotonic() - t) * 1000)
print(f"{statistics.median(took):.1f}")
PY
)
  # 1% of the file in random 4 KiB reads, 16 readers (a guest with queue depth).
  m=$(mark); t0=$(now)
  fio --name=r4 --filename="$FILE" --readonly --direct=1 --rw=randread --bs=4k --ioengine=psync --numjobs=16 \
    --io_size=$((DSIZE / 100 / 16 / 4096 * 4096)) --group_reporting --output-format=terse > /dev/null
  r4=$(secs "$t0" "$(now)"); r4b=$(served_since "$m")
  stop_node "$d"
  # The whole file read in order (the KubeVirt checksum), then again warm (page cache dropped).
  d=$B/run$run-$label-full; node "$d" "$kind" off; pull_and_mount "$d" "$image" "$diff"; until_10s
  # (a full pull's time to the whole disk includes its pull)
  t0=$(now); dd if="$FILE" of=/dev/null bs=4M status=none
  local took; took=$(secs "$t0" "$(now)")
  ! whole_pull "$kind" || took=$(python3 -c "print($took + $PULL_S)")
  full=$(python3 -c "print(f'{$DSIZE / 1e6 / $took:.1f}')")
  # What a complete layer sets off (vmdisk checks it against its diff_id, then hands the file
  # to the kernel) settles first.
  # Read twice, page cache dropped before each: the first read of a file written moments ago
  # varies 0.3-1.5 s on this machine's virtual disk for any writer (a plain file written in
  # pieces shows it too); the second is the snapshotter's read path.
  sleep 5
  local first
  m=$(mark)
  sync; echo 3 > /proc/sys/vm/drop_caches
  t0=$(now); dd if="$FILE" of=/dev/null bs=4M status=none; first=$(secs "$t0" "$(now)")
  sync; echo 3 > /proc/sys/vm/drop_caches
  t0=$(now); dd if="$FILE" of=/dev/null bs=4M status=none; warm=$(secs "$t0" "$(now)")
  warmb=$(served_since "$m")
  stop_node "$d"
  echo "$label $ready $bytes10 $bg $r64 $r64g $miss $r4 $r4b $full $warm $warmb $first $r64r" >> "$B/figures"
  echo "run $run: $label $ready $bytes10 $bg $r64 $r64g $miss $r4 $r4b $full $warm $warmb $first $r64r" >&2
}

GZ=$(chain_id gzip) ES=$(chain_id estargz) OWN=$(chain_id lazy) OWN128=$(chain_id lazy128k)
NYDUS=$(chain_id nydus)
for run in $(seq "$RUNS"); do
  measure soci soci "$PULL/peers/disk:soci" "$GZ" "$run"
  measure stargz stargz "$PULL/peers/disk:estargz" "$ES" "$run"
  measure stargz-passthrough stargz-passthrough "$PULL/peers/disk:estargz" "$ES" "$run"
  measure nydus nydus "$PULL/peers/disk:nydus" "$NYDUS" "$run"
  measure vmdisk-index vmdisk "$PULL/peers/disk:gzip" "$GZ" "$run"
  measure vmdisk-estargz vmdisk "$PULL/peers/disk:estargz" "$ES" "$run"
  measure vmdisk-own vmdisk "$PULL/peers/disk:lazy" "$OWN" "$run"
  measure vmdisk-own-128k vmdisk "$PULL/peers/disk:lazy128k" "$OWN128" "$run"
  measure soci-parallel soci-parallel "$PULL/peers/disk:gzip" "$GZ" "$run"
  measure full-pull overlayfs "$PULL/peers/disk:gzip" "$GZ" "$run"
done

{
  echo
  echo "Peers ($GIB GiB-virtual qcow2, file $DSIZE bytes; $LAYOUT_TEXT; containerd 1.6 CRI;"
  echo "medians of $RUNS fresh-node runs, [min-max]; bytes and requests at the registry and its blob host; peers: $VERSIONS):"
  echo "  index build from the registry: soci (ctr pull + soci-convert + ctr push) $SOCI_INDEX_S s; vmdisk index $VI_S s, peak RSS $((VI_RSS / 1024)) MiB"
  echo "  nydus conversion of the pulled image (nydus-convert + ctr push): $NYDUS_CONVERT_S s"
  python3 - "$B/figures" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    rows.setdefault(f[0], []).append([float(x) for x in f[1:]])
MB = 1e6
# (heading, column, scale, format, better): "low" time/bytes/requests, "high" throughput
cols = [("ready s", 0, 1, "{:.2f}", "low"), ("MB ≤10 s", 1, MB, "{:.2f}", "low"),
        ("bg on", 2, MB, "{:.0f}", None), ("64K s", 3, 1, "{:.1f}", "low"),
        ("64K GETs", 4, 1, "{:.0f}", "low"), ("64K API", 12, 1, "{:.0f}", "low"),
        ("miss ms", 5, 1, "{:.1f}", "low"),
        ("4K×16 s", 6, 1, "{:.1f}", "low"), ("4K MB", 7, MB, "{:.0f}", "low"),
        ("full MB/s", 8, 1, "{:.1f}", "high"), ("warm s", 9, 1, "{:.2f}", "low"),
        ("warm MB", 10, MB, "{:.2f}", "low"), ("1st warm s", 11, 1, "{:.2f}", None)]
med = {k: [statistics.median(r[i] for r in v) for i in range(len(v[0]))] for k, v in rows.items()}
def cell(k, c):
    return c[3].format(med[k][c[1]] / c[2])
def span(k, c):
    vals = [r[c[1]] / c[2] for r in rows[k]]
    return c[3].format(min(vals)) + "-" + c[3].format(max(vals))
print("  " + f"{'':26}" + "".join(f"{c[0]:>11}" for c in cols))
for k in rows:
    print("  " + f"{k:26}" + "".join(f"{cell(k, c):>11}" for c in cols))
if len(next(iter(rows.values()))) > 1:
    print("  ranges:")
    for k in rows:
        print("  " + f"{k:26}" + "  ".join(f"{c[0]} {span(k, c)}" for c in cols))
# Each vmdisk row against the peer on the same image and against the best peer of all;
# below 1 is ahead (for throughput: the peer's over vmdisk's).
same = {"vmdisk-index": "soci", "vmdisk-estargz": "stargz"}
peers = [k for k in ("soci", "stargz", "stargz-passthrough", "nydus") if k in med]
def ratio(k, p, c):
    a, b = med[k][c[1]], med[p][c[1]]
    if c[4] is None or a == 0 and b == 0:
        return "-"
    if c[4] == "high":
        return f"{b / a:.2f}" if a else "-"
    return f"{a / b:.2f}" if b else ("0 B" if a == 0 else "inf")
for k in (k for k in med if k.startswith("vmdisk")):
    if same.get(k) in med:
        print("  " + f"{k + ' / ' + same[k]:26}" + "".join(f"{ratio(k, same[k], c):>11}" for c in cols))
    best = []
    for c in cols:
        if c[4] is None or not peers:
            best.append("-")
            continue
        pick = (max if c[4] == "high" else min)(peers, key=lambda p: med[p][c[1]])
        best.append(ratio(k, pick, c))
    print("  " + f"{k + ' / best peer':26}" + "".join(f"{r:>11}" for r in best))
PY
} | tee -a "$RESULTS"
