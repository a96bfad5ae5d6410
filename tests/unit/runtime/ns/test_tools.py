from __future__ import annotations

from pathlib import Path

from aenv.runtime import tools

LDD = """\
\tlinux-vdso.so.1 (0x00007ffd)
\tlibpython3.11.so.1.0 => /opt/py/lib/libpython3.11.so.1.0 (0x00007f15)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f15)
\tlibmissing.so.1 => not found
\t/lib64/ld-linux-x86-64.so.2 (0x00007f15)
"""


def test_parse_ldd() -> None:
    libs = tools.parse_ldd(LDD)
    assert libs["libc.so.6"] == Path("/lib/x86_64-linux-gnu/libc.so.6")
    assert libs[tools.LOADER_NAME] == Path("/lib64/ld-linux-x86-64.so.2")
    assert "linux-vdso.so.1" not in libs and "libmissing.so.1" not in libs


def test_launch_argv_passes_library_path_as_argument_not_env() -> None:
    argv = tools.launch_argv("/.aenv")
    assert argv[:4] == ["/.aenv/lib/ld-linux-x86-64.so.2", "--inhibit-cache", "--library-path", "/.aenv/lib"]
    assert argv[4] == f"/.aenv/bin/{tools.PY_BIN}" and argv[5] == "-I"


def test_bundle_key_is_stable() -> None:
    assert tools.bundle_key() == tools.bundle_key()
    assert len(tools.bundle_key()) == 16


def test_stdlib_filter(tmp_path: Path) -> None:
    ignore = tools._stdlib_ignore(tmp_path)
    skipped = ignore(str(tmp_path), ["os.py", "test", "tkinter", "idlelib", "ensurepip", "site-packages",
                                      "config-3.11-x86_64-linux-gnu", "asyncio"])
    assert skipped == {"test", "tkinter", "idlelib", "ensurepip", "site-packages", "config-3.11-x86_64-linux-gnu"}
    dyn = ignore(str(tmp_path / "lib-dynload"), ["_ssl.cpython-311.so", "_tkinter.cpython-311.so"])
    assert dyn == {"_tkinter.cpython-311.so"}


def test_gc_keeps_current_recent_and_mounted(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import os
    import time

    current, recent, stale, mounted = (tmp_path / n for n in ("cur", "recent", "stale", "mounted"))
    for d in (current, recent, stale, mounted):
        d.mkdir()
    old = time.time() - 3600
    for d in (current, stale, mounted):
        os.utime(d, (old, old))
    monkeypatch.setattr(tools, "_mounted_sources", lambda: {str(mounted), "/"})
    removed = tools.gc_tools(tmp_path, keep=current)
    assert removed == [stale]
    assert current.exists() and recent.exists() and mounted.exists() and not stale.exists()


def test_gc_keeps_a_bundle_another_server_holds(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A bundle a running server launched from keeps its share lock: another version's GC (a test run
    beside a dev server, both on one cache dir) leaves it, even with no sandbox mounting it now."""
    import os
    import subprocess
    import sys
    import time

    current, held, stale = (tmp_path / n for n in ("cur", "held", "stale"))
    for d in (current, held, stale):
        d.mkdir()
        (d / "MANIFEST.json").write_text("{}")
        old = time.time() - 3600
        os.utime(d, (old, old))
    monkeypatch.setattr(tools, "_mounted_sources", lambda: {"/"})
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                               "from aenv.runtime import tools; tools._hold(Path(sys.argv[1])); "
                               "print('held', flush=True); sys.stdin.read()", str(held)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert tools.gc_tools(tmp_path, keep=current) == [stale]
        assert held.exists()
    finally:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.wait()
        holder.stdout.close()
    assert tools.gc_tools(tmp_path, keep=current) == [held]  # its server is gone
