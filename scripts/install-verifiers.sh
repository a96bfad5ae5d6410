#!/usr/bin/env bash
# verifiers (an RL environments library whose E2B runtime routes a sandbox's model calls) for
# tests/integration/test_private_egress.py, in a venv of its own: it cannot share aenv's .venv (its
# prime-sandboxes pins connectrpc<0.12, which drags the E2B SDK back to 2.56, and its httpx2 moves
# starlette's TestClient). In its own venv the E2B SDK is put back at >= 2.63 with connectrpc 0.12, which
# its E2B runtime is fine with. Idempotent: a stamp in the venv names the installed spec, written last.
#
#   scripts/install-verifiers.sh [DIR]     DIR: AENV_VERIFIERS_DIR, else <aenv cache>/verifiers
#
# Prints the venv's python on stdout; exits 1 saying why where it cannot be had.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/tool-venv.sh"

SPEC="verifiers[e2b]>=0.4,<0.5"
SDK=("e2b>=2.63,<3" "connectrpc>=0.12,<0.13")
cache="$([ "$(id -u)" -eq 0 ] && echo /var/cache/aenv || echo "${XDG_CACHE_HOME:-$HOME/.cache}/aenv")"
dir="${1:-${AENV_VERIFIERS_DIR:-$cache/verifiers}}"
venv="$dir/venv"
stamp="$venv/.aenv-verifiers"
want="$SPEC ${SDK[*]}"

works() { [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import verifiers.v1.runtimes.e2b, e2b' 2>/dev/null; }

mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9  # the set-up and a test may both get here
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && works; then
  echo "$venv/bin/python"; exit 0
fi
base="${AENV_VERIFIERS_BASE_PYTHON:-$(command -v python3.11 || command -v python3)}"
echo "installing $want into $venv with $base" >&2
rm -rf "$venv"
"$base" -m venv "$venv"
pip_steps "$venv" "$dir/pip.log" "$SPEC" "${SDK[*]}"
works || { echo "$want installed but 'import verifiers.v1.runtimes.e2b, e2b' fails" >&2; exit 1; }
echo "$want" > "$stamp"
echo "$venv/bin/python"
