#!/bin/sh
# Build the image fixtures (busybox, Debian multi-layer, Alpine) and push them to a local registry.
# Usage: scripts/build-fixture-images.sh --start DIR | --registry HOST:PORT [--bench]
set -eu
cd "$(dirname "$0")/.."
PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" exec .venv/bin/python -m tests.fixtures.push "$@"
