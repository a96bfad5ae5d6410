"""``process.Process`` RPC handlers (spec §3.5) over the process table.

Handlers decode requests, resolve the user, and subscribe streams to process
output. A stream ending (client gone, deadline, cancel) only unsubscribes;
the only things that end a process are its own exit, SendSignal, and the
Start deadline (``Connect-Timeout-Ms`` is also the process lifetime).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

from aenv.envd.connect import (
    CallContext,
    ClientStreamEndpoint,
    ServerStreamEndpoint,
    UnaryEndpoint,
)
from aenv.envd.errors import InvalidArgument, Unimplemented
from aenv.envd.fields import (
    Message,
    get_bytes,
    get_enum,
    get_int,
    get_obj,
    get_opt_bool,
    get_opt_str,
    get_str,
    get_str_list,
    get_str_map,
    has,
)
from aenv.envd.identity import SandboxState
from aenv.envd.proctable import ManagedProcess, ProcessConfig, ProcessTable, SpawnRequest, Subscriber

_SIGNALS = {"SIGNAL_UNSPECIFIED": 0, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9}
_KEEPALIVE: Message = {"event": {"keepalive": {}}}
DEFAULT_PTY_SIZE = (80, 24)
KILL_REAP_WAIT_S = 2.0


class ProcessService:
    def __init__(self, state: SandboxState, table: ProcessTable) -> None:
        self.state = state
        self.table = table

    def routes(self) -> dict[str, object]:
        prefix = "/process.Process/"
        return {
            prefix + "Start": ServerStreamEndpoint(self.start, _KEEPALIVE),
            prefix + "Connect": ServerStreamEndpoint(self.connect, _KEEPALIVE),
            prefix + "List": UnaryEndpoint(self.list),
            prefix + "SendInput": UnaryEndpoint(self.send_input),
            prefix + "StreamInput": ClientStreamEndpoint(self.stream_input),
            prefix + "SendSignal": UnaryEndpoint(self.send_signal),
            prefix + "CloseStdin": UnaryEndpoint(self.close_stdin),
            prefix + "Update": UnaryEndpoint(self.update),
        }

    # ---- helpers

    def _select(self, msg: Message) -> ManagedProcess:
        selector = get_obj(msg, "process") or {}
        if has(selector, "pid"):
            return self.table.get(get_int(selector, "pid"))
        if has(selector, "tag"):
            return self.table.get_by_tag(get_str(selector, "tag"))
        raise InvalidArgument("process selector needs a pid or a tag")

    async def _announce_and_follow(self, proc: ManagedProcess, queue: Subscriber) -> AsyncIterator[Message]:
        """The ``start`` event first (the SDK requires it), then the process's output until its end.
        A client gone before ``start`` was sent must not leave its output queue subscribed."""
        try:
            yield {"event": {"start": {"pid": proc.pid}}}
        except BaseException:
            proc.unsubscribe(queue)
            raise
        async for event in self._follow(proc, queue):
            yield event

    @staticmethod
    async def _follow(proc: ManagedProcess, queue: Subscriber) -> AsyncIterator[Message]:
        try:
            while True:
                event = await queue.get()
                proc.maybe_resume()
                if event is None:
                    return
                yield {"event": event}
        finally:
            proc.unsubscribe(queue)

    # ---- streams

    async def start(self, msg: Message, ctx: CallContext) -> AsyncIterator[Message]:
        process = get_obj(msg, "process") or {}
        cmd = get_str(process, "cmd")
        if not cmd:
            raise InvalidArgument("process.cmd is required")
        config = ProcessConfig(
            cmd=cmd,
            args=get_str_list(process, "args"),
            envs=get_str_map(process, "envs"),
            cwd=get_opt_str(process, "cwd"),
        )
        pty_size = None
        pty = get_obj(msg, "pty")
        if pty is not None:
            size = get_obj(pty, "size") or {}
            cols, rows = get_int(size, "cols"), get_int(size, "rows")
            pty_size = (cols or DEFAULT_PTY_SIZE[0], rows or DEFAULT_PTY_SIZE[1])
        stdin = get_opt_bool(msg, "stdin")
        user = self.state.resolve_user(ctx.username)
        request = SpawnRequest(
            config=config,
            user=user,
            env=self.state.process_env(user, config.envs),
            cwd=self.state.resolve_path(config.cwd or "", user),
            tag=get_opt_str(msg, "tag"),
            pty_size=pty_size,
            stdin=True if stdin is None else stdin,
        )
        proc = self.table.spawn(request)
        queue = proc.subscribe()  # before the first await: no output is missed
        if ctx.deadline is not None:
            proc.kill_at(ctx.deadline)
        async for event in self._announce_and_follow(proc, queue):
            yield event

    async def connect(self, msg: Message, ctx: CallContext) -> AsyncIterator[Message]:
        selector = get_obj(msg, "process") or {}
        try:
            proc = self._select(msg)
        except Exception:
            pid = get_int(selector, "pid") if has(selector, "pid") else None
            retained = self.table.retained_exit(pid=pid, tag=get_opt_str(selector, "tag"))
            if retained is None or pid is None:
                raise
            yield {"event": {"start": {"pid": pid}}}
            yield {"event": {"end": retained}}
            return
        queue = proc.subscribe()
        async for event in self._announce_and_follow(proc, queue):
            yield event

    # ---- unary

    async def list(self, msg: Message, ctx: CallContext) -> Message:
        return {"processes": [proc.info() for proc in self.table.list()]}

    async def send_input(self, msg: Message, ctx: CallContext) -> Message:
        proc = self._select(msg)
        await self._write(proc, get_obj(msg, "input") or {})
        return {}

    @staticmethod
    async def _write(proc: ManagedProcess, input_msg: Message) -> None:
        if has(input_msg, "pty"):
            await proc.write_input(get_bytes(input_msg, "pty"), pty=True)
        elif has(input_msg, "stdin"):
            await proc.write_input(get_bytes(input_msg, "stdin"), pty=False)

    async def stream_input(self, messages: AsyncIterator[Message], ctx: CallContext) -> Message:
        proc: ManagedProcess | None = None
        async for msg in messages:
            if has(msg, "start"):
                proc = self._select(get_obj(msg, "start") or {})
            elif has(msg, "data"):
                if proc is None:
                    raise InvalidArgument("StreamInput: data before start")
                data = get_obj(msg, "data") or {}
                await self._write(proc, get_obj(data, "input") or {})
            # keepalive envelopes carry nothing
        return {}

    async def send_signal(self, msg: Message, ctx: CallContext) -> Message:
        proc = self._select(msg)
        signum = get_enum(msg, "signal", _SIGNALS)
        if signum == 9:
            proc.signal(signal.SIGKILL)
            # answer once the pid is gone (SIGKILL cannot be caught; the reap follows at once), so the
            # caller's next command never finds the process, or its zombie, still there on a busy host
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(KILL_REAP_WAIT_S):
                    await proc.reaped.wait()
        elif signum == 15:
            proc.signal(signal.SIGTERM)
        else:
            raise Unimplemented(f"signal {signum} is not supported")
        return {}

    async def close_stdin(self, msg: Message, ctx: CallContext) -> Message:
        await self._select(msg).close_stdin()
        return {}

    async def update(self, msg: Message, ctx: CallContext) -> Message:
        proc = self._select(msg)
        pty = get_obj(msg, "pty")
        if pty is not None:
            size = get_obj(pty, "size") or {}
            proc.resize(get_int(size, "cols"), get_int(size, "rows"))
        return {}


__all__ = ["ProcessService"]
