"""Contexts whose kernel is a process of aenv's own over two pipes, no Jupyter: JavaScript and TypeScript
(``js_kernel.js``, on Node's REPL evaluator) and Java (``JavaKernel.java``, on the JDK's JShell).

Why not Jupyter kernels: the npm ones (ijavascript, tslab) need ZeroMQ's native addon, whose prebuilt
binaries come from GitHub releases, E2B's JavaScript kernel is a GitHub fork and IJava is published as
GitHub releases: none reachable from the hosts this was built on. Both runtimes have a REPL evaluator
that does what a cell needs. The protocol: requests on the process's stdin (one line each, in the
kernel's encoding), events back on a pipe of their own (one JSON object per line; the process's own
stdout/stderr are what child processes that inherited them write).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
from typing import Any

from . import messages as m
from .kernels import KERNEL_READY_TIMEOUT, Context, ContextInfo, Sink, default_sigint

# aenv's own Node kernel (``js_kernel.js``, beside this file in the template) and the TypeScript compiler
# the template's packages layer holds (``images/interpreter.py``: NODE_PREFIX)
JS_KERNEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "js_kernel.js")
TYPESCRIPT = "/usr/local/lib/aenv-node/node_modules/typescript"


# Written by a pipe kernel to its own stdout and stderr at the end of each run (js_kernel.js, JavaKernel.java)
RUN_END = b"\x00aenv-run-end\x00\n"
RUN_END_WAIT_S = 2.0


class PipeKernelContext(Context):
    """A kernel process driven over a request pipe and an event pipe. An interrupt ends the process
    (neither Node nor the JVM has a safe way to stop running code): the next run starts a fresh one and
    says so."""

    LANGUAGE = ""
    RUNTIME = ""  # what the 400 and the errors call the process

    def argv(self) -> list[str]:
        raise NotImplementedError

    def request(self, code: str, env: dict[str, str], temp: dict[str, str]) -> bytes:
        """One request line in the kernel's encoding."""
        return (json.dumps({"code": code, "language": self.LANGUAGE, "env": env, "temp": temp}) + "\n").encode()

    def __init__(self, info: ContextInfo, env: dict[str, str]) -> None:
        super().__init__(info, env)
        self._proc: asyncio.subprocess.Process | None = None
        self._events: asyncio.StreamReader | None = None
        self._sink: Sink | None = None
        self._pumps: list[asyncio.Task[None]] = []
        self._count = 0
        self._interrupted = False
        self._ended: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        read_end, write_end = os.pipe()
        try:
            self._proc = proc = await asyncio.create_subprocess_exec(
                *self.argv(), cwd=self.info.cwd, env={**self.env, "AENV_EVENTS_FD": str(write_end)},
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                pass_fds=(write_end,), start_new_session=True, preexec_fn=default_sigint,
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self._events = asyncio.StreamReader(limit=1 << 26)
        events = self._events
        await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(events), os.fdopen(read_end, "rb", 0))
        assert proc.stdout is not None and proc.stderr is not None
        self._pumps = [asyncio.create_task(self._pump(proc.stdout, "stdout")),
                       asyncio.create_task(self._pump(proc.stderr, "stderr"))]
        ready = await asyncio.wait_for(self._next(), KERNEL_READY_TIMEOUT)
        if ready is None or ready.get("type") != "ready":
            raise RuntimeError(f"{self.RUNTIME} ended before its kernel was ready (exit {await proc.wait()})")
        self._interrupted = False

    async def _pump(self, stream: asyncio.StreamReader, name: str) -> None:
        """What the process's own stdout/stderr get (a child process that inherited them), to the run
        under way; outside a run it has nowhere to go. The kernel writes ``RUN_END`` to both after each
        run, before its ``done`` event: what came before it is the run's, though it travels on another
        pipe than the events."""
        while line := await stream.readline():
            text = line.removesuffix(RUN_END)
            if text and self._sink is not None:
                self._sink(m.stream_line(name, text.decode(errors="replace")))
            if text != line and name in self._ended:
                self._ended[name].set()

    async def _settled(self) -> None:
        """Both of the process's own streams are read up to this run's end (bounded: a stream that is
        stuck must not hold the run)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self._ended.values())), RUN_END_WAIT_S)

    async def _next(self) -> dict[str, Any] | None:
        assert self._events is not None
        line = await self._events.readline()
        return json.loads(line) if line else None

    async def run(
        self, code: str, persistent_env: dict[str, str], temp_env: dict[str, str], sink: Sink
    ) -> None:
        self.interrupt_pending = False
        if self._proc is None or self._proc.returncode is not None:
            await self._restart()
        assert self._proc is not None and self._proc.stdin is not None
        self._count += 1
        sink(m.count_line(self._count))
        self._sink = sink
        self._ended = {"stdout": asyncio.Event(), "stderr": asyncio.Event()}
        try:
            self._proc.stdin.write(self.request(code, persistent_env, temp_env))
            await self._proc.stdin.drain()
            if self.interrupt_pending:
                await self.interrupt()
            while (event := await self._next()) is not None:
                kind = event.get("type")
                if kind == "done":
                    await self._settled()
                    return
                if kind in ("stdout", "stderr"):
                    sink(m.stream_line(kind, str(event.get("text", ""))))
                elif kind == "result":
                    sink(m.result_line({"text/plain": str(event.get("text", ""))}, is_main_result=True))
                elif kind == "error":
                    sink(m.error_line(str(event.get("name", "Error")), str(event.get("value", "")),
                                      str(event.get("traceback", ""))))
            if self._interrupted:
                sink(m.error_line("KeyboardInterrupt", f"interrupted: the context's {self.RUNTIME} process was "
                                  "ended (its state is gone; the next run starts a fresh one)", []))
            else:
                sink(m.error_line("DeadKernelError", f"the {self.RUNTIME} process ended during execution "
                                  "(restarted for the next run)", []))
        except (BrokenPipeError, ConnectionResetError):
            sink(m.error_line("DeadKernelError", f"the {self.RUNTIME} process ended (restarted for the next run)", []))
        finally:
            self._sink = None
        await self.aclose()  # reached only when the process is gone: the next run starts a new one

    async def interrupt(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._interrupted = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)

    async def _restart(self) -> None:
        await self.aclose()
        await self.start()

    async def aclose(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        for task in self._pumps:
            task.cancel()
        self._pumps = []


class JsContext(PipeKernelContext):
    """Node running ``js_kernel.js``: Node's own REPL evaluator (top-level await, the last expression's
    value, declarations that persist)."""

    LANGUAGE = "javascript"
    RUNTIME = "Node"

    @classmethod
    def available(cls) -> bool:
        return shutil.which("node") is not None and os.path.exists(JS_KERNEL)

    def argv(self) -> list[str]:
        return ["node", JS_KERNEL]


class TsContext(JsContext):
    """TypeScript: each run transpiled by the ``typescript`` package (types stripped, nothing checked), then
    run as JavaScript, as E2B's kernel does."""

    LANGUAGE = "typescript"

    @classmethod
    def available(cls) -> bool:
        return super().available() and os.path.isdir(TYPESCRIPT)


JAVA_KERNEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "JavaKernel.java")
# A small heap and the quick JIT tier: a kernel per context, short cells; the source launcher compiles
# JavaKernel.java as the JVM starts (no build step, no javac on the host that builds the template).
JAVA_OPTIONS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xss4m")


def _pairs(values: dict[str, str]) -> str:
    return base64.b64encode("".join(f"{k}\0{v}\0" for k, v in values.items()).encode()).decode()


class JavaContext(PipeKernelContext):
    """A JVM running ``JavaKernel.java``: JShell in process (declarations, imports and methods persist, an
    expression's value is the result). Its "envs" are system properties, as in E2B's template."""

    LANGUAGE = "java"
    RUNTIME = "JVM"

    @classmethod
    def available(cls) -> bool:
        return shutil.which("java") is not None and os.path.exists(JAVA_KERNEL)

    def argv(self) -> list[str]:
        return ["java", *JAVA_OPTIONS, JAVA_KERNEL]

    def request(self, code: str, env: dict[str, str], temp: dict[str, str]) -> bytes:
        return f"{base64.b64encode(code.encode()).decode()} {_pairs(env)} {_pairs(temp)}\n".encode()
