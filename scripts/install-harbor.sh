#!/usr/bin/env bash
# Harbor (an agent-evaluation harness that drives sandboxes through the E2B SDK) for
# tests/integration/test_harbor.py, in a venv of its own: Harbor needs Python >= 3.12, aenv's .venv
# may be 3.11. Idempotent: a stamp in the venv names the installed spec, written last.
#
#   scripts/install-harbor.sh [DIR]     DIR: AENV_HARBOR_DIR, else <aenv cache>/harbor
#
# Python: AENV_HARBOR_BASE_PYTHON, else python3.12 / python3.13 on PATH, else pyenv's newest 3.12, then
# 3.13 (Harbor 0.26 was tried on 3.12). Prints the venv's python on stdout; exits 1 saying why where it cannot be had.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/tool-venv.sh"

SPEC="harbor[e2b]==0.26.0"
cache="$([ "$(id -u)" -eq 0 ] && echo /var/cache/aenv || echo "${XDG_CACHE_HOME:-$HOME/.cache}/aenv")"
dir="${1:-${AENV_HARBOR_DIR:-$cache/harbor}}"
venv="$dir/venv"
stamp="$venv/.aenv-harbor"

works() { [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import harbor.environments.e2b, e2b' 2>/dev/null; }

find_python() {
  local cand root
  for cand in "${AENV_HARBOR_BASE_PYTHON:-}" python3.12 python3.13; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  root="$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")"
  for cand in $(ls -d "$root"/versions/3.12.* 2>/dev/null | sort -V -r) $(ls -d "$root"/versions/3.13.* 2>/dev/null | sort -V -r); do
    [ -x "$cand/bin/python3" ] && "$cand/bin/python3" -c 'import venv' 2>/dev/null && { echo "$cand/bin/python3"; return 0; }
  done
  return 1
}

mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9  # the set-up and a test may both get here
if [ "$(cat "$stamp" 2>/dev/null)" = "$SPEC" ] && works; then
  echo "$venv/bin/python"; exit 0
fi
base="$(find_python)" || { echo "no Python >= 3.12 found (python3.12/3.13 on PATH or in pyenv; or set AENV_HARBOR_BASE_PYTHON)" >&2; exit 1; }
echo "installing $SPEC into $venv with $base" >&2
rm -rf "$venv"
"$base" -m venv "$venv"
pip_steps "$venv" "$dir/pip.log" "$SPEC"
works || { echo "$SPEC installed but 'import harbor.environments.e2b, e2b' fails" >&2; exit 1; }
echo "$SPEC" > "$stamp"
echo "$venv/bin/python"
