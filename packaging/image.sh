#!/usr/bin/env bash
# Builds the vmdisk node image and copies it to DEST with skopeo:
#   packaging/image.sh BIN_DIR DEST      e.g. packaging/image.sh target/release docker://REG/vmdisk:0.1.0
# (`make image IMAGE=REG/vmdisk:0.1.0`). FROM scratch: the three binaries (stripped) in
# /usr/bin, the C libraries they link, busybox (the DaemonSet's install step copies the shim
# and its configuration to the host with it), TLS roots, the default configuration in
# /etc/vmdisk and the containerd snippets in /usr/share/vmdisk. Loopback registries are spoken to over plain HTTP.
set -euo pipefail
bin=$1 dest=$2
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fs=$work/rootfs
install -d "$fs"/{usr/bin,bin,etc/vmdisk,usr/share/vmdisk,tmp,run,var/lib,dev,proc,sys}
for b in vmdisk vmdisk-snapshotter containerd-shim-vmdisk-v2; do
  install -m 0755 "$bin/$b" "$fs/usr/bin/$b"
  strip --strip-debug "$fs/usr/bin/$b"
done
ln -s containerd-shim-vmdisk-v2 "$fs/usr/bin/containerd-shim-vmdisk-peerpods-v2"
for lib in $(ldd "$bin/vmdisk-snapshotter" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\/.*ld-linux/ {print $1}'); do
  install -D -m 0755 "$(readlink -f "$lib")" "$fs$lib"
done
install -m 0755 /bin/busybox "$fs/bin/busybox"
for c in sh cp mv mkdir ln cat; do ln -s busybox "$fs/bin/$c"; done
# TLS roots (Debian's ca-certificates bundle; the DaemonSet mounts the host's trust store over
# it) and a group file naming root alone (the DaemonSet mounts the host's).
install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$fs/etc/ssl/certs/ca-certificates.crt"
printf 'root:x:0:\n' > "$fs/etc/group"
install -m 0644 "$root/config/vmdisk-snapshotter.toml" "$fs/etc/vmdisk/snapshotter.toml"
install -m 0644 "$root/config/shim.toml" "$fs/etc/vmdisk/shim.toml"
install -m 0644 "$root"/config/containerd-*.toml "$root/config/runtimeclass.yaml" "$fs/usr/share/vmdisk/"
tar --numeric-owner --owner=0 --group=0 -C "$fs" -cf "$work/layer.tar" .
python3 "$root/packaging/oci-layout.py" "$work/layout" "$work/layer.tar"
tls=()
case $dest in docker://127.0.0.1:*|docker://localhost:*) tls=(--dest-tls-verify=false) ;; esac
skopeo copy --quiet "${tls[@]}" --dest-compress-format gzip "oci:$work/layout:latest" "$dest"
echo "$dest"
