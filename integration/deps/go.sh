#!/bin/bash
# Prints the path of a Go compiler new enough for the Go modules the tests and the bench build
# (containerd 2.3/2.4, their conformance suites, the peers: go.mod names 1.26.8): the machine's
# own where it is new enough (/usr/local/go, then PATH), else Go's toolchain module of that
# version from the Go module proxy (golang.org/toolchain, as the go command itself fetches
# toolchains), unpacked once into target/deps/go-<version>.
set -euo pipefail
want=1.26.8
here=$(cd "$(dirname "$0")/../.." && pwd)
new_enough() {  # new_enough GO
  local v
  v=$("$1" env GOVERSION 2> /dev/null) || return 1
  v=${v#go}
  [ "$(printf '%s\n%s\n' "$want" "${v%%[-+ ]*}" | sort -V | head -1)" = "$want" ]
}
for go in /usr/local/go/bin/go "$(command -v go || true)"; do
  if [ -n "$go" ] && [ -x "$go" ] && new_enough "$go"; then
    echo "$go"
    exit 0
  fi
done
dir=$here/target/deps/go-$want
if [ ! -x "$dir/bin/go" ]; then
  zip=https://proxy.golang.org/golang.org/toolchain/@v/v0.0.1-go$want.linux-amd64.zip
  echo "go.sh: no Go $want or newer here; fetching Go's toolchain module $zip" >&2
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  curl -sSfL -o "$tmp/go.zip" "$zip"
  python3 - "$tmp/go.zip" "$tmp/x" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        path = z.extract(info, sys.argv[2])
        mode = info.external_attr >> 16
        if mode:
            os.chmod(path, mode & 0o777)
PY
  mkdir -p "$(dirname "$dir")"
  rm -rf "$dir"
  mv "$tmp/x/golang.org/toolchain@v0.0.1-go$want.linux-amd64" "$dir"
fi
echo "$dir/bin/go"
