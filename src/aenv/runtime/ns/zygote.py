"""Host side of the ns zygote (``aenv.agent.zygote``): start it once per tools bundle, ask it to launch.

The zygote is an optimisation with a safe fallback: if it cannot start or dies, ``launch`` returns None
and the caller uses the plain ``unshare`` + launcher path. It is restarted on the next launch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

from aenv.runtime.process import Reaped
from aenv.runtime.tools import launch_argv

log = logging.getLogger("aenv.ns")

READY_TIMEOUT = 60.0


SOCKET_PREFIX = "aenv-zygote-"


def socket_path_for(directory: Path, owner_pid: int, tag: int) -> Path:
    """``<dir>/aenv-zygote-<server pid>-<tag>.sock``: unix socket paths are short (108 bytes), so it
    lives in the temp dir, not in a deep state dir; the server's pid in the name lets a later server
    remove it if this one dies without :meth:`Zygote.aclose` (see :func:`sweep_stale_sockets`)."""
    return directory / f"{SOCKET_PREFIX}{owner_pid}-{tag:x}.sock"


def sweep_stale_sockets(directory: Path) -> list[Path]:
    """Remove zygote sockets whose server process is gone (killed servers leave them behind)."""
    removed = []
    for path in directory.glob(f"{SOCKET_PREFIX}*.sock"):
        pid_text = path.name[len(SOCKET_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or os.path.exists(f"/proc/{pid_text}"):
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed


class Zygote:
    def __init__(self, tools: Path, socket_path: Path) -> None:
        self.tools = tools
        self.socket_path = socket_path
        self._proc: Reaped | None = None
        self._lock = asyncio.Lock()
        self._failed = False

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.proc.poll() is None

    async def ensure(self) -> bool:
        """Start the zygote if needed. False when it cannot run here (then callers fall back)."""
        if self.running:
            return True
        async with self._lock:
            if self.running:
                return True
            if self._proc is not None:
                await self._proc.aclose()
                self._proc = None
            self.socket_path.parent.mkdir(parents=True, exist_ok=True)
            proc = Reaped.spawn(
                [*launch_argv(str(self.tools)), "-m", "aenv.agent.zygote", "--socket", str(self.socket_path),
                 "--parent", str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            )
            try:
                async with asyncio.timeout(READY_TIMEOUT):
                    line = await proc.readline()
                ready = json.loads(line or b"{}")
            except (TimeoutError, ValueError) as exc:
                ready = {"error": str(exc)}
            if not ready.get("ready"):
                log.warning("ns zygote did not start (%s); using the exec launcher", ready)
                await proc.aclose()
                self._failed = True
                return False
            if ready.get("missing"):
                log.info("ns zygote preloaded without %s", ", ".join(ready["missing"]))
            self._proc = proc
            log.info("ns zygote ready pid=%s", ready.get("pid"))
            return True

    async def launch(self, cfg: dict[str, Any], timeout: float = 30.0) -> dict[str, Any] | None:
        """Launch one sandbox; the launcher's report (``{"pid","start"}`` or ``{"error"}``), or None
        when the zygote is unavailable."""
        if not await self.ensure():
            return None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(str(self.socket_path))
                try:
                    writer.write((json.dumps(cfg) + "\n").encode())
                    await writer.drain()
                    line = await reader.readline()
                finally:
                    writer.close()
        except (OSError, TimeoutError) as exc:
            log.warning("ns zygote launch failed: %s", exc)
            return None
        try:
            report: dict[str, Any] = json.loads(line or b"{}")
        except ValueError:
            report = {"error": f"bad zygote answer {line[:200]!r}"}
        if not report:
            report = {"error": "the zygote closed the connection without an answer"}
        return report

    async def aclose(self) -> None:
        if self._proc is not None:
            await self._proc.aclose()
            self._proc = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
