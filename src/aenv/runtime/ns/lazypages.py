"""CRIU lazy restores (``ns_fork_lazy_pages``): one ``criu lazy-pages`` daemon per restore.

A ``--lazy-pages`` restore maps the tree's private anonymous memory empty and registers it with
userfaultfd; the daemon (``criu.lazy_pages_argv``) reads the dump's pages and copies each one in
when first touched, then, after a second with no fault, copies every page still missing, and ends.
So a child's memory is no smaller once it has run a second: the pages are copied later, not shared
(``bench/lazy_restore_probe.py`` measures what that buys). A daemon serves exactly one restore (it
accepts one connection and takes that tree's userfaultfds), and its socket has a fixed name in
CRIU's work dir, so every restore gets a directory of its own under ``criu.KDAT_BASE`` (a tmpfs
every mount namespace of a restore sees).

Lifetime: started before the restore and waited for until its socket exists; after a restore that
failed it is killed; after one that succeeded a thread waits for it to end (every page in place,
or the tree gone: its userfaultfds close) and removes its directory. A daemon killed while the child
still lacks pages leaves the child's next touch of a missing page failing (SIGBUS): the child is
then broken, the parent and the other children are not.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from aenv.runtime.ns import criu

log = logging.getLogger("aenv.runtime.ns")

PREFIX = "aenv-lazy-"  # the daemons' work dirs under criu.KDAT_BASE
READY_S = 10.0  # the daemon reads the images' process list and listens: milliseconds, not seconds
LIFETIME_S = 600.0  # a daemon still serving then is stuck: killed


class LazyPagesError(Exception):
    """The daemon did not start listening (its log's last lines say why)."""


class LazyPages:
    """One running ``criu lazy-pages`` daemon for one restore of ``images``."""

    def __init__(self, exe: str, images: Path, kdat: Path | None) -> None:
        self.work = Path(tempfile.mkdtemp(prefix=PREFIX, dir=criu.KDAT_BASE))
        self.proc = subprocess.Popen(criu.in_kdat_cache_argv(kdat, criu.lazy_pages_argv(exe, images, self.work)),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_listening()
        except BaseException:
            self.abandon()
            raise

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + READY_S
        delay = 0.0005
        sock = self.work / criu.LAZY_SOCKET
        while not sock.exists():
            if self.proc.poll() is not None:
                raise LazyPagesError(f"criu lazy-pages exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise LazyPagesError(f"criu lazy-pages did not listen in {READY_S:g} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def log_tail(self, n: int = 3) -> str:
        try:
            lines = (self.work / criu.LAZY_LOG).read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "; ".join(ln.strip() for ln in lines[-n:])

    def abandon(self) -> None:
        """After a failed restore: the daemon is killed and its directory removed."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.work, ignore_errors=True)

    def serve_on(self, what: str) -> threading.Thread:
        """After a restore that succeeded: wait in a thread for the daemon to end, then clean up."""
        thread = threading.Thread(target=self._reap, args=(what,), name=f"aenv-lazy-{what}", daemon=True)
        thread.start()
        return thread

    def _reap(self, what: str) -> None:
        t0 = time.monotonic()
        try:
            rc = self.proc.wait(timeout=LIFETIME_S)
        except subprocess.TimeoutExpired:
            log.warning("%s: criu lazy-pages still running after %g s: killed", what, LIFETIME_S)
            self.proc.kill()
            rc = self.proc.wait()
        if rc != 0:
            log.warning("%s: criu lazy-pages ended with %s: %s", what, rc, self.log_tail())
        else:
            log.debug("%s: every lazy page in place after %.0f ms", what, (time.monotonic() - t0) * 1000)
        shutil.rmtree(self.work, ignore_errors=True)


@contextlib.contextmanager
def lazy_restore(exe: str, images: Path, kdat: Path | None, on: bool, what: str,
                 served: list[threading.Thread] | None = None) -> Iterator[Path | None]:
    """The work dir a ``--lazy-pages`` restore of ``images`` runs in (``criu.restore_argv``'s
    ``lazy_work``), its daemon listening there; None (``on`` false): an ordinary restore. ``served``
    gets the thread that waits for the daemon after a restore that succeeded: the daemon still reads
    ``images`` until it ends, so whoever keeps them from being rewritten (``images_gate.py``) holds
    them until that thread is done."""
    if not on:
        yield None
        return
    daemon = LazyPages(exe, images, kdat)
    try:
        yield daemon.work
    except BaseException:
        daemon.abandon()
        raise
    reaper = daemon.serve_on(what)
    if served is not None:
        served.append(reaper)
