#!/usr/bin/env bash
# Build CRIU >= 4.2 for the ns runtime's process snapshots, once, into the aenv cache.
#
#   scripts/build-criu.sh [CACHE_DIR]     (root; CACHE_DIR defaults to /var/cache/aenv)
#
# Why: Debian bookworm's criu 3.17 fails `criu check` on kernels >= 6.13 and 4.1 cannot dump INET sockets on
# kernels >= 6.16 (notes: storage-and-runtime.md §4). Debian unstable carries 4.2.1; its upstream tarball builds
# with bookworm's build dependencies in about a minute. The source comes through a *private* apt configuration
# (a deb-src line for sid on the host's own Debian mirror, its own lists and cache dirs): the host's sources are
# never touched. The tarball is checked against the .dsc's sha256, and the build is kept under
# CACHE_DIR/criu/<that sha256>/criu with CACHE_DIR/criu/current pointing at it: a second run builds nothing.
# One patch of ours (scripts/criu-rlimit-proc.patch): where prlimit64() on another uid's task is refused
# (root without CAP_SYS_RESOURCE, as in containers), the dump reads its limits from /proc/<pid>/limits
# instead of failing "Can't get rlimit 0" on every sandbox that runs something as `user`.
# Where it cannot be had (no network, no sid on the mirror), it says why and exits 0: aenv then keeps
# refusing process snapshots with the honest 409 (`aenv doctor` tells).
set -euo pipefail

cache="${1:-/var/cache/aenv}/criu"
say() { printf '\033[1;34m==>\033[0m %s\n' "$*" >&2; }
skip() { say "CRIU not built: $*; process snapshots on ns stay off"; exit 0; }

# aenv's own patches to the upstream source (scripts/criu-*.patch, applied in name order); the build
# directory is named after the tarball's sha256 and theirs, so a changed patch means a new build.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
patches=("$here"/criu-*.patch)
[ -e "${patches[0]}" ] || patches=()
patch_sum="$(cat "${patches[@]}" /dev/null | sha256sum | cut -c1-12)"

[ "$(id -u)" -eq 0 ] || skip "needs root"
cur="$(readlink "$cache/current" 2>/dev/null || true)"
if [ -x "$cache/current/criu" ] && [ "${cur%-"$patch_sum"}" != "$cur" ] \
   && "$cache/current/criu" --version 2>/dev/null | grep -qE 'Version: (4\.([2-9]|[1-9][0-9])|[5-9])'; then
  exit 0
fi

BUILD_DEPS=(build-essential pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
            python3-protobuf libnl-3-dev libcap-dev libnet1-dev libbsd-dev libnftables-dev libgnutls28-dev
            libaio-dev uuid-dev xz-utils patch)
missing=()
for pkg in "${BUILD_DEPS[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing CRIU's build dependencies: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
    || skip "its build dependencies could not be installed"
fi

mirror="$("$here/debian-mirror.sh")"
[ -n "$mirror" ] || skip "no Debian mirror found in the host's apt sources"

work="$(mktemp -d /tmp/aenv-criu-XXXXXX)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/apt/lists/partial" "$work/apt/cache/archives/partial" "$work/src"
echo "deb-src $mirror sid main" > "$work/apt/sources.list"
apt_opts=(-o "Dir::Etc::sourcelist=$work/apt/sources.list" -o "Dir::Etc::sourceparts=-"
          -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache" -o "APT::Get::List-Cleanup=0")
say "fetching the criu source package from $mirror (sid), through a private apt configuration"
apt-get "${apt_opts[@]}" -q update >/dev/null 2>&1 || skip "apt-get update of the private sid source list failed"
# The .debian.tar.xz may be missing on the mirror; only the .dsc and the upstream tarball are needed.
(cd "$work/src" && apt-get "${apt_opts[@]}" -q source --download-only criu >/dev/null 2>&1) || true
dsc="$(ls "$work"/src/criu_*.dsc 2>/dev/null | head -1 || true)"
orig="$(ls "$work"/src/criu_*.orig.tar.* 2>/dev/null | head -1 || true)"
[ -n "$dsc" ] && [ -n "$orig" ] || skip "the sid source package of criu could not be downloaded"
want="$(awk '/^Checksums-Sha256:/{f=1;next} f&&/^ /{print $1, $3} /^[^ ]/{f=0}' "$dsc" | awk -v n="$(basename "$orig")" '$2==n{print $1}')"
got="$(sha256sum "$orig" | cut -d' ' -f1)"
[ -n "$want" ] && [ "$want" = "$got" ] || skip "$(basename "$orig") does not match the sha256 in $(basename "$dsc")"

dest="$cache/$got-$patch_sum"
if [ ! -x "$dest/criu" ]; then
  say "building $(basename "$orig" | sed 's/\.orig.*//') (about a minute on 2 cores)"
  tar -xf "$orig" -C "$work/src"
  srcdir="$(find "$work/src" -maxdepth 1 -mindepth 1 -type d -name 'criu-*' | head -1)"
  for p in "${patches[@]}"; do
    patch -d "$srcdir" -p1 -s <"$p" || skip "$(basename "$p") does not apply to this source"
  done
  make -C "$srcdir" -j"$(nproc)" criu >"$work/build.log" 2>&1 || { tail -20 "$work/build.log" >&2; skip "the build failed"; }
  mkdir -p "$dest"
  install -m 0755 "$srcdir/criu/criu" "$dest/criu.tmp"
  mv "$dest/criu.tmp" "$dest/criu"
fi
ln -sfn "$got-$patch_sum" "$cache/current"
if "$dest/criu" check >/dev/null 2>&1; then
  say "CRIU $("$dest/criu" --version | awk '/Version/{print $2}') at $cache/current/criu: criu check looks good"
else
  say "CRIU built at $cache/current/criu, but criu check fails on this kernel: aenv will not use it"
fi
