#!/usr/bin/env bash
# Prints the host's Debian mirror (the first non-security URI of its deb822 .sources, else of a classic
# sources.list line; nothing when there is none), for the private apt configurations of build-criu.sh
# and install-qemu.sh, which add a suite of that mirror without touching the host's sources.
set -euo pipefail
mirror="$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -1 || true)"
[ -n "$mirror" ] || mirror="$(grep -hE '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' | grep -v security | head -1 || true)"
[ -z "$mirror" ] || printf '%s\n' "$mirror"
