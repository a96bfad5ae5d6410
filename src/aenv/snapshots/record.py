"""The stored form of what a runtime wrote into a snapshot (a store row's ``result``, a manifest's).

Keys, the same for every runtime::

    layers       paths inside the snapshot directory the repository stores (its own files)
    stack        host paths of *other* snapshots' layers this one sits on, top first (ns: the parents'
                 ``upper`` dirs); published as ``stack/<i>``, rewritten to the local copies on fetch
    base_lowers  host paths of the image layers under the stack (ns); a fetching server puts its own
                 template's in their place
    paused_ms    how long the sandbox was stopped to take it, when the runtime measured it
    data         the runtime's own facts; nobody else reads them, but for ``data["machine"]`` (vm:
                 the machine it restores on, ``aenv.machine_key``), shown in the snapshot's JSON

Records written before these keys existed kept the ns stack in ``data`` (``lowers`` and
``snapshot_depth``) and ``paused_ms`` in ``data`` too; :func:`normalize` reads both forms.
"""

from __future__ import annotations

from typing import Any


def normalize(raw: dict[str, Any] | None) -> dict[str, Any]:
    """``raw`` in the current form (a new dict; ``raw`` is not changed)."""
    raw = dict(raw or {})
    data = dict(raw.get("data") or {})
    out: dict[str, Any] = {
        "layers": [str(p) for p in raw.get("layers") or ()],
        "stack": [str(p) for p in raw.get("stack") or ()],
        "base_lowers": [str(p) for p in raw.get("base_lowers") or ()],
        "paused_ms": raw.get("paused_ms"),
        "data": data,
    }
    if "stack" not in raw and isinstance(data.get("lowers"), list):
        lowers = [str(p) for p in data.pop("lowers")]
        depth = max(0, min(len(lowers), int(data.pop("snapshot_depth", 0) or 0)))
        out["stack"], out["base_lowers"] = lowers[:depth], lowers[depth:]
    if out["paused_ms"] is None and isinstance(data.get("paused_ms"), (int, float)):
        out["paused_ms"] = data.pop("paused_ms")
    return out
