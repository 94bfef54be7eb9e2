#!/usr/bin/env bash
# Builds the Debian package from built binaries: packaging/deb.sh BIN_DIR OUT_DIR
# (`make deb` uses target/release). Binaries go to /usr/bin (stripped), their manual pages
# (generated from the command-line definitions) to /usr/share/man, the systemd unit to
# /lib/systemd/system, the default configuration to /etc/vmdisk (conffiles), the containerd,
# Kubernetes and Kata examples to /usr/share/vmdisk (the alerting rules and the Grafana dashboard
# in its monitoring/), the docs, changelog and copyright to
# /usr/share/doc/vmdisk. `lintian` passes it with no error or warning.
set -euo pipefail
bin=$1 out=$2
root=$(cd "$(dirname "$0")/.." && pwd)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -1)
arch=$(dpkg --print-architecture)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
pkg=$stage/vmdisk
install -d "$pkg/DEBIAN" "$pkg/usr/bin" "$pkg/lib/systemd/system" "$pkg/etc/vmdisk" \
  "$pkg/usr/share/vmdisk" "$pkg/usr/share/doc/vmdisk" "$pkg/usr/share/man"
for b in vmdisk vmdisk-snapshotter containerd-shim-vmdisk-v2; do
  install -m 0755 "$bin/$b" "$pkg/usr/bin/$b"
  strip --strip-unneeded --remove-section=.comment --remove-section=.note "$pkg/usr/bin/$b"
done
# The peer-pod handler's shim name (config/shim.toml) is a link to the same binary.
ln -s containerd-shim-vmdisk-v2 "$pkg/usr/bin/containerd-shim-vmdisk-peerpods-v2"
# Manual pages, generated from the command-line definitions.
"$bin/vmdisk" generate-man "$pkg/usr/share/man" >/dev/null
ln -s containerd-shim-vmdisk-v2.8 "$pkg/usr/share/man/man8/containerd-shim-vmdisk-peerpods-v2.8"
install -m 0644 "$root/packaging/vmdisk-snapshotter.service" "$pkg/lib/systemd/system/"
install -m 0644 "$root/config/vmdisk-snapshotter.toml" "$pkg/etc/vmdisk/snapshotter.toml"
install -m 0644 "$root/config/shim.toml" "$pkg/etc/vmdisk/shim.toml"
install -m 0644 "$root"/config/containerd-*.toml "$root/config/runtimeclass.yaml" \
  "$root/config/kata-configuration.toml" "$root/packaging/kubernetes/vmdisk.yaml" \
  "$root/config/nginx-regional-cache.conf" "$root/packaging/kubernetes/vmdisk-monitoring.yaml" \
  "$pkg/usr/share/vmdisk/"
# The Prometheus alerting rules and the Grafana dashboard (docs/install.md#monitoring).
install -d "$pkg/usr/share/vmdisk/monitoring"
install -m 0644 "$root/packaging/monitoring/vmdisk-alerts.yaml" \
  "$root/packaging/monitoring/vmdisk-dashboard.json" "$pkg/usr/share/vmdisk/monitoring/"
install -m 0644 "$root/README.md" "$root"/docs/*.md "$pkg/usr/share/doc/vmdisk/"
install -m 0644 "$root/packaging/deb/changelog" "$pkg/usr/share/doc/vmdisk/changelog"
cat > "$pkg/usr/share/doc/vmdisk/copyright" <<COPYRIGHT
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: vmdisk
Source: https://vmdisk.dev

Files: *
Copyright: 2026 vmdisk developers
License: Apache-2.0
 Licensed under the Apache License, Version 2.0 (the "License"); you may not use
 this file except in compliance with the License.
 .
 On Debian systems, the complete text of the Apache License, Version 2.0 can be
 found in "/usr/share/common-licenses/Apache-2.0".
COPYRIGHT
# Documentation and manual pages are compressed, as Debian policy asks.
find "$pkg/usr/share/man" -type f -exec gzip -9n {} +
ln -sf containerd-shim-vmdisk-v2.8.gz "$pkg/usr/share/man/man8/containerd-shim-vmdisk-peerpods-v2.8.gz"
rm -f "$pkg/usr/share/man/man8/containerd-shim-vmdisk-peerpods-v2.8"
find "$pkg/usr/share/doc/vmdisk" -type f ! -name copyright -size +4k -exec gzip -9n {} +
gzip -9n "$pkg/usr/share/doc/vmdisk/changelog" 2>/dev/null || true
find "$pkg" -type d -exec chmod 0755 {} +
printf '/etc/vmdisk/snapshotter.toml\n/etc/vmdisk/shim.toml\n' > "$pkg/DEBIAN/conffiles"
install -m 0755 "$root"/packaging/deb/{postinst,prerm,postrm} "$pkg/DEBIAN/"
(cd "$pkg" && find . -type f ! -path './DEBIAN/*' -printf '%P\0' | sort -z | xargs -0 md5sum) > "$pkg/DEBIAN/md5sums"
size=$(du -sk --exclude=DEBIAN "$pkg" | cut -f1)
cat > "$pkg/DEBIAN/control" <<CONTROL
Package: vmdisk
Version: $version
Architecture: $arch
Maintainer: vmdisk developers <vmdisk-maint@vmdisk.dev>
Installed-Size: $size
Depends: libc6 (>= 2.36), libgcc-s1, fuse3, init-system-helpers (>= 1.54~)
Recommends: containerd
Suggests: qemu-utils, libvirt-daemon-system
Section: admin
Priority: optional
Homepage: https://vmdisk.dev
Description: lazily loaded VM disks from container registries
 A containerd proxy snapshotter (vmdisk-snapshotter) that mounts VM-disk layers
 (KubeVirt containerDisks, peer-pod and Kata images) as remote snapshots and
 fetches them chunk by chunk with HTTP Range requests, verifying every chunk,
 into a persistent local block cache served through FUSE; a runtime shim that
 hands Kata and peer-pod runtimes a ready disk; and the vmdisk command line that
 publishes disks.
CONTROL
mkdir -p "$out"
deb=$out/vmdisk_${version}_${arch}.deb
dpkg-deb --root-owner-group -Zxz -z1 --build "$pkg" "$deb" >/dev/null
echo "$deb"
