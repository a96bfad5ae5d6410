"""Memory-pressure policy of the vm runtime: MemAvailable parsing, who goes first, when it is due."""

from __future__ import annotations

from pathlib import Path

from aenv.runtime.vm.pressure import mem_available_mb, release_order, under_pressure

MEMINFO = """MemTotal:       24641332 kB
MemFree:        16548816 kB
MemAvailable:   23306240 kB
Buffers:          258532 kB
"""


def test_mem_available_mb(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text(MEMINFO)
    assert mem_available_mb(f) == 23306240 / 1024
    f.write_text("MemTotal: 1 kB\n")  # a kernel without MemAvailable (< 3.14)
    assert mem_available_mb(f) is None
    f.write_text("MemAvailable: lots\n")
    assert mem_available_mb(f) is None
    assert mem_available_mb(tmp_path / "missing") is None


def test_real_meminfo_is_readable() -> None:
    value = mem_available_mb()
    assert value is not None and value > 0


def test_longest_paused_goes_first() -> None:
    assert release_order({"b": 20.0, "a": 5.0, "c": 20.0, "d": 1.0}) == ["d", "a", "b", "c"]
    assert release_order({}) == []


def test_under_pressure() -> None:
    assert under_pressure(100.0, 512.0)
    assert not under_pressure(600.0, 512.0)
    assert not under_pressure(100.0, 0.0)  # off
    assert not under_pressure(None, 512.0)  # unknown: do nothing
