"""Lifecycle options through the unmodified E2B SDK, honoured or refused, never ignored (issue 14, item 4):
timeout 0, auto-pause at expiry keeping memory or files only, files-only pauses and reboots as cold
starts with a boot id of their own, ``started_after``, directory sizes, a command stream whose sandbox
is killed under it, and the create options aenv refuses by name. Marked ``sdk``: it runs on vm too."""

from __future__ import annotations

import datetime as dt
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from e2b import (
    CommandExitException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
)

from tests.integration.conftest import API_KEY

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _boot_id(sbx: Sandbox) -> str:
    value = sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout.strip()
    assert UUID.match(value), value
    return value


def _detail(e2b_env: dict[str, str], sandbox_id: str) -> dict[str, Any]:
    """The control plane's SandboxDetail as JSON (the SDK's SandboxInfo leaves out pauseMode)."""
    resp = httpx.get(f"{e2b_env['E2B_API_URL']}/sandboxes/{sandbox_id}", headers={"X-API-KEY": API_KEY},
                     trust_env=False)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def _wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _keeper(sbx: Sandbox) -> int:
    handle = sbx.commands.run("sleep 100000", background=True, timeout=0)
    handle.disconnect()
    return handle.pid


def _pids(sbx: Sandbox) -> set[int]:
    return {p.pid for p in sbx.commands.list()}


def test_each_sandbox_has_a_boot_id_that_a_full_pause_keeps(e2b_env: dict[str, str], runtime_name: str) -> None:
    a = Sandbox.create("base")
    b = Sandbox.create("base")
    try:
        first = _boot_id(a)
        if runtime_name == "ns":  # one kernel for all: the id is the sandbox's own, not the host's
            with open("/proc/sys/kernel/random/boot_id") as fh:
                assert first != fh.read().strip()
            assert first != _boot_id(b)
        with pytest.raises(CommandExitException):  # read-only, for sandbox root too
            a.commands.run("echo 0 > /proc/sys/kernel/random/boot_id", user="root")
        assert a.pause()
        again = Sandbox.connect(a.sandbox_id)
        assert _boot_id(again) == first  # memory kept: the same boot
    finally:
        a.kill()
        b.kill()


def test_files_only_pause_and_reboot_are_cold_starts(e2b_env: dict[str, str]) -> None:
    sbx = Sandbox.create("base", timeout=600)
    try:
        sbx.files.write("/home/user/kept.txt", "still here")
        keeper = _keeper(sbx)
        boot = _boot_id(sbx)
        assert sbx.pause(mode="filesystem") is True
        detail = _detail(e2b_env, sbx.sandbox_id)
        assert detail["state"] == "paused" and detail["pauseMode"] == "filesystem"
        assert not sbx.is_running()
        assert sbx.pause() is False  # already paused
        back = Sandbox.connect(sbx.sandbox_id)
        assert back.files.read("/home/user/kept.txt") == "still here"
        assert keeper not in _pids(back), "a files-only pause keeps no process"
        cold = _boot_id(back)
        assert cold != boot
        assert back.commands.run("echo up").stdout.strip() == "up"

        # a full pause, then connect(on_resume="reboot"): the memory is discarded, files stay
        keeper = _keeper(back)
        back.files.write("/home/user/second.txt", "written before the reboot")
        back.commands.run("sync")
        assert back.pause() is True
        assert _detail(e2b_env, sbx.sandbox_id)["pauseMode"] == "full"
        rebooted = Sandbox.connect(sbx.sandbox_id, on_resume="reboot")
        assert rebooted.files.read("/home/user/second.txt") == "written before the reboot"
        assert keeper not in _pids(rebooted)
        assert _boot_id(rebooted) not in (boot, cold)
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_timeout_zero_expires_now(e2b_env: dict[str, str]) -> None:
    killed = Sandbox.create("base", timeout=600)
    killed.set_timeout(0)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(killed.sandbox_id)
    assert Sandbox.kill(killed.sandbox_id) is False

    paused = Sandbox.create("base", timeout=600, lifecycle={"on_timeout": "pause"})
    try:
        keeper = _keeper(paused)
        paused.set_timeout(0)
        assert Sandbox.get_info(paused.sandbox_id).state == SandboxState.PAUSED
        assert _detail(e2b_env, paused.sandbox_id)["pauseMode"] == "full"
        assert keeper in _pids(Sandbox.connect(paused.sandbox_id))
    finally:
        Sandbox.kill(paused.sandbox_id)


def test_auto_pause_at_expiry_keeps_files_only_when_asked(e2b_env: dict[str, str]) -> None:
    lifecycle: Any = {"on_timeout": {"action": "pause", "keep_memory": False}}
    sbx = Sandbox.create("base", timeout=600, lifecycle=lifecycle)
    try:
        sbx.files.write("/home/user/at-expiry.txt", "files only")
        keeper = _keeper(sbx)
        sbx.set_timeout(2)  # the reaper's own expiry, soon (a short create timeout could end the setup)
        _wait_for(lambda: Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED, 60, "the expiry pause")
        info = Sandbox.get_info(sbx.sandbox_id)
        assert info.lifecycle == {"on_timeout": "pause", "auto_resume": False}
        assert _detail(e2b_env, sbx.sandbox_id)["pauseMode"] == "filesystem"
        back = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert back.files.read("/home/user/at-expiry.txt") == "files only"
        assert keeper not in _pids(back)
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_auto_resume_wakes_a_full_pause(e2b_env: dict[str, str]) -> None:
    sbx = Sandbox.create("base", timeout=600, lifecycle={"on_timeout": {"action": "pause", "mode": "full"},
                                                         "auto_resume": True})
    try:
        keeper = _keeper(sbx)
        assert sbx.pause()
        assert keeper in _pids(sbx)  # the request itself woke it, where it stopped
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING
    finally:
        sbx.kill()


def test_list_started_after(e2b_env: dict[str, str]) -> None:
    before = dt.datetime.now()  # naive: the SDK reads it as local time
    sbx = Sandbox.create("base")
    try:
        info = sbx.get_info()
        ids = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(started_after=before)).next_items()]
        assert sbx.sandbox_id in ids
        ids = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(started_after=info.started_at)).next_items()]
        assert sbx.sandbox_id in ids, "at or after: a sandbox started at that instant is listed"
        later = info.started_at + dt.timedelta(microseconds=1)
        ids = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(started_after=later)).next_items()]
        assert sbx.sandbox_id not in ids
    finally:
        sbx.kill()


def test_directory_size_as_e2b_reports_it(sandbox: Sandbox) -> None:
    sandbox.files.make_dir("/home/user/empty-dir")
    assert sandbox.files.get_info("/home/user/empty-dir").size == 4096  # ext4's one block, E2B's root
    assert sandbox.files.get_info("/etc").size >= 4096
    sandbox.files.write("/home/user/five.txt", "12345")
    assert sandbox.files.get_info("/home/user/five.txt").size == 5
    listed = {e.name: e.size for e in sandbox.files.list("/home/user")}
    assert listed["empty-dir"] == 4096 and listed["five.txt"] == 5


def test_a_command_whose_sandbox_is_killed_ends_as_not_running(e2b_env: dict[str, str]) -> None:
    sbx = Sandbox.create("base")
    handle = sbx.commands.run("sleep 600", background=True, timeout=0)
    # the stream must be flowing before the kill (a background run returns after the start event)
    killer = threading.Timer(1.0, Sandbox.kill, args=(sbx.sandbox_id,))
    killer.start()
    try:
        with pytest.raises(SandboxNotRunningException) as info:
            handle.wait()
    finally:
        killer.join()
    message = str(info.value)
    # the proxy cuts the stream (connect_end.py); the SDK probes /health, hears "not found" and says so
    assert "killed or reached its end of life" in message, message


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"network": {"egress_proxy": {"address": "proxy.example.com:1080"}}}, "network.egressProxy"),
        ({"mcp": {"exa": {"apiKey": "k"}}}, "mcp"),
    ],
    ids=["network", "mcp"],
)
def test_create_options_aenv_does_not_do_are_refused_by_name(
    e2b_env: dict[str, str], options: dict[str, Any], named: str
) -> None:
    before = {s.sandbox_id for s in Sandbox.list().next_items()}
    with pytest.raises(SandboxException) as info:
        Sandbox.create("base", **options)
    assert "400" in str(info.value) and named in str(info.value), info.value
    assert {s.sandbox_id for s in Sandbox.list().next_items()} == before  # nothing was started


def test_allow_internet_access_still_works(e2b_env: dict[str, str]) -> None:
    sbx = Sandbox.create("base", allow_internet_access=False)
    try:
        assert sbx.get_info().allow_internet_access is False
    finally:
        sbx.kill()
