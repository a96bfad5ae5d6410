"""An earlier commit of aenv as a baseline in the same run: ``python -m bench --against REV``.

The commit is checked out into a temporary git worktree and served by a second server on its own state
dir, with the worktree's ``src`` first on ``PYTHONPATH`` (the venv's editable install stays on the current
checkout). Scenarios that compare commits (create → first command, ``commands.run``) sample both servers
alternately, so machine drift hits both alike: "no regression" is then a claim about one run, not two.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class PreviousServer:
    system: str  # the row label, e.g. aenv-ns@c2f83ca
    url: str


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


@contextlib.contextmanager
def previous_server(rev: str, runtime: str) -> Iterator[PreviousServer]:
    from aenv.testing.server import discard_vm_state, kill_sandboxes, start_server, stop_server

    short = _git("rev-parse", "--short", rev)
    tmp = Path(tempfile.mkdtemp(prefix=f"aenv-bench-{short}-"))
    tree = tmp / "src-tree"
    _git("worktree", "add", "--detach", str(tree), rev)
    server = None
    try:
        env = {"PYTHONPATH": os.pathsep.join([str(tree / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               "AENV_POOL_SIZE": "4", "AENV_KSM": "auto"}
        # vm: an older commit may boot another guest kernel, built on its first start (~6 min on 2 cores)
        server = start_server(tmp, runtime, env, ready_s=900 if runtime == "vm" else 240)
        served_from = subprocess.run(
            [sys.executable, "-c", "import aenv; print(aenv.__file__)"],
            env={**os.environ, **env}, capture_output=True, text=True, check=False,
        ).stdout.strip()
        if served_from and not served_from.startswith(str(tree)):
            raise RuntimeError(f"--against {rev}: the second server would import aenv from {served_from}")
        yield PreviousServer(f"aenv-{runtime}@{short}", server.url)
    finally:
        if server is not None:
            kill_sandboxes(server)  # an older commit may not know stop_sandboxes_on_exit
            stop_server(server)
            if runtime == "vm":
                discard_vm_state(server.state_dir)
        _git("worktree", "remove", "--force", str(tree))
        if str(tmp) not in Path("/proc/mounts").read_text():  # never rmtree through a live mount
            shutil.rmtree(tmp, ignore_errors=True)
