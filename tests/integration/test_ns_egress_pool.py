"""A template's start command and the egress policy on ns, the runtime driven directly: a pooled
sandbox runs its template's start command from the moment it is pooled, under the base filter, and
the policy comes only at hand-out. A sandbox with a policy whose template has a start command is
therefore not served from the pool: its start command begins in a namespace that already has the
policy. Test hosts in a netns (tests/fixtures/policyhosts.py); needs root, cgroups, slirp4netns."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from aenv.config import Settings, default_cache_dir
from aenv.runtime.base import SandboxImage, SandboxSpec
from aenv.runtime.netpolicy import ALL_TRAFFIC, parse
from aenv.runtime.network import BLOCKED_RANGES, slirp_available
from aenv.runtime.ns import NsRuntime
from tests.fixtures.envd import run_cmd
from tests.fixtures.policyhosts import ALLOWED, OTHER, PolicyHosts, policy_hosts
from tests.integration.test_ns_runtime import BUSYBOX, _static, build_busybox_rootfs

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(os.environ.get("AENV_TEST_RUNTIME", "ns") != "ns", reason="ns runtime suite"),
]

# Knocks on OTHER:80 all the time; notes every answer in /tmp/reached.
KNOCK = (f"while :; do printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {OTHER} 80 | grep -q addr= "
         "&& echo reached >> /tmp/reached; usleep 20000; done")


@pytest.fixture(scope="module")
def hosts() -> Iterator[PolicyHosts]:
    if os.geteuid() != 0 or not slirp_available():
        pytest.skip("needs root and slirp4netns")
    if not BUSYBOX.exists() or not _static(BUSYBOX):
        pytest.skip("needs Debian's busybox-static at /bin/busybox")
    with policy_hosts() as h:
        yield h


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rt(tmp_path_factory: pytest.TempPathFactory, hosts: PolicyHosts) -> AsyncIterator[NsRuntime]:
    cache = Path(os.environ.get("AENV_CACHE_DIR") or default_cache_dir())
    settings = Settings(state_dir=tmp_path_factory.mktemp("state"), cache_dir=cache, pool_size=1)
    runtime = NsRuntime(settings, pool_size=1)
    await runtime.start()
    yield runtime
    for sid in list(runtime.table.running):
        await runtime.kill(sid)
    await runtime.close()
    await runtime.reconcile(set())


def _spec(rt: NsRuntime, sid: str, template: SandboxImage) -> SandboxSpec:
    return SandboxSpec(sandbox_id=sid, template=template, workdir=rt.settings.sandboxes_dir / sid, allow_internet=True)


async def _reached(rt: NsRuntime, sid: str) -> str:
    _, out, _ = await run_cmd(rt, sid, "cat /tmp/reached 2>/dev/null; true")
    return out


async def test_a_start_command_never_runs_without_the_sandboxes_policy(
    rt: NsRuntime, tmp_path_factory: pytest.TempPathFactory
) -> None:
    knocking = SandboxImage("bb-knock", build_busybox_rootfs(tmp_path_factory.mktemp("bbknock")), start_cmd=KNOCK)
    await rt.wait_warm(knocking, True)
    await asyncio.sleep(1.5)  # the pooled one knocks meanwhile, under the base filter alone

    policy = parse([ALLOWED], [ALL_TRAFFIC], None, BLOCKED_RANGES)
    await rt.set_egress("pol1", policy)
    await rt.create(_spec(rt, "pol1", knocking))
    await asyncio.sleep(0.5)
    assert await _reached(rt, "pol1") == "", "the start command ran before the policy"
    _, out, _ = await run_cmd(rt, "pol1", f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {ALLOWED} 80")
    assert f"addr={ALLOWED}" in out  # the policy's allow holds: it is this policy, not no network

    # The control: without a policy the pooled sandbox is handed out, and its knocks were answered.
    await rt.wait_warm(knocking, True)
    await rt.create(_spec(rt, "free1", knocking))
    for _ in range(100):
        if "reached" in await _reached(rt, "free1"):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the control never reached the test host: the test proves nothing")
    for sid in ("pol1", "free1"):
        await rt.kill(sid)
