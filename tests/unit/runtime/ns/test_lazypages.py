"""The lazy-pages daemon's lifetime (``lazypages.py``) with a stand-in for ``criu lazy-pages``: a
script that listens (makes the socket file) the way CRIU does, or fails first."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from aenv.runtime.ns import criu, lazypages


def _fake(tmp_path: Path, body: str) -> str:
    exe = tmp_path / "criu"
    exe.write_text(f'#!/bin/sh\nshift 4; work="$1"\n{body}\n')  # lazy-pages -D IMAGES -W WORK ...
    exe.chmod(0o755)
    return str(exe)


@pytest.fixture
def base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setattr(criu, "KDAT_BASE", d)
    return d


def test_restore_argv_lazy_names_its_own_work_dir() -> None:
    argv = criu.restore_argv("/c", Path("/i"), root=Path("/r"), pidfile=Path("/p"), tools=Path("/t"),
                             run_dir=Path("/w/ns/run"), lazy_work=Path("/dev/shm/aenv-lazy-x"))
    assert argv[argv.index("--lazy-pages") + 1:argv.index("--lazy-pages") + 3] == ["-W", "/dev/shm/aenv-lazy-x"]
    plain = criu.restore_argv("/c", Path("/i"), root=Path("/r"), pidfile=Path("/p"), tools=Path("/t"),
                              run_dir=Path("/w/ns/run"))
    assert "--lazy-pages" not in plain and "-W" not in plain


def test_daemon_that_ends_is_reaped_and_its_dir_removed(tmp_path: Path, base: Path) -> None:
    exe = _fake(tmp_path, f'touch "$work/{criu.LAZY_SOCKET}"; sleep 0.2')
    with lazypages.lazy_restore(exe, tmp_path, None, True, "t") as work:
        assert work is not None and (work / criu.LAZY_SOCKET).exists()
    for t in threading.enumerate():
        if t.name == "aenv-lazy-t":
            t.join(10)
    assert list(base.iterdir()) == []


def test_failed_restore_kills_the_daemon(tmp_path: Path, base: Path) -> None:
    # the pid first: the daemon is killed as soon as it listens
    exe = _fake(tmp_path, f'echo $$ > {tmp_path}/pid; touch "$work/{criu.LAZY_SOCKET}"; exec sleep 60')
    with pytest.raises(RuntimeError), lazypages.lazy_restore(exe, tmp_path, None, True, "t"):
        raise RuntimeError("criu restore failed")
    pid = int((tmp_path / "pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert list(base.iterdir()) == []


def test_daemon_that_never_listens_fails_with_its_log(tmp_path: Path, base: Path) -> None:
    exe = _fake(tmp_path, f'echo "Error: no uffd" > "$work/{criu.LAZY_LOG}"; exit 1')
    with pytest.raises(lazypages.LazyPagesError, match="no uffd"), lazypages.lazy_restore(exe, tmp_path, None, True, "t"):
        pass
    assert list(base.iterdir()) == []


def test_off_starts_nothing(tmp_path: Path, base: Path) -> None:
    with lazypages.lazy_restore("/nonexistent", tmp_path, None, False, "t") as work:
        assert work is None
    assert list(base.iterdir()) == []


async def test_the_images_stay_held_until_the_lazy_daemon_has_ended() -> None:
    """A lazy restore returns while its daemon still reads the dump's pages: the read hold on the images
    (which keeps the page linker from rewriting them) is let go only once the daemon's reaper is done."""
    import asyncio
    import contextlib
    import threading

    from aenv.runtime.ns.images_gate import ImagesGate
    from aenv.runtime.ns.snapshot import _release_after

    gate, images = ImagesGate(), Path("/snap/criu")
    daemon_done = threading.Event()
    reaper = threading.Thread(target=daemon_done.wait, daemon=True)
    reaper.start()
    hold = contextlib.AsyncExitStack()
    await hold.enter_async_context(gate.reading(images))
    released = asyncio.create_task(_release_after([reaper], hold))

    async def rewrite() -> None:
        async with gate.writing(images, grace=0):
            pass

    writer = asyncio.create_task(rewrite())
    await asyncio.sleep(0.1)
    assert not writer.done()  # the daemon still reads: no rewrite
    daemon_done.set()
    await asyncio.wait_for(asyncio.gather(released, writer), 2)
