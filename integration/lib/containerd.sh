# Sourced by demo.sh and the bench scripts (which keep started pids in the PIDS array): a
# registry, containerd and a node started as the integration tests start them (integration/lab.rs
# runs the tests' fixtures: one implementation), the links and CDN in front of a registry,
# stopping mount servers, and the test disks they publish.

LAB=${LAB:-$PWD/target/release/examples/lab}
# lab PART ARGS...: starts PART with integration/lab.rs, sets what it prints (REG, LAB_PID) and
# keeps its pid in PIDS.
lab() {
  local out
  out=$("$LAB" "$@") || { echo "lab $1 failed" >&2; return 1; }
  eval "$out"
  PIDS+=("$LAB_PID")
}
# stop_pids PID...: SIGTERM to each, then waits until they are gone (they are not this shell's
# children: the lab started them), SIGKILL after 10 s.
stop_pids() {
  [ $# -gt 0 ] || return 0
  kill "$@" 2>/dev/null || true
  for _ in $(seq 100); do
    local alive=0 p
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 1 ] || return 0
    sleep 0.1
  done
  kill -KILL "$@" 2>/dev/null || true
}

# bench_scratch NAME: what every bench script starts with: its scratch directory B
# (scratch/bench-NAME-XXXXXX), the pids it starts (PIDS), the results file (RESULTS), and at
# exit bench_cleanup.
bench_scratch() {
  mkdir -p scratch/bench
  RESULTS=$PWD/scratch/bench/results.txt
  B=$(mktemp -d "$PWD/scratch/bench-$1-XXXXXX")
  PIDS=()
  trap 'status=$?; bench_cleanup || true; exit $status' EXIT
}
# bench_cleanup: the script's own bench_cleanup_first (if it defines one), then stops what runs
# under $B (qemu, PIDS, anything configured under $B, mount servers), unmounts everything below
# it and removes it (kept with BENCH_KEEP set).
bench_cleanup() {
  ! declare -F bench_cleanup_first > /dev/null || bench_cleanup_first
  pkill -f "qemu-system-x86_64 .*$B" 2>/dev/null || true
  stop_pids "${PIDS[@]}"
  # What the lab started in a subshell (a `$(...)` measurement) is not in PIDS: every process
  # configured under $B goes too.
  stop_pids $(pgrep -f -- "--config $B/" || true)
  wait 2>/dev/null || true
  stop_mount_servers "$B"
  unmount_under "$B"
  [ -n "${BENCH_KEEP:-}" ] || rm -rf "$B"
}
# unmount_under DIR: lazily unmounts every mount at or below DIR, deepest first.
unmount_under() {
  { grep -o " $1[^ ]*" /proc/self/mounts || true; } | sort -r | while read -r m; do umount -l "$m" 2> /dev/null || true; done
}
now() { date +%s.%N; }
secs() { python3 -c "print(f'{$2 - $1:.2f}')"; }
# json FILE KEY: KEY's value in the JSON object in FILE.
json() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
# mark, served_since MARK: the registry of $B's log position, and the GET body bytes it served
# since (registry_mark, registry_bytes_since).
mark() { registry_mark "$B"; }
served_since() { registry_bytes_since "$B" "$1"; }
# start_containerd DIR REGISTRY SNAPSHOTTER_SOCK|"" [NAME] [EXTRA_TOML]: containerd 1.6 with its
# CRI plugin in DIR (socket DIR/containerd.sock), plain HTTP to the loopback REGISTRY, and the
# proxy snapshotter at SNAPSHOTTER_SOCK (called NAME, vmdisk by default) as the CRI snapshotter
# (containerd's overlayfs when empty); EXTRA_TOML is appended to the configuration. Returns when
# its CRI answers.
start_containerd() {
  local args=(containerd "$1" --mirror "$2" --extra "${5:-}")
  [ -z "$3" ] || args+=(--snapshotter "$3" --name "${4:-vmdisk}")
  lab "${args[@]}"
}

# stop_mount_servers DIR: mount servers outlive their daemon by design; stop the ones started
# with a configuration under DIR (each unmounts and exits on SIGTERM).
stop_mount_servers() {
  pkill -TERM -f "serve-layer --config $1" 2>/dev/null || true
  for _ in $(seq 50); do pgrep -f "serve-layer --config $1" > /dev/null || return 0; sleep 0.1; done
  pkill -KILL -f "serve-layer --config $1" 2>/dev/null || true
}

# publish_lazy_and_gzip DISK LAZY_REF GZIP_REF: pushes DISK with `vmdisk push` (lazy) and, as
# KubeVirt users publish containerDisks today, as /disk/<name> in a gzip layer with skopeo.
# Needs $VMDISK; works in a scratch directory beside DISK.
publish_lazy_and_gzip() {
  local disk=$1 work
  work=$(mktemp -d "$(dirname "$disk")/publish-XXXXXX")
  "$VMDISK" push "$disk" "$2" > /dev/null
  mkdir -p "$work/root/disk"
  ln "$disk" "$work/root/disk/$(basename "$disk")"
  tar --owner=107 --group=107 -C "$work/root" -cf "$work/layer.tar" disk
  python3 packaging/oci-layout.py "$work/layout" "$work/layer.tar"
  skopeo copy --quiet --dest-tls-verify=false --dest-compress-format gzip "oci:$work/layout:latest" "docker://$3"
  rm -rf "$work"
}

# random_qcow2 DISK MIB: a qcow2 of MIB MiB fully written with random data (file = virtual
# size), written in 256 MiB pieces.
random_qcow2() {
  local disk=$1 mib=$2 at step
  qemu-img create -q -f qcow2 "$disk" "${mib}M"
  for ((at = 0; at < mib; at += 256)); do
    step=$((mib - at < 256 ? mib - at : 256))
    head -c "${step}M" /dev/urandom > "$disk.piece"
    qemu-io -c "write -s $disk.piece ${at}M ${step}M" "$disk" > /dev/null
  done
  rm -f "$disk.piece"
}

# free_port: a free TCP port on loopback.
# boot_workload FILE PERCENT: a qemu-io script reading PERCENT% of a 2 GiB guest's 64 KiB
# clusters at scattered offsets (seeded: the same set every run), a boot-like read set.
boot_workload() {
  python3 - "$1" "$2" <<'PY'
import random, sys
random.seed(2026)
clusters = (2 << 30) // 65536
picks = random.sample(range(clusters), clusters * int(sys.argv[2]) // 100)
with open(sys.argv[1], "w") as f:
    for c in picks:
        f.write(f"read -q {c * 65536} 65536\n")
PY
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start_registry DIR [REALM]: a registry (CNCF distribution) on a free loopback port storing in
# DIR/registry, logging each request with its response size to DIR/registry.log; sets REG and
# REG_PID. With
# REALM it answers a request without a token with the challenge public registries send (401,
# Bearer realm=REALM) and takes any token (distribution's "silly" access control): a token
# service such as start_token_service's hands them out to anyone, as for a public image.
start_registry() {
  lab registry "$1" ${2:+--realm "$2"}
  REG_PID=$LAB_PID
}

# start_token_service DIR: an anonymous token service on a free loopback port (any GET gets a
# token for 5 minutes, as a public registry's does for a public image); sets TOKENS to its
# host:port. Logs to DIR/tokens.log.
start_token_service() {
  TOKENS=127.0.0.1:$(free_port)
  python3 - "${TOKENS#*:}" > "$1/tokens.log" 2>&1 <<'PY' &
import http.server, sys
class Tokens(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"token": "anonymous", "access_token": "anonymous", "expires_in": 300}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Tokens).serve_forever()
PY
  PIDS+=($!)
  for _ in $(seq 100); do curl -sf "http://$TOKENS/token" > /dev/null && break; sleep 0.1; done
}

# start_cluster_link DIR UPSTREAM: the shaped "cluster" link to UPSTREAM (20 ms round trip,
# 200 Mbit/s; examples/shaped-link.rs, needs $RELAY); sets CLUSTER to its host:port.
start_cluster_link() {
  CLUSTER=127.0.0.1:$(free_port)
  "$RELAY" "$CLUSTER" "$2" 20 200 > "$1/relay.out" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 100); do grep -q listening "$1/relay.out" && break; sleep 0.05; done
}

# start_internet_registry DIR [REALM]: the registry as public registries run (docs/registry.md#redirects):
# the registry (start_registry DIR REALM) behind a front that answers its blob GETs with a 307
# to a blob host, a signed URL good for CDN_LIFETIME (300) seconds that refuses the registry's
# credentials (examples/blob-cdn.rs, $CDN), the front behind a link of API_RTT (80) ms and the
# blob host behind one of BLOB_RTT (10) ms — the registry's API far, the CDN's edge near — each
# LINK_MBIT (200) Mbit/s. Sets REG (the registry itself, on loopback: publish there), API (the
# front's link: what nodes pull from), BLOBS (the blob host's link) and CDN_STATS (the URL of the
# front's and blob host's counts, as JSON).
start_internet_registry() {
  start_registry "$1" "${2:-}"
  local front blob
  front=127.0.0.1:$(free_port)
  blob=127.0.0.1:$(free_port)
  BLOBS=127.0.0.1:$(free_port)
  API=127.0.0.1:$(free_port)
  "$CDN" "$front" "$blob" "http://$REG" "$1/registry" "http://$BLOBS" "${CDN_LIFETIME:-300}" > "$1/cdn.out" 2>&1 &
  PIDS+=($!)
  "$RELAY" "$BLOBS" "$blob" "${BLOB_RTT:-10}" "${LINK_MBIT:-200}" > "$1/blob-link.out" 2>&1 &
  PIDS+=($!)
  "$RELAY" "$API" "$front" "${API_RTT:-80}" "${LINK_MBIT:-200}" > "$1/api-link.out" 2>&1 &
  PIDS+=($!)
  for f in cdn.out blob-link.out api-link.out; do
    for _ in $(seq 100); do grep -q listening "$1/$f" && break; sleep 0.05; done
  done
  CDN_STATS=http://$blob/_cdn/stats
}
# cdn_count KEY: one of the counts start_internet_registry's front and blob host keep.
cdn_count() { curl -sf "$CDN_STATS" | python3 -c "import json,sys; print(json.load(sys.stdin)[sys.argv[1]])" "$1"; }

# start_origin DIR [REALM]: the registry the nodes pull from, laid out as $LAYOUT says:
#   redirect (the default)  as public registries run: start_internet_registry (the API 80 ms
#                           away redirecting blobs to a blob host 10 ms away);
#   itself                  a registry serving blobs itself behind the cluster link (20 ms), as
#                           the lab was before.
# Sets REG (the registry on loopback: publish there), PULL (what nodes pull from), PULL_PIDS
# (the links' and servers' pids, for CPU accounting) and LAYOUT_TEXT (the layout, for tables).
start_origin() {
  case ${LAYOUT:=redirect} in
  redirect)
    start_internet_registry "$1" "${2:-}"
    PULL=$API
    PULL_PIDS="${PIDS[*]: -3}"
    LAYOUT_TEXT="registry API ${API_RTT:-80} ms away redirecting blobs to a blob host ${BLOB_RTT:-10} ms away, ${LINK_MBIT:-200} Mbit/s each"
    ;;
  itself)
    start_registry "$1" "${2:-}"
    start_cluster_link "$1" "$REG"
    PULL=$CLUSTER
    PULL_PIDS="${PIDS[*]: -1}"
    LAYOUT_TEXT="registry serving blobs itself behind the cluster link (20 ms, 200 Mbit/s)"
    ;;
  *) echo "LAYOUT is redirect or itself, not $LAYOUT" >&2; return 1 ;;
  esac
}
# origin_mark DIR, then origin_bytes_since DIR MARK: the body bytes the origin (the registry of
# DIR and, on the redirect layout, its blob host) sent since the mark.
origin_mark() {
  if [ -n "${CDN_STATS:-}" ]; then
    echo "$(registry_mark "$1"):$(cdn_count blob_bytes)"
  else
    echo "$(registry_mark "$1"):0"
  fi
}
origin_bytes_since() {
  local reg=${2%%:*} blobs=${2##*:} now=0
  [ -z "${CDN_STATS:-}" ] || now=$(cdn_count blob_bytes)
  echo $(($(registry_bytes_since "$1" "$reg") + now - blobs))
}

# registry_mark DIR, then registry_bytes_since DIR MARK: the bytes of the GET responses the
# registry of DIR logged since the mark (it logs a request just after answering it).
registry_mark() { wc -c < "$1/registry.log"; }
registry_bytes_since() {
  sleep 0.3
  tail -c +"$(($2 + 1))" "$1/registry.log" | { grep 'http.request.method=GET' || true; } |
    { grep -o 'http.response.written=[0-9]*' || true; } | cut -d= -f2 | awk '{s+=$1} END {printf "%.0f\n", s}'
}

# start_node DIR NAME [EXTRA] [CONTAINERD_ROOT]: vmdisk-snapshotter with its own root DIR/NAME (a
# node with a cold cache): snapshots socket DIR/NAME/vmdisk.sock, management socket
# DIR/NAME/manage.sock, log DIR/NAME/vmdisk.log (info); EXTRA (TOML) is appended to its
# configuration; CONTAINERD_ROOT is the root of the containerd that pulls through it (whose
# content store it reads manifests from, as on a node). Needs $SNAPSHOTTER. Its `[cache]
# hydrate` is $NODE_HYDRATE, `off` unless set: the benches and the demo measure what a boot or a
# pull fetches and how long it takes, and background hydration (the daemon's default) would
# fetch the rest meanwhile and share the link; benches/baddays.sh measures what it costs.
# $NODE_TOP: top-level settings added to its configuration.
start_node() {
  local dir=$1/$2
  lab node "$dir" --program "$SNAPSHOTTER" --containerd-root "${4:-$dir/no-containerd}" \
    --top "${NODE_TOP:-}" --extra "[cache]
hydrate = \"${NODE_HYDRATE:-off}\"
${3:-}"
}
