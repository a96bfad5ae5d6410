"""Self-contained asyncio QMP (QEMU Machine Protocol) client. No aenv imports on purpose.

Layers, one per module: :mod:`.message` (framing), :mod:`.protocol` (run states, bounded reads),
:mod:`.client` (greeting, negotiation, execute with ids), :mod:`.events` (scoped listeners),
:mod:`.errors` (the error tree).
"""

from __future__ import annotations

from .client import QMPClient
from .errors import (
    ConnectError,
    DeserializationError,
    ExecInterruptedError,
    ExecuteError,
    FrameTooLargeError,
    ProtocolError,
    QMPError,
    StateError,
)
from .events import EventListener
from .protocol import Runstate

__all__ = [
    "ConnectError",
    "DeserializationError",
    "EventListener",
    "ExecInterruptedError",
    "ExecuteError",
    "FrameTooLargeError",
    "ProtocolError",
    "QMPClient",
    "QMPError",
    "Runstate",
    "StateError",
]
