# Sourced by install-harbor.sh and install-verifiers.sh: a client tool's venv of its own, made once.
# pip_steps VENV LOG STEP...: each STEP is one quoted `pip install` argument list, run in order (a later
# step may put back what an earlier one's pins pulled down); on failure, the log's tail and exit 1.
pip_steps() {
  local venv="$1" log="$2" step
  local -; set -f  # a spec like pkg[extra] is no glob
  shift 2
  : >"$log"
  for step in "$@"; do
    # shellcheck disable=SC2086  # each step is a word list on purpose
    if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check $step >>"$log" 2>&1; then
      echo "pip install $step failed (log: $log):" >&2
      grep -v '^WARNING: Location' "$log" | tail -5 >&2
      exit 1
    fi
  done
}
