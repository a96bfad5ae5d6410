"""Execution contexts: one kernel (python) or shell (bash) each, with the state that persists between runs.

Why the producer/consumer split: ``Context.run`` drives one execution to its end (kernel back to idle) and
pushes lines into a sink, holding the context's lock the whole time. The HTTP side only consumes. When the
client goes away the service calls ``interrupt`` and stops listening, while ``run`` keeps draining until
the kernel is idle, so the next execution never sees the tail of the previous one.

Python contexts use ``jupyter_client``'s ``AsyncKernelManager`` with ipykernel's built-in ``python3`` spec
(imported lazily: the host-side unit tests import this module without Jupyter). Bash contexts run each
code block as ``bash -c`` in the context's cwd; they keep no shell state between runs (a known limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import queue
import signal
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import messages as m

log = logging.getLogger("aenv_interpreter.kernels")

Sink = Callable[[m.Line], None]
KERNEL_READY_TIMEOUT = 60.0
LIVENESS_POLL = 1.0  # how often a silent kernel is checked for death while we wait for its output


class ContextNotFound(KeyError):
    """No context with that id (the route answers 404 with this text)."""


class UnusableCwd(ValueError):
    """A context asked for in a directory that is not there: the service answers 400."""


class ContextStartFailed(RuntimeError):
    """A kernel that would not start: the service answers 500 with why (never a bare "internal error")."""


class UnsupportedLanguage(ValueError):
    """A language with no backend here."""


@dataclass(frozen=True)
class ContextInfo:
    id: str
    language: str
    cwd: str

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


def env_prelude(persistent: dict[str, str], temporary: dict[str, str]) -> tuple[str, str]:
    """Python snippets run silently before and after user code: set ``persistent`` for good, set
    ``temporary`` for this run only and restore the previous values afterwards."""
    before = (
        "import os as _aenv_os\n"
        f"_aenv_os.environ.update({persistent!r})\n"
        f"_aenv_saved = {{k: _aenv_os.environ.get(k) for k in {sorted(temporary)!r}}}\n"
        f"_aenv_os.environ.update({temporary!r})\n"
    )
    after = (
        "for _aenv_k, _aenv_v in _aenv_saved.items():\n"
        "    if _aenv_v is None: _aenv_os.environ.pop(_aenv_k, None)\n"
        "    else: _aenv_os.environ[_aenv_k] = _aenv_v\n"
        "del _aenv_saved\n"
    )
    return before, after


class Context(ABC):
    """One execution context. ``run`` is serialised by ``lock``; ``aclose`` is idempotent."""

    def __init__(self, info: ContextInfo, env: dict[str, str]) -> None:
        self.info = info
        self.env = env
        self.lock = asyncio.Lock()
        self.current: asyncio.Task[None] | None = None  # the execution holding the lock, if any
        # Set by ``abandon``: an interrupt that arrived while ``run`` was still starting its code
        # (no process or execute request yet) is delivered as soon as there is something to stop.
        self.interrupt_pending = False

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def run(
        self, code: str, persistent_env: dict[str, str], temp_env: dict[str, str], sink: Sink
    ) -> None:
        """Run ``code`` to completion, pushing lines (not ``end_of_execution``) into ``sink``."""

    @abstractmethod
    async def interrupt(self) -> None: ...

    async def abandon(self) -> None:
        """The client of the running execution is gone: interrupt it now, or as soon as it starts."""
        self.interrupt_pending = True
        await self.interrupt()

    @abstractmethod
    async def _restart(self) -> None: ...

    @abstractmethod
    async def aclose(self) -> None: ...

    async def restart(self) -> None:
        """Abandon a running execution (its client gets ``unexpected_end_of_execution``) and start fresh."""
        if self.current is not None and not self.current.done():
            self.current.cancel()
            with contextlib.suppress(BaseException):
                await self.current
        await self._restart()


# run by every python kernel as it starts (``display.py``): the result fields beyond Jupyter's own; the
# package's top-level name in the template is ``aenv_interpreter`` (``images/interpreter.py``)
INSTALL_DISPLAY = f"__import__('{__package__}.display', fromlist=['install']).install()"


class PythonContext(Context):
    """An ipykernel process driven through ``jupyter_client``."""

    def __init__(self, info: ContextInfo, env: dict[str, str]) -> None:
        super().__init__(info, env)
        self._km: Any = None
        self._kc: Any = None
        self._applied: dict[str, str] = {}  # persistent env already set in the kernel

    async def start(self) -> None:
        # imported by name: only the template's Python has jupyter_client (the host's type checker does not)
        manager = importlib.import_module("jupyter_client.manager")
        self._km = manager.AsyncKernelManager(kernel_name="python3")
        await self._km.start_kernel(cwd=self.info.cwd, env=self.env,
                                    extra_arguments=[f"--IPKernelApp.exec_lines={INSTALL_DISPLAY}"])
        await self._connect()

    async def _connect(self) -> None:
        if self._kc is not None:
            self._kc.stop_channels()
        self._kc = self._km.client()
        self._kc.start_channels()
        await self._kc.wait_for_ready(timeout=KERNEL_READY_TIMEOUT)
        self._applied = {}

    async def _restart(self) -> None:
        await self._km.restart_kernel(now=True)
        await self._connect()

    async def interrupt(self) -> None:
        if self._km is not None:
            with contextlib.suppress(Exception):
                await self._km.interrupt_kernel()

    async def run(
        self, code: str, persistent_env: dict[str, str], temp_env: dict[str, str], sink: Sink
    ) -> None:
        self.interrupt_pending = False
        if not await self._km.is_alive():
            log.warning("context %s: kernel died; restarting it", self.info.id)
            await self._restart()
        persistent = {k: v for k, v in persistent_env.items() if self._applied.get(k) != v}
        after = ""
        if persistent or temp_env:
            before, after = env_prelude(persistent, temp_env)
            await self._execute(before, silent=True, sink=None)
            self._applied.update(persistent)
        try:
            await self._execute(code, silent=False, sink=sink)
        finally:
            if temp_env:
                await self._execute(after, silent=True, sink=None)

    async def _execute(self, code: str, *, silent: bool, sink: Sink | None) -> None:
        msg_id = self._kc.execute(
            code, silent=silent, store_history=not silent, allow_stdin=False, stop_on_error=True
        )
        if self.interrupt_pending and not silent:
            await self.interrupt()
        while True:
            try:
                msg = await self._kc.get_iopub_msg(timeout=LIVENESS_POLL)
            except queue.Empty:
                if not await self._km.is_alive():
                    if sink is not None:
                        sink(
                            m.error_line(
                                "DeadKernelError",
                                "the kernel died during execution (restarted for the next run)",
                                [],
                            )
                        )
                    return
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue  # output of an abandoned execution or another client
            if msg["header"]["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                break
            if sink is not None:
                for line in m.iopub_to_lines(msg):
                    sink(line)
        # execute_reply: nothing in it we need, but do not let the shell queue grow
        with contextlib.suppress(Exception):
            while True:
                await self._kc.get_shell_msg(timeout=0)

    async def aclose(self) -> None:
        kc, km, self._kc, self._km = self._kc, self._km, None, None
        if kc is not None:
            with contextlib.suppress(Exception):
                kc.stop_channels()
        if km is not None:
            with contextlib.suppress(Exception):
                await km.shutdown_kernel(now=True)


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default. A process started in the background
    of a shell (``cmd &``, as CI runners and nohup do) inherits SIGINT *ignored*, through exec, and
    then an interrupt would not stop the user's code."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class BashContext(Context):
    """``bash -c`` per run in the context's cwd; output streamed line by line."""

    def __init__(self, info: ContextInfo, env: dict[str, str]) -> None:
        super().__init__(info, env)
        self._proc: asyncio.subprocess.Process | None = None
        self._count = 0

    async def start(self) -> None:
        return None

    async def _restart(self) -> None:
        await self.interrupt()
        self._count = 0

    async def interrupt(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGINT)

    async def run(
        self, code: str, persistent_env: dict[str, str], temp_env: dict[str, str], sink: Sink
    ) -> None:
        self.interrupt_pending = False
        self._count += 1
        sink(m.count_line(self._count))
        env = {**self.env, **persistent_env, **temp_env}
        self._proc = proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            code,
            cwd=self.info.cwd,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_default_sigint,
        )
        if self.interrupt_pending:  # abandoned while the process was being spawned
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)

        async def pump(stream: asyncio.StreamReader, name: str) -> None:
            while line := await stream.readline():
                sink(m.stream_line(name, line.decode(errors="replace")))

        assert proc.stdout is not None and proc.stderr is not None
        try:
            await asyncio.gather(pump(proc.stdout, "stdout"), pump(proc.stderr, "stderr"))
            code_ = await proc.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.shield(proc.wait())
            raise
        if code_ != 0:
            sink(m.error_line("CommandExitError", f"exit status {code_}", []))

    async def aclose(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


BACKENDS: dict[str, type[Context]] = {"python": PythonContext, "bash": BashContext}
ALIASES = {"python3": "python", "ipython": "python", "sh": "bash", "shell": "bash"}


class Registry:
    """All contexts by id, plus one default per language (created on first use)."""

    def __init__(self, base_env: dict[str, str], default_cwd: str) -> None:
        self.base_env = base_env
        self.default_cwd = default_cwd
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}
        self._default_lock = asyncio.Lock()

    @staticmethod
    def normalise(language: str | None) -> str:
        lang = ALIASES.get((language or "python").lower(), (language or "python").lower())
        if lang not in BACKENDS:
            raise UnsupportedLanguage(
                f"language '{language}' is not supported here (available: {', '.join(BACKENDS)})"
            )
        return lang

    async def create(self, language: str | None, cwd: str | None) -> Context:
        lang = self.normalise(language)
        info = ContextInfo(id=str(uuid.uuid4()), language=lang, cwd=cwd or self.default_cwd)
        if not os.path.isdir(info.cwd):
            raise UnusableCwd(f"cwd '{info.cwd}' is not a directory in this sandbox")
        ctx = BACKENDS[lang](info, dict(self.base_env))
        try:
            await ctx.start()
        except BaseException as exc:
            await asyncio.shield(ctx.aclose())
            if isinstance(exc, Exception):
                raise ContextStartFailed(f"could not start a {lang} context in {info.cwd}: "
                                         f"{type(exc).__name__}: {exc}") from exc
            raise
        self.contexts[info.id] = ctx
        return ctx

    async def default(self, language: str | None) -> Context:
        lang = self.normalise(language)
        async with self._default_lock:
            cid = self.defaults.get(lang)
            if cid is None or cid not in self.contexts:
                ctx = await self.create(lang, None)
                self.defaults[lang] = ctx.info.id
            return self.contexts[self.defaults[lang]]

    def get(self, context_id: str) -> Context:
        try:
            return self.contexts[context_id]
        except KeyError:
            raise ContextNotFound(f"Context {context_id} not found") from None

    async def remove(self, context_id: str) -> None:
        ctx = self.get(context_id)
        del self.contexts[context_id]
        if ctx.current is not None:
            ctx.current.cancel()
        await ctx.aclose()

    async def aclose(self) -> None:
        for cid in list(self.contexts):
            with contextlib.suppress(Exception):
                await self.remove(cid)
