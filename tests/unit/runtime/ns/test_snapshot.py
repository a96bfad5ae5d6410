"""``runtime/ns/snapshot.py``: the layer copy and the compaction merge, checked against what the kernel's
overlayfs shows (the merged view of N stacked layers must equal the view of their merge on the same
base). Mount tests need root; the pure parts run anywhere."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from aenv.errors import InvalidRequest, StateError
from aenv.kinds import SnapshotMode
from aenv.runtime.base import SnapshotResult
from aenv.runtime.ns import snapshot as snap

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts and trusted.* xattrs need root")


def _view(root: Path) -> dict[str, tuple[str, str]]:
    """Path -> (kind, content or link target) of a mounted tree."""
    out: dict[str, tuple[str, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", oct(st.st_mode & 0o7777))
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", p.read_text())
            else:
                out[rel] = ("other", oct(st.st_mode))
    return out


class Overlay:
    """Mount helper that always unmounts (one owner per mount)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.mounted: list[Path] = []
        self.n = 0

    def mount(self, lowers: list[Path], upper: Path | None = None) -> Path:
        self.n += 1
        m = self.tmp / f"m{self.n}"
        m.mkdir()
        opts = f"lowerdir={':'.join(map(str, lowers))}"
        if upper is not None:
            work = self.tmp / f"w{self.n}"
            work.mkdir()
            opts += f",upperdir={upper},workdir={work}"
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(m)], check=True)
        self.mounted.append(m)
        return m

    def umount(self, m: Path) -> None:
        subprocess.run(["umount", str(m)], check=True)
        self.mounted.remove(m)

    def close(self) -> None:
        for m in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(m)], check=False)
        self.mounted.clear()


@pytest.fixture
def overlay(tmp_path: Path) -> Iterator[Overlay]:
    ov = Overlay(tmp_path)
    yield ov
    ov.close()


def _base(tmp: Path) -> Path:
    base = tmp / "base"
    for d in ("etc", "data/keep", "data/gone", "data/replaced", "opt/tree/sub", "home/user"):
        (base / d).mkdir(parents=True)
    (base / "etc/conf").write_text("base")
    (base / "data/keep/a").write_text("a")
    (base / "data/gone/b").write_text("b")
    (base / "data/replaced/c").write_text("c")
    (base / "data/file-then-dir").write_text("file")
    (base / "opt/tree/sub/x").write_text("x")
    return base


def _layer(ov: Overlay, tmp: Path, name: str, lowers: list[Path], script: str) -> Path:
    """Run a shell ``script`` in a mounted overlay over ``lowers``; its upper becomes a layer."""
    upper = tmp / name
    upper.mkdir()
    m = ov.mount(lowers, upper)
    subprocess.run(["sh", "-ec", script], cwd=m, check=True)
    ov.umount(m)
    return upper


@needs_root
def test_merge_layers_matches_the_stacked_view(tmp_path: Path, overlay: Overlay) -> None:
    base = _base(tmp_path)
    l1 = _layer(overlay, tmp_path, "l1", [base], """
        echo one > etc/conf; echo new > etc/new; rm -rf data/gone; rm data/file-then-dir
        mkdir data/file-then-dir; echo inside > data/file-then-dir/f
        rm -rf data/replaced; mkdir data/replaced; echo fresh > data/replaced/d
        echo h > home/user/h; ln home/user/h home/user/h2; ln -s ../etc/conf home/user/link
        truncate -s 32M home/user/sparse; rm opt/tree/sub/x""")
    l2 = _layer(overlay, tmp_path, "l2", [l1, base], """
        echo two > etc/conf; rm etc/new; mkdir data/gone; echo back > data/gone/z
        rm -rf data/file-then-dir; echo file-again > data/file-then-dir
        rm -rf opt/tree; mkdir -p opt/tree; echo t > opt/tree/t; chmod 700 home/user""")
    l3 = _layer(overlay, tmp_path, "l3", [l2, l1, base], """
        echo three > etc/new; rm data/keep/a; rm home/user/h; echo more >> data/gone/z""")

    stacked = overlay.mount([l3, l2, l1, base])
    want = _view(stacked)
    merged = tmp_path / "merged"
    snap.merge_layers([l1, l2, l3], merged)
    flat = overlay.mount([merged, base])
    assert _view(flat) == want
    # sanity on the expected result itself
    assert want["etc/conf"] == ("file", "two\n") and want["etc/new"] == ("file", "three\n")
    assert "data/keep/a" not in want and "opt/tree/sub" not in want and "home/user/h" not in want
    assert want["data/gone/z"] == ("file", "back\nmore\n") and "data/gone/b" not in want
    assert want["data/file-then-dir"] == ("file", "file-again\n")
    # hard link, sparse file and modes survive the merge
    assert os.stat(merged / "home/user/h2").st_nlink == 1  # its partner was deleted in l3
    assert (merged / "home/user/sparse").stat().st_blocks == 0
    assert oct((flat / "home/user").stat().st_mode & 0o777) == "0o700"


@needs_root
def test_copy_tree_keeps_overlay_metadata(tmp_path: Path, overlay: Overlay) -> None:
    base = _base(tmp_path)
    upper = _layer(overlay, tmp_path, "u", [base], """
        rm etc/conf; rm -rf data/replaced; mkdir data/replaced; echo h > h; ln h h2; truncate -s 8M sp""")
    copy = tmp_path / "copy"
    snap.copy_tree(upper, copy)
    wh = (copy / "etc/conf").lstat()
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0  # whiteout node
    assert os.getxattr(copy / "data/replaced", snap.OPAQUE_XATTR) == b"y"
    assert (copy / "h").stat().st_ino == (copy / "h2").stat().st_ino
    assert (copy / "sp").stat().st_blocks == 0
    view = _view(overlay.mount([copy, base]))
    assert "etc/conf" not in view and "data/replaced/c" not in view


def test_needs_compaction_by_depth_and_option_length(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(snap.ENV_MAX_DEPTH, raising=False)
    short = ["/s/a/upper"] * 3 + ["/rootfs"]
    assert not snap.needs_compaction(short, 3, "/s/new/upper")
    assert snap.needs_compaction(short, snap.MAX_DEPTH, "/s/new/upper")
    long_paths = ["/" + "p" * 300 + f"/{i}/upper" for i in range(12)] + ["/rootfs"]
    assert snap.needs_compaction(long_paths, 12, "/s/new/upper")  # > one page of mount options
    monkeypatch.setenv(snap.ENV_MAX_DEPTH, "2")
    assert snap.needs_compaction(short, 2, "/s/new/upper")
    assert not snap.needs_compaction(short, 1, "/s/new/upper")


def test_stack_of_rebuilds_the_layers(tmp_path: Path) -> None:
    (tmp_path / "upper").mkdir()
    result = SnapshotResult(mode=SnapshotMode.FILESYSTEM, stack=("/s1/upper", "/s0/upper"), base_lowers=("/rootfs",))
    layers, lowers = snap.stack_of(tmp_path, result)
    assert layers == (str(tmp_path / "upper"), "/s1/upper", "/s0/upper")
    assert lowers == (Path("/rootfs"),)
    with pytest.raises(StateError):
        snap.stack_of(tmp_path, SnapshotResult(mode=SnapshotMode.FILESYSTEM))
    with pytest.raises(StateError, match="missing its files"):
        snap.stack_of(tmp_path / "nope", result)


# ---- full mode with a (fake) usable CRIU: the order of operations and the refusals ---------------
class _FakeCgroup:
    def __init__(self, log: list[str], tmp: Path) -> None:
        self.log, self.tmp, self.is_frozen = log, tmp, False

    def frozen(self) -> bool:
        return self.is_frozen

    def freeze(self) -> None:
        self.is_frozen = True
        self.log.append("freeze")

    def thaw(self) -> None:
        self.is_frozen = False
        self.log.append("thaw")

    def dir(self, controller: str) -> Path:
        return self.tmp / "cg" / controller / "sb1"


def _snapshots(tmp: Path, log: list[str], allow_internet: bool = False, from_zygote: bool = False) -> snap.NsSnapshots:
    """``NsSnapshots`` over a table holding one fake sandbox ``sb1`` (its cgroup logs what is done to it)
    and a real ``NsHost`` (its CRIU status is what the test makes ``criu.probe`` say); nothing that
    starts or restores a sandbox is reached, so those are stand-ins."""
    import contextlib
    from collections.abc import AsyncIterator
    from types import SimpleNamespace

    from aenv.config import Settings
    from aenv.runtime.ns.host import NsHost
    from aenv.runtime.ns.paths import Paths
    from aenv.runtime.ns.table import NsTable
    from aenv.runtime.process import ProcRef

    @contextlib.asynccontextmanager
    async def quiesce() -> AsyncIterator[None]:
        log.append("quiesce")
        try:
            yield
        finally:
            log.append("streams open")

    paths = Paths(tmp / "sbx")
    paths.upper.mkdir(parents=True)
    sbx = SimpleNamespace(name="sb1", nested=False, cgroup=_FakeCgroup(log, tmp), init=ProcRef(4242, 1), paths=paths, quiesce=quiesce,
                          allow_internet=allow_internet, from_zygote=from_zygote, lowers=["/rootfs"],
                          snapshot_depth=0, opts=None)
    table = NsTable()
    table.running["sb1"] = sbx  # type: ignore[assignment]
    host = NsHost(Settings(state_dir=tmp / "state", cache_dir=tmp / "cache"), tools_dir=None, debug_log=False,
                  launch_timeout=30.0)

    async def unused(*a: Any, **kw: Any) -> Any:
        raise AssertionError("no sandbox is started here")

    return snap.NsSnapshots(table, host, SimpleNamespace(), start=unused,  # type: ignore[arg-type]
                            launch_ready=unused, prelaunch=unused)


@pytest.fixture
def usable_criu(monkeypatch: pytest.MonkeyPatch) -> None:
    from aenv.runtime.ns import criu

    status = criu.CriuStatus("/opt/criu", (4, 2, 1), True, "criu 4.2.1 at /opt/criu")
    monkeypatch.setattr(criu, "probe", lambda refresh=False, settings=None: status)


async def test_full_snapshot_dumps_while_frozen(tmp_path: Path, usable_criu: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []

    def run(argv: list[str]) -> None:
        log.append(argv[0])
        if argv[0] == "cp":
            Path(argv[-1]).mkdir()

    def dump(exe: str, pid: int, images: Path, *, freezer: Path | None, leave_running: bool = True,
             volumes: Sequence[str] = (), run_dir: Path | None = None) -> None:
        assert (exe, pid, leave_running, list(volumes)) == ("/opt/criu", 4242, True, [])
        assert freezer is not None and run_dir is not None  # its debug log is kept while frozen
        log.append("dump")

    monkeypatch.setattr(snap, "_run", run)
    monkeypatch.setattr(snap.checkpoint, "dump", dump)
    into = tmp_path / "snap"
    into.mkdir()
    ns = _snapshots(tmp_path, log, allow_internet=True)
    result = await ns.snapshot("sb1", into, "full")
    # no host connection while dumping; the files are copied while still frozen
    assert log == ["quiesce", "freeze", "dump", "cp", "thaw", "streams open"]
    assert result.mode == "full" and result.layers == ("upper", "criu")
    assert result.data["criu"] == "4.2.1 at /opt/criu" and (into / "upper").is_dir()


async def test_full_snapshot_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, usable_criu: None) -> None:
    ns = _snapshots(tmp_path, [], from_zygote=True)
    with pytest.raises(StateError, match="zygote"):
        await ns.snapshot("sb1", tmp_path, "full")
    assert ns.best_mode(ns.table.get("sb1")) == "filesystem"


async def test_full_snapshot_dump_failure_is_explicit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      usable_criu: None) -> None:
    """A process CRIU cannot dump fails the request with CRIU's reason; nothing is kept, nothing is
    downgraded to a filesystem snapshot, and the sandbox runs on (thawed)."""
    log: list[str] = []

    def dump(*a: Any, **kw: Any) -> None:
        raise snap.CheckpointError("criu dump failed: Unknown shit 600 (anon_inode:[io_uring])")

    monkeypatch.setattr(snap.checkpoint, "dump", dump)
    into = tmp_path / "snap"
    into.mkdir()
    ns = _snapshots(tmp_path, log)
    with pytest.raises(StateError, match=r"cannot be snapshotted: criu dump failed: .*io_uring.*mode=filesystem"):
        await ns.snapshot("sb1", into, "full")
    assert log == ["quiesce", "freeze", "thaw", "streams open"]
    assert list(into.iterdir()) == []


async def test_a_task_criu_could_not_seize_in_time_gets_one_more_try(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, usable_criu: None) -> None:
    """A task in uninterruptible sleep under load: CRIU's "Unseizable ... state D" is transient, so the
    sandbox is thawed a moment and dumped again; a second refusal is the answer."""
    log: list[str] = []
    failures = ["criu dump failed: Timeout reached. Try to interrupt: 0; Unseizable non-zombie 15993 found, "
                "state D, err -1/4"]  # fmt: skip

    def run(argv: list[str]) -> None:
        if argv[0] == "cp":
            Path(argv[-1]).mkdir()

    def dump(exe: str, pid: int, images: Path, **kw: Any) -> None:
        log.append("dump")
        images.mkdir(parents=True, exist_ok=True)
        (images / "partial.img").write_text("x")
        if failures:
            raise snap.CheckpointError(failures.pop())

    monkeypatch.setattr(snap, "_run", run)
    monkeypatch.setattr(snap.checkpoint, "dump", dump)
    monkeypatch.setattr(snap, "STUCK_TASK_PAUSE_S", 0.0)
    into = tmp_path / "snap"
    into.mkdir()
    ns = _snapshots(tmp_path, log)
    result = await ns.snapshot("sb1", into, "full")
    assert result.mode == "full"
    assert log == ["quiesce", "freeze", "dump", "thaw", "freeze", "dump", "thaw", "streams open"]
    failures[:] = ["criu dump failed: Unseizable non-zombie 1 found, state D"] * 2
    log.clear()
    again = tmp_path / "snap2"
    again.mkdir()
    with pytest.raises(StateError, match="Unseizable"):
        await ns.snapshot("sb1", again, "full")
    assert log.count("dump") == 2 and log[-2:] == ["thaw", "streams open"]


async def test_full_snapshot_refused_without_criu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aenv.runtime.ns import criu

    monkeypatch.setattr(criu, "probe", lambda refresh=False, settings=None: criu.evaluate(None))
    ns = _snapshots(tmp_path, [])
    with pytest.raises(StateError, match="can only take filesystem snapshots here.*CRIU"):
        await ns.snapshot("sb1", tmp_path, "full")
    with pytest.raises(InvalidRequest):
        await ns.snapshot("sb1", tmp_path, "memory")


async def test_a_cancelled_restore_waits_for_its_thread_before_the_clean_up() -> None:
    """A restore runs CRIU in a thread that a cancellation cannot stop: the caller's clean-up must run
    after the thread ended, or the tree it restores afterwards is owned by no one."""
    import asyncio
    import threading
    import time as _time

    from aenv.runtime.ns.restored import outlive_cancel

    ended = threading.Event()

    def restore() -> int:
        _time.sleep(0.3)
        ended.set()
        return 4242

    seen: list[bool] = []

    async def caller() -> int:
        try:
            return await outlive_cancel(asyncio.get_running_loop().run_in_executor(None, restore))
        except asyncio.CancelledError:
            seen.append(ended.is_set())  # where restore_tree's clean-up runs
            raise

    task = asyncio.create_task(caller())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [True]
    assert await outlive_cancel(asyncio.get_running_loop().run_in_executor(None, lambda: 7)) == 7
