"""The one translation of the vm runtime's own failures into aenv's errors.

QEMU (``MachineError``), qemu-img (``disk.DiskError``), RAM layers (``memlayer.LayerError``) and a
bad recorded config (``VmConfigError``) mean the runtime could not do what was asked:
``RuntimeFailure``. A channel that broke or timed out while the guest was being talked to
(``MuxError``, ``EnvdError``, ``OSError`` including ``TimeoutError``) means the VM runs but its
agent or envd did not answer: ``SandboxUnreachable``, for the steps that talk to the guest (those
that pass ``after``); elsewhere an ``OSError`` is a host-side failure like the others. Errors that are
already aenv's pass through unchanged, so a step may raise its own more precise one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from aenv.errors import RuntimeFailure, SandboxUnreachable
from aenv.mux import MuxError
from aenv.runtime.envd_client import EnvdError

from .config import VmConfigError
from .disk import DiskError
from .machine import MachineError
from .memlayer import LayerError

FAILURES: tuple[type[BaseException], ...] = (MachineError, DiskError, LayerError, VmConfigError)
UNREACHABLE: tuple[type[BaseException], ...] = (MuxError, EnvdError, OSError)


@contextlib.contextmanager
def translated(
    sandbox_id: str, action: str, *, after: str | None = None, also: tuple[type[BaseException], ...] = ()
) -> Iterator[None]:
    """Raise what fails inside as ``RuntimeFailure("sandbox <id>: <action> failed: …")``, or, with
    ``after`` (the step talks to envd), a broken channel as ``SandboxUnreachable("sandbox <id>: envd
    unreachable after <after>: …")``. ``also``: more exception types that count as a failure here
    (e.g. ``KeyError`` for a snapshot record missing a field)."""
    try:
        yield
    except (*FAILURES, *also) as exc:
        raise RuntimeFailure(f"sandbox {sandbox_id}: {action} failed: {exc}", sandbox_id=sandbox_id) from exc
    except UNREACHABLE as exc:
        if after is None:
            raise RuntimeFailure(f"sandbox {sandbox_id}: {action} failed: {exc}", sandbox_id=sandbox_id) from exc
        raise SandboxUnreachable(
            f"sandbox {sandbox_id}: envd unreachable after {after}: {exc}", sandbox_id=sandbox_id
        ) from exc
