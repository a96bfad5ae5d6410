"""What an episode ended as, telling infrastructure failures from the policy's own failures.

A trainer must not learn from a rollout whose sandbox died (a 429, a lost connection, an expired
sandbox): that is noise to retry or drop, not a low reward. A command that ran and exited non-zero
is the opposite: a real outcome of the policy's action, to score. ``classify`` draws that line once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

OK = "ok"
COMMAND_FAILED = "command_failed"  # a command ran and exited non-zero: the policy's outcome
INFRA_FAILED = "infra_failed"  # the sandbox or the server failed: retry or drop, never score
ERROR = "error"  # the caller's own code raised: a bug, re-raised


@dataclass
class Outcome:
    status: str = OK
    exit_code: int | None = None  # of the last command that failed
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def infra_failure(self) -> bool:
        return self.status == INFRA_FAILED

    @property
    def ok(self) -> bool:
        return self.status == OK

    def fail_infra(self, exc: BaseException) -> None:
        """Record an infrastructure failure; it wins over a command failure seen before."""
        self.status = INFRA_FAILED
        self.error = f"{type(exc).__name__}: {exc}"

    def fail_command(self, exit_code: int, stderr: str) -> None:
        if self.status == OK:
            self.status = COMMAND_FAILED
        self.exit_code = exit_code
        self.error = stderr[-500:] or f"exit code {exit_code}"


def is_infra(exc: BaseException) -> bool:
    """Whether ``exc`` came from the sandbox platform rather than from the command or the caller."""
    from e2b import AuthenticationException, CommandExitException, SandboxException, ServiceBusyException

    from aenv.client import AenvClientError

    if isinstance(exc, CommandExitException):
        return False
    return isinstance(exc, (SandboxException, ServiceBusyException, AuthenticationException, AenvClientError,
                            httpx.HTTPError, ConnectionError, TimeoutError))


class Stopwatch:
    """Adds the seconds of each ``with`` block to ``metrics[key]``."""

    def __init__(self, metrics: dict[str, Any], key: str) -> None:
        self.metrics, self.key = metrics, key

    def __enter__(self) -> None:
        self.t0 = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self.metrics[self.key] = round(self.metrics.get(self.key, 0.0) + time.monotonic() - self.t0, 4)
