"""What every scenario gets: the server under test, its runtime, the baselines that could be started,
and how many samples to take."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aenv.client import AenvClient
    from bench.baselines import DockerBaseline, RuncBaseline
    from bench.previous import PreviousServer
    from bench.vmboot import QemuColdBoot


@dataclass
class Ctx:
    runtime: str  # "ns" | "vm"
    url: str
    state_dir: Path | None  # None with --server (density then needs AENV_STATE_DIR)
    smoke: bool
    client: AenvClient
    docker: DockerBaseline | None = None
    runc: RuncBaseline | None = None
    qemu: QemuColdBoot | None = None
    previous: PreviousServer | None = None  # --against REV: an earlier commit, served beside this one
    network: dict[str, Any] | None = None  # --network: this checkout's sandboxes are made with it

    @property
    def system(self) -> str:
        if self.network == {"allow_internet_access": False}:
            return f"aenv-{self.runtime} offline"
        return f"aenv-{self.runtime}" + ("+policy" if self.network else "")

    def heavy_docker(self) -> DockerBaseline | None:
        """The docker baseline for scenarios where it costs many seconds (bursts, commit + run ×16): not in
        ``--smoke``, which must stay under a minute."""
        return None if self.smoke else self.docker

    def n(self, smoke: int, full: int, vm: int | None = None) -> int:
        """Sample count: ``vm`` (if given) caps the full count on the vm runtime, slow under TCG."""
        if self.smoke:
            return smoke
        return min(full, vm) if vm is not None and self.runtime == "vm" else full
