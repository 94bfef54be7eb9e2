#!/bin/bash
# Builds containerd's snapshotter conformance suite (snapshots/testsuite) against
# vmdisk-snapshotter as a Go test binary, offline: Debian 12's Go (1.19) in GOPATH mode and
# containerd's source as Debian packages it (golang-github-containerd-containerd-dev, 1.6.20,
# with its dependencies). `make deps` installs both.
# Usage: build.sh OUT_BINARY
# Run (as root): VMDISK_SNAPSHOTTER=/path/to/vmdisk-snapshotter OUT_BINARY -test.v
set -euo pipefail
out=${1:?usage: build.sh OUT_BINARY}
here=$(cd "$(dirname "$0")" && pwd)
src=/usr/share/gocode/src/github.com/containerd/containerd/snapshots/testsuite
command -v go >/dev/null && [ -d "$src" ] || {
  echo "build.sh: needs golang-go and golang-github-containerd-containerd-dev (make deps)" >&2
  exit 1
}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src/vmdisk.test/conformance"
cp "$here/conformance_test.go" "$work/src/vmdisk.test/conformance/"
mkdir -p "$(dirname "$out")"
cache=${GOCACHE:-$(dirname "$out")/gocache}
cd "$work/src/vmdisk.test/conformance"
GO111MODULE=off GOPATH="$work:/usr/share/gocode" GOFLAGS= GOPROXY=off GOCACHE="$cache" CGO_ENABLED=0 \
  go test -c -o "$out" .
