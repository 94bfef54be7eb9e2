#!/bin/bash
# Builds a containerd release from the Go module proxy by its module version, with nothing
# fetched from elsewhere: containerd, ctr and the runc shim, as containerd's own release builds
# them (static, no cgo, no btrfs snapshotter), into OUT/usr/bin (the layout debs.sh unpacks
# Debian's builds into, so the tests find every release the same way).
#   containerd-go.sh OUT VERSION      e.g. containerd-go.sh target/deps/containerd-2.3 v2.3.7
# Needs the Go that the release's go.mod names or newer (containerd 2.3.7 names 1.26.8):
# integration/deps/go.sh finds or fetches it.
set -euo pipefail
out=${1:?usage: containerd-go.sh OUT VERSION}
version=${2:?usage: containerd-go.sh OUT VERSION}
go=$("$(dirname "$0")/go.sh")
echo "building containerd $version from the Go module proxy with $("$go" version)"
mkdir -p "$out/usr/bin"
bin=$(cd "$out/usr/bin" && pwd)
module=github.com/containerd/containerd/v2
# -trimpath and the version in the binaries as the release's Makefile stamps it.
env GOFLAGS= CGO_ENABLED=0 GOBIN="$bin" "$go" install -trimpath -tags no_btrfs \
  -ldflags "-X $module/version.Version=${version#v}" \
  "$module/cmd/containerd@$version" "$module/cmd/ctr@$version" \
  "$module/cmd/containerd-shim-runc-v2@$version"
"$bin/containerd" --version
