from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.images import bootstrap
from aenv.images.errors import BootstrapError


def test_mirror_from_deb822_and_one_line(tmp_path: Path) -> None:
    deb822 = tmp_path / "debian.sources"
    deb822.write_text(
        "Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\n"
        "Types: deb\nURIs: http://security.example/debian-security\nSuites: bookworm-security\n"
    )
    assert bootstrap.debian_mirror([deb822]) == "http://mirror.example/debian"
    one = tmp_path / "sources.list"
    one.write_text("# c\ndeb [arch=amd64] http://other.example/debian bookworm main\n")
    assert bootstrap.debian_mirror([one]) == "http://other.example/debian"
    assert bootstrap.debian_mirror([tmp_path / "missing"]) == bootstrap.DEFAULT_MIRROR


def test_argv_and_hash() -> None:
    argv = bootstrap.mmdebstrap_argv(Path("/t"), "http://m/debian")
    assert argv[:3] == ["mmdebstrap", "--mode=root", "--variant=minbase"]
    assert "--include=bash,python3,python-is-python3,python3-pip,git,curl,ca-certificates,procps,sudo" in argv
    assert any("EXTERNALLY-MANAGED" in a for a in argv)  # pip installs, as in E2B's templates
    assert "--dpkgopt=path-exclude=/usr/share/man/*" in argv
    assert argv[-3:] == ["bookworm", "/t", "http://m/debian"]
    assert any("useradd" in a and "--uid 1000" in a for a in argv)
    h1 = bootstrap.recipe_hash(bootstrap.recipe("http://m/debian"))
    assert h1 == bootstrap.recipe_hash(
        bootstrap.recipe("http://m/debian", list(reversed(bootstrap.BASE_PACKAGES)))
    )
    assert h1 != bootstrap.recipe_hash(bootstrap.recipe("http://m/debian", ["bash"]))


def test_reuses_existing_and_refuses_non_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c")
    path = bootstrap.base_rootfs_path(s, mirror="http://m/debian")
    monkeypatch.setattr(bootstrap.os, "geteuid", lambda: 1000)
    with pytest.raises(BootstrapError, match="needs root"):
        bootstrap.ensure_base_rootfs(s, mirror="http://m/debian")
    path.mkdir(parents=True)
    assert bootstrap.ensure_base_rootfs(s, mirror="http://m/debian") == path


def test_profile_hook_reads_euid_and_keeps_semantics(tmp_path: Path) -> None:
    """The /etc/profile rewrite: bash takes $EUID (no `id` fork), dash still falls back to id."""
    hook = next(a for a in bootstrap.mmdebstrap_argv(Path("/t"), "http://m/debian") if "etc/profile" in a)
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/profile").write_text(
        'if [ "$(id -u)" -eq 0 ]; then\n  PATH="/sbin:/bin"\nelse\n  PATH="/bin"\nfi\nexport PATH\n'
    )
    cmd = hook.removeprefix("--customize-hook=")
    subprocess.run(["sh", "-c", cmd, "hook", str(root)], check=True)
    text = (root / "etc/profile").read_text()
    assert '"${EUID:-$(id -u)}"' in text and '"$(id -u)"' not in text
    expect = "/sbin:/bin" if os.geteuid() == 0 else "/bin"
    for shell in ("bash", "dash"):
        if shutil.which(shell) is None:
            continue
        out = subprocess.run(
            [shell, "-c", f". {root}/etc/profile; echo $PATH"], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert out == expect, shell
