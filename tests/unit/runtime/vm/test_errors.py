"""The one translation of the vm runtime's failures into aenv's errors (``vm/errors.py``)."""

from __future__ import annotations

import pytest

from aenv.errors import RuntimeFailure, SandboxUnreachable, StateError
from aenv.mux import MuxError
from aenv.runtime.envd_client import EnvdError
from aenv.runtime.vm.config import VmConfigError
from aenv.runtime.vm.disk import DiskError
from aenv.runtime.vm.errors import translated
from aenv.runtime.vm.machine import MachineError
from aenv.runtime.vm.memlayer import LayerError


@pytest.mark.parametrize("exc", [MachineError("qmp gone"), DiskError("qemu-img"), LayerError("bad"),
                                 VmConfigError("cfg")])
def test_runtime_side_failures(exc: Exception) -> None:
    with pytest.raises(RuntimeFailure) as err, translated("s1", "restore from snapshot", after="restore"):
        raise exc
    assert type(err.value) is RuntimeFailure
    assert str(err.value) == f"sandbox s1: restore from snapshot failed: {exc}"
    assert err.value.context == {"sandbox_id": "s1"} and err.value.__cause__ is exc


@pytest.mark.parametrize("exc", [MuxError("closed"), EnvdError("incomplete HTTP response"), OSError("reset"),
                                 TimeoutError("slow")])
def test_a_broken_channel_is_unreachable_after_a_guest_step(exc: Exception) -> None:
    with pytest.raises(SandboxUnreachable) as err, translated("s1", "resume", after="resume"):
        raise exc
    assert str(err.value) == f"sandbox s1: envd unreachable after resume: {exc}"


def test_without_a_guest_step_an_os_error_is_a_failure() -> None:
    with pytest.raises(RuntimeFailure) as err, translated("s1", "snapshot"):
        raise OSError(28, "No space left on device")
    assert type(err.value) is RuntimeFailure
    assert str(err.value) == "sandbox s1: snapshot failed: [Errno 28] No space left on device"


def test_aenv_errors_and_others_pass_through() -> None:
    own = StateError("sandbox s1 already exists")
    with pytest.raises(StateError) as err, translated("s1", "restore", after="restore"):
        raise own
    assert err.value is own
    with pytest.raises(KeyError), translated("s1", "restore"):
        raise KeyError("ram_id")
    with pytest.raises(RuntimeFailure, match="restore from snapshot failed: 'ram_id'"):
        with translated("s1", "restore from snapshot", also=(KeyError,)):
            raise KeyError("ram_id")
