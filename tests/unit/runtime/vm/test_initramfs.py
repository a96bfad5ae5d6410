"""Initramfs archive: valid newc that cpio can list, deterministic, cached by content."""

from __future__ import annotations

import gzip
import shutil
import subprocess
from pathlib import Path

import pytest

from aenv.runtime.vm import initramfs


def _fake_busybox(tmp: Path) -> Path:
    p = tmp / "busybox"
    p.write_bytes(b"\x7fELF" + b"\0" * 60)
    return p


def test_render_init_quotes_agent() -> None:
    script = initramfs.render_init(["/.aenv/lib/ld.so", "--x", "a b", "--channel", "serial:@PORT@"])
    assert script.startswith("#!/bin/busybox sh\n")
    assert 'exec switch_root /newroot /.aenv/lib/ld.so --x \'a b\' --channel serial:"$port" "$@"' in script
    assert "= aenv ]" in script and "__" not in script
    with pytest.raises(initramfs.InitramfsError):
        initramfs.render_init(["/a"], channel_name="a b")
    with pytest.raises(initramfs.InitramfsError):
        initramfs.render_init([])


def test_archive_is_deterministic_newc(tmp_path: Path) -> None:
    bb = b"\x7fELF-busybox"
    a = initramfs.archive("#!/bin/busybox sh\necho hi\n", bb)
    assert a == initramfs.archive("#!/bin/busybox sh\necho hi\n", bb)
    raw = gzip.decompress(a)
    assert raw.startswith(b"070701") and b"TRAILER!!!" in raw
    if shutil.which("cpio") is None:
        pytest.skip("cpio not installed")
    listing = subprocess.run(["cpio", "-itv"], input=raw, capture_output=True, check=True).stdout.decode()
    names = [line.split()[-1] for line in listing.splitlines()]
    assert names == [
        "bin",
        "dev",
        "dev/console",
        "dev/null",
        "proc",
        "sys",
        "tmp",
        "newroot",
        "bin/busybox",
        "init",
    ]
    assert listing.splitlines()[2].startswith("crw-------")
    assert "rwxr-xr-x" in listing.splitlines()[-1]


def test_build_caches(tmp_path: Path) -> None:
    bb = _fake_busybox(tmp_path)
    p1 = initramfs.build(tmp_path / "cache", ["/agent"], busybox=bb)
    mtime = p1.stat().st_mtime_ns
    assert initramfs.build(tmp_path / "cache", ["/agent"], busybox=bb) == p1
    assert p1.stat().st_mtime_ns == mtime
    p2 = initramfs.build(tmp_path / "cache", ["/other-agent"], busybox=bb)
    assert p2 != p1 and p2.parent == p1.parent
    assert [p.name for p in p1.parent.iterdir() if p.name.startswith(".")] == []


def test_build_rejects_missing_busybox(tmp_path: Path) -> None:
    with pytest.raises(initramfs.InitramfsError):
        initramfs.build(tmp_path, ["/agent"], busybox=tmp_path / "none")


def test_config_disk_bytes_roundtrip_through_sh(tmp_path: Path) -> None:
    args = ["--env-json", '{"A": "b c", "Q": "it\'s"}', "--start-cmd", "echo $HOME; ls"]
    raw = initramfs.config_disk_bytes(args)
    assert len(raw) % 4096 == 0 and raw.rstrip(b"\0").endswith(b"\n")
    dev = tmp_path / "cfg"
    dev.write_bytes(raw)
    script = f'extra=$(tr -d \'\\000\' < {dev}); eval "set -- $extra"; for a in "$@"; do printf \'%s\\0\' "$a"; done'
    out = subprocess.run(["/bin/busybox", "sh", "-c", script], capture_output=True, check=True).stdout
    assert out.split(b"\0")[:-1] == [a.encode() for a in args]
    with pytest.raises(initramfs.InitramfsError):
        initramfs.config_disk_bytes(["a\0b"])


def test_init_reads_the_config_disk_before_moving_sys_and_dev() -> None:
    """The config disk is found through /sys/block; once /sys moves into the new root it is gone
    (this once silently dropped every template's env and start command)."""
    script = initramfs.render_init(["/agent", initramfs.PORT_PLACEHOLDER])
    assert script.index("disk config") < script.index('mount --move "/$d"')


def test_init_gives_the_guest_slirps_resolver(tmp_path: Path) -> None:
    """The guest resolves through slirp's 10.0.2.3 (the jail's filter lets only that out, and on to
    the server's sandbox_dns), whatever the image's resolv.conf named or linked to: the image's
    one was the build host's resolver, which no guest query reached."""
    script = initramfs.render_init(["/agent", initramfs.PORT_PLACEHOLDER])
    start = script.index("if [ -d /newroot/etc ]")
    block = script[start : script.index("\nfi\n", start) + 4].replace("/newroot", str(tmp_path))
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "resolv.conf").symlink_to("../run/systemd/resolve/stub-resolv.conf")
    subprocess.run(["/bin/busybox", "sh", "-c", "say() { :; }\n" + block], check=True)
    conf = tmp_path / "etc" / "resolv.conf"
    assert not conf.is_symlink() and conf.read_text() == "nameserver 10.0.2.3\n"
    assert script.index("resolv.conf") < script.index("switch_root /newroot")


def _nested_block(script: str) -> str:
    start = script.index('if [ "$nested" = 1 ]')
    return script[start : script.index("\nfi\n", start) + 4]


def test_init_reads_the_nested_word_and_mounts_run_before_switch_root() -> None:
    script = initramfs.render_init(["/agent", initramfs.PORT_PLACEHOLDER])
    assert f"{initramfs.NESTED_WORD}) nested=1;;" in script
    assert script.index('if [ "$nested" = 1 ]') < script.index('mount --move "/$d"') < script.index("switch_root")


@pytest.mark.skipif(shutil.which("unshare") is None or not Path("/bin/busybox").is_file(), reason="needs unshare and busybox")
def test_nested_run_is_a_tmpfs_seeded_from_the_image(tmp_path: Path) -> None:
    """A cold boot on the sandbox's disk must not see the last boot's pid files (dockerd refuses to
    start over one naming a live PID); the image's own /run content stays visible."""
    import os

    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs in a private mount namespace: needs root")
    root = tmp_path / "newroot"
    (root / "run" / "lock").mkdir(parents=True)
    (root / "run" / "image-file").write_text("from the image")
    block = _nested_block(initramfs.render_init(["/agent", initramfs.PORT_PLACEHOLDER]))
    block = block.replace("/newroot", str(root)).replace(" /run", f" {tmp_path}/seed")
    check = f"echo stale > {root}/run/docker.pid; grep -c ' {root}/run tmpfs' /proc/mounts; ls {root}/run"
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/busybox", "sh", "-c",
                          "nested=1; die() { echo \"$*\"; exit 1; }\n" + block + check],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "docker.pid", "image-file", "lock"], out
    assert not (root / "run" / "docker.pid").exists()  # written to the tmpfs, gone with its namespace
