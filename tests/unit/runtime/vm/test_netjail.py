"""The vm network jail without QEMU: a plain process stands in for it (same argv wrapper, same
filter and slirp4netns wiring), so what the jail promises is checked in a second."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path

import pytest

from aenv.runtime import network
from aenv.runtime.network import SLIRP_DNS, slirp_available
from aenv.runtime.process import ProcRef
from aenv.runtime.vm import netjail

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
needs_slirp = pytest.mark.skipif(not slirp_available(), reason="slirp4netns or iptables missing")


def test_jailed_argv_runs_the_command_last_in_new_net_and_mount_namespaces(tmp_path: Path) -> None:
    argv = netjail.jailed_argv(["qemu-system-x86_64", "-name", "a,b"], tmp_path / "resolv.conf")
    assert argv[:6] == ["unshare", "--net", "--mount", "--propagation", "slave", "--"]
    assert argv[-3:] == ["qemu-system-x86_64", "-name", "a,b"]
    assert str(tmp_path / "resolv.conf") in argv


async def test_connect_refuses_a_process_still_in_the_host_namespace() -> None:
    proc = await asyncio.create_subprocess_exec("sleep", "5")
    r, w = os.pipe()
    os.close(w)
    try:
        with pytest.raises(netjail.JailError, match="own network namespace"):
            await netjail.connect(proc.pid, r, timeout=0.2)
    finally:
        proc.kill()
        await proc.wait()
    with pytest.raises(OSError):
        os.fstat(r)  # connect closed the exit fd whatever happened


def _host_rules() -> list[str]:
    """The host's iptables rules without counters or the dated comments."""
    out = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout
    return [re.sub(r"\[\d+:\d+\]", "", line) for line in out.splitlines() if not line.startswith("#")]


def _in_netns(pid: int, *cmd: str) -> str:
    return subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", *cmd], capture_output=True, text=True,
                          check=True).stdout


@needs_root
@needs_slirp
async def test_jail_has_the_filter_a_private_resolver_and_slirp_ends_with_the_process(tmp_path: Path) -> None:
    host_rules = _host_rules()
    host_resolv = Path("/etc/resolv.conf").read_bytes()
    resolv = tmp_path / "resolv.conf"
    netjail.write_resolv_conf(resolv)
    r, w = os.pipe()
    proc = await asyncio.create_subprocess_exec(*netjail.jailed_argv(["sleep", "30"], resolv), pass_fds=(w,))
    os.close(w)
    try:
        slirp = await netjail.connect(proc.pid, r)
        assert "tap0" in _in_netns(proc.pid, "ip", "-o", "link")
        rules = _in_netns(proc.pid, (network.known_tool() or "iptables-restore").replace("-restore", "-save"))
        assert "-A OUTPUT -d 10.0.0.0/8 -j REJECT" in rules
        assert f"-A OUTPUT -d {SLIRP_DNS}/32 -p udp -m udp --dport 53 -j ACCEPT" in rules
        # the host's own namespace and files are untouched
        assert _host_rules() == host_rules
        assert Path("/etc/resolv.conf").read_bytes() == host_resolv
        # what QEMU's slirp reads for DNS: slirp4netns's resolver, not the host's
        assert Path(f"/proc/{proc.pid}/root/etc/resolv.conf").read_text() == f"nameserver {SLIRP_DNS}\n"
        ref = slirp.ref
        assert ref.alive()
    finally:
        proc.kill()
        await proc.wait()
    # nothing but the exit fd tells slirp4netns to go
    assert await ProcRef(ref.pid, ref.start).wait_gone_async(5.0)
    await slirp.aclose()
