"""Accelerator probe: KVM only where an ordinary guest really runs under it, TCG otherwise.

``/dev/kvm`` existing proves little: on the project's machines it is KVM-PVM, which emulates an
ordinary guest kernel instruction by instruction and then crashes (notes/vmm.md, headline). So KVM
is chosen only when a hardware module (``kvm_intel``/``kvm_amd``) is loaded and the device opens;
the caller may additionally run a boot probe. Under TCG the guest needs ``tsc_early_khz`` because
PIT calibration hangs; :func:`host_tsc_khz` finds the host value.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .config import Accel


@dataclass(frozen=True)
class AccelChoice:
    """The decision and why, for logs and ``aenv doctor``."""

    accel: Accel
    reason: str
    tsc_khz: int | None

    @property
    def name(self) -> str:
        """Alias of ``accel`` (what ``aenv doctor`` prints)."""
        return self.accel


def _modules(sys_module: Path) -> set[str]:
    try:
        return {p.name for p in sys_module.iterdir()}
    except OSError:
        return set()


def _kvm_usable(dev: Path) -> str | None:
    """None if the device opens read-write, else why not."""
    if not dev.exists():
        return f"{dev} does not exist"
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"cannot open {dev}: {exc.strerror}"
    os.close(fd)
    return None


def choose_accel(
    sys_module: Path = Path("/sys/module"),
    kvm_dev: Path = Path("/dev/kvm"),
    force: Accel | None = None,
) -> AccelChoice:
    """Pick tcg or kvm from what the host exposes. ``force`` (config/env) wins but still gets a reason."""
    tsc = host_tsc_khz()
    if force is not None:
        return AccelChoice(force, f"forced by configuration ({force})", tsc if force == "tcg" else None)
    mods = _modules(sys_module)
    hw = sorted(mods & {"kvm_intel", "kvm_amd"})
    if hw:
        problem = _kvm_usable(kvm_dev)
        if problem is None:
            return AccelChoice("kvm", f"hardware KVM ({hw[0]}) and {kvm_dev} usable", None)
        return AccelChoice("tcg", f"{hw[0]} loaded but {problem}; using TCG", tsc)
    if "kvm_pvm" in mods:
        return AccelChoice(
            "tcg",
            "/dev/kvm is KVM-PVM (no kvm_intel/kvm_amd): an ordinary guest kernel cannot run under it; using TCG",
            tsc,
        )
    if "kvm" in mods or kvm_dev.exists():
        return AccelChoice(
            "tcg", "no kvm_intel/kvm_amd module: hardware virtualization not exposed; using TCG", tsc
        )
    return AccelChoice("tcg", "no /dev/kvm: using TCG", tsc)


_DMESG_TSC = re.compile(r"tsc: (?:Detected|Refined TSC clocksource calibration:) ([0-9.]+) MHz")
_CPUINFO_MHZ = re.compile(r"^cpu MHz\s*:\s*([0-9.]+)", re.MULTILINE)


def parse_tsc_khz(dmesg: str | None, cpuinfo: str | None) -> int | None:
    """The host TSC in kHz: the kernel's own calibration from dmesg, else ``cpu MHz`` from cpuinfo."""
    if dmesg:
        found = _DMESG_TSC.findall(dmesg)
        if found:
            return round(float(found[-1]) * 1000)
    if cpuinfo:
        m = _CPUINFO_MHZ.search(cpuinfo)
        if m:
            return round(float(m.group(1)) * 1000)
    return None


def host_tsc_khz() -> int | None:
    dmesg: str | None = None
    if shutil.which("dmesg"):
        try:
            dmesg = subprocess.run(["dmesg"], check=False, capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            dmesg = None
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = None
    return parse_tsc_khz(dmesg, cpuinfo)


def probe() -> AccelChoice:
    """The host's choice with default paths (used by ``aenv doctor``)."""
    return choose_accel()


def qemu_binary() -> str | None:
    """Path of ``qemu-system-x86_64`` or None."""
    return shutil.which("qemu-system-x86_64")
