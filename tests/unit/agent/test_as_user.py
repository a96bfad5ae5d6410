"""The start command's user and directory switch (``aenv.agent.as_user``), run for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aenv.runtime.base import SandboxImage
from aenv.runtime.ns.sandbox import LaunchOptions, agent_argv


def _as_user(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aenv.agent.as_user", *args], capture_output=True, text=True,
                          check=False, env={**os.environ, "PYTHONPATH": "src"})


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_runs_as_the_user_in_the_directory() -> None:
    r = _as_user("nobody", "/tmp", "/bin/sh", "-c", "id -un; pwd; echo $HOME")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["nobody", "/tmp", "/nonexistent"]


def test_empty_user_and_cwd_keep_the_callers_and_errors_are_clear() -> None:
    r = _as_user("", "", "/bin/sh", "-c", "pwd")
    assert r.returncode == 0 and r.stdout.strip() == os.getcwd()
    bad = _as_user("no-such-user-here", "", "true")
    assert bad.returncode == 127 and "cannot run as no-such-user-here" in bad.stderr
    assert _as_user("x").returncode == 2


def _opts(img: SandboxImage) -> LaunchOptions:
    return LaunchOptions(template=img, tools=Path("/tools"), allow_internet=False, default_limits=(1, 256, 64))


def test_the_ns_agent_gets_the_start_user_and_directory_only_with_a_start_command() -> None:
    img = SandboxImage("t", rootfs=Path("/r"), start_cmd="srv", start_user="user", start_cwd="/srv")
    argv = agent_argv(_opts(img))
    assert argv[argv.index("--start-user") + 1] == "user" and argv[argv.index("--start-cwd") + 1] == "/srv"
    assert "--start-user" not in agent_argv(_opts(SandboxImage("t", rootfs=Path("/r"), start_user="user")))
