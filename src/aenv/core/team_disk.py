"""A team's disk: what its snapshots, templates and volumes keep, against its ``max_disk_mb`` quota.

Checked before a team adds to it (a snapshot, a pull, a build, a volume): a team at or over its quota is
refused until it deletes something (429, ``quota: max_disk_mb``). Snapshots and templates are counted by
the sizes their rows record (a snapshot's template row is the snapshot itself, counted once); volumes by
the blocks their directories hold now (a volume grows between checks: the quota bounds what a team can
*add*, the per-volume size limit bounds each volume).
"""

from __future__ import annotations

import asyncio

from aenv.core.admission import Admission
from aenv.core.sync import disk_usage
from aenv.core.volumes import Volumes
from aenv.errors import QuotaExceeded
from aenv.kinds import TemplateKind
from aenv.store.sqlite import Store

MB = 1 << 20


def kept_bytes(store: Store, volumes: Volumes, owner: str) -> int:
    """Bytes ``owner``'s team keeps on this node (blocking: volumes are measured)."""
    snaps = sum(r.size_bytes for r in store.list_snapshots() if r.owner == owner and not r.internal)
    templates = sum(t.size_bytes for t in store.list_templates()
                    if t.owner == owner and t.kind is not TemplateKind.SNAPSHOT)  # fmt: skip
    vols = sum(disk_usage(volumes.path(v.id)) for v in volumes.of_owner(owner))
    return snaps + templates + vols


async def check_disk(admission: Admission, store: Store, volumes: Volumes, owner: str) -> None:
    """Refuse (QuotaExceeded) when ``owner``'s team keeps its whole ``max_disk_mb`` already."""
    limit = admission.quota(owner).max_disk_mb
    if limit is None:
        return
    kept = await asyncio.to_thread(kept_bytes, store, volumes, owner)
    if kept >= limit * MB:
        admission.refusals[(owner, "max_disk_mb")] = admission.refusals.get((owner, "max_disk_mb"), 0) + 1
        raise QuotaExceeded(f"team quota max_disk_mb = {limit} reached: the team keeps {kept / MB:.0f} MiB of "
                            "snapshots, templates and volumes; delete some first", "max_disk_mb", limit)
