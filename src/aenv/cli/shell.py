"""Interactive shell in a sandbox over envd's PTY: raw local terminal, resize on SIGWINCH."""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import termios
import threading
import tty
from typing import Any


def attach_shell(sbx: Any) -> int:
    """Run an interactive login shell in ``sbx`` (an e2b Sandbox) until it exits; return its exit code."""
    from e2b import PtySize

    cols, rows = shutil.get_terminal_size((80, 24))
    out = sys.stdout.buffer

    def on_data(data: bytes) -> None:
        out.write(data)
        out.flush()

    handle = sbx.pty.create(PtySize(rows=rows, cols=cols), timeout=0)
    done = threading.Event()
    result: dict[str, int] = {}

    def waiter() -> None:
        try:
            result["code"] = handle.wait(on_pty=on_data).exit_code
        except Exception as exc:  # CommandExitException carries the code
            result["code"] = getattr(exc, "exit_code", 1)
        finally:
            done.set()

    threading.Thread(target=waiter, daemon=True).start()

    def on_winch(*_: Any) -> None:
        c, r = shutil.get_terminal_size((80, 24))
        try:
            sbx.pty.resize(handle.pid, PtySize(rows=r, cols=c))
        except Exception:
            pass

    interactive = sys.stdin.isatty()
    old = termios.tcgetattr(sys.stdin.fileno()) if interactive else None
    if interactive:
        tty.setraw(sys.stdin.fileno())
        signal.signal(signal.SIGWINCH, on_winch)
    try:
        fd = sys.stdin.fileno()
        while not done.is_set():
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                data = os.read(fd, 4096)
                if not data:
                    break
                sbx.pty.send_stdin(handle.pid, data)
        done.wait(timeout=5)
    finally:
        if old is not None:
            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, old)
    return result.get("code", 0)
