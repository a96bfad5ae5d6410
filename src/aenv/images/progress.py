"""Pull progress events: one small JSON-able shape the server streams and the CLI draws as Rich bars.

Per layer the status goes ``waiting → downloading → verifying → extracting → done`` (or ``cached``
when the unpacked layer was already present, ``error`` on failure). Image-level events have
``layer == ""``: ``resolving``, ``resolved`` (``total`` = number of layers), ``user-layer``,
``complete`` (``message`` = summary line) and ``error``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

Status = Literal[
    "resolving",
    "resolved",
    "waiting",
    "downloading",
    "verifying",
    "extracting",
    "cached",
    "done",
    "user-layer",
    "lazy",  # no layers pulled: the image is served on demand (images/lazy)
    "complete",
    "error",
]


@dataclass(frozen=True)
class PullEvent:
    reference: str  # normalised reference being pulled
    status: Status
    layer: str = ""  # blob digest (``sha256:…``); "" for image-level events
    current: int = 0  # bytes done (downloading: compressed bytes; extracting: uncompressed bytes)
    total: int = 0  # bytes expected (0 = unknown); for "resolved": layer count
    message: str = ""

    @property
    def short_id(self) -> str:
        """12 hex chars, as ``docker pull`` prints layer ids."""
        return self.layer.split(":", 1)[-1][:12]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


ProgressCallback = Callable[[PullEvent], None]


def emit(cb: ProgressCallback | None, event: PullEvent) -> None:
    """Call the callback, never letting a UI bug break a pull."""
    if cb is None:
        return
    try:
        cb(event)
    except Exception:  # noqa: BLE001 - progress display must not fail the pull
        import logging

        logging.getLogger(__name__).exception("progress callback failed")
