#!/bin/bash
# Unpacks packages from Debian releases (trixie, sid, and bookworm's own) beside Debian 12
# without installing them: a private apt state (its own sources list, package lists and archive cache) is used for
# the download, so the machine's apt configuration and installed packages stay as they are;
# `dpkg-deb -x` unpacks each package into OUT. Go programs of those releases (containerd, SOCI,
# oras, cosign, notation) need only libc6 >= 2.34, which Debian 12 has. bookworm's nginx (the
# fleet tests' regional cache) is unpacked the same way, so no service is started on the machine.
#
# Usage: debs.sh OUT PKG[/SUITE|=VERSION]...     e.g. debs.sh target/deps/containerd-2.1 containerd/sid
#        debs.sh --go-sources SUITE OUT PKG...  the Go source packages PKG of SUITE (trixie, sid)
#                                               with every golang-* package they depend on, the
#                                               Go compiler included: a GOPATH to build them in
# Prints "unpacked <package> <version>" for each. VMDISK_APT_STATE moves the apt state
# (default /var/tmp/vmdisk-apt; its package lists are refreshed when older than a day).
set -euo pipefail
go_suite=
if [ "${1:-}" = --go-sources ]; then
  go_suite=${2:?usage: debs.sh --go-sources SUITE OUT PKG...}
  shift 2
fi
out=${1:?usage: debs.sh OUT PKG[/SUITE|=VERSION]...}
shift
[ $# -gt 0 ] || { echo "debs.sh: name at least one package" >&2; exit 2; }
state=${VMDISK_APT_STATE:-/var/tmp/vmdisk-apt}
# The Debian mirror this machine already uses for bookworm (deb822 or one-line sources).
uri=$(awk '/^URIs:/ {u=$2} /^Suites:.*bookworm/ && u {print u; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
[ -n "$uri" ] || uri=$(awk '$1=="deb" && / bookworm / {for (i=2;i<=NF;i++) if ($i ~ /^https?:/) {print $i; exit}}' \
  /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
uri=${uri:-http://deb.debian.org/debian}
mkdir -p "$state/sources" "$state/lists/partial" "$state/archives/partial" "$out"
cat > "$state/sources/newer.sources" <<SOURCES
Types: deb
URIs: $uri
Suites: bookworm trixie sid
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
apt_opts=(-o "Dir::Etc::sourcelist=/dev/null" -o "Dir::Etc::sourceparts=$state/sources"
  -o "Dir::State::Lists=$state/lists" -o "Dir::Cache::archives=$state/archives"
  -o "APT::Get::List-Cleanup=false")
if [ -z "$(find "$state/lists" -maxdepth 1 -name '*_Packages*' -mtime -1 2>/dev/null | head -1)" ]; then
  apt-get "${apt_opts[@]}" update -qq
fi
packages=("$@")
if [ -n "$go_suite" ]; then
  apt_opts+=(-o "APT::Default-Release=$go_suite")
  # Go source packages depend on one another only; anything else they name is not needed to
  # compile them.
  mapfile -t packages < <(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends \
    --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances "$@" |
    grep -E '^golang-' | sort -u)
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get "${apt_opts[@]}" -o APT::Sandbox::User=root download "${packages[@]}" >/dev/null)
for deb in "$work"/*.deb; do
  dpkg-deb -x "$deb" "$out"
  [ -n "$go_suite" ] || echo "unpacked $(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version)"
done
[ -z "$go_suite" ] || echo "unpacked ${#packages[@]} Go source packages of $go_suite for $*"
