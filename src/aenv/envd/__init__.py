"""envd: the E2B envd-compatible daemon that runs inside each sandbox.

It serves the Connect-JSON ``process.Process`` and ``filesystem.Filesystem``
services plus ``/files``, ``/health``, ``/envs``, ``/metrics`` and ``/init``
(spec ``e2b-protocol.md`` §3). It imports only the stdlib, starlette, uvicorn,
python-multipart, inotify_simple and anyio, because it runs from the read-only
tools mount with its own interpreter.
"""

from __future__ import annotations

# The lowest envd version whose SDK feature gates are all implemented here
# (octet-stream uploads 0.5.7, metadata 0.6.2, includeEntry 0.6.3, allowNetworkMounts 0.6.4).
ENVD_VERSION = "0.6.4"

__all__ = ["ENVD_VERSION"]
