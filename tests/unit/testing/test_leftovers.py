"""The leftover check finds what a run started and left: processes by kind (an ns sandbox's agent is
``python3 -I -m aenv.agent``), mounts under the temp dirs, ``aenv-*`` temp dirs; and nothing that was
there before the run. Real processes (``exec -a`` gives them the names the suite's processes have)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aenv.testing import leftovers
from aenv.testing.leftovers import Proc, Record, find

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["python3.11", "-I", "-m", "aenv.agent", "--channel", "x"], "aenv process"),
        (["/usr/bin/python3", "-I", "-m", "aenv.envd"], "aenv process"),
        (["/work/.venv/bin/aenv", "serve"], "aenv process"),
        (["/usr/bin/slirp4netns", "--configure", "1234", "tap0"], "slirp4netns"),
        (["/usr/bin/qemu-system-x86_64", "-M", "microvm"], "QEMU"),
        (["containerd-shim-runc-v2", "-namespace", "moby"], "docker engine"),
        (["dockerd", "--data-root", "/tmp/x"], "docker engine"),
        (["docker-registry", "serve", "/tmp/c.yml"], "registry"),
        (["/usr/lib/python3/site-packages/ray/core/src/ray/raylet/raylet", "--x"], "ray"),
        (["redis-server", "127.0.0.1:6379"], "redis"),
    ],
)
def test_kinds(argv: list[str], kind: str) -> None:
    found = Proc(1, 0.0, tuple(argv)).kind
    assert found is not None and found.startswith(kind)


@pytest.mark.parametrize("argv", [["bash", "-c", "aenv"], ["python3", "-m", "pytest"], ["sshd"], ["aenvx", "serve"]])
def test_other_processes_are_not_a_kind(argv: list[str]) -> None:
    assert Proc(1, 0.0, tuple(argv)).kind is None


def _spawn_named(name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["bash", "-c", f"exec -a {name} sleep 60"])


def _listed(proc: subprocess.Popen[bytes]) -> list[int]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # until bash has exec'ed under its new name
        if Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"slirp4netns"):
            break
        time.sleep(0.01)
    return [p.pid for p in leftovers.processes()]


def test_a_process_started_after_the_record_is_found_and_one_from_before_is_not() -> None:
    older = _spawn_named("slirp4netns")
    try:
        assert older.pid in _listed(older)
        time.sleep(0.05)
        before = Record.now()
        newer = _spawn_named("slirp4netns")
        try:
            _listed(newer)
            pids = [p.pid for p in find(before).procs]
            assert newer.pid in pids
            assert older.pid not in pids
        finally:
            newer.kill()
            newer.wait()
    finally:
        older.kill()
        older.wait()


def test_a_new_aenv_temp_dir_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leftovers.tempfile, "gettempdir", lambda: str(tmp_path))
    (tmp_path / "aenv-old").mkdir()
    before = Record.now()
    (tmp_path / "aenv-bench-x").mkdir()
    (tmp_path / "pytest-of-root").mkdir()  # pytest keeps its own on purpose
    assert find(before, roots=[str(tmp_path)]).temps == [str(tmp_path / "aenv-bench-x")]


def test_the_cli_fails_naming_a_leftover_and_kill_ends_it(tmp_path: Path) -> None:
    record = tmp_path / "before.json"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cli = [sys.executable, "-m", "aenv.testing.leftovers"]
    subprocess.run([*cli, "record", str(record)], env=env, check=True)
    stray = _spawn_named("slirp4netns")
    try:
        _listed(stray)
        res = subprocess.run([*cli, "check", str(record), "--grace", "0", "--kill"], env=env, capture_output=True,
                             text=True)  # fmt: skip
        assert res.returncode == 1
        assert f"pid {stray.pid} (slirp4netns" in res.stderr
        assert stray.wait(timeout=10) != 0  # killed by the check
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()
    res = subprocess.run([*cli, "check", str(record), "--grace", "0"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
