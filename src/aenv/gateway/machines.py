"""Which machine a vm snapshot restores on, as far as the gateway has heard (``aenv.machine_key``).

Each node reports its own machine in ``/aenv/info`` (``Node.machine``). A snapshot's machine comes with
the answers the gateway relays (the snapshot's create, ``GET /snapshots/{id}``: their ``machine``) or
with a node's refusal to restore it (a 409 ``reason: machine`` whose ``snapshotMachine`` names it; the
node started nothing). From then on placement only picks nodes of that machine; when no live node has
it, the create (or adoption) is a 409 that names the snapshot's machine and each live node's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from fastapi.responses import JSONResponse

from aenv.api.errors import error_response
from aenv.gateway.nodes import Node
from aenv.machine_key import MachineKey, describe, parse

MAX_CACHED = 100_000  # snapshots whose machine is kept (least recently used dropped first)
REASON = "machine"  # a node's refusal: the saved state is of another machine


class SnapshotMachines:
    """Snapshot (or published pause) id or name -> the machine it was taken on."""

    def __init__(self, max_cached: int = MAX_CACHED) -> None:
        self._known: OrderedDict[str, MachineKey] = OrderedDict()
        self._max = max_cached

    def get(self, key: str | None) -> MachineKey | None:
        return self._known.get(key) if key else None

    def learn(self, keys: Iterable[str], machine: Any) -> MachineKey | None:
        """Remember ``machine`` (when it is a well-formed record) under each key; returns it."""
        parsed = parse(machine)
        if parsed is not None:
            for key in keys:
                self._known[key] = parsed
                self._known.move_to_end(key)
            while len(self._known) > self._max:
                self._known.popitem(last=False)
        return parsed

    def learn_snapshot(self, snapshot: Any) -> None:
        """From a node's snapshot JSON: its ``machine``, under its ID and names."""
        if isinstance(snapshot, dict) and isinstance(sid := snapshot.get("snapshotID"), str):
            names = [n for n in snapshot.get("names") or [] if isinstance(n, str)]
            self.learn([sid, *names], snapshot.get("machine"))

    def learn_refusal(self, key: str | None, body: Any) -> MachineKey | None:
        """From a 409 ``reason: machine``: the snapshot's machine, remembered under ``key``."""
        machine = body.get("snapshotMachine") if isinstance(body, dict) else None
        return self.learn([key] if key else [], machine)


def is_refusal(status: int, body: Any) -> bool:
    """A node's 409 saying the saved state is of another machine (nothing was started)."""
    return status == 409 and isinstance(body, dict) and body.get("reason") == REASON


def fits(machine: MachineKey | None, node: Node) -> bool:
    """The node can restore state of ``machine`` (unknown: any node can try)."""
    return machine is None or node.machine == machine


def none_fits(what: str, machine: MachineKey, live: Iterable[Node]) -> JSONResponse:
    """The 409 when no live node has the machine ``what`` was taken on."""
    nodes = "; ".join(f"{n.id}: {describe(n.machine)}" for n in live) or "none"
    message = f"no live node can restore {what}: it was taken on {describe(machine)} (live nodes: {nodes})"
    return error_response(409, message, None, reason=REASON, snapshotMachine=machine)
