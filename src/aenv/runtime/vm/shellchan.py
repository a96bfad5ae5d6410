"""Host side of the initramfs test shell (``aenv.init=shell``): one command per line, reply ends
with ``\\x01END <rc>``. Used by boot probes and integration tests; the real channel is the mux."""

from __future__ import annotations

import asyncio
import contextlib

from .initramfs import END_MARK


class ShellChannel:
    """Owns one connection to the guest test shell. ``aclose`` is idempotent."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._lock = asyncio.Lock()

    async def run(self, command: str, timeout: float = 30.0) -> tuple[int, str]:
        """Run ``command`` with the guest's ``sh -c``; returns (exit code, combined output)."""
        if "\n" in command:
            raise ValueError("one line per command")
        async with self._lock, asyncio.timeout(timeout):
            self._writer.write(command.encode() + b"\n")
            await self._writer.drain()
            data = await self._reader.readuntil(END_MARK)
            rc = await self._reader.readline()
        return int(rc.strip() or b"-1"), data[: -len(END_MARK)].decode(errors="replace").removesuffix("\n")

    async def aclose(self) -> None:
        if self._writer.is_closing():
            return
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()
