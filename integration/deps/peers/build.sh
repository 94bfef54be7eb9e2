#!/bin/bash
# Builds the peers `make bench` measures vmdisk beside, from the Go module proxy by module
# version (the versions in soci/go.mod and stargz/go.mod; go.sum pins every module):
#   soci-snapshotter-grpc, soci-convert   SOCI (github.com/awslabs/soci-snapshotter)
#   containerd-stargz-grpc                stargz-snapshotter (github.com/containerd/stargz-snapshotter)
# Each project's own main is in a module the proxy does not serve (it replaces the library with
# a local copy), so the mains here are this project's: the same wiring of the library, in
# brief (each says what it sets up). SOCI's zTOCs use zlib through cgo (gcc, zlib1g-dev).
#   build.sh OUT_DIR
set -euo pipefail
out=${1:?usage: build.sh OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
go=$("$here/../go.sh")
if ! command -v gcc > /dev/null || [ ! -f /usr/include/zlib.h ]; then
  echo "peers/build.sh: installing gcc and zlib1g-dev (SOCI's zTOCs use zlib through cgo)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev zlib1g-dev > /dev/null
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
(cd "$here/soci" && env GOFLAGS=-mod=readonly CGO_ENABLED=1 "$go" build -trimpath -o "$out/" ./...)
(cd "$here/stargz" && env GOFLAGS=-mod=readonly CGO_ENABLED=0 "$go" build -trimpath -o "$out/" ./...)
# The versions built, for the bench's table.
{
  echo "soci $(cd "$here/soci" && "$go" list -m -f '{{.Version}}' github.com/awslabs/soci-snapshotter)"
  echo "stargz $(cd "$here/stargz" && "$go" list -m -f '{{.Version}}' github.com/containerd/stargz-snapshotter)"
} > "$out/versions"
# What they were built from: a checkout whose go.sum files differ builds them again.
cat "$here"/*/go.sum | sha256sum | cut -d' ' -f1 > "$out/built-from"
cat "$out/versions"
