"""A tiny stream multiplexer for the host↔sandbox channel (unix socket for ns, virtio-serial for vm).

Self-contained: stdlib only, no imports from the rest of aenv, because the in-sandbox agent runs it
from the tools mount. See ``protocol`` for the wire format, ``session`` for the two roles.
"""

from aenv.mux.protocol import MuxError, ProtocolError
from aenv.mux.session import MuxSession, open_unix_session
from aenv.mux.stream import ByteStream, MuxStream, StreamClosed, StreamRefused

__all__ = [
    "ByteStream",
    "MuxError",
    "MuxSession",
    "MuxStream",
    "ProtocolError",
    "StreamClosed",
    "StreamRefused",
    "open_unix_session",
]
