"""Which guest kernel a template boots: the base one, or the docker flavour for nested containers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aenv.runtime.base import SandboxImage
from aenv.runtime.vm import artifacts, kernel
from aenv.runtime.vm.artifacts import GuestArtifacts

ART = GuestArtifacts(Path("/k/base"), Path("/i"), Path("/t"))


def test_flavour_of_follows_nested_containers() -> None:
    assert artifacts.flavour_of(SandboxImage(template_id="base", rootfs=Path("/r"))) == "base"
    assert artifacts.flavour_of(SandboxImage(template_id="d", rootfs=Path("/r"), nested_containers=True)) == "docker"


def test_with_flavour_swaps_only_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    monkeypatch.setattr(kernel, "find_kernel", lambda cache, flavour="base": asked.append(flavour) or Path("/k/d"))
    assert asyncio.run(artifacts.with_flavour(ART, tmp_path, "base")) is ART
    docker = asyncio.run(artifacts.with_flavour(ART, tmp_path, "docker"))
    assert docker == GuestArtifacts(Path("/k/d"), ART.initrd, ART.tools_image) and asked == ["docker"]
    assert docker.key() != ART.key()  # templates of each flavour are built and cached apart


def test_with_flavour_builds_a_missing_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    monkeypatch.setattr(kernel, "find_kernel", lambda cache, flavour="base": None)
    monkeypatch.setattr(kernel, "build", lambda cache, flavour="base": built.append(flavour) or Path("/k/new"))
    assert asyncio.run(artifacts.with_flavour(ART, tmp_path, "docker")).kernel == Path("/k/new")
    assert built == ["docker"]
