"""The agent undoes ignored signal dispositions it inherits (they would reach every sandbox process)."""

from __future__ import annotations

import signal
import subprocess
import sys


def test_inherited_ignores_are_reset_for_children() -> None:
    # A child started with SIGHUP/SIGINT/SIGQUIT ignored (as under nohup or `cmd &`) runs the reset,
    # then its own child must see none of them ignored.
    code = (
        "import subprocess; from aenv.agent.main import restore_default_signals;"
        "print(sorted(restore_default_signals()));"
        "print(subprocess.run(['grep', 'SigIgn', '/proc/self/status'], capture_output=True, text=True).stdout)"
    )

    def ignore() -> None:
        for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_IGN)

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=ignore).stdout.split("\n")  # noqa: PLW1509
    assert out[0] == str(sorted([int(signal.SIGHUP), int(signal.SIGINT), int(signal.SIGQUIT)]))
    mask = int(out[1].split()[1], 16)
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT):
        assert not mask & (1 << (int(sig) - 1)), f"{sig.name} still ignored: {out[1]}"
