#!/usr/bin/env bash
# Builds the Debian package from built binaries: packaging/deb.sh BIN_DIR OUT_DIR
# (`make deb` uses target/release). Binaries go to /usr/bin (stripped), the systemd unit to
# /lib/systemd/system, the default configuration to /etc/vmdisk (conffiles), the containerd,
# Kubernetes and Kata examples to /usr/share/vmdisk, the docs to /usr/share/doc/vmdisk.
set -euo pipefail
bin=$1 out=$2
root=$(cd "$(dirname "$0")/.." && pwd)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -1)
arch=$(dpkg --print-architecture)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
pkg=$stage/vmdisk
install -d "$pkg/DEBIAN" "$pkg/usr/bin" "$pkg/lib/systemd/system" "$pkg/etc/vmdisk" \
  "$pkg/usr/share/vmdisk" "$pkg/usr/share/doc/vmdisk"
for b in vmdisk vmdisk-snapshotter containerd-shim-vmdisk-v2; do
  install -m 0755 "$bin/$b" "$pkg/usr/bin/$b"
  strip --strip-debug "$pkg/usr/bin/$b"
done
# The peer-pod handler's shim name (config/shim.toml) is a link to the same binary.
ln -s containerd-shim-vmdisk-v2 "$pkg/usr/bin/containerd-shim-vmdisk-peerpods-v2"
install -m 0644 "$root/packaging/vmdisk-snapshotter.service" "$pkg/lib/systemd/system/"
install -m 0644 "$root/config/vmdisk-snapshotter.toml" "$pkg/etc/vmdisk/snapshotter.toml"
install -m 0644 "$root/config/shim.toml" "$pkg/etc/vmdisk/shim.toml"
install -m 0644 "$root"/config/containerd-*.toml "$root/config/runtimeclass.yaml" \
  "$root/config/kata-configuration.toml" "$root/packaging/kubernetes/vmdisk.yaml" \
  "$pkg/usr/share/vmdisk/"
install -m 0644 "$root/README.md" "$root"/docs/*.md "$pkg/usr/share/doc/vmdisk/"
cat > "$pkg/usr/share/doc/vmdisk/copyright" <<COPYRIGHT
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: vmdisk
Files: *
License: Apache-2.0
 On Debian systems the license is in /usr/share/common-licenses/Apache-2.0.
COPYRIGHT
printf '/etc/vmdisk/snapshotter.toml\n/etc/vmdisk/shim.toml\n' > "$pkg/DEBIAN/conffiles"
install -m 0755 "$root"/packaging/deb/{postinst,prerm,postrm} "$pkg/DEBIAN/"
size=$(du -sk --exclude=DEBIAN "$pkg" | cut -f1)
cat > "$pkg/DEBIAN/control" <<CONTROL
Package: vmdisk
Version: $version
Architecture: $arch
Maintainer: vmdisk developers <vmdisk@localhost>
Installed-Size: $size
Depends: libc6 (>= 2.36), libgcc-s1, fuse3
Recommends: containerd
Suggests: qemu-utils, libvirt-daemon-system
Section: admin
Priority: optional
Description: lazily loaded VM disks from container registries
 A containerd proxy snapshotter (vmdisk-snapshotter) that mounts VM-disk layers
 (KubeVirt containerDisks, peer-pod and Kata images) as remote snapshots and fetches
 them chunk by chunk with HTTP Range requests, verifying every chunk, into a
 persistent local block cache served through FUSE; a runtime shim that hands Kata
 and peer-pod runtimes a ready disk; and the vmdisk CLI that publishes disks.
CONTROL
mkdir -p "$out"
deb=$out/vmdisk_${version}_${arch}.deb
dpkg-deb --root-owner-group -Zxz -z1 --build "$pkg" "$deb" >/dev/null
echo "$deb"
