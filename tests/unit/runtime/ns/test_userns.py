"""The shared user namespace of ns sandboxes: its range is checked, and the namespace maps it."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from aenv.runtime.ns.userns import RANGE, SharedUserns


@pytest.mark.parametrize("uid", [0, -1, 2**32 - RANGE])
def test_range_must_fit_above_host_root(uid: int) -> None:
    with pytest.raises(ValueError, match="ns_userns_uid"):
        SharedUserns(uid)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nsenter") is None, reason="needs root and nsenter")
def test_namespace_maps_uids_and_gids_to_the_range() -> None:
    ns = SharedUserns(1_300_000_000)
    try:
        fd = ns.fd()
        assert ns.fd() == fd  # made once
        out = subprocess.run(["nsenter", f"--user=/proc/self/fd/{fd}", "cat", "/proc/self/uid_map",
                              "/proc/self/gid_map"], pass_fds=(fd,), capture_output=True, text=True, check=True)
        assert [" ".join(line.split()) for line in out.stdout.splitlines()] == [f"0 1300000000 {RANGE}"] * 2
    finally:
        ns.close()
    ns.close()  # idempotent
