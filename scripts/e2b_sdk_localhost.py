"""pytest plugin for the SDK suite (``-p e2b_sdk_localhost``): ``*.localhost`` resolves to 127.0.0.1, and
the runner's known failures are strict xfails.

E2B's sandboxes are ``<port>-<id>.<domain>`` names under a wildcard DNS record; aenv's are under
``aenv.localhost:PORT``. RFC 6761 (6.3) reserves ``.localhost`` for loopback and the E2B SDK's own
clients resolve it so, but the tests' plain ``httpx.get`` / ``urllib`` go through glibc, which
on this host answers only ``localhost`` itself. This stands in for the wildcard record; nothing
else in the tests changes.
"""

from __future__ import annotations

import socket
from typing import Any

_getaddrinfo = socket.getaddrinfo


def _loopback_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
    name = host.decode() if isinstance(host, bytes) else host
    if isinstance(name, str) and name.rstrip(".").lower().endswith(".localhost"):
        host = "127.0.0.1"
    return _getaddrinfo(host, *args, **kwargs)


socket.getaddrinfo = _loopback_getaddrinfo


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """The runner's known failures (``AENV_SDK_XFAIL``: node ID or file -> reason) as strict xfails; a
    reason that starts with ``timing`` (the test races a fixed wait that a slow host misses or makes) is
    a non-strict one: it may pass or fail."""
    import json
    import os

    import pytest

    known: dict[str, str] = json.loads(os.environ.get("AENV_SDK_XFAIL") or "{}")
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        why = known.get(item.nodeid.split("[", 1)[0]) or known.get(path)
        if why:
            item.add_marker(pytest.mark.xfail(reason=why, strict=not why.startswith("timing")))
