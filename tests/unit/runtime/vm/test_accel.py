"""Accelerator choice from a fake /sys/module and /dev/kvm, and TSC parsing."""

from __future__ import annotations

from pathlib import Path

from aenv.runtime.vm.accel import choose_accel, parse_tsc_khz


def _mods(tmp: Path, *names: str) -> Path:
    root = tmp / "module"
    root.mkdir()
    for n in names:
        (root / n).mkdir()
    return root


def test_pvm_means_tcg(tmp_path: Path) -> None:
    dev = tmp_path / "kvm"
    dev.write_text("")
    c = choose_accel(_mods(tmp_path, "kvm", "kvm_pvm"), dev)
    assert c.accel == "tcg" and "PVM" in c.reason


def test_hardware_kvm(tmp_path: Path) -> None:
    dev = tmp_path / "kvm"
    dev.write_text("")
    c = choose_accel(_mods(tmp_path, "kvm", "kvm_amd"), dev)
    assert c.accel == "kvm" and "kvm_amd" in c.reason and c.tsc_khz is None


def test_hardware_module_but_no_device(tmp_path: Path) -> None:
    c = choose_accel(_mods(tmp_path, "kvm_intel"), tmp_path / "missing")
    assert c.accel == "tcg" and "does not exist" in c.reason


def test_nothing(tmp_path: Path) -> None:
    c = choose_accel(_mods(tmp_path), tmp_path / "missing")
    assert c.accel == "tcg" and "no /dev/kvm" in c.reason


def test_forced(tmp_path: Path) -> None:
    c = choose_accel(_mods(tmp_path), tmp_path / "missing", force="kvm")
    assert c.accel == "kvm" and "forced" in c.reason


def test_parse_tsc() -> None:
    dmesg = "[    0.000021] tsc: Detected 2100.000 MHz processor\n"
    assert parse_tsc_khz(dmesg, None) == 2100000
    refined = dmesg + "[ 1.2] tsc: Refined TSC clocksource calibration: 2099.998 MHz\n"
    assert parse_tsc_khz(refined, None) == 2099998
    assert parse_tsc_khz("", "processor\t: 0\ncpu MHz\t\t: 2600.123\n") == 2600123
    assert parse_tsc_khz(None, None) is None
