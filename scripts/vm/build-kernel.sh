#!/usr/bin/env bash
# Build (or find) the cached microVM guest kernel from Debian's linux-source-6.1 and print its path.
# Idempotent: a cache hit returns at once. Needs (as root):
#   apt-get install -y --no-install-recommends linux-source-6.1 build-essential bc bison flex libelf-dev libssl-dev cpio
# Usage: scripts/vm/build-kernel.sh [--cache-dir DIR] [--jobs N]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} exec "$PY" -m aenv.runtime.vm.kernel build "$@"
