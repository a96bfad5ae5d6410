"""A vm snapshot records the machine it restores on; one recorded on another machine is refused
(``MachineMismatch``, the API's 409 ``reason: machine``) before anything starts: no QEMU, no run
dir, and a rollback to it leaves the sandbox's VM running. Same fixtures and skips as
``test_vm_runtime.py`` (one template boot under TCG, then restores)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from aenv.errors import MachineMismatch
from aenv.runtime.vm import compat
from aenv.runtime.vm.runtime import VmRuntime
from tests.integration.test_vm_runtime import (
    _health,
    _no_qemu_under,
    _spec,
    _template,
    make_runtime,
    pytestmark,
    shared,
)

__all__ = ["make_runtime", "pytestmark", "shared"]  # fixtures and marks of test_vm_runtime


async def test_a_snapshot_of_another_machine_is_refused_before_anything_starts(
    make_runtime: Callable[[], VmRuntime], tmp_path: Path
) -> None:
    rt = make_runtime()
    tpl = _template(tmp_path)
    await rt.create(_spec(tmp_path, "src", tpl))
    here = rt.machine()
    assert rt.accel is not None and here == compat.machine_key(rt.accel.accel, Path("/proc/cpuinfo").read_text(),
                                                               compat.qemu_version())  # fmt: skip
    snap = tmp_path / "snap"
    result = await rt.snapshot("src", snap, "full")
    assert result.data["machine"] == here
    assert here is not None
    other = replace(result, data={**result.data, "machine": {**here, "qemu": "0.1"}})  # as if from another QEMU
    src = rt.sandbox("src")
    with pytest.raises(MachineMismatch) as info:
        await rt.create_from_snapshot(_spec(tmp_path, "kid", tpl), snap, other)
    assert info.value.recorded["qemu"] == "0.1" and info.value.here == here
    assert "QEMU 0.1" in info.value.message and f"QEMU {here['qemu']}" in info.value.message
    with pytest.raises(MachineMismatch):
        await rt.rollback("src", _spec(tmp_path, "src", tpl), snap, other)
    assert "kid" not in rt.table.running and not (rt.run_root / "kid").exists()
    await asyncio.to_thread(_no_qemu_under, rt.run_root / "kid")
    assert rt.sandbox("src") is src and await _health(rt, "src") in (200, 204)  # the rollback ended nothing
    # the record alone made the difference: the snapshot as taken restores
    await rt.create_from_snapshot(_spec(tmp_path, "kid", tpl), snap, result)
    assert await _health(rt, "kid") in (200, 204)
