"""The build cache stays bounded: the oldest entries go first, and a step snapshot nothing names any
more loses its hidden template (the snapshot GC then takes it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aenv.core.builds as builds
from aenv.config import Settings
from aenv.core.builds import TemplateBuilds
from aenv.core.context import Context
from aenv.core.table import SandboxTable
from aenv.core.templates import TemplateCatalog
from aenv.kinds import TemplateKind
from aenv.store.sqlite import Store
from tests.fixtures.runtime import FakeRuntime


class _Snapshots:
    def __init__(self) -> None:
        self.collected = 0

    def collect_garbage(self) -> None:
        self.collected += 1


def test_old_entries_and_their_hidden_templates_go(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(builds, "CACHE_ENTRIES", 2)
    settings = Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c")
    settings.state_dir.mkdir()
    store = Store(settings.db_path)
    catalog = TemplateCatalog(settings, store)
    ctx = Context(settings, store, FakeRuntime(), catalog, SandboxTable())  # type: ignore[arg-type]
    snaps = _Snapshots()
    b = TemplateBuilds(ctx, None, snaps, None)  # type: ignore[arg-type]
    for sid in ("snapa", "snapb", "snapc"):
        catalog.register(alias=None, kind=TemplateKind.SNAPSHOT, rootfs=tmp_path, template_id=sid,
                         config={"snapshot": sid, "hidden": True})
    # a visible built template still points at snapa: it must survive its entry's eviction
    catalog.register(alias="kept", kind=TemplateKind.SNAPSHOT, rootfs=tmp_path, template_id="kept",
                     config={"snapshot": "snapa", "built": True})
    cache = {"k1": {"snapshot": "snapa"}, "k2": {"snapshot": "snapb"}, "k3": {"snapshot": "snapc"}}
    b._save_cache(cache)
    assert list(cache) == ["k2", "k3"] and list(b._cache()) == ["k2", "k3"]
    assert store.get_template("snapa") is not None  # named by a template
    b._save_cache({"k3": {"snapshot": "snapc"}, "k4": {"snapshot": "snapc"}, "k5": {"snapshot": "snapc"}})
    assert store.get_template("snapb") is None and store.get_template("snapc") is not None
    assert snaps.collected == 2
    store.close()
