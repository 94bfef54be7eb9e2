#!/bin/bash
# Builds containerd's snapshotter conformance suite (snapshots/testsuite of a containerd
# release) against vmdisk-snapshotter as a Go test binary, offline, in GOPATH mode from Debian's
# packaged Go sources:
#   build.sh OUT_BINARY          containerd 1.6.20: Debian 12's golang-go (1.19) and
#                                golang-github-containerd-containerd-dev, installed by make deps
#   build.sh OUT_BINARY ROOT     the release whose Go sources and compiler make deps unpacked
#                                under ROOT (debs.sh --go-sources: 1.7 from Debian 13, 2.x from
#                                unstable); 2.x's packages live under .../containerd/v2/core
#   build.sh OUT_BINARY --module VERSION
#                                a 2.x release from the Go module proxy by its module version
#                                (github.com/containerd/containerd/v2 VERSION, e.g. v2.3.7),
#                                with the Go integration/deps/go.sh finds (make deps builds that
#                                release's containerd the same way: integration/deps/containerd-go.sh)
# Run (as root): VMDISK_SNAPSHOTTER=/path/to/vmdisk-snapshotter OUT_BINARY -test.v
set -euo pipefail
out=${1:?usage: build.sh OUT_BINARY [ROOT | --module VERSION]}
here=$(cd "$(dirname "$0")" && pwd)
# containerd 2.x moved the packages under v2/core; the API stays where it was.
to_v2() {
  sed -e 's#"github.com/containerd/containerd/mount"#"github.com/containerd/containerd/v2/core/mount"#' \
      -e 's#"github.com/containerd/containerd/snapshots\(/[a-z]*\)\{0,1\}"#"github.com/containerd/containerd/v2/core/snapshots\1"#' \
      "$here/conformance_test.go"
}
if [ "${2:-}" = --module ]; then
  version=${3:?usage: build.sh OUT_BINARY --module VERSION}
  go=$("$here/../go.sh")
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
  mkdir -p "$(dirname "$out")"
  out=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")
  cd "$work"
  to_v2 > conformance_test.go
  printf 'module vmdisk.test/conformance\n\ngo 1.26\n\nrequire github.com/containerd/containerd/v2 %s\n' "$version" > go.mod
  # The suite's other modules at the versions that containerd release requires.
  env GOFLAGS= "$go" mod tidy
  env GOFLAGS= CGO_ENABLED=0 "$go" test -c -o "$out" .
  exit 0
fi
root=$(cd "${2:-/}" && pwd)
gocode=$root/usr/share/gocode
if [ "$root" = / ]; then
  go=$(command -v go || true)
  goroot=
else
  go=$(ls -d "$root"/usr/lib/go-*/bin/go 2>/dev/null | sort -V | tail -1)
  goroot=$(dirname "$(dirname "$go")")
fi
[ -n "$go" ] && [ -d "$gocode/src/github.com/containerd/containerd" ] || {
  echo "build.sh: no Go compiler or containerd sources under $root (make deps)" >&2
  exit 1
}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
pkg=$work/src/vmdisk.test/conformance
mkdir -p "$pkg"
if [ -d "$gocode/src/github.com/containerd/containerd/v2/core/snapshots/testsuite" ]; then
  to_v2 > "$pkg/conformance_test.go"
else
  cp "$here/conformance_test.go" "$pkg/"
fi
mkdir -p "$(dirname "$out")"
cache=${GOCACHE:-$(dirname "$out")/gocache}
cd "$pkg"
env ${goroot:+GOROOT=$goroot} GO111MODULE=off GOPATH="$work:$gocode" GOFLAGS= GOPROXY=off \
  GOTOOLCHAIN=local GOCACHE="$cache" CGO_ENABLED=0 "$go" test -c -o "$out" .
