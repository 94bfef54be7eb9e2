#!/bin/bash
# Builds the peers `make bench` measures vmdisk beside, from the Go module proxy by module
# version (the versions in */go.mod; go.sum pins every module) and from crates.io by version:
#   soci-snapshotter-grpc, soci-convert   SOCI (github.com/awslabs/soci-snapshotter)
#   containerd-stargz-grpc                stargz-snapshotter (github.com/containerd/stargz-snapshotter)
#   containerd-nydus-grpc                 nydus-snapshotter's own main (github.com/containerd/nydus-snapshotter,
#                                         a `tool` of nydus/go.mod)
#   nydus-convert                         nydusify's conversion over the snapshotter's converter library
#   nydus-rs/bin/{nydusd,nydus-image}     crates.io nydus-rs (NYDUS_RS_VERSION), `cargo install --locked`
# SOCI's and stargz's own mains are in modules the proxy does not serve (they replace the library
# with a local copy), and nydusify's module is not served, so those mains here are this
# project's: the same wiring of the library, in brief (each says what it sets up). SOCI's zTOCs
# use zlib through cgo (gcc, zlib1g-dev).
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
(cd "$here/nydus" && env GOFLAGS=-mod=readonly CGO_ENABLED=0 "$go" build -trimpath -o "$out/" ./... \
  github.com/containerd/nydus-snapshotter/cmd/containerd-nydus-grpc)
# nydus-rs 2.2.0 is the newest release on crates.io (the project's 2.3/2.4 are not published there).
nydus_rs=2.2.0
[ -x "$out/nydus-rs/bin/nydusd" ] && [ "$(cat "$out/nydus-rs/version" 2> /dev/null)" = "$nydus_rs" ] || {
  cargo install --quiet --locked nydus-rs --version "$nydus_rs" --root "$out/nydus-rs" --force
  echo "$nydus_rs" > "$out/nydus-rs/version"
}
# The versions built, for the bench's table.
{
  echo "soci $(cd "$here/soci" && "$go" list -m -f '{{.Version}}' github.com/awslabs/soci-snapshotter)"
  echo "stargz $(cd "$here/stargz" && "$go" list -m -f '{{.Version}}' github.com/containerd/stargz-snapshotter)"
  echo "nydus-snapshotter $(cd "$here/nydus" && "$go" list -m -f '{{.Version}}' github.com/containerd/nydus-snapshotter)"
  echo "nydus-rs $nydus_rs"
} > "$out/versions"
# What they were built from: a checkout whose go.sum files differ builds them again.
cat "$here"/*/go.sum | sha256sum | cut -d' ' -f1 > "$out/built-from"
cat "$out/versions"
