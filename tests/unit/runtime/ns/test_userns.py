"""The shared user namespace of ns sandboxes: its range is checked, and the namespace maps it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aenv.agent import launch
from aenv.runtime.ns.userns import RANGE, SharedUserns, mapped_base


@pytest.mark.parametrize("uid", [0, -1, 2**32 - RANGE])
def test_range_must_fit_above_host_root(uid: int) -> None:
    with pytest.raises(ValueError, match="first host uid must be in"):
        SharedUserns(uid)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nsenter") is None, reason="needs root and nsenter")
def test_namespace_maps_uids_and_gids_to_the_range() -> None:
    ns = SharedUserns(1_300_000_000)
    try:
        fd = ns.fd()
        assert ns.fd() == fd  # made once
        out = subprocess.run(["nsenter", f"--user=/proc/self/fd/{fd}", "cat", "/proc/self/uid_map",
                              "/proc/self/gid_map"], pass_fds=(fd,), capture_output=True, text=True, check=True)
        assert [" ".join(line.split()) for line in out.stdout.splitlines()] == [f"0 1300000000 {RANGE}"] * 2
    finally:
        ns.close()
    ns.close()  # idempotent


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")


@needs_root
def test_mapped_base_tells_a_user_namespace_from_the_hosts() -> None:
    ns = SharedUserns(1_300_000_000)
    try:
        fd = ns.fd()
        child = subprocess.Popen(["nsenter", f"--user=/proc/self/fd/{fd}", "sleep", "30"], pass_fds=(fd,))
        try:
            deadline = time.monotonic() + 5
            while mapped_base(child.pid) is None and time.monotonic() < deadline:  # until nsenter has joined
                time.sleep(0.01)
            assert mapped_base(child.pid) == 1_300_000_000
        finally:
            child.kill()
            child.wait()
    finally:
        ns.close()
    assert mapped_base(os.getpid()) is None


@needs_root
def test_unusable_on_names_a_filesystem_that_cannot_be_idmapped(tmp_path: Path) -> None:
    """ext4/btrfs/tmpfs take idmapped mounts; an overlay mount (what a state dir inside a container
    often is) does not: the start-up check names it, so the server runs without the namespace."""
    ns = SharedUserns(1_300_000_000)
    lower, upper, work, merged = (tmp_path / n for n in ("lower", "upper", "work", "merged"))
    for d in (lower, upper, work, merged):
        d.mkdir()
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lower},upperdir={upper},workdir={work}",
                    str(merged)], check=True)
    try:
        assert ns.unusable_on([tmp_path, tmp_path / "not" / "made" / "yet"]) is None
        why = ns.unusable_on([tmp_path, merged / "state"])
        assert why is not None and str(merged) in why and "idmapped" in why
    finally:
        subprocess.run(["umount", str(merged)], check=True)
        ns.close()


def test_images_say_which_namespace_they_restore_into(tmp_path: Path) -> None:
    """Images restore in the mode they were dumped in, not the server's: plain ones plainly even with
    a user namespace configured; user-namespaced ones only into the same mapping, else a clear error."""
    from aenv.runtime.ns import checkpoint

    ns = SharedUserns(1_300_000_000)
    plain, old, marked = tmp_path / "plain", tmp_path / "old", tmp_path / "marked"
    for d in (plain, old, marked):
        d.mkdir()
    (old / "userns-14.img").write_bytes(b"")  # dumped in a user namespace before the mark existed
    (marked / checkpoint.USERNS_MARK).write_text("1200000000")
    assert [checkpoint.dumped_userns(d) for d in (plain, old, marked)] == [None, 0, 1_200_000_000]
    assert checkpoint._userns_for(plain, ns) is None and checkpoint._userns_for(plain, None) is None
    assert checkpoint._userns_for(old, ns) is ns
    with pytest.raises(checkpoint.CheckpointError, match="host uid 1200000000; this server's is 1300000000"):
        checkpoint._userns_for(marked, ns)
    with pytest.raises(checkpoint.CheckpointError, match="without one"):
        checkpoint._userns_for(old, None)


def test_restore_in_a_user_namespace_binds_the_sources_read_only_and_has_no_netns_hook(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on the plain path every restored host bind is born read-only: the mounts made for CRIU bind
    each source (the staged tools and boot id by their staged paths) read-only over itself. There is no
    fresh network namespace before CRIU ends, so an ``on_netns`` hook is refused."""
    from aenv.runtime.ns import checkpoint, criu

    seen: dict[str, Any] = {}

    def run_criu(argv: list[str], log: Path, what: str, on_ready: object = None,
                 mounts: Callable[[], None] | None = None, env: dict[str, str] | None = None) -> None:
        assert mounts is not None
        seen["argv"] = argv
        mounts()  # in the private mount namespace CRIU is spawned into
        (tmp_path / "run" / "criu-restore.pid").write_text("77\n")

    monkeypatch.setattr(launch, "restore_mounts", lambda cfg: seen.setdefault("cfg", cfg))

    ns = SharedUserns(1_300_000_000)
    monkeypatch.setattr(ns, "fd", lambda: 9)
    monkeypatch.setattr(checkpoint, "run_criu", run_criu)
    monkeypatch.setattr(checkpoint, "end_restore_network", lambda pid: None)  # no tree: CRIU does not run
    monkeypatch.setattr(checkpoint, "kdat_cache", lambda exe: None)
    monkeypatch.setattr(criu, "KDAT_BASE", tmp_path)
    monkeypatch.setattr(criu, "ro_remount_action", lambda masked, base=tmp_path, volumes=(), lo_up=False: "/action.sh")
    monkeypatch.setattr(os, "chown", lambda *a: None)
    (tmp_path / "run").mkdir()
    (tmp_path / "i").mkdir()
    (tmp_path / "i" / checkpoint.USERNS_MARK).write_text("1300000000")  # what dump writes for such a tree
    kw: dict[str, Any] = {"lowers": ["/l"], "upper": tmp_path / "u", "work": tmp_path / "w", "merged": tmp_path / "m",
                          "run_dir": tmp_path / "run", "tools": Path("/tools"), "boot_id": tmp_path / "boot_id",
                          "procs_files": []}
    with pytest.raises(ValueError, match="network namespace"):
        checkpoint.restore("/c", tmp_path / "i", **kw, userns=ns, on_netns=lambda pid: None)
    assert checkpoint.restore("/c", tmp_path / "i", **kw, userns=ns) == 77
    cfg = seen["cfg"]
    stage = Path(cfg["stage_dir"])
    read_only = {src: flags for src, flags in cfg["read_only"]}
    assert read_only[str(stage / "tools")] == criu.MS_NOSUID | criu.MS_NODEV
    assert read_only[str(stage / "boot_id")] == criu.MS_NOSUID | criu.MS_NODEV | criu.MS_NOEXEC
    assert read_only["/dev/null"] == 0 and str(stage / "run") not in read_only
    assert cfg["userns"]["fd"] == 9 and "--inherit-fd" not in seen["argv"] and not stage.exists()
    argv = seen["argv"]
    assert argv[argv.index("--empty-ns") + 1] == "net"  # bare but for loopback (criu.LO_UP)
    assert argv[0] == "/bin/sh" and "/c" in argv  # CRIU itself behind the cgroup wrapper, no launcher


async def test_filter_of_a_user_namespaced_restore_goes_in_after_criu_into_the_sandboxs_init(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No hook during CRIU (its network namespace is the image's); afterwards the filter is written only
    while the pid is the sandbox's init (start time and cgroup), else the restore fails."""
    import asyncio
    from types import SimpleNamespace

    from aenv.errors import RuntimeFailure
    from aenv.runtime.ns import restored
    from aenv.runtime.ns.table import NsTable

    sbx = SimpleNamespace(name="s1", allow_internet=True, cgroup=SimpleNamespace(pids=lambda: [5]))
    host = SimpleNamespace(userns=SharedUserns(1_300_000_000), host_addrs=[])
    restorer = restored.Restorer(host, NsTable())  # type: ignore[arg-type]
    assert restorer.filter_while_restoring(sbx, asyncio.get_running_loop()) is None  # type: ignore[arg-type]
    installed: list[int] = []

    async def install(sid: str, pid: int, addrs: list[str]) -> None:
        installed.append(pid)

    monkeypatch.setattr(restored.ENFORCER, "install", install)
    await restorer._filter_restored(sbx, SimpleNamespace(pid=5, alive=lambda: True))  # type: ignore[arg-type]
    assert installed == [5]
    with pytest.raises(RuntimeFailure, match="ended before its filter"):
        await restorer._filter_restored(sbx, SimpleNamespace(pid=6, alive=lambda: True))  # type: ignore[arg-type]
    assert installed == [5]


def test_restores_follow_the_images_range_and_refuse_another_teams(tmp_path: Path) -> None:
    """Processes cannot change uid range: a restore goes where the images were dumped (the shared range
    for images of before teams had their own), a sandbox's own released processes wherever they were,
    and another team's range (its published snapshot) is refused before anything is made."""
    from aenv.config import Settings
    from aenv.errors import InvalidRequest
    from aenv.runtime.ns.checkpoint import USERNS_MARK
    from aenv.runtime.ns.host import NsHost

    first = 1_200_000_000
    host = NsHost(Settings(state_dir=tmp_path / "state", ns_userns_uid=first), tools_dir=None, debug_log=False,
                  launch_timeout=1.0)
    assert host.userns is not None and host.userns_at(0) is host.userns
    assert host.userns_at(2) is host.userns_at(2)  # one namespace per range, made lazily
    assert [ns.host_uid for ns in (host.userns_at(2), host.userns_at(5))] == [first + 2 * RANGE, first + 5 * RANGE]
    assert host.ranges_in_use() == [first, first + 2 * RANGE, first + 5 * RANGE]

    def images(base: int | None) -> Path:
        d = tmp_path / f"img-{base}"
        d.mkdir(exist_ok=True)
        if base is not None:
            (d / USERNS_MARK).write_text(str(base))
        return d

    assert host.userns_for_images(images(first + 2 * RANGE), 2) is host.userns_at(2)  # its own range
    assert host.userns_for_images(images(first), 2) is host.userns  # from before ranges per team
    assert host.userns_for_images(images(None), 2) is host.userns_at(2)  # host-ns images: checkpoint decides
    with pytest.raises(InvalidRequest, match="another team's uid range"):
        host.userns_for_images(images(first + 5 * RANGE), 2)
    assert host.userns_for_images(images(first + 5 * RANGE), 2, own=True) is host.userns_at(5)
    assert host.userns_for_images(images(first + 7 * RANGE), 0, own=True) is host.userns_at(7)
    odd = host.userns_for_images(images(900_000_000), 2)  # another ns_userns_uid's: checkpoint refuses it
    assert odd is host.userns_at(2)
    host.close_ranges()
    assert host.ranges_in_use() == [first]
