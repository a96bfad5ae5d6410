"""``NsSandbox.init_envd``: the hand-out runs between writing /init and reading its answer, a stale
pre-opened stream falls back to a fresh one, and the hand-out's own errors are not mistaken for one."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.mux import StreamClosed
from aenv.runtime.envd_client import EnvdError
from aenv.runtime.ns.cgroups import Cgroup, Layout
from aenv.runtime.ns.paths import Paths
from aenv.runtime.ns.sandbox import NsSandbox

NO_CONTENT = b"HTTP/1.1 204 No Content\r\n\r\n"


class Stream:
    def __init__(self, log: list[str], name: str, reply: bytes = NO_CONTENT, fail_write: bool = False,
                 fail_read: bool = False) -> None:
        self.log, self.name, self.reply = log, name, reply
        self.fail_write, self.fail_read = fail_write, fail_read
        self.closed = False

    async def write(self, data: bytes) -> None:
        if self.fail_write:
            raise StreamClosed("stale")
        assert data.startswith(b"POST /init ")
        self.log.append(f"{self.name}: write")

    async def read(self, n: int = 65536) -> bytes:
        if self.fail_read:
            raise StreamClosed("reset")
        self.log.append(f"{self.name}: read")
        reply, self.reply = self.reply, b""
        return reply

    async def write_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        self.closed = True


def sandbox(tmp_path: Path, log: list[str], spare: Stream | None) -> NsSandbox:
    sbx = NsSandbox("s1", Paths(tmp_path), Cgroup(Layout(version=2, v2=tmp_path), "s1"), None)
    sbx._init_stream = spare  # type: ignore[assignment]

    async def open_stream(port: int, timeout: float = 10.0) -> Stream:
        log.append("open")
        return Stream(log, "fresh")

    sbx.open_stream = open_stream  # type: ignore[method-assign]
    return sbx


async def test_hand_out_runs_while_envd_applies_init(tmp_path: Path) -> None:
    log: list[str] = []
    spare = Stream(log, "spare")
    await sandbox(tmp_path, log, spare).init_envd({}, meanwhile=lambda: log.append("hand-out"))
    assert log == ["spare: write", "hand-out", "spare: read"]
    assert spare.closed


@pytest.mark.parametrize("failure", ["write", "read"])
async def test_stale_spare_stream_falls_back_to_a_fresh_one(tmp_path: Path, failure: str) -> None:
    log: list[str] = []
    spare = Stream(log, "spare", fail_write=failure == "write", fail_read=failure == "read")
    await sandbox(tmp_path, log, spare).init_envd({}, meanwhile=lambda: log.append("hand-out"))
    assert log[log.index("open"):][:3] == ["open", "fresh: write", "fresh: read"]
    assert "hand-out" in log and spare.closed


async def test_hand_out_error_is_raised_not_retried(tmp_path: Path) -> None:
    log: list[str] = []
    spare = Stream(log, "spare")

    def hand_out() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        await sandbox(tmp_path, log, spare).init_envd({}, meanwhile=hand_out)
    assert "open" not in log and spare.closed


async def test_init_refused_is_an_envd_error(tmp_path: Path) -> None:
    log: list[str] = []
    spare = Stream(log, "spare", reply=b"HTTP/1.1 400 Bad Request\r\nContent-Length: 3\r\n\r\nbad")
    with pytest.raises(EnvdError) as err:
        await sandbox(tmp_path, log, spare).init_envd({})
    assert err.value.status == 400
