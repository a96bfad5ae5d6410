"""Kernel builder pieces that need no compiler: fragment, cache key, dropped-symbol check."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def test_docker_flavour_adds_to_the_base_fragment_which_stays_as_it_was() -> None:
    base, docker = kernel.fragment_text(), kernel.fragment_text("docker")
    assert kernel.fragment_text("base") == base
    assert set(base.splitlines()) < set(docker.splitlines())
    for sym in ("NF_TABLES", "NFT_COMPAT", "NF_NAT", "IP_NF_NAT", "NETFILTER_XT_MATCH_ADDRTYPE",
                "NETFILTER_XT_MATCH_CONNTRACK", "NETFILTER_XT_TARGET_MASQUERADE", "BRIDGE", "BRIDGE_NETFILTER",
                "VETH", "CPUSETS", "CGROUP_BPF", "BPF_SYSCALL", "SECCOMP_FILTER", "KEYS", "OVERLAY_FS"):
        assert f"CONFIG_{sym}=y\n" in docker
        assert sym == "OVERLAY_FS" or f"CONFIG_{sym}=y\n" not in base
    assert kernel.cache_key("v", base) != kernel.cache_key("v", docker)
    with pytest.raises(kernel.KernelBuildError, match="flavour"):
        kernel.fragment_text("nope")


def test_find_kernel_looks_up_the_flavours_own_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "source_version", lambda: "6.1.192-3")
    docker = kernel.kernel_dir(tmp_path, kernel.cache_key("6.1.192-3", kernel.fragment_text("docker"))).bzimage
    docker.parent.mkdir(parents=True)
    docker.write_bytes(b"k")
    assert kernel.find_kernel(tmp_path, "docker") == docker
    assert kernel.find_kernel(tmp_path) is None
