"""``runtime/ns/procimage.py``: which starts may restore a template's process image, and its key."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from aenv.runtime.base import SandboxImage
from aenv.runtime.ns import procimage
from aenv.runtime.ns.criu import CriuStatus

BASE = SandboxImage("base", Path("/rootfs/base"), env={"A": "1"})


def test_the_key_follows_what_the_processes_depend_on() -> None:
    key = procimage.image_key(BASE, True, Path("/tools/1"), "/criu")
    assert key == procimage.image_key(replace(BASE, template_id="other-name"), True, Path("/tools/1"), "/criu")
    for changed in (procimage.image_key(BASE, False, Path("/tools/1"), "/criu"),  # resolv.conf in the upper
                    procimage.image_key(replace(BASE, env={"A": "2"}), True, Path("/tools/1"), "/criu"),
                    procimage.image_key(replace(BASE, user="root"), True, Path("/tools/1"), "/criu"),
                    procimage.image_key(replace(BASE, lowers=(Path("/l2"), Path("/rootfs/base"))), True,
                                        Path("/tools/1"), "/criu"),
                    procimage.image_key(BASE, True, Path("/tools/2"), "/criu"),
                    procimage.image_key(BASE, True, Path("/tools/1"), "/criu-4.3")):
        assert changed != key


def _images(usable: bool, zygote: object = None) -> procimage.ProcImages:
    status = CriuStatus("/criu", (4, 2, 1), usable, "")
    host = SimpleNamespace(zygote=zygote, criu_status=lambda: status)
    return procimage.ProcImages(host, SimpleNamespace())  # type: ignore[arg-type]


def test_only_exec_started_sandboxes_without_a_start_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(procimage.ENV_OFF, raising=False)
    assert _images(True).enabled(BASE)
    assert not _images(False).enabled(BASE)  # no CRIU: nothing to restore with
    assert not _images(True, zygote=object()).enabled(BASE)  # the zygote starts faster still
    assert not _images(True).enabled(replace(BASE, start_cmd="serve"))  # would be restored mid-run
    monkeypatch.setenv(procimage.ENV_OFF, "0")
    assert not _images(True).enabled(BASE)


async def test_a_pool_entry_cancelled_while_warming_up_is_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool cancels its fills when it closes; an entry restored or launched but not yet in the
    pool has no other owner, so it must not outlive the cancellation (found as a leftover sandbox)."""
    import asyncio

    from aenv.config import Settings
    from aenv.runtime.ns.runtime import NsRuntime

    rt = NsRuntime(Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache"), pool_size=0,
                   tools_dir=tmp_path)
    rt.host.layout = object()  # type: ignore[assignment]
    closed: list[bool] = []
    warming = asyncio.Event()

    class Entry:
        async def warm_up(self) -> None:
            warming.set()
            await asyncio.Event().wait()

        async def aclose(self) -> None:
            closed.append(True)

    async def pooled(*_: object) -> Entry:
        return Entry()

    monkeypatch.setattr(rt.procimages, "pooled", pooled)
    fill = asyncio.create_task(rt._launch_pooled(replace(BASE, rootfs=tmp_path), False))
    await warming.wait()
    fill.cancel()
    with pytest.raises(asyncio.CancelledError):
        await fill
    assert closed == [True]
