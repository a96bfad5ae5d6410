"""What a gateway places creates by besides load (``/aenv/info``): this node's machine record (vm only:
snapshots restore on the same machine, ``aenv.machine_key``), the templates it has warm sandboxes of, the
built templates it holds (their snapshot is here: no fetch from the store) and the store it shares with
other nodes (a gateway builds once only where every node names the same one)."""

from __future__ import annotations

from typing import Any

from aenv.core.template_share import shares_templates
from aenv.core.templates import TemplateCatalog
from aenv.runtime.base import MachineBound, Runtime, WarmReporting


def placement_facts(runtime: Runtime, catalog: TemplateCatalog) -> dict[str, Any]:
    """``machine`` (None without a record: ns) and ``warm``: ready pool entries per template, under its
    ID and its alias alike (a create may name either); ``held``: the built templates here (IDs and
    aliases); ``templateStore``: the store it shares built templates through (None: it does not)."""
    machine = runtime.machine() if isinstance(runtime, MachineBound) else None
    warm: dict[str, int] = {}
    for template_id, n in (runtime.warm_counts() if isinstance(runtime, WarmReporting) else {}).items():
        warm[template_id] = n
        row = catalog.store.get_template(template_id)
        if row is not None and row.alias:
            warm[row.alias] = n
    held: set[str] = set()
    for row in catalog.store.list_templates():
        if row.config.get("built") and not row.config.get("hidden"):
            held |= {row.id, str(row.config.get("family") or row.id)} | ({row.alias} if row.alias else set())
    store = catalog.settings.snapshot_store_url if shares_templates(catalog.settings, runtime.name) else None
    return {"machine": machine, "warm": warm, "held": sorted(held), "templateStore": store}
