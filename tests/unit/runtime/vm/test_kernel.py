"""Kernel builder pieces that need no compiler: fragment, cache key, dropped-symbol check."""

from __future__ import annotations

from pathlib import Path

from aenv.runtime.vm import kernel


def test_fragment_has_essentials() -> None:
    frag = kernel.fragment_text()
    for sym in (
        "VIRTIO_MMIO_CMDLINE_DEVICES",
        "VIRTIO_BLK",
        "EXT4_FS",
        "BLOCK",
        "VIRTIO_CONSOLE",
        "INOTIFY_USER",
    ):
        assert f"CONFIG_{sym}=y\n" in frag
    assert "# CONFIG_MODULES is not set" in frag and "CONFIG_NR_CPUS=16" in frag


def test_cache_key_stable_and_sensitive() -> None:
    assert kernel.cache_key("6.1.192-3") == kernel.cache_key("6.1.192-3")
    assert kernel.cache_key("6.1.192-3") != kernel.cache_key("6.1.193-1")
    assert kernel.cache_key("v", "CONFIG_A=y\n") != kernel.cache_key("v", "CONFIG_B=y\n")


def test_dropped_symbols() -> None:
    frag = "CONFIG_A=y\nCONFIG_B=y\n# CONFIG_C is not set\n# CONFIG_D is not set\n"
    config = "CONFIG_A=y\n# CONFIG_B is not set\nCONFIG_C=y\n"
    assert kernel.dropped_symbols(config, frag) == ["CONFIG_B=y", "# CONFIG_C is not set"]


def test_kernel_dir_layout(tmp_path: Path) -> None:
    assert kernel.kernel_dir(tmp_path, "abc").bzimage == tmp_path / "vm" / "kernel-abc" / "bzImage"
