from __future__ import annotations

from pathlib import Path

import pytest

from aenv.agent import launch as launcher
from aenv.runtime.base import SandboxImage
from aenv.runtime.ns.sandbox import LaunchOptions, agent_argv


def test_overlay_options_order_and_validation() -> None:
    opts = launcher.overlay_options(["/l/top", "/l/base"], "/s/upper", "/s/work")
    assert opts == "lowerdir=/l/top:/l/base,upperdir=/s/upper,workdir=/s/work"
    with pytest.raises(ValueError):
        launcher.overlay_options(["/a:b"], "/u", "/w")
    with pytest.raises(ValueError):
        launcher.overlay_options(["/a"], "/u,x", "/w")


def test_dangerous_capabilities_are_dropped() -> None:
    # SYS_ADMIN 21, MKNOD 27, DAC_READ_SEARCH 2, NET_ADMIN 12, SYS_PTRACE 19, SYS_MODULE 16, SYS_RAWIO 17
    for cap in (21, 27, 2, 12, 19, 16, 17):
        assert cap not in launcher.KEEP_CAPS


def test_agent_argv_runs_from_tools_mount_without_host_paths() -> None:
    t = SandboxImage("t", Path("/rootfs"), env={"A": "1"}, start_cmd="echo hi", user="user")
    argv = agent_argv(LaunchOptions(t, Path("/host/cache/tools/x"), False, (1, 256, 64)))
    assert argv[0] == "/.aenv/lib/ld-linux-x86-64.so.2"
    assert "--library-path" in argv and "/.aenv/lib" in argv
    assert not any("/host/" in a for a in argv)
    assert argv[argv.index("--channel") + 1] == "unix-listen:/.aenv-run/mux.sock"
    assert argv[argv.index("--start-cmd") + 1] == "echo hi"
