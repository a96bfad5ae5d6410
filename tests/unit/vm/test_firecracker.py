"""Firecracker driver pieces that need no KVM: request building, the API client against a fake
API socket, vmlinux extraction and the availability reason."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import pytest

from aenv.runtime.vm.firecracker import (
    ApiClient,
    FcDrive,
    FirecrackerConfig,
    FirecrackerError,
    boot_requests,
    extract_vmlinux,
    unavailable_reason,
)


def _cfg(tmp_path: Path, **kw: object) -> FirecrackerConfig:
    return FirecrackerConfig(
        name="t",
        binary="/bin/true",
        kernel=tmp_path / "vmlinux",
        api_socket=tmp_path / "api.sock",
        **kw,  # type: ignore[arg-type]
    )


def test_boot_requests_cover_machine_kernel_drives_vsock(tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path, initrd=tmp_path / "initrd", memory_mb=256, cpu_count=2,
        drives=(FcDrive("root", tmp_path / "root.ext4", is_root_device=False), FcDrive("tools", tmp_path / "t", True)),
        vsock_uds=tmp_path / "v.sock",
    )  # fmt: skip
    reqs = boot_requests(cfg)
    paths = [p for _, p, _ in reqs]
    assert paths == ["/machine-config", "/boot-source", "/drives/root", "/drives/tools", "/vsock"]
    assert reqs[0][2] == {"vcpu_count": 2, "mem_size_mib": 256, "smt": False}
    assert reqs[1][2]["initrd_path"] == str(tmp_path / "initrd")
    assert reqs[3][2]["is_read_only"] is True
    assert reqs[4][2] == {"guest_cid": 3, "uds_path": str(tmp_path / "v.sock")}


def test_config_rejects_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        _cfg(tmp_path, memory_mb=16)
    with pytest.raises(ValueError):
        _cfg(tmp_path, drives=(FcDrive("a", tmp_path), FcDrive("a", tmp_path)))


async def test_api_client_round_trip_and_fault(tmp_path: Path) -> None:
    seen: list[tuple[str, dict[str, object]]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        length = 0
        while (h := await reader.readline()) not in (b"\r\n", b""):
            if h.lower().startswith(b"content-length:"):
                length = int(h.split(b":")[1])
        body = json.loads(await reader.readexactly(length)) if length else {}
        method, path = line.decode().split()[:2]
        seen.append((f"{method} {path}", body))
        if path == "/bad":
            out = json.dumps({"fault_message": "nope"}).encode()
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(out), out))
        else:
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()
        writer.close()

    sock = tmp_path / "api.sock"
    server = await asyncio.start_unix_server(handle, path=str(sock))
    async with server:
        api = ApiClient(sock)
        assert await api.call("PATCH", "/vm", {"state": "Paused"}) == b""
        with pytest.raises(FirecrackerError, match="nope") as info:
            await api.call("PUT", "/bad", {})
        assert info.value.status == 400
    assert seen[0] == ("PATCH /vm", {"state": "Paused"})


def test_extract_vmlinux_from_gzip_payload(tmp_path: Path) -> None:
    elf = b"\x7fELF" + b"\x02" * 1000
    bz = tmp_path / "bzImage"
    bz.write_bytes(b"MZ setup code \x1f\x8b\x08\x00 not really" + gzip.compress(elf, mtime=0) + b"trailer")
    out = extract_vmlinux(bz, tmp_path / "vmlinux")
    assert out.read_bytes() == elf
    bad = tmp_path / "bad"
    bad.write_bytes(b"no kernel here")
    with pytest.raises(FirecrackerError):
        extract_vmlinux(bad, tmp_path / "v2")


def test_unavailable_reason(tmp_path: Path) -> None:
    assert "AENV_FIRECRACKER" in (unavailable_reason(None) or "")
    assert "not an executable" in (unavailable_reason(str(tmp_path / "missing")) or "")
    reason = unavailable_reason("/bin/true", kvm_dev=tmp_path / "kvm")  # no KVM device at all
    assert reason is not None and "no hardware KVM" in reason
