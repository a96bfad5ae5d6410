"""Firecracker driver: the same microVM operations as :class:`~aenv.runtime.vm.machine.Machine`
(boot, pause, resume, snapshot, restore, kill) for hosts with real KVM.

Firecracker has no TCG, so it is only usable where a hardware KVM module (``kvm_intel``/
``kvm_amd``) is loaded; on the project's machines ``/dev/kvm`` is KVM-PVM, where an ordinary guest
kernel cannot run (notes/vmm.md), and :func:`unavailable_reason` says so. It boots the same mini
kernel as QEMU, as an ELF ``vmlinux`` (:func:`extract_vmlinux` unpacks it from the bzImage), with
the same initramfs and drives; devices are virtio-mmio from the kernel command line.

Layers, one per class: :class:`FirecrackerConfig` (plain data, validated) → :func:`boot_requests`
(pure: the API calls that configure a VM) → :class:`ApiClient` (HTTP/1.1 over the API unix socket,
one request per connection, bounded reads) → :class:`FirecrackerVm` (one process; idempotent
``kill``). Snapshots are Firecracker's own: ``PUT /snapshot/create`` (Full) writes device state
and guest memory to two files; a restore is a new process with ``PUT /snapshot/load`` and the File
memory backend (MAP_PRIVATE over the memory file, like QEMU's ``share=off``).

Not done yet (honest list): the guest agent has no vsock channel (QEMU uses virtio-serial, which
Firecracker lacks), so :class:`~aenv.runtime.vm.runtime.VmRuntime` does not select this driver yet;
it logs why when ``AENV_FIRECRACKER`` is set. Networking (tap devices) is not configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .accel import choose_accel

log = logging.getLogger(__name__)

MAX_RESPONSE = 1 << 20  # API answers are small JSON documents
GZIP_MAGIC = b"\x1f\x8b\x08\x00"
ELF_MAGIC = b"\x7fELF"


class FirecrackerError(RuntimeError):
    """The API refused a request, the process died, or the host cannot run Firecracker.
    ``status`` and ``body`` keep the API's answer when there was one."""

    def __init__(self, message: str, status: int | None = None, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


# ---- host facts --------------------------------------------------------------------------------


def unavailable_reason(binary: str | None, kvm_dev: Path = Path("/dev/kvm")) -> str | None:
    """None when Firecracker can run guests here, else why not."""
    if not binary:
        return "no firecracker binary configured (AENV_FIRECRACKER)"
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        return f"{binary} is not an executable file"
    choice = choose_accel(kvm_dev=kvm_dev)
    if choice.accel != "kvm":
        return f"no hardware KVM: {choice.reason} (Firecracker has no TCG)"
    return None


def extract_vmlinux(bzimage: Path, dest: Path) -> Path:
    """Unpack the ELF kernel from a gzip-compressed bzImage (``KERNEL_GZIP=y``, as the aenv mini
    kernel is built) into ``dest``; cached: an existing ``dest`` is returned as is."""
    if dest.is_file() and dest.read_bytes()[:4] == ELF_MAGIC:
        return dest
    data = bzimage.read_bytes()
    start = data.find(GZIP_MAGIC)
    while start != -1:
        try:
            out = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data[start:])
        except zlib.error:
            out = b""
        if out[:4] == ELF_MAGIC:
            tmp = dest.with_name(f".{dest.name}.tmp")
            tmp.write_bytes(out)
            os.replace(tmp, dest)
            return dest
        start = data.find(GZIP_MAGIC, start + 1)
    raise FirecrackerError(f"{bzimage}: no gzip-compressed ELF kernel inside (is it KERNEL_GZIP?)")


# ---- config --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FcDrive:
    drive_id: str
    path: Path
    read_only: bool = False
    is_root_device: bool = False


@dataclass(frozen=True)
class FirecrackerConfig:
    """One Firecracker process. Paths are absolute; the API socket path must fit AF_UNIX."""

    name: str
    binary: str
    kernel: Path  # ELF vmlinux
    api_socket: Path
    initrd: Path | None = None
    boot_args: str = "console=ttyS0 quiet panic=-1 reboot=k"
    memory_mb: int = 512
    cpu_count: int = 1
    drives: tuple[FcDrive, ...] = ()
    vsock_uds: Path | None = None  # host side of the guest's vsock (CID 3)
    log_path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb={self.memory_mb}: at least 64 MiB")
        if not 1 <= self.cpu_count <= 32:
            raise ValueError(f"cpu_count={self.cpu_count}: 1..32")
        if len(str(self.api_socket).encode()) >= 108:
            raise ValueError(f"api socket path {self.api_socket} is too long for AF_UNIX")
        ids = [d.drive_id for d in self.drives]
        if len(set(ids)) != len(ids):
            raise ValueError(f"drive ids must be unique: {ids}")


def boot_requests(cfg: FirecrackerConfig) -> list[tuple[str, str, dict[str, Any]]]:
    """The API calls (method, path, body) that configure ``cfg`` before ``InstanceStart``."""
    boot: dict[str, Any] = {"kernel_image_path": str(cfg.kernel), "boot_args": cfg.boot_args}
    if cfg.initrd is not None:
        boot["initrd_path"] = str(cfg.initrd)
    reqs: list[tuple[str, str, dict[str, Any]]] = [
        (
            "PUT",
            "/machine-config",
            {"vcpu_count": cfg.cpu_count, "mem_size_mib": cfg.memory_mb, "smt": False},
        ),
        ("PUT", "/boot-source", boot),
    ]
    for d in cfg.drives:
        reqs.append((
            "PUT", f"/drives/{d.drive_id}",
            {"drive_id": d.drive_id, "path_on_host": str(d.path), "is_root_device": d.is_root_device,
             "is_read_only": d.read_only},
        ))  # fmt: skip
    if cfg.vsock_uds is not None:
        reqs.append(("PUT", "/vsock", {"guest_cid": 3, "uds_path": str(cfg.vsock_uds)}))
    return reqs


# ---- API client ----------------------------------------------------------------------------------


class ApiClient:
    """HTTP/1.1 to Firecracker's API socket: one connection per request (the API is tiny and local)."""

    def __init__(self, socket_path: Path, timeout: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        payload = b"" if body is None else json.dumps(body).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        ).encode()
        async with asyncio.timeout(self.timeout):
            reader, writer = await asyncio.open_unix_connection(str(self.socket_path))
            try:
                writer.write(head + payload)
                await writer.drain()
                status_line = await reader.readline()
                parts = status_line.split()
                if len(parts) < 2 or not parts[1].isdigit():
                    raise FirecrackerError(f"{method} {path}: bad status line {status_line[:100]!r}")
                status = int(parts[1])
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                if length > MAX_RESPONSE:
                    raise FirecrackerError(f"{method} {path}: response of {length} bytes is too large")
                data = await reader.readexactly(length) if length else b""
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
        return status, data

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
        """A request that must succeed (2xx); else FirecrackerError with the API's fault message."""
        status, data = await self.request(method, path, body)
        if not 200 <= status < 300:
            try:
                msg = json.loads(data).get("fault_message", data.decode(errors="replace"))
            except (ValueError, AttributeError):
                msg = data.decode(errors="replace")
            raise FirecrackerError(f"{method} {path}: HTTP {status}: {msg}", status, data)
        return data


# ---- one process ---------------------------------------------------------------------------------


class FirecrackerVm:
    """A Firecracker process and its API. Create with :meth:`boot` or :meth:`restore`."""

    def __init__(
        self, cfg: FirecrackerConfig, proc: asyncio.subprocess.Process, owned: Iterable[Path]
    ) -> None:
        self.cfg = cfg
        self.proc = proc
        self.api = ApiClient(cfg.api_socket)
        self._owned = [cfg.api_socket, *owned]
        self._killed = False
        self.timings: dict[str, float] = {}

    @classmethod
    async def _spawn(
        cls, cfg: FirecrackerConfig, owned: Iterable[Path] = (), timeout: float = 5.0
    ) -> FirecrackerVm:
        with contextlib.suppress(FileNotFoundError):
            cfg.api_socket.unlink()
        argv = [cfg.binary, "--api-sock", str(cfg.api_socket), "--id", cfg.name[:64]]
        log_fh = open(cfg.log_path, "ab") if cfg.log_path else None  # noqa: SIM115 - handed to the child
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log_fh or asyncio.subprocess.DEVNULL,
                stderr=log_fh or asyncio.subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            raise FirecrackerError(f"cannot start {cfg.binary}: {exc}") from exc
        finally:
            if log_fh is not None:
                log_fh.close()
        vm = cls(cfg, proc, owned)
        try:
            async with asyncio.timeout(timeout):
                while not cfg.api_socket.exists():
                    if proc.returncode is not None:
                        raise FirecrackerError(f"firecracker exited with {proc.returncode}")
                    await asyncio.sleep(0.002)
        except BaseException:
            await vm.kill()
            raise
        return vm

    @classmethod
    async def boot(cls, cfg: FirecrackerConfig) -> FirecrackerVm:
        """Start a process, configure it (:func:`boot_requests`) and start the guest."""
        t0 = time.perf_counter()
        vm = await cls._spawn(cfg, owned=[cfg.vsock_uds] if cfg.vsock_uds else [])
        try:
            for method, path, body in boot_requests(cfg):
                await vm.api.call(method, path, body)
            await vm.api.call("PUT", "/actions", {"action_type": "InstanceStart"})
        except BaseException:
            await vm.kill()
            raise
        vm.timings["boot_ms"] = (time.perf_counter() - t0) * 1000
        return vm

    @classmethod
    async def restore(
        cls, cfg: FirecrackerConfig, state: Path, memory: Path, resume: bool = True
    ) -> FirecrackerVm:
        """A new process from a snapshot: memory mapped privately from ``memory`` (File backend),
        so many restores share one frozen memory file."""
        t0 = time.perf_counter()
        vm = await cls._spawn(cfg, owned=[cfg.vsock_uds] if cfg.vsock_uds else [])
        try:
            await vm.api.call(
                "PUT", "/snapshot/load",
                {"snapshot_path": str(state), "mem_backend": {"backend_type": "File", "backend_path": str(memory)},
                 "enable_diff_snapshots": False, "resume_vm": resume},
            )  # fmt: skip
        except BaseException:
            await vm.kill()
            raise
        vm.timings["restore_ms"] = (time.perf_counter() - t0) * 1000
        return vm

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and not self._killed

    async def pause(self) -> None:
        await self.api.call("PATCH", "/vm", {"state": "Paused"})

    async def resume(self) -> None:
        await self.api.call("PATCH", "/vm", {"state": "Resumed"})

    async def snapshot(self, state: Path, memory: Path) -> float:
        """Pause and write a full snapshot (device state + guest memory). The VM stays paused."""
        t0 = time.perf_counter()
        await self.pause()
        await self.api.call(
            "PUT", "/snapshot/create",
            {"snapshot_type": "Full", "snapshot_path": str(state), "mem_file_path": str(memory)},
        )  # fmt: skip
        self.timings["snapshot_ms"] = (time.perf_counter() - t0) * 1000
        return self.timings["snapshot_ms"]

    async def kill(self) -> None:
        """SIGKILL, reap under shield, remove owned files. Idempotent."""
        if self._killed:
            return
        self._killed = True
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
        await asyncio.shield(self._reap())

    async def _reap(self) -> None:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            await self.proc.wait()
        for p in self._owned:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                p.unlink()


def vmlinux_for(bzimage: Path) -> Path:
    """The ELF kernel next to a cached bzImage (extracted once)."""
    return extract_vmlinux(bzimage, bzimage.with_name("vmlinux"))


__all__ = [
    "ApiClient", "FcDrive", "FirecrackerConfig", "FirecrackerError", "FirecrackerVm",
    "boot_requests", "extract_vmlinux", "unavailable_reason", "vmlinux_for",
]  # fmt: skip
