"""QMP error tree. Every error keeps the evidence (bytes read, message sent, reply received).

::

    QMPError
    ├── ConnectError            could not connect / negotiate (wraps the cause)
    ├── StateError              operation not allowed in the client's current run state
    ├── ProtocolError           the peer broke the protocol (bad greeting, reply without id, ...)
    │   ├── DeserializationError   a frame was not valid JSON object (keeps raw bytes)
    │   └── FrameTooLargeError     a frame exceeded the read limit
    ├── ExecuteError            QEMU answered a command with {"error": ...} (keeps sent, reply, class)
    └── ExecInterruptedError    the connection ended before the reply came
"""

from __future__ import annotations

from typing import Any


class QMPError(Exception):
    """Root of every error raised by this package."""


class ConnectError(QMPError):
    """Connecting or capability negotiation failed; ``__cause__`` holds why."""


class StateError(QMPError):
    """The client is not in a state that allows this operation."""


class ProtocolError(QMPError):
    """The peer sent something QMP does not allow."""


class DeserializationError(ProtocolError):
    """A frame could not be decoded as a JSON object."""

    def __init__(self, message: str, raw: bytes) -> None:
        super().__init__(f"{message}: {raw[:200]!r}")
        self.raw = raw


class FrameTooLargeError(ProtocolError):
    """A frame was longer than the configured limit; the connection is unusable afterwards."""


class ExecuteError(QMPError):
    """QEMU rejected a command. ``error_class`` is QMP's class, e.g. ``GenericError``."""

    def __init__(self, sent: dict[str, Any], reply: dict[str, Any]) -> None:
        err = reply.get("error", {})
        self.sent = sent
        self.reply = reply
        self.error_class: str = str(err.get("class", "?"))
        self.desc: str = str(err.get("desc", ""))
        super().__init__(f"{sent.get('execute')}: {self.error_class}: {self.desc}")


class ExecInterruptedError(QMPError):
    """The connection closed while a command was waiting for its reply."""
