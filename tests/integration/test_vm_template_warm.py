"""A vm template's snapshot holds a warm page cache: what a sandbox's first commands read (Python and
the stdlib modules servers start with) is already in the guest's memory in every sandbox restored
from it, instead of being read through virtio-blk on first use (2.9 s for the first
``python3 -m http.server`` under TCG, 0.9 s warm). Checked by residency, not by time."""

from __future__ import annotations

import pytest
from e2b import Sandbox

PYC = "/usr/lib/python3.11/http/__pycache__/server.cpython-311.pyc"


def test_a_fresh_vm_sandbox_has_pythons_http_server_in_its_page_cache(sandbox: Sandbox, runtime_name: str) -> None:
    if runtime_name != "vm":
        pytest.skip("the page cache of an ns sandbox is the host's")
    resident = sandbox.commands.run(f"fincore --raw --noheadings --bytes -o RES {PYC}", user="root").stdout.split()
    assert resident and int(resident[0]) > 0, resident
