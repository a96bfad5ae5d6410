"""Which mux session the bytes read from the vm's virtio-serial port belong to.

The port is one byte stream shared by every host that ever attaches: the server before and after a
restart, the one that resumes a paused VM, the one that restores a snapshot into a new QEMU. Linux
reports a host leaving (``read`` returns 0) through the port's *control* queue, which is not ordered
with its data. So the notice can come late: QEMU queues it while the VM is stopped, and when the
next host attaches right after ``cont`` (every resume and restore), the guest may read that host's
HELLO and first requests before it learns that the previous host left.

Ending the session on that notice would void the new host's streams mid-request. What a departed
host can really leave behind is half a frame, which would swallow the next host's bytes. So:

* at a frame boundary, the notice changes nothing: the next host's HELLO resets the session's
  streams anyway (mux.session), whenever it comes;
* mid-frame, the bytes that follow are held until they show who sent them: a HELLO means a new host
  (the half frame is dropped, the old reader ends, a fresh one starts); anything else is the same
  host, whose frame they complete.
"""

from __future__ import annotations

import asyncio
import logging

from aenv.mux.protocol import HEADER_SIZE, starts_with_hello

log = logging.getLogger("aenv.agent")

LATE_NOTICE_WAIT_S = 0.05  # a new host's HELLO comes in one write; fewer bytes than it takes to tell
# it from a frame's tail are given this long before they count as the tail


class FrameTracker:
    """Follows the frame boundaries of a byte stream without keeping its payloads."""

    def __init__(self) -> None:
        self._header = bytearray()
        self._payload_left = 0

    @property
    def at_boundary(self) -> bool:
        return not self._header and self._payload_left == 0

    def advance(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._payload_left:
                step = min(self._payload_left, len(view))
                self._payload_left -= step
                view = view[step:]
                continue
            need = HEADER_SIZE - len(self._header)
            self._header += view[:need]
            view = view[need:]
            if len(self._header) == HEADER_SIZE:
                self._payload_left = int.from_bytes(self._header[8:12], "big")
                self._header.clear()


def _new_reader() -> asyncio.StreamReader:
    return asyncio.StreamReader(limit=1 << 20)


class SerialReaders:
    """The reader the serial pump feeds (in the loop thread); a new one per mux session."""

    def __init__(self) -> None:
        self.current = _new_reader()
        self._frames = FrameTracker()
        self._held: bytearray | None = None  # after a notice mid-frame: bytes not yet attributed
        self._timer: asyncio.TimerHandle | None = None

    def feed(self, data: bytes) -> None:
        if self._held is None:
            self._deliver(data)
            return
        self._held += data
        verdict = starts_with_hello(bytes(self._held[: HEADER_SIZE + 3]))
        if verdict is not None:
            self._attribute_held(new_host=verdict)
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(
                LATE_NOTICE_WAIT_S, self._attribute_held, False
            )

    def host_gone(self) -> None:
        """The port said the host left (maybe long ago, see the module doc)."""
        if self._held is None and not self._frames.at_boundary:
            log.info("host left mid-frame: holding what follows until it shows who sent it")
            self._held = bytearray()

    def renew(self) -> asyncio.StreamReader:
        """Start a fresh reader for the next bytes (a new session); returns the old one."""
        old, self.current = self.current, _new_reader()
        self._frames = FrameTracker()
        return old

    def _attribute_held(self, new_host: bool) -> None:
        held, self._held = bytes(self._held or b""), None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        log.info("bytes after the host left mid-frame: %s", "a new host's HELLO" if new_host else "the same host's")
        if new_host:
            self.renew().feed_eof()  # its session ends; the half frame goes with it
        self._deliver(held)

    def _deliver(self, data: bytes) -> None:
        if data:
            self._frames.advance(data)
            self.current.feed_data(data)
