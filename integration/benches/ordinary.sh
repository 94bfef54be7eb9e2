#!/usr/bin/env bash
# Ordinary container images through vmdisk (part of `make bench`): a node whose containerd uses
# vmdisk-snapshotter for every image (the shipped setup) against one on containerd's overlayfs,
# same run, both pulling over the shaped cluster link (20 ms, 200 Mbit/s). Images: busybox alone
# (1 layer) and busybox under 9 and 29 more small layers (10, 30), each with Cmd set, fresh for
# every trial (each layer holds a file unique to the trial: nothing is shared or cached). For
# each: CRI PullImage time, the requests each node's containerd and vmdisk made to the registry
# (its request log, by user agent), and the time to start a container of the image
# (`ctr run --rm … /bin/true` on the node's snapshotter). Medians of ORDINARY_TRIALS (3). With
# BASE_BIN (a directory holding another build's vmdisk-snapshotter), a third node runs that build.
set -euo pipefail
cd "$(dirname "$0")/../.."
SNAPSHOTTER=${SNAPSHOTTER:-$PWD/target/release/vmdisk-snapshotter}
CRI_PULL=${CRI_PULL:-$PWD/target/release/examples/cri-pull}
RELAY=${RELAY:-$PWD/target/release/examples/shaped-link}
TRIALS=${ORDINARY_TRIALS:-3}
source integration/lib/containerd.sh
bench_scratch ordinary

start_registry "$B"
start_cluster_link "$B" "$REG"
start_node "$B" node "" "$B/vmdisk-ctd/root"
start_containerd "$B/vmdisk-ctd" "$CLUSTER" "$B/node/vmdisk.sock"
start_containerd "$B/overlay-ctd" "$CLUSTER" ""
NODES="vmdisk overlay"
if [ -n "${BASE_BIN:-}" ]; then
  SNAPSHOTTER=$BASE_BIN/vmdisk-snapshotter start_node "$B" before "" "$B/before-ctd/root"
  start_containerd "$B/before-ctd" "$CLUSTER" "$B/before/vmdisk.sock"
  NODES="vmdisk overlay before"
fi

# image NAME LAYERS TRIAL: publishes $CLUSTER/NAME:TRIAL, busybox and LAYERS-1 layers of 64 KiB
# of random data, every layer with a file naming the trial.
image() {
  local work; work=$(mktemp -d "$B/image-XXXXXX")
  mkdir -p "$work/0/bin"
  cp /bin/busybox "$work/0/bin/busybox"
  ln -s busybox "$work/0/bin/sh"
  ln -s busybox "$work/0/bin/true"
  local tars=()
  for i in $(seq 0 $(($2 - 1))); do
    mkdir -p "$work/$i/etc"
    echo "$1 $3 $i $RANDOM" > "$work/$i/etc/trial-$i"
    [ "$i" = 0 ] || head -c 64K /dev/urandom > "$work/$i/etc/data-$i"
    tar --owner=0 --group=0 -C "$work/$i" -cf "$work/$i.tar" .
    tars+=("$work/$i.tar")
  done
  python3 packaging/oci-layout.py --cmd /bin/sh "$work/layout" "${tars[@]}"
  skopeo copy --quiet --dest-tls-verify=false --dest-compress-format gzip \
    "oci:$work/layout:latest" "docker://$REG/$1:$3"
  rm -rf "$work"
}

# requests MARK AGENT: requests the registry logged since MARK from user agent AGENT.
requests() {
  sleep 0.3
  tail -c +"$(($1 + 1))" "$B/registry.log" | { grep -c "\"$2/" || true; }
}
# pull NODE IMAGE: prints "seconds containerd_requests vmdisk_requests"
pull() {
  local m; m=$(mark)
  local out; out=$("$CRI_PULL" --address "$B/$1-ctd/containerd.sock" "$2")
  echo "$(echo "$out" | sed -E 's/.* in ([0-9.]+) s$/\1/') $(requests "$m" containerd) $(requests "$m" vmdisk)"
}
# start NODE IMAGE: seconds to run /bin/true in a container of IMAGE on NODE's snapshotter.
start() {
  local snapshotter=overlayfs; [ "$1" = overlay ] || snapshotter=vmdisk
  local t0; t0=$(now)
  ctr --address "$B/$1-ctd/containerd.sock" -n k8s.io run --rm --snapshotter "$snapshotter" \
    "$2" "start-$RANDOM" /bin/true
  secs "$t0" "$(now)"
}
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }

ROWS=()
for LAYERS in 1 10 30; do
  declare -A T=() C=() V=() S=()
  for trial in $(seq "$TRIALS"); do
    image "ordinary-$LAYERS" "$LAYERS" "$trial"
    # Rotating which node goes first.
    order=$NODES
    for _ in $(seq 2 "$trial"); do order="${order#* } ${order%% *}"; done
    for node in $order; do
      read -r secs creq vreq < <(pull "$node" "$CLUSTER/ordinary-$LAYERS:$trial")
      T[$node]+="$secs "; C[$node]+="$creq "; V[$node]+="$vreq "
      S[$node]+="$(start "$node" "$CLUSTER/ordinary-$LAYERS:$trial") "
    done
  done
  for node in $NODES; do
    # shellcheck disable=SC2086
    ROWS+=("$LAYERS $node $(median ${T[$node]}) $(median ${C[$node]}) $(median ${V[$node]}) $(median ${S[$node]})")
  done
  unset T C V S
done
DECISIONS=$(sed 's/\x1b\[[0-9;]*m//g' "$B/node/vmdisk.log" | grep -o 'reason="\?[a-z_]*' | tr -d '"' | sort | uniq -c | awk '{printf "%s %s, ", $2, $1}')

{
  echo
  echo "Ordinary container images (Cmd set, fresh per trial) over the cluster link (20 ms, 200 Mbit/s), same run, median of $TRIALS:"
  printf '  %-7s %-10s %8s %22s %18s %16s\n' layers snapshotter "pull s" "containerd requests" "vmdisk requests" "container start s"
  for row in "${ROWS[@]}"; do
    read -r LAYERS NODE SECS CREQ VREQ START <<< "$row"
    printf '  %-7s %-10s %8s %22s %18s %16s\n' "$LAYERS" "$NODE" "$SECS" "$CREQ" "$VREQ" "$START"
  done
  echo "  vmdisk's decisions: ${DECISIONS%, }${BASE_BIN:+ (before: $BASE_BIN/vmdisk-snapshotter)}"
} | tee -a "$RESULTS"
