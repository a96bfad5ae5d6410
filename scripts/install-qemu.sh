#!/usr/bin/env bash
# QEMU >= 10 for the vm runtime from Debian's bookworm-backports, through a private apt configuration.
#
#   scripts/install-qemu.sh [CACHE_DIR]     (root; CACHE_DIR defaults to /var/cache/aenv)
#
# Why: bookworm ships QEMU 7.2; bookworm-backports carries 10.x (newer microvm and migration code, the
# release AgentENV-class hosts run). The backports suite is added only for this install: a sources list of
# our own (the host's Debian mirror, bookworm-backports main) beside the host's own sources, with our own
# lists and cache under CACHE_DIR/apt-backports, so the host's apt configuration is never changed and a
# later `apt-get update` of the host knows nothing of it. Idempotent: a QEMU >= 10 already installed is
# kept. Where it cannot be had (not bookworm, no network, not root) it says why and exits 0: the vm
# runtime works on bookworm's 7.2 as well (`aenv doctor` shows the version; vm snapshots record it).
set -euo pipefail

cache="${1:-/var/cache/aenv}/apt-backports"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
say() { printf '\033[1;34m==>\033[0m %s\n' "$*" >&2; }
skip() { say "QEMU from bookworm-backports not installed: $*; the vm runtime uses $(qemu_version || echo 'no QEMU')"; exit 0; }
qemu_version() { qemu-system-x86_64 --version 2>/dev/null | sed -n 's/^QEMU emulator version \([0-9.]*\).*/\1/p'; }

major="$(qemu_version | cut -d. -f1)"
[ -n "$major" ] && [ "$major" -ge 10 ] && exit 0
[ "$(id -u)" -eq 0 ] || skip "needs root"
# shellcheck disable=SC1091
codename="$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")"
[ "$codename" = bookworm ] || skip "this host is '${codename:-unknown}', not Debian bookworm"

mirror="$("$here/debian-mirror.sh")"
[ -n "$mirror" ] || skip "no Debian mirror found in the host's apt sources"

mkdir -p "$cache/lists/partial" "$cache/archives/partial"
# Ours: the host's own sources.list lines (if any) and bookworm-backports; sourceparts stays the host's, so
# bookworm itself resolves the dependencies.
{ grep -hE '^deb(-src)? ' /etc/apt/sources.list 2>/dev/null || true; echo "deb $mirror bookworm-backports main"; } \
  > "$cache/backports.list"
apt_opts=(-o "Dir::Etc::sourcelist=$cache/backports.list" -o "Dir::State::Lists=$cache/lists"
          -o "Dir::Cache=$cache" -o "Dir::Cache::archives=$cache/archives" -o "APT::Get::List-Cleanup=0")
say "installing QEMU from bookworm-backports ($mirror), through a private apt configuration"
apt-get "${apt_opts[@]}" -q update >/dev/null 2>&1 || skip "apt-get update of the private backports list failed"
DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" install -y -q --no-install-recommends \
  -t bookworm-backports qemu-system-x86 qemu-utils >/dev/null 2>"$cache/install.err" \
  || { tail -5 "$cache/install.err" >&2; skip "apt-get install -t bookworm-backports failed"; }
say "QEMU $(qemu_version) installed from bookworm-backports"
