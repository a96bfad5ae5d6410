"""ns sandboxes in a user namespace (``ns_userns_uid``): root inside is a non-zero host uid, files on
disk keep their unshifted owners, and what sandboxes do today (root and ``user`` commands, envd's
file writes, ports < 1024 for root, filesystem forks) still works. NsRuntime driven directly, on the
busybox rootfs of ``test_ns_runtime``. Needs root, cgroups and busybox-static; skips otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from aenv.config import Settings, default_cache_dir
from aenv.runtime.base import SandboxImage
from aenv.runtime.envd_client import as_user, build_request, exchange
from aenv.runtime.network import slirp_available
from aenv.runtime.ns import NsRuntime, criu
from tests.fixtures.envd import run_cmd
from tests.integration.test_ns_runtime import ENVD, busybox_root, rt, spec_for, template

pytestmark = [pytest.mark.asyncio(loop_scope="module")]
__all__ = ["busybox_root", "rt", "template"]  # fixtures: rt runs on the settings below

BASE = 1_200_000_000  # far above any /etc/subuid range a host hands out
MAP = f"0 {BASE} 65536"


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    cache = Path(os.environ.get("AENV_CACHE_DIR") or default_cache_dir())
    return Settings(state_dir=tmp_path_factory.mktemp("state"), cache_dir=cache, pool_size=1, ns_userns_uid=BASE)


async def sh(rt: NsRuntime, sid: str, cmd: str, user: str = "root") -> str:
    code, out, err = await run_cmd(rt, sid, cmd, user=user)
    assert code == 0, (cmd, out, err)
    return out


def _maps(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines()]


async def two_children(rt: NsRuntime, settings: Settings, template: SandboxImage, sid: str, snap: Path, mode: str,
                       children: list[str], allow_internet: bool = False) -> bool:
    """Snapshot ``sid`` into ``snap`` and start two children from it at once, as a fork does (their IDs
    go into ``children``); whether the snapshot had the mode asked for."""
    snap.mkdir()
    result = await rt.snapshot(sid, snap, mode)  # type: ignore[arg-type]
    specs = [spec_for(settings, template, allow_internet=allow_internet) for _ in range(2)]
    children += [s.sandbox_id for s in specs]
    await asyncio.gather(*(rt.create_from_snapshot(s, snap, result) for s in specs))
    return bool(result.mode == mode)


def _upper(rt: NsRuntime, sid: str) -> Path:
    return rt.sandbox(sid).paths.upper


async def test_root_and_user_are_shifted_host_uids(rt: NsRuntime, settings: Settings, template: SandboxImage) -> None:
    assert f"user namespace (uids 0-65535 are host {BASE}.." in rt.capabilities()["isolation"]
    spec = spec_for(settings, template)
    state = await rt.create(spec)
    try:
        for user in ("root", "user"):
            out = await sh(rt, spec.sandbox_id, "cat /proc/self/uid_map /proc/self/gid_map", user=user)
            assert _maps(out) == [MAP, MAP]
        assert (await sh(rt, spec.sandbox_id, "id -u; id -u user")).split() == ["0", "1000"]
        # the host sees the sandbox's root, its init, as BASE: never host uid 0
        status = Path(f"/proc/{state.data['pid']}/status").read_text()
        uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
        assert uids == [str(BASE)] * 4
        # the launcher left behind to reap the init holds no capability and nothing of the host but stdio
        stage1 = rt.sandbox(spec.sandbox_id)._stage1
        assert stage1 is not None
        caps = dict(line.split(":\t") for line in Path(f"/proc/{stage1.pid}/status").read_text().splitlines())
        assert int(caps["CapEff"], 16) == int(caps["CapPrm"], 16) == 0
        assert sorted(os.listdir(f"/proc/{stage1.pid}/fd")) == ["0", "1", "2"]
        if json.loads((rt.host.tools / "MANIFEST.json").read_text()).get("reap"):  # type: ignore[operator]
            # it is the bundle's static reaper by then, not an interpreter (a few hundred KB, not ~6 MB)
            assert caps["Name"] == "reap" and int(caps["NoNewPrivs"]) == 1
            assert int(caps["RssAnon"].split()[0]) < 1024, caps["RssAnon"]
        # and the sandbox cannot map itself any further: no capability over its user namespace's parent
        code, _, _ = await run_cmd(rt, spec.sandbox_id, "echo '0 0 1' > /proc/self/uid_map")
        assert code != 0
    finally:
        await rt.kill(spec.sandbox_id)


async def test_files_keep_unshifted_owners_on_disk(rt: NsRuntime, settings: Settings, template: SandboxImage) -> None:
    spec = spec_for(settings, template)
    await rt.create(spec)
    try:
        await sh(rt, spec.sandbox_id, "echo r > /root/by-root")
        await sh(rt, spec.sandbox_id, "echo u > /home/user/by-user", user="user")
        boundary = "BOUND"
        body = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="up.txt"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n").encode() + b"hello\r\n" + f"--{boundary}--\r\n".encode()
        raw = build_request("POST", "/files?path=/home/user/up.txt", body, as_user("user"),
                            content_type=f"multipart/form-data; boundary={boundary}")
        response = await exchange(await rt.open_stream(spec.sandbox_id, ENVD), raw)
        assert response.status == 200, response.body
        inside = await sh(rt, spec.sandbox_id, "stat -c '%u:%g %n' /root/by-root /home/user/by-user /home/user/up.txt")
        assert inside.split("\n")[:3] == ["0:0 /root/by-root", "1000:1000 /home/user/by-user",
                                          "1000:1000 /home/user/up.txt"]
        upper = _upper(rt, spec.sandbox_id)
        for rel, owner in (("root/by-root", 0), ("home/user/by-user", 1000), ("home/user/up.txt", 1000)):
            st = (upper / rel).stat()
            assert (st.st_uid, st.st_gid) == (owner, owner), rel
    finally:
        await rt.kill(spec.sandbox_id)


async def test_root_listens_below_1024_and_mounts_stay_out_of_reach(rt: NsRuntime, settings: Settings,
                                                                    template: SandboxImage) -> None:
    spec = spec_for(settings, template)
    await rt.create(spec)
    try:
        out = await sh(rt, spec.sandbox_id, "nc -l -p 80 & sleep 0.3; netstat -ltn; kill %1")
        assert ":80 " in out
        # the network namespace is the user namespace's: root's CAP_NET_RAW counts in it, as before
        assert " 0% packet loss" in await sh(rt, spec.sandbox_id, "ping -c1 -W2 127.0.0.1")
        code, _, err = await run_cmd(rt, spec.sandbox_id, "nc -l -p 81", user="user")
        assert code != 0 and "denied" in err  # as without a user namespace: no CAP_NET_BIND_SERVICE
        for cmd in ("mount -t tmpfs none /mnt", "umount /proc/kcore", "mount -o remount,rw /.aenv",
                    "touch /.aenv/x", "chown 0 /dev/null"):
            code, _, _ = await run_cmd(rt, spec.sandbox_id, cmd)
            assert code != 0, cmd
    finally:
        await rt.kill(spec.sandbox_id)


@pytest.mark.skipif(not criu.probe().usable, reason="needs CRIU >= 4.2")
async def test_process_fork_children_keep_the_mapping_and_their_processes(
        rt: NsRuntime, settings: Settings, template: SandboxImage, tmp_path: Path) -> None:
    spec = spec_for(settings, template)
    await rt.create(spec)
    children: list[str] = []
    try:
        assert rt.snapshots.best_mode(rt.sandbox(spec.sandbox_id)) == "full"
        await sh(rt, spec.sandbox_id, "echo u > /home/user/u; (i=0; while true; do i=$((i+1)); echo $i > /tmp/tick; "
                                      "sleep 0.05; done) >/dev/null 2>&1 &", user="user")
        assert await two_children(rt, settings, template, spec.sandbox_id, tmp_path / "full", "full", children)
        for sid in children:
            out = await sh(rt, sid, "cat /proc/self/uid_map; stat -c %u /home/user/u; a=$(cat /tmp/tick); "
                                    "sleep 0.5; b=$(cat /tmp/tick); test $a != $b && echo ticking")
            lines = _maps(out)
            assert lines[0] == MAP and lines[1] == "1000" and lines[-1] == "ticking", out
            await sh(rt, sid, "echo more >> /home/user/u", user="user")
            assert (_upper(rt, sid) / "home/user/u").stat().st_uid == 1000
        # a restored child can itself be dumped again (its namespaces all belong to its user namespace)
        again = tmp_path / "again"
        again.mkdir()
        assert (await rt.snapshot(children[0], again, "full")).mode == "full"
    finally:
        for sid in [spec.sandbox_id, *children]:
            await rt.kill(sid)


async def test_filesystem_fork_child_has_the_mapping(rt: NsRuntime, settings: Settings, template: SandboxImage,
                                                     tmp_path: Path) -> None:
    spec = spec_for(settings, template)
    await rt.create(spec)
    children: list[str] = []
    try:
        await sh(rt, spec.sandbox_id, "echo a > /root/a; rm /etc/group")
        await sh(rt, spec.sandbox_id, "echo u > /home/user/u", user="user")
        await two_children(rt, settings, template, spec.sandbox_id, tmp_path / "snap", "filesystem", children)
        for sid in children:
            out = await sh(rt, sid, "cat /proc/self/uid_map; cat /root/a; test -e /etc/group || echo gone; "
                                    "stat -c %u /home/user/u")
            assert _maps(out) == [MAP, "a", "gone", "1000"]
            await sh(rt, sid, "echo more >> /home/user/u", user="user")  # copy-up of a lower file as user
    finally:
        for sid in [spec.sandbox_id, *children]:
            await rt.kill(sid)


@pytest.mark.skipif(not slirp_available(), reason="needs slirp4netns and iptables")
async def test_internet_sandbox_gets_its_tap_in_the_namespace(rt: NsRuntime, settings: Settings,
                                                              template: SandboxImage, tmp_path: Path) -> None:
    spec = spec_for(settings, template, allow_internet=True)
    await rt.create(spec)
    children: list[str] = []
    try:
        out = await sh(rt, spec.sandbox_id, "cat /proc/self/uid_map; ip -o addr show tap0")
        assert _maps(out)[0] == MAP and "10.0.2.100/24" in out
        if not criu.probe().usable:
            return
        # a process fork dumps the network namespace: the tap (slirp4netns's) is set aside for the dump
        # and comes back configured; each child gets a tap of its own
        assert await two_children(rt, settings, template, spec.sandbox_id, tmp_path / "full", "full", children,
                                  allow_internet=True)
        for sid in (spec.sandbox_id, *children):
            out = await sh(rt, sid, "cat /proc/self/uid_map; ip -o addr show tap0; ip route")
            assert _maps(out)[0] == MAP and "10.0.2.100/24" in out and "default via 10.0.2.2 dev tap0" in out, sid
    finally:
        for sid in [spec.sandbox_id, *children]:
            await rt.kill(sid)
