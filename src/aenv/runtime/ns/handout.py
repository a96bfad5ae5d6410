"""A pooled sandbox's filter at hand-out, when the create brings a network policy.

A pooled sandbox runs under the base filter. Writing the policy's filter used to hold the create's
answer back (a restore of both iptables tables, 40-50 ms with nf_tables beside the pool's own). Now it
is written while the hand-out goes on (envd's /init, the create's answer, the client's first request),
and every stream into the sandbox waits for it: nothing the sandbox is asked to do (a command, a file,
a port) reaches it before its policy is in force, and if writing it failed, streams fail and
slirp4netns stops, so the sandbox has no way out rather than one without its policy. A template's start
command never runs in a pooled sandbox handed out with a policy (``NsRuntime.create``).

So that the write costs no fork and exec either, each pooled sandbox with internet has an iptables
restore waiting in its namespace (``network.Restorer``); a hand-out without a policy lets it exit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aenv.runtime.network import Restorer

log = logging.getLogger(__name__)

DISCARD_AFTER_S = 0.2  # an unused restorer exits this long after the hand-out, once the create has answered
Install = Callable[[Restorer | None], Awaitable[None]]  # ENFORCER.start_install with the restorer to use


class HandOutFilter:
    """One sandbox's: the waiting restorer, then the write its streams wait for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.restorer: Restorer | None = None
        self._task: asyncio.Task[None] | None = None
        self._unused: Restorer | None = None  # a restorer the hand-out did not need, ended a little later
        self._discard_timer: asyncio.TimerHandle | None = None
        # adopted with nf_tables rules of an older server (``network.foreign_rules``): dropped once a
        # filter of ours is written (``NsRuntime.set_egress``)
        self.foreign = False

    async def prepare(self, pid: int) -> None:
        """Pooled: start the restorer in ``pid``'s namespace. Best effort: without one the hand-out
        starts its own restore."""
        try:
            self.restorer = await Restorer.start(pid)
        except Exception as exc:  # noqa: BLE001 - it only saves the hand-out an exec
            log.debug("sandbox %s: no restorer: %s", self.name, exc)

    def hand_out(self, sandbox_id: str, install: Install | None, cut_network: Callable[[], Awaitable[None]]) -> None:
        """With a policy, start writing it (``install``); ``cut_network`` if that fails. Without one,
        the restorer exits on a worker thread a little later, off the create's path."""
        restorer, self.restorer, self.name = self.restorer, None, sandbox_id
        if install is None:
            if restorer is not None:
                # later, not now: its worker thread would take the interpreter from the create's
                # hand-out and the exit would take a CPU from envd's /init (~0.9 ms a create, 2 cores);
                # until then it is still this filter's to end (``aclose``)
                loop = asyncio.get_running_loop()
                self._unused = restorer
                self._discard_timer = loop.call_later(DISCARD_AFTER_S, self._discard_unused, loop)
            return

        pending = install(restorer)  # its blocking part starts now (``Enforcer.start_install``)

        async def run() -> None:
            try:
                await pending
            except BaseException:
                await cut_network()
                raise
            finally:
                if restorer is not None and restorer.proc.returncode is None:  # failed before using it
                    await asyncio.to_thread(restorer.discard)

        self._task = asyncio.create_task(run(), name=f"egress-{self.name}")
        self._task.add_done_callback(_log_failure)

    @property
    def pending(self) -> bool:
        return self._task is not None and not self._task.done()

    async def ready(self) -> None:
        """Return once the policy is in force; OSError if it could not be written."""
        if (task := self._task) is None:
            return
        try:
            await asyncio.shield(task)
        except Exception as exc:  # noqa: BLE001 - whatever it was, the policy is not in force
            raise OSError(f"its network policy could not be applied: {exc}") from exc

    async def settled(self) -> None:
        """Written or failed: an update or a kill must not race it."""
        if self._task is not None:
            await asyncio.wait([self._task])

    def _discard_unused(self, loop: asyncio.AbstractEventLoop) -> None:
        self._discard_timer = None
        if (restorer := self._unused) is not None:
            self._unused = None
            loop.run_in_executor(None, restorer.discard)

    async def aclose(self) -> None:
        """The sandbox goes: a restorer never used exits (now, if its later end is still pending)."""
        if self._discard_timer is not None:
            self._discard_timer.cancel()
            self._discard_timer = None
        for restorer in (self.restorer, self._unused):
            if restorer is not None:
                await asyncio.to_thread(restorer.discard)
        self.restorer = self._unused = None


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("%s: the network policy could not be applied at hand-out (%r); its streams fail",
                    task.get_name(), exc)
