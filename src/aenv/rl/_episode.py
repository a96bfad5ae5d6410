"""One rollout in one sandbox: ``with Episode(...) as ep: ep.run(...)``, sync and async.

What an RL loop needs from a sandbox and should not write itself:

- **idempotent create** keyed by the rollout ID (``Idempotency-Key``): a trainer that retries a
  create after a timeout gets the same sandbox, not a second one nobody kills;
- **keepalive**: the sandbox's TTL is short (``timeout``) and refreshed in the background every
  ``keepalive`` seconds (``set_timeout``). If the trainer dies, its sandboxes end within ``timeout``
  seconds by themselves: the heartbeat is the TTL;
- **guaranteed kill** on leaving the block, whatever happened in it (``kill=False`` keeps it), tried
  again while the infrastructure refuses it (a gateway restarting) for up to 30 s;
- an **outcome** that tells infrastructure failures (not to be scored) from command failures (to be
  scored), and a per-rollout ``metrics`` dict (create, command and kill seconds, keepalives).

Every sandbox is tagged ``rollout=<id>`` and ``run=<run>`` so ``aenv ls -m run=X`` shows a run and
``aenv rm -m run=X`` reaps it; given ``lease=`` (``_lease.py``) it is also bound to the trainer's
heartbeat lease, and ends with it if the trainer dies, whatever its TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Self

from aenv.rl._kill import akill_until, kill_until
from aenv.rl._kill import deadline as kill_deadline
from aenv.rl._lease import Lease
from aenv.rl._outcome import ERROR, Outcome, Stopwatch, is_infra

DEFAULT_TIMEOUT = 120


def _metadata(rollout_id: str, run: str | None, extra: dict[str, str] | None) -> dict[str, str]:
    return {**(extra or {}), "rollout": rollout_id, **({"run": run} if run else {})}


class _Common:
    """What the sync and async episodes share: options, outcome, metrics and the exit's verdict."""

    def __init__(self, template: str = "base", *, rollout_id: str, run: str | None = None,
                 timeout: int = DEFAULT_TIMEOUT, keepalive: float | None = None,
                 metadata: dict[str, str] | None = None, envs: dict[str, str] | None = None,
                 sandbox_id: str | None = None, kill: bool = True, suppress_infra: bool = True,
                 lease: Lease | None = None, **connection: Any) -> None:
        self.template, self.rollout_id, self.run_tag = template, rollout_id, run
        self.timeout = timeout
        self.keepalive = keepalive if keepalive is not None else max(1.0, timeout / 3)
        self.metadata = _metadata(rollout_id, run, {**(metadata or {}), **(lease.metadata if lease else {})})
        self.envs = envs
        self.sandbox_id = sandbox_id  # given: attach to it (a fork child) instead of creating one
        self.kill_on_exit = kill
        self.suppress_infra = suppress_infra
        self.connection = connection  # api_key, api_url, sandbox_url, ... as the E2B SDK takes them
        self.outcome = Outcome()
        self.metrics = self.outcome.metrics
        self.metrics.update(commands=0, keepalives=0)
        self.score: float | None = None

    def _verdict(self, exc: BaseException | None) -> bool:
        """Record what the block raised; True swallows it (an infra failure, when suppressed)."""
        if exc is None:
            return False
        if is_infra(exc):
            self.outcome.fail_infra(exc)
            return self.suppress_infra
        if self.outcome.status != "infra_failed":
            self.outcome.status, self.outcome.error = ERROR, f"{type(exc).__name__}: {exc}"
        return False

    def _kill_failed(self, error: str | None) -> None:
        if error is not None:  # it ends with its timeout or lease; the caller sees why it was not killed
            self.metrics["kill_error"] = error

    def _record_command(self, result: Any) -> Any:
        self.metrics["commands"] += 1
        if result.exit_code != 0:
            self.outcome.fail_command(result.exit_code, result.stderr or "")
        return result


class Episode(_Common):
    """A rollout in a sandbox of the sync E2B SDK (``e2b.Sandbox``)."""

    sandbox: Any

    def __enter__(self) -> Self:
        from e2b import Sandbox

        try:
            with Stopwatch(self.metrics, "create_s"):
                if self.sandbox_id is not None:
                    self.sandbox = Sandbox.connect(self.sandbox_id, timeout=self.timeout, **self.connection)
                else:
                    self.sandbox = Sandbox.create(self.template, timeout=self.timeout, metadata=self.metadata,
                                                  envs=self.envs, idempotency_key=self.rollout_id,
                                                  **self.connection)
        except BaseException as exc:
            if not self._verdict(exc):
                raise
            raise EpisodeNotStarted(self.outcome) from exc
        self.sandbox_id = self.sandbox.sandbox_id
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._keepalive, name=f"aenv-rl-keepalive-{self.rollout_id}",
                                      daemon=True)
        self._beat.start()
        return self

    def run(self, cmd: str, **kw: Any) -> Any:
        """``sandbox.commands.run`` that returns a non-zero exit as a result (and records it) instead
        of raising: a failed command is an outcome of the policy, not an exception of the loop."""
        from e2b import CommandExitException

        try:
            with Stopwatch(self.metrics, "command_s"):
                result = self.sandbox.commands.run(cmd, **kw)
        except CommandExitException as exc:
            result = exc
        return self._record_command(result)

    def _keepalive(self) -> None:
        while not self._stop.wait(self.keepalive):
            try:
                self.sandbox.set_timeout(self.timeout)
                self.metrics["keepalives"] += 1
            except Exception as exc:  # noqa: BLE001 - recorded; the next command says the rest
                self.metrics["keepalive_error"] = f"{type(exc).__name__}: {exc}"

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        self._stop.set()
        self._beat.join()
        if self.kill_on_exit:
            with Stopwatch(self.metrics, "kill_s"):
                self._kill_failed(kill_until(self.sandbox.kill, kill_deadline()))
        return self._verdict(exc)


class AsyncEpisode(_Common):
    """The same over the async E2B SDK (``e2b.AsyncSandbox``): ``async with AsyncEpisode(...) as ep``."""

    sandbox: Any

    async def __aenter__(self) -> Self:
        from e2b import AsyncSandbox

        try:
            with Stopwatch(self.metrics, "create_s"):
                if self.sandbox_id is not None:
                    self.sandbox = await AsyncSandbox.connect(self.sandbox_id, timeout=self.timeout, **self.connection)
                else:
                    self.sandbox = await AsyncSandbox.create(
                        self.template, timeout=self.timeout, metadata=self.metadata, envs=self.envs,
                        idempotency_key=self.rollout_id, **self.connection)
        except BaseException as exc:
            if not self._verdict(exc):
                raise
            raise EpisodeNotStarted(self.outcome) from exc
        self.sandbox_id = self.sandbox.sandbox_id
        self._beat = asyncio.create_task(self._keepalive(), name=f"aenv-rl-keepalive-{self.rollout_id}")
        return self

    async def run(self, cmd: str, **kw: Any) -> Any:
        from e2b import CommandExitException

        try:
            with Stopwatch(self.metrics, "command_s"):
                result = await self.sandbox.commands.run(cmd, **kw)
        except CommandExitException as exc:
            result = exc
        return self._record_command(result)

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive)
            try:
                await self.sandbox.set_timeout(self.timeout)
                self.metrics["keepalives"] += 1
            except Exception as exc:  # noqa: BLE001 - recorded; the next command says the rest
                self.metrics["keepalive_error"] = f"{type(exc).__name__}: {exc}"

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        self._beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._beat
        if self.kill_on_exit:
            with Stopwatch(self.metrics, "kill_s"):
                self._kill_failed(await akill_until(self.sandbox.kill, kill_deadline()))
        return self._verdict(exc)


class EpisodeNotStarted(Exception):
    """The sandbox could not be had (an infrastructure failure); ``outcome`` says why."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.error)
        self.outcome = outcome
