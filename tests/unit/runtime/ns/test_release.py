"""``runtime/ns/release.py``: what the released marker means across a restart."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from aenv.runtime.ns import release
from aenv.runtime.ns.table import NsTable


def _releaser(host: object, after: float) -> release.NsReleaser:
    """A releaser over an empty table; ``host`` fakes what ``adopted`` reads of ``NsHost`` (the layout)."""
    return release.NsReleaser(NsTable(), host, SimpleNamespace(), after=after)  # type: ignore[arg-type]


async def test_no_marker_means_paused_in_memory_and_partial_images_go(tmp_path: Path) -> None:
    (tmp_path / release.RELEASED_DIR / "criu").mkdir(parents=True)  # a dump the server died in
    r = _releaser(SimpleNamespace(), after=1.0)
    assert await r.adopted("sb1", tmp_path) is False
    assert not (tmp_path / release.RELEASED_DIR).exists() and r.released == {}


async def test_marker_means_released(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / release.RELEASED_DIR).mkdir()
    release.marker(tmp_path).write_text(json.dumps({"dir": str(tmp_path), "lowers": ["/rootfs"], "released": True}))
    killed: list[str] = []

    class Cg:
        def __init__(self, layout: object, name: str) -> None:
            self.name = name

        def kill_all(self) -> None:
            killed.append(self.name)

        def remove(self) -> None:
            pass

    from aenv.runtime.ns import cgroups

    monkeypatch.setattr(cgroups, "Cgroup", Cg)
    r = _releaser(SimpleNamespace(layout=object()), after=1.0)
    assert await r.adopted("sb1", tmp_path) is True
    assert killed == ["sb1"]  # a tree restored before the crash is ended: the images are the truth
    assert r.released["sb1"]["lowers"] == ["/rootfs"]
    assert r.forget("sb1") is not None and "sb1" not in r.released


def test_bad_marker_reads_as_none(tmp_path: Path) -> None:
    (tmp_path / release.RELEASED_DIR).mkdir()
    release.marker(tmp_path).write_text("{")
    assert release.read_marker(tmp_path) is None


async def test_a_release_under_way_is_waited_for_not_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume (or kill) that comes while the release dumps and stops the sandbox waits for it: cancelled
    half-way, the release left a sandbox being killed that the resume then thawed."""
    import asyncio

    r = _releaser(SimpleNamespace(), after=0.0)
    started, go = asyncio.Event(), asyncio.Event()

    async def releasing(sandbox_id: str) -> bool:
        async with r.lock(sandbox_id):
            started.set()
            await go.wait()
            r.released[sandbox_id] = {"released": True}
        return True

    monkeypatch.setattr(r, "release", releasing)
    r.schedule("sb1")
    await started.wait()
    waiter = asyncio.create_task(r.settled("sb1"))
    await asyncio.sleep(0.02)
    assert not waiter.done()
    go.set()
    await waiter
    assert "sb1" in r.released
    r.schedule("sb2")  # not begun yet: settled() cancels it
    await r.settled("sb2")
    assert "sb2" not in r.released
    await r.aclose()
