"""A response whose sandbox went away mid-way is cut, on either protocol: over HTTP/1.1 the chunked
body stops short, over HTTP/2 the stream is reset (``cli/tls_serve.py``). That transport failure is
what every SDK version probes the sandbox's ``/health`` on, and the proxy's "The sandbox was not found"
there makes it raise the "killed or reached its end of life while the request was in flight" error:
JS (``@e2b`` 2.45: undici's ``terminated``, a ``ConnectError`` of code ``unknown``), Python 2.45 and
2.63 (a pyqwest read error as the cause). An end-of-stream ``unavailable`` envelope instead (what this
proxy sent before) is probed on by the newest Python SDK only.

Behind a gateway the client's HTTP/2 is the gateway's to see: it says so with ``X-Aenv-Client-H2`` (taken
off the request here), so the node cuts its connection to the gateway and the gateway resets the
client's stream.
"""

from __future__ import annotations

from .codec import Scope

CLIENT_H2_HEADER = b"x-aenv-client-h2"  # set by a gateway whose client speaks HTTP/2


def client_speaks_h2(scope: Scope) -> tuple[Scope, bool]:
    """Whether the client is on HTTP/2 (here, or at the gateway that relays it), and the scope without
    the gateway's header."""
    if not any(k == CLIENT_H2_HEADER for k, _ in scope["headers"]):
        return scope, scope.get("http_version") == "2"
    return {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != CLIENT_H2_HEADER]}, True
