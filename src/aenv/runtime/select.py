"""Pick the runtime for ``--runtime ns|vm|auto``: vm where QEMU and a guest kernel are usable, else ns."""

from __future__ import annotations

import logging

from aenv.config import Settings
from aenv.core.errors import RuntimeFailure
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


def make_runtime(settings: Settings) -> Runtime:
    choice = settings.runtime
    if choice == "auto":
        reason = vm_unavailable_reason(settings)
        choice = "vm" if reason is None else "ns"
        log.info("runtime auto: chose %s%s", choice, f" ({reason})" if reason else "")
    if choice == "vm":
        reason = vm_unavailable_reason(settings)
        if reason is not None:
            raise RuntimeFailure(f"--runtime vm is not usable here: {reason}")
        from aenv.runtime.vm.runtime import VmRuntime

        return VmRuntime(settings)
    from aenv.runtime.ns.runtime import NsRuntime

    return NsRuntime(settings, pool_size=settings.pool_size)
