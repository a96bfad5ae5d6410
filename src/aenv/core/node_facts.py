"""What a gateway places creates by besides load (``/aenv/info``): this node's machine record (vm only:
snapshots restore on the same machine, ``aenv.machine_key``) and the templates it has warm sandboxes of."""

from __future__ import annotations

from typing import Any

from aenv.core.templates import TemplateCatalog
from aenv.runtime.base import MachineBound, Runtime, WarmReporting


def placement_facts(runtime: Runtime, catalog: TemplateCatalog) -> dict[str, Any]:
    """``machine`` (None without a record: ns) and ``warm``: ready pool entries per template, under its
    ID and its alias alike (a create may name either)."""
    machine = runtime.machine() if isinstance(runtime, MachineBound) else None
    warm: dict[str, int] = {}
    for template_id, n in (runtime.warm_counts() if isinstance(runtime, WarmReporting) else {}).items():
        warm[template_id] = n
        row = catalog.store.get_template(template_id)
        if row is not None and row.alias:
            warm[row.alias] = n
    return {"machine": machine, "warm": warm}
