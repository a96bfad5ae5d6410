"""Read-only path lookup through a stack of overlay-format layer dirs, without mounting anything.

Used to inspect the image before a sandbox exists (does ``/etc/passwd`` have ``user``? is there a
``/bin/bash``?). Honours overlay whiteouts (0/0 char devices), opaque dirs (``trusted.overlay.opaque``)
and, for non-root unit tests, the OCI ``.wh.`` markers ``unpack`` leaves when it cannot mknod.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from aenv.images.unpack import OPAQUE, OVERLAY_OPAQUE_XATTR, WHITEOUT


def _opaque(path: Path) -> bool:
    try:
        if os.getxattr(path, OVERLAY_OPAQUE_XATTR, follow_symlinks=False) == b"y":
            return True
    except OSError:
        pass
    return (path / OPAQUE).exists()


def lookup(lowers_top_first: Sequence[Path], rel: str, *, follow: int = 8) -> Path | None:
    """Host path of ``/rel`` as the merged overlay would show it, or None if absent/whited out.

    Absolute symlinks in the *parents* (e.g. ``/bin -> usr/bin`` on merged-/usr Debian) are resolved
    inside the stack, at most ``follow`` times; the final component is returned unresolved.
    """
    parts = [p for p in rel.strip("/").split("/") if p]
    if not parts:
        return lowers_top_first[0] if lowers_top_first else None
    for layer in lowers_top_first:
        cur = layer
        for i, part in enumerate(parts):
            cur = cur / part
            if (cur.parent / f"{WHITEOUT}{part}").exists():
                return None
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                if i > 0 and _opaque(cur.parent):
                    return None
                break
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                return None
            if i == len(parts) - 1:
                return cur
            if stat.S_ISLNK(st.st_mode):
                if follow <= 0:
                    return None
                target = os.readlink(cur)
                base = "/".join(parts[:i]) if not target.startswith("/") else ""
                new = "/".join(x for x in (base, target.strip("/"), *parts[i + 1 :]) if x)
                return lookup(lowers_top_first, os.path.normpath("/" + new), follow=follow - 1)
            if not stat.S_ISDIR(st.st_mode):
                return None
        else:
            continue
    return None
