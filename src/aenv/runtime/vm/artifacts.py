"""Host-wide guest artifacts: kernel, initramfs and the read-only tools image, found or built once.

Each is cached by a hash of its inputs under ``<cache_dir>/vm/``; this module only ties them
together so the runtime asks one question ("what does a guest boot from?") at start-up.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

from aenv.runtime.base import SandboxImage

from . import disk, initramfs, kernel


@dataclass(frozen=True)
class GuestArtifacts:
    kernel: Path
    initrd: Path
    tools_image: Path

    def key(self) -> str:
        """Changes whenever any artifact changes (their names carry content hashes)."""
        h = hashlib.sha256("\0".join(str(p) for p in (self.kernel, self.initrd, self.tools_image)).encode())
        return h.hexdigest()[:12]


async def ensure_tools_image(cache_dir: Path, tools_dir: Path) -> Path:
    """ext4 image of the tools bundle directory (mounted read-only at ``/.aenv`` in the guest)."""
    key = hashlib.sha256(str(tools_dir.resolve()).encode()).hexdigest()[:16]
    out = cache_dir / "vm" / f"tools-{key}.ext4"
    if out.is_file():
        return out
    await disk.make_ext4(tools_dir, out, label="aenv-tools")
    prune_tools_images(out.parent, keep=out)
    return out


def prune_tools_images(vm_cache: Path, keep: Path, spare: int = 2) -> list[Path]:
    """Delete all but the newest ``spare`` tools images besides ``keep``. Each is ~150 MB and a
    new one appears whenever the in-sandbox code changes. Running VMs keep their open file; a
    template whose image is gone counts as incomplete and is rebuilt on next use."""
    images = sorted(
        (p for p in vm_cache.glob("tools-*.ext4") if p != keep), key=lambda p: p.stat().st_mtime, reverse=True
    )
    removed = images[spare:]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


async def ensure(cache_dir: Path, tools_dir: Path, *, build_kernel: bool = True) -> GuestArtifacts:
    """Find or build everything a guest boots from. The kernel build takes minutes the first time."""
    found = await asyncio.to_thread(kernel.find_kernel, cache_dir)
    if found is None:
        if not build_kernel:
            raise kernel.KernelBuildError(
                "guest kernel not built; hint: python -m aenv.runtime.vm.kernel build"
            )
        found = await asyncio.to_thread(kernel.build, cache_dir)
    initrd = await asyncio.to_thread(initramfs.build, cache_dir)
    tools = await ensure_tools_image(cache_dir, tools_dir)
    return GuestArtifacts(found, initrd, tools)


def flavour_of(image: SandboxImage) -> str:
    """The guest kernel a template boots: ``docker`` (netfilter, bridge, veth, cgroup controllers,
    seccomp, keys: what dockerd and runc need) for templates with ``nested_containers``, else the
    small ``base`` one every other template keeps."""
    return "docker" if image.nested_containers else "base"


async def with_flavour(art: GuestArtifacts, cache_dir: Path, flavour: str) -> GuestArtifacts:
    """``art`` with the kernel of ``flavour`` instead of the base one (the initramfs and tools image
    are the same), built the first time it is asked for (minutes; ``aenv setup`` builds it ahead).
    The kernel's path names its content hash, so templates of each flavour have their own keys."""
    if flavour == "base":
        return art
    found = await asyncio.to_thread(kernel.find_kernel, cache_dir, flavour)
    if found is None:
        found = await asyncio.to_thread(kernel.build, cache_dir, flavour=flavour)
    return replace(art, kernel=found)
