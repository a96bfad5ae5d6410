"""Execution contexts: one kernel (python) or shell (bash) each, with the state that persists between runs.

Why the producer/consumer split: ``Context.run`` drives one execution to its end (kernel back to idle) and
pushes lines into a sink, holding the context's lock the whole time. The HTTP side only consumes. When the
client goes away the service calls ``interrupt`` and stops listening, while ``run`` keeps draining until
the kernel is idle, so the next execution never sees the tail of the previous one.

Python and R contexts use ``jupyter_client``'s ``AsyncKernelManager``, with ipykernel's built-in ``python3``
spec and IRkernel's ``ir`` spec (Debian's ``r-cran-irkernel``, in the template where it was built with R;
``jupyter_client`` is imported lazily: the host-side unit tests import this module without Jupyter). Bash
contexts run each code block as ``bash -c`` in the context's cwd; they keep no shell state between runs (a
known limit). Each language sets environment variables in its own words (``env_prelude``, ``r_env_prelude``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import queue
import signal
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


def r_env_prelude(persistent: dict[str, str], temporary: dict[str, str]) -> tuple[str, str]:
    """``env_prelude`` in R. Strings are written as JSON literals, which R reads the same (``\\uXXXX``
    escapes included); names may be anything, so values are set through a named list."""
    def sets(env: dict[str, str]) -> str:
        return "".join(f".aenv_set({json.dumps(k)}, {json.dumps(v)})\n" for k, v in env.items())

    before = (
        ".aenv_set <- function(k, v) { a <- list(v); names(a) <- k; do.call(Sys.setenv, a) }\n"
        f"{sets(persistent)}"
        f".aenv_saved <- Sys.getenv(c({', '.join(json.dumps(k) for k in sorted(temporary))}), unset = NA, names = TRUE)\n"
        f"{sets(temporary)}"
    )
    after = (
        "for (.aenv_k in names(.aenv_saved)) {\n"
        "  if (is.na(.aenv_saved[[.aenv_k]])) Sys.unsetenv(.aenv_k) else .aenv_set(.aenv_k, .aenv_saved[[.aenv_k]])\n"
        "}\n"
        "rm(.aenv_saved)\n"
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

    @classmethod
    def available(cls) -> bool:
        """Whether this template can run the language at all (answered before a context is made)."""
        return True

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


_FOUND_KERNELS: set[str] = set()


class JupyterContext(Context):
    """A Jupyter kernel process driven through ``jupyter_client``: ``KERNEL`` names its spec."""

    KERNEL = ""
    EXTRA_ARGUMENTS: tuple[str, ...] = ()
    PRELUDE = staticmethod(env_prelude)

    def __init__(self, info: ContextInfo, env: dict[str, str]) -> None:
        super().__init__(info, env)
        self._km: Any = None
        self._kc: Any = None
        self._applied: dict[str, str] = {}  # persistent env already set in the kernel

    @classmethod
    def available(cls) -> bool:
        """Whether this template has the kernel (a template built without R has no ``ir`` spec); a
        kernel found stays found, one missing is looked for again (R installed in the sandbox later)."""
        if cls.KERNEL in _FOUND_KERNELS:
            return True
        try:
            spec = importlib.import_module("jupyter_client.kernelspec")
            spec.KernelSpecManager().get_kernel_spec(cls.KERNEL)
        except Exception:
            return False
        _FOUND_KERNELS.add(cls.KERNEL)
        return True

    async def start(self) -> None:
        # imported by name: only the template's Python has jupyter_client (the host's type checker does not)
        manager = importlib.import_module("jupyter_client.manager")
        self._km = manager.AsyncKernelManager(kernel_name=self.KERNEL)
        await self._km.start_kernel(cwd=self.info.cwd, env=self.env, extra_arguments=list(self.EXTRA_ARGUMENTS))
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
            before, after = self.PRELUDE(persistent, temp_env)
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


class PythonContext(JupyterContext):
    """ipykernel, with the formatters of ``display.py`` installed as it starts."""

    KERNEL = "python3"
    EXTRA_ARGUMENTS = (f"--IPKernelApp.exec_lines={INSTALL_DISPLAY}",)

    @classmethod
    def available(cls) -> bool:
        return True  # ipykernel is the template's own: a missing one is a failed start, said as such


class RContext(JupyterContext):
    """IRkernel (``R``): results as R prints them (``[1] "x"``), environment through ``Sys.setenv``."""

    KERNEL = "ir"
    PRELUDE = staticmethod(r_env_prelude)


def default_sigint() -> None:
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
            preexec_fn=default_sigint,
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
