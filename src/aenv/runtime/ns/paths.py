"""Where one ns sandbox keeps its files: the directory ``NsSandbox`` owns and removes last.

    upper/, work/   the root overlay's writable layer and overlayfs's work directory
    rootfs/         the mount point of the root (inside the sandbox's mount namespace only)
    run/            the channel to the agent (``mux.sock``), bound at ``/.aenv-run`` in the sandbox
    ns.json         what reconciliation after a crash needs to find and clean up the sandbox
    boot_id         the sandbox's own boot id, outside upper and run: out of the sandbox's reach
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

STATE_FILE = "ns.json"
BOOT_ID_FILE = "boot_id"
SOCKET_NAME = "mux.sock"


@dataclass(frozen=True)
class Paths:
    root: Path

    @property
    def upper(self) -> Path:
        return self.root / "upper"

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def merged(self) -> Path:
        return self.root / "rootfs"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def state_file(self) -> Path:
        return self.root / STATE_FILE

    @property
    def socket(self) -> Path:
        return self.run / SOCKET_NAME

    @property
    def boot_id(self) -> Path:
        return self.root / BOOT_ID_FILE

    def prepare(self) -> None:
        for d in (self.upper, self.work, self.merged, self.run):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)

    def reset(self) -> None:
        """Make work, run and the mount point fresh for a new start on the same upper (a cold start
        after a files-only pause, a restart after a failed rollback)."""
        for d in (self.work, self.run, self.merged):
            shutil.rmtree(d, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)

    def new_boot_id(self) -> str:
        """Write a fresh boot id (the kernel's format: a random UUID and a newline) for the next start."""
        value = str(uuid.uuid4())
        self.boot_id.write_text(value + "\n")
        return value
