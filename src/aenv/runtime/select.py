"""Pick the runtime for ``--runtime ns|vm|auto``.

``auto`` follows the product rule: a microVM where the host has KVM, a namespace sandbox where it
has not. Without hardware KVM a VM runs under TCG emulation (every guest instruction translated:
a command round trip ~60 ms instead of ~5, a fork child's first answer ~1 s of CPU), which no
user asking for "whatever is best here" wants by default; ``--runtime vm`` still gives them.
"""

from __future__ import annotations

import logging

from aenv.config import Settings
from aenv.errors import RuntimeFailure
from aenv.runtime.base import Runtime

log = logging.getLogger("aenv.runtime")


def vm_unavailable_reason(settings: Settings) -> str | None:
    """None when the VM runtime can run here, else why not (for `auto` and `aenv doctor`)."""
    try:
        from aenv.runtime.vm import runtime as vm_runtime
    except ImportError as exc:
        return f"VM runtime not available: {exc}"
    check = getattr(vm_runtime, "unavailable_reason", None)
    if check is None:
        return "VM runtime not implemented yet"
    reason: str | None = check(settings)
    return reason


def auto_choice(settings: Settings) -> tuple[str, str]:
    """(runtime, why) for ``--runtime auto``."""
    reason = vm_unavailable_reason(settings)
    if reason is not None:
        return "ns", reason
    from aenv.runtime.vm.accel import choose_accel

    accel = choose_accel()
    if accel.accel != "kvm":
        return "ns", f"no hardware KVM, VMs would run under TCG emulation ({accel.reason}); --runtime vm forces them"
    return "vm", accel.reason


def make_runtime(settings: Settings) -> Runtime:
    choice: str = settings.runtime
    if choice == "auto":
        choice, why = auto_choice(settings)
        log.info("runtime auto: chose %s (%s)", choice, why)
    if choice == "vm":
        reason = vm_unavailable_reason(settings)
        if reason is not None:
            raise RuntimeFailure(f"--runtime vm is not usable here: {reason}")
        from aenv.runtime.vm.runtime import VmRuntime

        return VmRuntime(settings)
    from aenv.runtime.ns.runtime import NsRuntime

    return NsRuntime(settings, pool_size=settings.pool_size)
