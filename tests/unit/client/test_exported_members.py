"""The public surface of ``aenv.client`` is exactly ``__all__`` (as httpx guards its own)."""

from __future__ import annotations

import aenv.client


def test_all_exports() -> None:
    public = {name for name in dir(aenv.client) if not name.startswith("_")}
    assert set(aenv.client.__all__) == public - {"annotations"}
    for name in aenv.client.__all__:
        assert getattr(aenv.client, name).__module__.startswith("aenv.client")
