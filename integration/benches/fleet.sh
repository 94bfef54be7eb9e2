#!/usr/bin/env bash
# A fleet booting one disk at once through the caches users run, with the nodes' default
# configuration (part of `make bench`; docs/fleet.md): N nodes (`vmdisk mount` processes run as
# the snapshotter runs a layer by default — background hydration at 50 MB/s — each with its own
# cache, started and timed by integration/benches/fleet-driver.py) boot at the same moment — 50
# scattered 64 KiB reads of a qcow2 holding FLEET_MIB (128) MiB of random data, each compared
# with the disk published — and go on until each holds the whole disk; the origin laid out as
# $LAYOUT says (start_origin in integration/lib/containerd.sh: by default as public registries are,
# the API 80 ms away redirecting blobs to a blob host 10 ms away, 200 Mbit/s each; LAYOUT=itself:
# the registry serving blobs itself behind the shaped cluster link, 20 ms, 200 Mbit/s), through:
#   none           no mirror: every node asks the origin;
#   nginx          the shipped slice cache (config/nginx-regional-cache.conf) as the mirror;
#   dist-first     CNCF distribution in pull-through mode as the hosts.toml mirror, cold, met by
#                  fresh nodes (what they learn of it, they learn in the run);
#   nginx-preheat  the slice cache warmed by `vmdisk preheat` before the rollout (the preheat's
#                  own cost is printed apart);
#   late-alone     one node alone through a cold slice cache, reading another boot set;
#   nginx-late     N-1 nodes boot through the slice cache, and once they have booted (while they
#                  hydrate) the last node boots the late-alone boot set: "late boot s";
#   full-*         each node downloads the disk's whole blob through none / dist / nginx instead:
#                  what a pull costs the same fleet (not run unless named in FLEET_MODES).
# For each: the origin's body bytes (the registry's and its blob host's; and as multiples of the
# blob B), the registry's GETs of the disk's blob (each redirected, on the redirect layout) and
# its other requests, the nodes' boot times (start to boot set read: p50, p99; "p99 own
# cpu": less what each node's threads waited for a CPU, i.e. on a machine of its own; "mount
# p99": start to the disk file's appearing, the image resolved through the mirror), the time
# from the start until every node was hydrated, wrong reads, and the CPU seconds the nodes, the
# cache and the harness (relay, origin, driver) used, to show when two cores are the limit.
# FLEET_NODES ("1 20 100"), FLEET_MODES, FLEET_ORIGIN (token, open: above), FLEET_SLICE (another slice size for nginx),
# FLEET_FULL_MAX (10: the largest fleet a link-bound full pull is run for), BASE_BIN (another
# build's vmdisk, run as a mode "before" through the slice cache).
set -euo pipefail
cd "$(dirname "$0")/../.."
VMDISK=${VMDISK:-$PWD/target/release/vmdisk}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
CDN=${CDN:-$PWD/target/release/examples/blob-cdn}
MIB=${FLEET_MIB:-128}
source integration/lib/containerd.sh
bench_scratch fleet
# The origin asks for a token, as public registries (Docker Hub, ghcr.io, quay.io) do, its token
# service behind a link of its own; FLEET_ORIGIN=open: one that asks for none, as some private
# registries (distribution's pull-through cache then asks the origin's /v2/ before every request
# it passes on, one at a time: docs/fleet.md).
REALM=
if [ "${FLEET_ORIGIN:-token}" = token ]; then
  mkdir -p "$B/tokens"
  start_token_service "$B/tokens"
  start_cluster_link "$B/tokens" "$TOKENS"
  REALM=http://$CLUSTER/token
fi
start_origin "$B" "$REALM"
ORIGIN=$REG
random_qcow2 "$B/fleet.qcow2" "$MIB"
"$VMDISK" push "$B/fleet.qcow2" "$ORIGIN/vm/fleet:1" > /dev/null
# Two boot sets: the fleet's, and the late node's (other places of the disk's file).
python3 - "$B/reads" "$B/late-reads" "$MIB" <<'PY'
import random, sys
random.seed(7)
pieces = random.sample(range((int(sys.argv[3]) << 20) // 65536), 100)
for name, part in ((sys.argv[1], pieces[:50]), (sys.argv[2], pieces[50:])):
    with open(name, "w") as f:
        for o in part:
            f.write(f"{o * 65536}\n")
PY

# mirror MODE DIR: a fresh regional cache of the origin (through the link) for MODE; sets
# MPORT and MIRROR_PID. dist-*: CNCF distribution in pull-through mode; nginx: the shipped slice
# cache (config/nginx-regional-cache.conf, slice $FLEET_SLICE if set).
mirror() {
  MPORT=$(free_port)
  mkdir -p "$2/storage"
  case $1 in
  *nginx)
    integration/lib/regional-cache.sh "$2/nginx" "$PULL" "$MPORT" ${FLEET_SLICE:-} > "$2/mirror.log" 2>&1 &
    ;;
  *)
    local origin=$REG
    lab registry "$2/mirror" --data "$2/storage" --extra "proxy: { remoteurl: \"http://$PULL\" }"
    MPORT=${REG##*:} REG=$origin MIRROR_PID=$LAB_PID
    return
    ;;
  esac
  PIDS+=($!)
  MIRROR_PID=$!
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$MPORT/v2/" > /dev/null && break; sleep 0.1; done
}

# run MODE N: prints one row (see the table's header). full-* modes download the whole blob
# on each node (a pull) instead of mounting it.
run() {
  local mode=$1 n=$2 dir=$B/run-$1-$2 bin=$VMDISK
  [ "$mode" = before ] && bin=$BASE_BIN/vmdisk
  mkdir -p "$dir/hosts"
  local via=$PULL args=() watch=(--watch "origin=$ORIGIN_PID")
  for p in $PULL_PIDS; do watch+=(--watch "link=$p"); done
  if [ "${mode#full-}" != none ] && [ "$mode" != none ]; then
    case $mode in before | *late* | *preheat) mirror nginx "$dir" ;; *) mirror "$mode" "$dir" ;; esac
    via=127.0.0.1:$MPORT
    watch+=(--watch "cache=$MIRROR_PID")
    mkdir -p "$dir/hosts/$PULL"
    printf 'server = "http://%s"\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' "$PULL" "$via" > "$dir/hosts/$PULL/hosts.toml"
  fi
  case $mode in
  full-*) args+=(--full "http://$via/v2/vm/fleet/blobs/$BLOB") ;;
  *) args+=(--vmdisk "$bin" --reference "$PULL/vm/fleet:1" --hosts-dir "$dir/hosts" --expect "$B/fleet.qcow2") ;;
  esac
  case $mode in
  late-alone) args+=(--late --late-reads "$B/late-reads") ;;
  nginx-late) args+=(--late --late-reads "$B/late-reads") ;;
  esac
  local preheat_mb=-
  if [ "$mode" = nginx-preheat ]; then
    local p; p=$(origin_mark "$B")
    "$bin" preheat --hosts-dir "$dir/hosts" "$PULL/vm/fleet:1" > "$dir/preheat.out"
    preheat_mb=$(python3 -c "print(f'{$(origin_bytes_since "$B" "$p") / 1e6:.1f}')")
  fi
  local m; m=$(origin_mark "$B") redirected=-
  [ "$LAYOUT" != redirect ] || redirected=$(cdn_count registry_blob_requests)
  # In the background, so an interrupted bench stops it (and it its nodes) with the rest.
  python3 integration/benches/fleet-driver.py "$dir" "$n" --reads "$B/reads" "${args[@]}" "${watch[@]}" > "$dir/result.json" &
  PIDS+=($!)
  wait $!
  # A mirror that started filling the blob keeps fetching it after the nodes are done: wait
  # (at most 2 minutes) until it holds it, so what it cost the origin is counted.
  if [ -d "$dir/storage" ] && [ -n "$(find "$dir/storage" -path '*/_uploads/*' -name data 2>/dev/null)" ]; then
    for _ in $(seq 600); do
      [ -z "$(find "$dir/storage" -path '*/_uploads/*' -name data 2>/dev/null)" ] && break
      sleep 0.2
    done
  fi
  local bytes; bytes=$(origin_bytes_since "$B" "$m")
  [ "$redirected" = - ] || redirected=$(($(cdn_count registry_blob_requests) - redirected))
  tail -c +"$((${m%%:*} + 1))" "$B/registry.log" | grep -o '"[A-Z]* /v2/[^ ]*' > "$dir/origin-requests" || true
  [ -z "${MIRROR_PID:-}" ] || kill "$MIRROR_PID" 2>/dev/null || true
  MIRROR_PID=
  # The nodes' caches (N x the disk) and the mirror's go: 100 nodes of 4 modes would not fit.
  rm -rf "$dir"/node*/cache "$dir/storage" "$dir/nginx/cache"
  python3 - "$mode" "$n" "$bytes" "$dir" "$BLOB" "$BLOB_SIZE" "$preheat_mb" "$redirected" <<'PY'
import json, sys
mode, n, nbytes, d, blob, size, preheat, redirected = sys.argv[1:]
r = json.load(open(d + "/result.json"))
reqs = [l.strip().lstrip('"') for l in open(d + "/origin-requests")]
gets = sum(1 for q in reqs if q.startswith("GET ") and q.endswith("/blobs/" + blob))
other = len(reqs) - gets
if redirected != "-":
    # The front asks the registry a HEAD of each blob it redirects: not the clients' requests.
    other -= sum(1 for q in reqs if q.startswith("HEAD ") and "/blobs/" in q)
    gets = int(redirected)
ok = sorted(t for t in r["times"] if t is not None)
def rank(p, ok=ok):
    return ok[min(len(ok) - 1, max(0, -(-len(ok) * p // 100) - 1))] if ok else float("nan")
# Each node's time less what its threads waited for a CPU: the node on a machine of its own.
own = sorted(t - w for t, w in zip(r["times"], r["cpu_waits"]) if t is not None)
mounts = sorted(t for t in r["mounted"] if t is not None)
c = r["cpu"]
harness = c.get("link", 0) + c.get("origin", 0) + c["driver"]
hydrated = [t for t in r.get("hydrated", []) if t is not None]
all_hydrated = f"{max(hydrated):.1f}" if hydrated and len(hydrated) == len(r["times"]) else "-"
late = f"{r['late']:.2f}" if r.get("late") is not None else "-"
print(f"{mode} {n} {int(nbytes) / 1e6:.1f} {int(nbytes) / int(size):.2f} {gets} {other} "
      f"{rank(50):.2f} {rank(99):.2f} {rank(99, own):.2f} {rank(99, mounts):.2f} "
      f"{all_hydrated} {late} "
      f"{r.get('wrong', 0)} {len(r['times']) - len(ok)} {preheat} {c['nodes']} "
      f"{c.get('cache', 0)} {harness:.1f} {r['wall']}")
PY
}

read -r BLOB BLOB_SIZE < <(curl -s -H 'Authorization: Bearer anonymous' -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://$ORIGIN/v2/vm/fleet/manifests/1" |
  python3 -c 'import json, sys; l = max(json.load(sys.stdin)["layers"], key=lambda l: l["size"]); print(l["digest"], l["size"])')
ORIGIN_PID=$REG_PID
MODES=${FLEET_MODES:-none nginx dist-first nginx-preheat late-alone nginx-late}
[ -z "${BASE_BIN:-}" ] || MODES="$MODES before"
# A full pull with no cache or through distribution sends the whole blob over the origin link
# once per node (distribution streams every concurrent miss from the origin): N x the blob at
# 200 Mbit/s, not run above FLEET_FULL_MAX nodes.
FULL_MAX=${FLEET_FULL_MAX:-10}
ROWS=()
for N in ${FLEET_NODES:-1 20 100}; do
  for MODE in $MODES; do
    case $MODE in full-none | full-dist) [ "$N" -le "$FULL_MAX" ] || continue ;; esac
    # The late node's cases: one node alone, and a fleet of 20.
    case $MODE in late-alone) [ "$N" = 1 ] || continue ;; nginx-late) [ "$N" = 20 ] || continue ;; esac
    ROWS+=("$(run "$MODE" "$N")")
  done
done
{
  echo
  echo "A fleet booting one disk at once and hydrating it, the nodes' default configuration ($MIB MiB of random data, blob B = $((BLOB_SIZE / 1000000)) MB; 50 scattered 64 KiB reads per node, each checked; full-*: each node downloads the whole blob), origin: $LAYOUT_TEXT, ${FLEET_ORIGIN:-token} origin, same run; hydrated s: from the start until every node held the whole disk; late: the late node's boot; preheat MB: what the preheat cost the origin before the rollout; CPU seconds of the nodes, the cache and the harness (link relay, origin, driver):"
  printf '  %-13s %5s %10s %6s %9s %9s %7s %7s %12s %12s %10s %7s %6s %6s %10s %9s %9s %11s %7s\n' mode nodes "origin MB" "x B" "blob GETs" "other req" "p50 s" "p99 s" "p99 own cpu" "mount p99 s" "hydrated s" "late s" wrong failed "preheat MB" "node cpu" "cache cpu" "harness cpu" "wall s"
  for row in "${ROWS[@]}"; do
    # shellcheck disable=SC2086
    printf '  %-13s %5s %10s %6s %9s %9s %7s %7s %12s %12s %10s %7s %6s %6s %10s %9s %9s %11s %7s\n' $row
  done
} | tee -a "$RESULTS"
