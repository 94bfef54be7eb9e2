# Sourced by demo.sh and the bench scripts (which keep started pids in the PIDS array).
# start_containerd DIR REGISTRY SNAPSHOTTER_SOCK|"": containerd 1.6 with its CRI plugin in DIR
# (socket DIR/containerd.sock), plain HTTP to the loopback REGISTRY, and vmdisk-snapshotter at
# SNAPSHOTTER_SOCK as the CRI snapshotter (containerd's overlayfs when empty). Returns when the
# socket is up.
start_containerd() {
  local dir=$1 reg=$2 proxy="" snapshotter=overlayfs
  mkdir -p "$dir"
  if [ -n "$3" ]; then
    snapshotter=vmdisk
    proxy=$(printf '[proxy_plugins.vmdisk]\n  type = "snapshot"\n  address = "%s"\n' "$3")
  fi
  cat > "$dir/containerd.toml" <<TOML
version = 2
root = "$dir/root"
state = "$dir/state"
[grpc]
  address = "$dir/containerd.sock"
$proxy
[plugins."io.containerd.grpc.v1.cri"]
  restrict_oom_score_adj = true
  disable_cgroup = true
[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "$snapshotter"
  disable_snapshot_annotations = false
[plugins."io.containerd.grpc.v1.cri".registry.mirrors."$reg"]
  endpoint = ["http://$reg"]
TOML
  containerd --config "$dir/containerd.toml" 2> "$dir/containerd.log" &
  PIDS+=($!)
  for _ in $(seq 200); do [ -S "$dir/containerd.sock" ] && break; sleep 0.05; done
  sleep 0.5
}

# stop_mount_servers DIR: mount servers outlive their daemon by design; stop the ones started
# with a configuration under DIR (each unmounts and exits on SIGTERM).
stop_mount_servers() {
  pkill -TERM -f "serve-layer --config $1" 2>/dev/null || true
  for _ in $(seq 50); do pgrep -f "serve-layer --config $1" > /dev/null || return 0; sleep 0.1; done
  pkill -KILL -f "serve-layer --config $1" 2>/dev/null || true
}
