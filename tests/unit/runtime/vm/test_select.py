"""``--runtime auto``: a microVM where the host has hardware KVM, a namespace sandbox where it has not."""

from __future__ import annotations

import pytest

from aenv.config import Settings
from aenv.runtime import select
from aenv.runtime.vm import accel
from aenv.runtime.vm.accel import AccelChoice


@pytest.mark.parametrize(
    ("vm_reason", "accelerator", "expected"),
    [
        (None, AccelChoice("kvm", "hardware KVM (kvm_intel)", None), "vm"),
        (None, AccelChoice("tcg", "/dev/kvm is KVM-PVM", 2100000), "ns"),
        ("qemu-system-x86_64 not installed", AccelChoice("kvm", "hardware KVM", None), "ns"),
    ],
)
def test_auto_choice(
    monkeypatch: pytest.MonkeyPatch, vm_reason: str | None, accelerator: AccelChoice, expected: str
) -> None:
    monkeypatch.setattr(select, "vm_unavailable_reason", lambda settings: vm_reason)
    monkeypatch.setattr(accel, "choose_accel", lambda **kw: accelerator)
    choice, why = select.auto_choice(Settings())
    assert choice == expected
    assert why  # always says why, for the log and `aenv doctor`
    if expected == "ns" and vm_reason is None:
        assert "TCG" in why and "--runtime vm" in why
