"""core/network.py's steps of the lifecycle: a new row's network columns, and whether a sandbox has a
way out, which is fixed at create while allowInternetAccess is switched by updates (store v4)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from aenv.config import Settings
from aenv.core import network as net
from aenv.core.context import Context
from aenv.core.models import NetworkRequest
from aenv.runtime.base import SandboxImage
from aenv.store.sqlite import SandboxRow


def _row(**kw: Any) -> SandboxRow:
    return SandboxRow(id="s1", template_id="base", state="running", runtime="fake", started_at=0.0, end_at=1.0,
                      cpu_count=1, memory_mb=256, disk_mb=512, **kw)


def _spec_allow_internet(tmp_path: Path, row: SandboxRow) -> bool:
    templates = SimpleNamespace(image=lambda t: SandboxImage("base", tmp_path))
    ctx = Context(Settings(state_dir=tmp_path), None, None, templates, None)  # type: ignore[arg-type]
    return ctx.spec_for(row, SimpleNamespace(id="base")).allow_internet  # type: ignore[arg-type]


def test_row_fields_fix_the_way_out_at_create() -> None:
    assert net.row_fields(None, True) == {"allow_internet": True, "network": {}, "traffic_token": None,
                                          "has_network": True}
    assert net.row_fields(None, False)["has_network"] is False
    # allowOut keeps its entries reachable without internet access: the sandbox needs slirp
    fields = net.row_fields(NetworkRequest(allow_out=["1.1.1.1"]), False)
    assert fields["has_network"] is True and fields["network"]["allowOut"] == ["1.1.1.1"]
    token = net.row_fields(NetworkRequest(allow_public_traffic=False), True)["traffic_token"]
    assert isinstance(token, str) and token


def test_the_spec_follows_has_network_not_the_switched_internet_access(tmp_path: Path) -> None:
    # made with internet, then PUT allow_internet_access: false: after a restart it still has slirp
    assert _spec_allow_internet(tmp_path, _row(allow_internet=False, has_network=True)) is True
    assert _spec_allow_internet(tmp_path, _row(allow_internet=True, has_network=False)) is False
    # a row from before v4: derived as before
    assert _spec_allow_internet(tmp_path, _row(allow_internet=False)) is False
    assert _spec_allow_internet(tmp_path, _row(allow_internet=False, network={"allowOut": ["1.1.1.1"]})) is True
