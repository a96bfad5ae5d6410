"""Channel failures → domain errors, the same for every runtime."""

from __future__ import annotations

import pytest

from aenv.errors import PortNotOpen, SandboxNotFound, SandboxUnreachable
from aenv.mux import MuxError, StreamRefused
from aenv.runtime.streams import open_checked


class Boom(Exception):
    pass


def opener(exc: BaseException):  # type: ignore[no-untyped-def]
    async def _open(port: int):  # type: ignore[no-untyped-def]
        raise exc

    return _open


@pytest.mark.parametrize(
    ("exc", "alive", "expected"),
    [
        (StreamRefused("nothing on 8080"), True, PortNotOpen),
        (MuxError("channel closed"), True, SandboxUnreachable),
        (MuxError("channel closed"), False, SandboxNotFound),
        (ConnectionResetError(), False, SandboxNotFound),
        (Boom("vmm died"), False, SandboxNotFound),
    ],
)
async def test_translation(exc: BaseException, alive: bool, expected: type[Exception]) -> None:
    with pytest.raises(expected):
        await open_checked("sbx1", 8080, opener(exc), lambda: alive, channel_errors=(Boom,))


async def test_unlisted_errors_pass_through() -> None:
    with pytest.raises(Boom):
        await open_checked("sbx1", 8080, opener(Boom("x")), lambda: True)
