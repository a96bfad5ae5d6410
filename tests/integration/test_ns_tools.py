"""The tools bundle runs where there is no libc and no Python: a busybox-static root."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from aenv.config import Settings, default_cache_dir
from aenv.runtime.tools import ensure_tools, launch_argv

BUSYBOX = Path("/bin/busybox")


@pytest.fixture(scope="module")
def bundle() -> Path:
    cache = Path(os.environ.get("AENV_CACHE_DIR") or default_cache_dir())
    return ensure_tools(Settings(cache_dir=cache))


def test_bundle_is_cached_and_complete(bundle: Path) -> None:
    cache = bundle.parent.parent
    assert ensure_tools(Settings(cache_dir=cache)) == bundle  # second call reuses it
    lib = bundle / "lib"
    for name in ("ld-linux-x86-64.so.2", "libc.so.6", "libm.so.6", "libssl.so.3", "libffi.so.8", "libz.so.1"):
        assert (lib / name).is_file(), name
    assert any(lib.glob("libpython3.11.so*"))
    stdlib = lib / "python3.11"
    for gone in ("test", "idlelib", "tkinter", "ensurepip"):
        assert not (stdlib / gone).exists()
    for pkg in ("starlette", "uvicorn", "h11", "anyio", "aenv/mux", "aenv/agent", "aenv/envd"):
        assert (stdlib / "site-packages" / pkg).exists(), pkg
    assert not (stdlib / "site-packages" / "aenv" / "api").exists()  # server code stays out


@pytest.mark.skipif(os.geteuid() != 0, reason="chroot and bind mounts need root")
def test_bundle_runs_in_busybox_only_root(bundle: Path, tmp_path: Path) -> None:
    if not BUSYBOX.exists():
        pytest.skip("needs busybox-static")
    root = tmp_path / "root"
    for d in ("bin", ".aenv", "tmp", "dev"):
        (root / d).mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    (root / "bin" / "sh").symlink_to("busybox")
    (root / "bin" / "env").symlink_to("busybox")
    assert not (root / "lib").exists() and not (root / "lib64").exists()
    code = (
        "import ssl, sqlite3, ctypes, zlib, bz2, lzma, json, asyncio, uvicorn, starlette.applications, "
        "aenv.agent.main, aenv.mux, aenv.envd.app; import subprocess, sys; "
        "print(sys.prefix); print(subprocess.run(['/bin/env'], capture_output=True, text=True, env={}).stdout.strip() or 'EMPTY')"
    )
    script = f"mount --bind {bundle} {root}/.aenv && mount -o remount,bind,ro {root}/.aenv && chroot {root} " + \
        " ".join(f"'{a}'" for a in launch_argv()) + f' -c "{code}"'
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0] == "/.aenv"
    assert "LD_" not in out.stdout  # children inherit no loader settings
