#!/usr/bin/env bash
# One entry point for a fresh Debian/Ubuntu machine. Idempotent: every step checks before it acts.
#
#   scripts/setup.sh serve [aenv serve options]   set up, then run the server on 127.0.0.1:8000
#   scripts/setup.sh test  [pytest options]       set up, then run the test suite (default: ruff, mypy
#                                                 --strict and lint-imports, the fast selection, then its
#                                                 SDK tests again on the vm runtime), then the leftover
#                                                 check (no process of the suite may outlive it)
#   scripts/setup.sh deps                         set up only
#
# Steps: system packages (apt, as root; otherwise prints the exact apt line) → .venv in the repo root →
# the project and its test, cluster and bench extras → the tools bundle and the `base` template rootfs (cached outside the
# repo, in /var/cache/aenv as root or ~/.cache/aenv).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
mode="${1:-deps}"
[ $# -gt 0 ] && shift

say() { printf '\033[1;34m==>\033[0m %s\n' "$*" >&2; }

APT_PACKAGES=(
  python3-venv ca-certificates
  # ns runtime and sandbox networking
  util-linux iproute2 iptables slirp4netns uidmap procps psmisc e2fsprogs btrfs-progs
  # the static helpers a restore runs (criu_action, tmpfs_tar: gcc, static libc and zlib)
  build-essential zlib1g-dev
  # images: base template, local registry for tests, cross-checks; libfuse3 for lazy images (aenv-lazyd)
  mmdebstrap docker-registry skopeo umoci busybox-static zstd libfuse3-3
  # vm runtime: QEMU, disk tools, guest kernel build
  qemu-system-x86 qemu-utils cpio lz4 kmod socat
  linux-source-6.1 build-essential bc bison flex libelf-dev libssl-dev
  # the benchmark's baselines (docker run/exec/commit/build, runc run), run on a private engine
  docker.io runc
  # the cluster: its directory and Ray's GCS fault-tolerance store (started by hand, never the system unit)
  redis-server
  # the console's browser tests: Debian's Chromium, driven by Playwright (no browser download)
  chromium
)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ! command -v node >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    say "installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "error: missing system packages: ${missing[*]}" >&2
    echo "hint: run as root, or: sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi
fi

python_bin="${AENV_PYTHON:-}"
if [ -z "$python_bin" ]; then
  for cand in python3.11 python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      python_bin="$(command -v "$cand")"; break
    fi
  done
fi
[ -n "$python_bin" ] || { echo "error: Python >= 3.11 not found" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $python_bin"
  "$python_bin" -m venv .venv
fi

stamp=.venv/.aenv-installed
# cluster: Ray (~250 MB); bench: matplotlib, so a bench run writes its charts beside its tables
extras="test,cluster,bench"
want="$({ cat pyproject.toml; echo "$extras"; } | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "installing aenv and its dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e ".[$extras]"
  echo "$want" > "$stamp"
fi

# The console's browser libraries (xterm.js, uPlot, Cytoscape + dagre) from the npm registry, at the
# versions package-lock.json pins, served by the server under /console/vendor (nothing built is committed).
console_dir=src/aenv/api/console
if command -v npm >/dev/null 2>&1; then
  want_console="$(sha256sum "$console_dir/package-lock.json" | cut -d' ' -f1)"
  if [ ! -f "$console_dir/node_modules/.aenv-installed" ] || [ "$(cat "$console_dir/node_modules/.aenv-installed")" != "$want_console" ]; then
    say "installing the console's browser libraries (npm ci in $console_dir)"
    (cd "$console_dir" && npm ci --silent --no-audit --no-fund) && echo "$want_console" > "$console_dir/node_modules/.aenv-installed"
  fi
fi

# The JS SDK for the JS tests (npm `e2b`), once, in the machine's aenv cache.
js_cache="${AENV_JS_SDK_DIR:-$([ "$(id -u)" -eq 0 ] && echo /var/cache/aenv/js-sdk || echo "$HOME/.cache/aenv/js-sdk")}"
if command -v npm >/dev/null 2>&1 && [ ! -d "$js_cache/node_modules/e2b" ]; then
  say "installing the JS SDK (npm e2b@2) into $js_cache"
  mkdir -p "$js_cache"
  [ -f "$js_cache/package.json" ] || echo '{"type":"module","private":true}' > "$js_cache/package.json"
  (cd "$js_cache" && npm install --silent --no-audit --no-fund e2b@2) || say "npm install e2b failed: the JS tests will try again"
fi

# Harbor for the Harbor end-to-end test (a venv of its own: it needs Python >= 3.12), once, in the
# machine's aenv cache; not for `serve`. Where it cannot be had the script says why and the test skips.
if [ "$mode" != serve ]; then
  ./scripts/install-harbor.sh >/dev/null || say "Harbor not installed: tests/integration/test_harbor.py will try again"
  # verifiers for the private-egress test, also in a venv of its own (its pins would drag .venv's E2B SDK back)
  ./scripts/install-verifiers.sh >/dev/null || say "verifiers not installed: tests/integration/test_private_egress.py will try again"
fi

if [ "$(id -u)" -eq 0 ]; then
  # QEMU 10 from bookworm-backports for the vm runtime (bookworm's own is 7.2), private apt configuration.
  ./scripts/install-qemu.sh
  # CRIU >= 4.2 for process snapshots on ns (bookworm's is too old for this kernel): built once, cached.
  ./scripts/build-criu.sh
  say "preparing the tools bundle and the base template (first run: about a minute)"
  .venv/bin/aenv setup
else
  say "not root: skipping sandbox set-up (the ns and vm runtimes need root)"
fi

case "$mode" in
  serve)
    say "starting the server on ${AENV_HOST:-127.0.0.1}:${AENV_PORT:-8000}"
    exec .venv/bin/aenv serve "$@"
    ;;
  test)
    # The leftover check: what the suite starts (servers, sandboxes, slirp4netns, QEMU, dockerd,
    # registries, Ray, Redis) must not outlive it; it fails the run naming each one, and ends them.
    record="$(mktemp -t leftover-record.XXXXXX)"
    .venv/bin/python -m aenv.testing.leftovers record "$record"
    rc=0
    if [ $# -gt 0 ]; then
      .venv/bin/python -m pytest "$@" || rc=$?
    else
      say "static checks: ruff, mypy --strict, import-linter (the layers)"
      .venv/bin/ruff check src tests bench
      .venv/bin/mypy --strict src
      .venv/bin/lint-imports
      say "docs: mkdocs build --strict (the CLI, REST and bench pages generated from the code)"
      site="$(mktemp -d -t docs-site.XXXXXX)"
      NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site" || { rm -rf "$site"; exit 1; }
      rm -rf "$site"
      say "running the test suite (ns runtime for the SDK tests)"
      .venv/bin/python -m pytest -m "not slow" || rc=$?
      # The SDK suite once more against the microVM runtime (skips with the reason where it cannot run).
      if [ "$rc" -eq 0 ]; then
        say "running the SDK suite on the vm runtime"
        AENV_TEST_RUNTIME=vm .venv/bin/python -m pytest -m "sdk and not slow" tests/integration || rc=$?
      fi
    fi
    say "leftover check: no process, mount or temp dir of the suite may outlive it"
    .venv/bin/python -m aenv.testing.leftovers check "$record" --kill || { [ "$rc" -ne 0 ] || rc=1; }
    rm -f "$record"
    exit "$rc"
    ;;
  deps) ;;
  *) echo "usage: scripts/setup.sh serve|test|deps [args]" >&2; exit 2 ;;
esac
