"""One translation of channel failures into domain errors, shared by every runtime's ``open_stream``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aenv.errors import PortNotOpen, SandboxNotFound, SandboxUnreachable
from aenv.mux import ByteStream, MuxError, StreamRefused


async def open_checked(
    sandbox_id: str,
    port: int,
    opener: Callable[[int], Awaitable[ByteStream]],
    alive: Callable[[], bool],
    channel_errors: tuple[type[BaseException], ...] = (),
) -> ByteStream:
    """Open a stream to ``port``: a refusal by the agent means the port is closed (the sandbox is fine);
    any other channel failure means the sandbox is gone if ``alive()`` says so, else unreachable."""
    failures: tuple[type[BaseException], ...] = (MuxError, OSError, *channel_errors)
    try:
        return await opener(port)
    except StreamRefused as exc:
        raise PortNotOpen(f"sandbox {sandbox_id}: nothing listens on port {port}", sandbox_id=sandbox_id) from exc
    except failures as exc:
        if not alive():
            raise SandboxNotFound(sandbox_id) from exc
        raise SandboxUnreachable(f"sandbox {sandbox_id} port {port}: {exc}", sandbox_id=sandbox_id) from exc
