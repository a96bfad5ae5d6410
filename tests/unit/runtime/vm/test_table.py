"""The vm runtime's live-sandbox table: running and released sandboxes, specs, locks, states."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from aenv.errors import SandboxNotFound
from aenv.runtime.base import SandboxImage, SandboxSpec
from aenv.runtime.vm.sandbox import VmSandbox
from aenv.runtime.vm.table import Released, VmTable


class FakeSandbox:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def state(self) -> dict[str, Any]:
        return {"name": self.run_dir.name, "run_dir": str(self.run_dir)}


def test_forms_states_and_removal(tmp_path: Path) -> None:
    table = VmTable()
    spec = SandboxSpec("a", SandboxImage("t", tmp_path), tmp_path / "work-a")
    table.add("a", cast(VmSandbox, FakeSandbox(tmp_path / "run" / "pool-1")), spec)
    table.released["b"] = Released("b", tmp_path / "run" / "b", "t-key", 2, False)
    assert table.run_dir_names() == {"pool-1", "b"}
    assert table.state_of("a").data == {"name": "pool-1", "run_dir": str(tmp_path / "run" / "pool-1"),
                                        "workdir": str(tmp_path / "work-a")}
    rel = table.state_of("b").data
    assert rel["released"] == str(tmp_path / "run" / "b" / "released.full") and rel["workdir"] is None
    assert rel["disk_generation"] == 2
    with pytest.raises(SandboxNotFound):
        table.get("b")  # released: not running
    lock = table.lock("a")
    assert table.lock("a") is lock
    sbx, released, got = table.remove("a")
    assert sbx is not None and released is None and got is spec and table.lock("a") is lock
    table.remove("a", drop_lock=True)
    assert table.lock("a") is not lock
    assert table.remove("b")[1] is not None and table.run_dir_names() == set()
