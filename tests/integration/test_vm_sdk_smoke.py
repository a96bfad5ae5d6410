"""A short smoke of the microVM runtime through the real e2b SDK against a real ``aenv serve --runtime vm``.

In the default CI selection (the full SDK suite on vm is ``AENV_TEST_RUNTIME=vm``): create, run, files,
fresh clock and randomness after restore and fork, pause that releases the VM to disk (the release
period is 0 here, so QEMU really ends), a server restart while released, connect, kill. Skipped with
the reason when QEMU, the guest kernel or root are missing. Every QEMU of this module's state dir is
reaped and its template RAM removed afterwards.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from aenv.config import Settings
from aenv.testing.server import API_KEY, KEEP_SANDBOXES, Server, discard_vm_state, start_server, stop_server

ENV = {
    **KEEP_SANDBOXES,  # the released sandbox outlives a graceful restart
    "AENV_POOL_SIZE": "1",
    "AENV_VM_RELEASE_PAUSED_AFTER": "0",
}


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the vm runtime needs root"
    from aenv.runtime.vm.runtime import unavailable_reason

    return unavailable_reason(Settings())


_reason = _unavailable()
pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(_reason is not None, reason=f"vm runtime unavailable: {_reason}"),
    pytest.mark.timeout(300),
]


def _qemu_pids(*markers: str) -> list[int]:
    from aenv.runtime.vm.reconcile import qemu_cmdlines

    return [pid for pid, cmd in qemu_cmdlines().items() if any(m.encode() in cmd for m in markers)]


@pytest.fixture(scope="module")
def vm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vm-smoke")
    box: dict[str, Any] = {"tmp": tmp, "server": start_server(tmp, "vm", extra_env=ENV)}
    old = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "NO_PROXY")}
    os.environ.update(
        E2B_API_URL=box["server"].url,
        E2B_SANDBOX_URL=box["server"].url,
        E2B_API_KEY=API_KEY,
        NO_PROXY="127.0.0.1",
    )
    try:
        yield box
    finally:
        srv: Server = box["server"]
        import httpx

        try:
            for s in httpx.get(
                srv.url + "/v2/sandboxes", headers={"X-API-KEY": API_KEY}, trust_env=False
            ).json():
                httpx.delete(
                    f"{srv.url}/sandboxes/{s['sandboxID']}", headers={"X-API-KEY": API_KEY}, trust_env=False
                )
        except Exception:
            pass
        stop_server(srv)
        discard_vm_state(srv.state_dir)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _clock_skew(sbx: Any) -> float:
    before = time.time()
    guest = float(sbx.commands.run("date +%s").stdout.strip())
    after = time.time()
    return max(0.0, before - 1 - guest, guest - after)  # date truncates to whole seconds


def _host_facts(box: dict[str, Any], sandbox_id: str) -> str:
    """What envd answered to the runtime's clock/RNG refresh (recorded in the runtime state)."""
    import json
    import sqlite3

    db = sqlite3.connect(f"file:{box['tmp'] / 'state' / 'aenv.db'}?mode=ro", uri=True, timeout=5)
    try:
        row = db.execute("SELECT runtime_state FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
    finally:
        db.close()
    return str(json.loads(row[0]).get("host_facts", "")) if row else ""


def _urandom(sbx: Any) -> str:
    return str(sbx.commands.run("head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'").stdout.strip())


def test_vm_smoke(vm_server: dict[str, Any]) -> None:
    from e2b import Sandbox

    t0 = time.monotonic()
    sbx = Sandbox.create("base", timeout=300)
    created = time.monotonic() - t0
    try:
        r = sbx.commands.run("echo hello; uname -r; grep -c hypervisor /proc/cpuinfo")
        assert r.exit_code == 0 and r.stdout.startswith("hello\n")
        assert r.stdout.split()[1] != os.uname().release, "the guest kernel must not be the host's"
        sbx.files.write("/home/user/smoke.txt", "vm-smoke")
        assert sbx.files.read("/home/user/smoke.txt") == "vm-smoke"
        assert _clock_skew(sbx) <= 3, "create must set the guest clock to host time"

        # fork(2): same files, own identities, distinct randomness (the CRNG is reseeded per child)
        children = sbx.fork(count=2)
        assert all(not isinstance(c, Exception) for c in children), children
        try:
            for c in children:
                assert c.files.read("/home/user/smoke.txt") == "vm-smoke"
            for c in children:  # envd really set the clock and forced a CRNG reseed
                facts = _host_facts(vm_server, c.sandbox_id)
                assert "hostTime=set" in facts and "reseed" in facts, facts
            rands = {_urandom(c) for c in children} | {_urandom(sbx)}
            assert len(rands) == 3, rands
            assert all(_clock_skew(c) <= 3 for c in children)
        finally:
            for c in children:
                c.kill()

        # pause releases the VM to disk at once (period 0): no QEMU left for this sandbox
        h = sbx.commands.run(
            "while true; do date +%s > /tmp/tick; sleep 0.2; done", background=True, timeout=0
        )
        assert sbx.pause() is True
        assert not _qemu_pids(f"/{sbx.sandbox_id}/"), "a released sandbox must have no QEMU process"

        # the released sandbox survives a server restart
        srv: Server = vm_server["server"]
        stop_server(srv)
        time.sleep(2)  # the guest clock stands still meanwhile; resume must fix it
        vm_server["server"] = start_server(
            vm_server["tmp"], "vm", extra_env=ENV, port=int(srv.url.rsplit(":", 1)[1])
        )
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"

        resumed = Sandbox.connect(sbx.sandbox_id)
        assert resumed.files.read("/home/user/smoke.txt") == "vm-smoke"
        assert any(p.pid == h.pid for p in resumed.commands.list()), "processes survive release and restart"
        assert _clock_skew(resumed) <= 3, "resume from disk must set the guest clock"
        print(f"\nvm smoke: create {created * 1000:.0f} ms, total {time.monotonic() - t0:.1f} s")
    finally:
        sbx.kill()
