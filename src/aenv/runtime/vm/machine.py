"""One running QEMU process: spawn, QMP, pause/resume, device-state snapshot and restore, teardown.

A :class:`Machine` owns exactly one QEMU process and the files listed at spawn time (its sockets,
and whatever the caller hands over: an overlay, a RAM file). :meth:`Machine.kill` is the single,
idempotent teardown: SIGKILL first (synchronous, so it happens even under cancellation), then the
reap under :func:`asyncio.shield`, then the QMP connection, then the files.

Snapshots follow notes/vmm.md §3b: guest RAM lives in a ``memory-backend-file`` with
``share=on``, so with the ``x-ignore-shared`` capability only device state (~50 KB) is written,
in ~10 ms regardless of RAM size. A restore is a new process with the same shape, ``share=off``
(copy-on-write over the frozen RAM file) and ``-incoming defer``; it loads the device state with
``migrate-incoming`` and then continues. The RAM file of a snapshot must never be written again,
so a snapshotted machine is left stopped; the caller kills it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from aenv.runtime.network import Slirp

from . import netjail
from .cmdline import build_argv
from .config import Drive, VmConfig
from .memlayer import Mapping, find_mapping
from .qmp import QMPClient, QMPError

log = logging.getLogger(__name__)


class MachineError(RuntimeError):
    """QEMU failed to start, died, or refused an operation. Carries the stderr tail when known."""


@dataclass
class Timings:
    """Milliseconds of the last operations, for benchmarks and logs."""

    spawn_ms: float | None = None  # exec → QMP negotiated
    snapshot_ms: float | None = None  # stop → migration completed
    restore_ms: float | None = None  # migrate-incoming → resumed
    extra: dict[str, float] = field(default_factory=dict)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


class AdoptedProcess:
    """The subset of ``asyncio.subprocess.Process`` that Machine uses, for a QEMU we did not start
    (server restart). A pidfd pins the process, so signals never hit a recycled pid; the exit is
    seen when the pidfd turns readable. The exit code of a non-child is unknowable: -9 stands in."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = os.pidfd_open(pid)
        self.returncode: int | None = None

    def _poll(self) -> bool:
        if self._fd is None:
            return True
        import select

        r, _, _ = select.select([self._fd], [], [], 0)
        if r:
            self._exited()
        return self.returncode is not None

    def _exited(self) -> None:
        self.returncode = -9 if self.returncode is None else self.returncode
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        """Drop the pidfd without touching the process (a failed attach)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def send_signal(self, sig: int) -> None:
        if self._poll() or self._fd is None:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._fd, sig)

    async def wait(self) -> int:
        while not self._poll():
            await asyncio.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


class Machine:
    """A QEMU microVM process and its QMP connection. Create with :meth:`spawn`."""

    def __init__(
        self,
        cfg: VmConfig,
        proc: asyncio.subprocess.Process | AdoptedProcess,
        stderr_path: Path | None,
        owned: list[Path],
    ) -> None:
        self.cfg = cfg
        self.proc = proc
        self.qmp = QMPClient(name=f"qmp-{cfg.name}")
        self.stderr_path = stderr_path
        self.timings = Timings()
        self._owned = owned
        self._killed = False
        self.slirp: Slirp | None = None  # the jail's way out (netjail.py); None when not ours to close

    # -- start --------------------------------------------------------------------------------------

    @classmethod
    async def spawn(
        cls,
        cfg: VmConfig,
        *,
        stderr_path: Path | None = None,
        owned: Iterable[Path] = (),
        timeout: float = 10.0,
    ) -> Machine:
        """Start QEMU and connect QMP. On any failure the process is killed and files removed."""
        for sock in (cfg.qmp_socket, cfg.channel_socket):
            sock.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                sock.unlink()  # stale socket from a dead process: QEMU would fail to bind
        files = [cfg.qmp_socket, cfg.channel_socket, *owned]
        if stderr_path is not None:
            files.append(stderr_path)
        argv = build_argv(cfg)
        exit_r = exit_w = -1
        if cfg.network == "user":  # internet: in a network namespace of its own (netjail.py)
            if not netjail.available():
                raise MachineError(
                    "internet access needs slirp4netns and iptables on the host "
                    "(apt-get install slirp4netns iptables)"
                )
            resolv = cfg.qmp_socket.parent / "resolv.conf"
            netjail.write_resolv_conf(resolv)
            files.append(resolv)
            argv = netjail.jailed_argv(argv, resolv)
            exit_r, exit_w = os.pipe()
        t0 = time.perf_counter()
        err = open(stderr_path, "wb") if stderr_path is not None else None  # noqa: SIM115, ASYNC230 - tiny, handed to the child
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=err if err is not None else asyncio.subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C to the server must not hit guests
                pass_fds=(exit_w,) if exit_w >= 0 else (),
            )
        except BaseException as exc:
            if exit_r >= 0:
                os.close(exit_r)
            if isinstance(exc, FileNotFoundError):
                raise MachineError(f"{argv[0]} not found; hint: apt-get install qemu-system-x86 util-linux") from exc
            raise
        finally:
            if err is not None:
                err.close()
            if exit_w >= 0:
                os.close(exit_w)  # QEMU holds the only write end now
        m = cls(cfg, proc, stderr_path, files)
        log.debug("vm %s: spawned pid %d: %s", cfg.name, proc.pid, shlex.join(argv))
        try:
            if exit_r >= 0:
                try:
                    m.slirp = await netjail.connect(proc.pid, exit_r, cfg.name)
                except netjail.JailError as exc:
                    raise MachineError(f"vm {cfg.name}: network namespace: {exc}; {m.stderr_tail()}") from exc
            await m._connect_qmp(timeout)
        except BaseException:
            await m.kill()
            raise
        m.timings.spawn_ms = _ms(t0)
        return m

    @classmethod
    async def attach(
        cls, cfg: VmConfig, pid: int, *, stderr_path: Path | None = None, owned: Iterable[Path] = ()
    ) -> Machine:
        """Re-attach to a QEMU left running by a previous server (found by pid, checked by its
        command line naming ``cfg.qmp_socket``). Raises MachineError if it is gone or not ours."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError as exc:
            raise MachineError(f"vm {cfg.name}: pid {pid} is gone") from exc
        if str(cfg.qmp_socket).encode() not in cmdline:
            raise MachineError(f"vm {cfg.name}: pid {pid} is not this VM's QEMU")
        try:
            proc = AdoptedProcess(pid)
        except ProcessLookupError as exc:
            raise MachineError(f"vm {cfg.name}: pid {pid} is gone") from exc
        files = [cfg.qmp_socket, cfg.channel_socket, *owned]
        if stderr_path is not None:
            files.append(stderr_path)
        m = cls(cfg, proc, stderr_path, files)
        try:
            await m.qmp.connect(cfg.qmp_socket, timeout=5.0, retry=False)
        except QMPError as exc:
            m._killed = True  # not ours to kill on a failed attach; the caller decides
            proc.release()
            raise MachineError(f"vm {cfg.name}: QMP of pid {pid} unreachable: {exc}") from exc
        return m

    async def _connect_qmp(self, timeout: float) -> None:
        connect = asyncio.create_task(self.qmp.connect(self.cfg.qmp_socket, timeout=timeout))
        died = asyncio.create_task(self.proc.wait())
        try:
            await asyncio.wait({connect, died}, return_when=asyncio.FIRST_COMPLETED)
            if connect.done():
                connect.result()  # raises ConnectError if negotiation failed
                return
            raise MachineError(
                f"vm {self.cfg.name}: QEMU exited with {self.proc.returncode}: {self.stderr_tail()}"
            )
        except QMPError as exc:
            raise MachineError(f"vm {self.cfg.name}: no QMP: {exc}; {self.stderr_tail()}") from exc
        finally:
            for t in (connect, died):
                if not t.done():
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, QMPError):
                        await t

    # -- facts --------------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and not self._killed

    def stderr_tail(self, n: int = 2000) -> str:
        if self.stderr_path is None:
            return "(stderr not kept)"
        try:
            return self.stderr_path.read_bytes()[-n:].decode(errors="replace").strip() or "(stderr empty)"
        except OSError:
            return "(stderr unreadable)"

    # -- control ------------------------------------------------------------------------------------

    async def execute(self, cmd: str, args: dict[str, Any] | None = None) -> Any:
        """A QMP command; errors become MachineError with QEMU's stderr attached if it died."""
        try:
            return await self.qmp.execute(cmd, args)
        except QMPError as exc:
            dead = (
                ""
                if self.proc.returncode is None
                else f" (QEMU exited {self.proc.returncode}: {self.stderr_tail()})"
            )
            raise MachineError(f"vm {self.cfg.name}: {cmd}: {exc}{dead}") from exc

    def set_nice(self, nice: int) -> None:
        """CPU priority of every QEMU thread (Linux nice is per thread; threads created later
        inherit their creator's). Pool entries warm up at a low priority so that a refill never
        slows the sandboxes in use on a small host; a hand-out sets 0 again. Best effort."""
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return
        for tid in tids:
            with contextlib.suppress(OSError, ValueError):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)

    async def status(self) -> str:
        """QEMU's run state: running, paused, inmigrate, postmigrate, ..."""
        ret = await self.execute("query-status")
        return str(ret["status"])

    async def pause(self) -> None:
        """Stop all vCPUs at once (~0.5 ms)."""
        await self.execute("stop")

    async def resume(self) -> None:
        await self.execute("cont")

    async def _ignore_shared(self, on: bool = True) -> None:
        await self.execute(
            "migrate-set-capabilities", {"capabilities": [{"capability": "x-ignore-shared", "state": on}]}
        )

    async def _wait_migration(self, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while True:
                info = await self.execute("query-migrate")
                st = info.get("status")
                if st == "completed":
                    return
                if st in ("failed", "cancelled"):
                    raise MachineError(f"vm {self.cfg.name}: migration {st}: {info.get('error-desc', info)}")
                await asyncio.sleep(0.0005)

    async def snapshot(self, device_state: Path, timeout: float = 30.0) -> float:
        """Stop the guest and write its device state to ``device_state`` (RAM stays in the shared
        file). Returns milliseconds. The machine stays stopped; its RAM file is now a frozen
        template and must not be written again: kill this machine, restore copies instead."""
        if not self.cfg.mem_share:
            raise MachineError(
                f"vm {self.cfg.name}: device-state snapshot needs share=on RAM (this is a private fork); "
                "a full migration would be needed"
            )
        device_state.parent.mkdir(parents=True, exist_ok=True)
        tmp = device_state.with_name(f".{device_state.name}.tmp")
        t0 = time.perf_counter()
        await self.pause()
        await self._ignore_shared()
        await self.execute("migrate", {"uri": f"exec:cat > {shlex.quote(str(tmp))}"})
        await self._wait_migration(timeout)
        os.rename(tmp, device_state)
        self.timings.snapshot_ms = _ms(t0)
        return self.timings.snapshot_ms

    async def save_full(self, path: Path, timeout: float = 300.0) -> float:
        """Stop the guest and write device state *and all guest RAM* to ``path`` (classic
        migration). Needed when RAM is private (a restored sandbox, ``share=off``): x-ignore-shared
        cannot see its pages. Costs time proportional to touched RAM (200-800 ms under TCG for a
        small guest). The machine stays paused (QEMU state ``postmigrate``); :meth:`resume`
        continues it. Restore with ``restore(path, ignore_shared=False)`` into a process whose RAM
        file is new and empty (QEMU skips zero pages, so the target must read as zeros)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        t0 = time.perf_counter()
        await self.pause()
        await self._ignore_shared(False)
        await self.execute("migrate", {"uri": f"exec:cat > {shlex.quote(str(tmp))}"})
        await self._wait_migration(timeout)
        os.rename(tmp, path)
        self.timings.extra["save_full_ms"] = _ms(t0)
        return self.timings.extra["save_full_ms"]

    async def save_devices(self, path: Path) -> float:
        """Write the device and vCPU state, without any RAM, to ``path``
        (``xen-save-devices-state``; the machine must be stopped and stays so). Pairs with a RAM
        layer read from the stopped process (``memlayer``): together they are a snapshot of a
        ``share=off`` machine in milliseconds. The stream has no configuration section, so the
        restoring process needs ``send_configuration=False``. Returns ms."""
        if await self.status() == "running":
            raise MachineError(f"vm {self.cfg.name}: stop the machine before saving its devices")
        tmp = path.with_name(f".{path.name}.tmp")
        t0 = time.perf_counter()
        await self.execute("xen-save-devices-state", {"filename": str(tmp)})
        os.rename(tmp, path)
        return _ms(t0)

    def ram_mapping(self) -> Mapping:
        """Where this QEMU maps guest RAM (its ``mem_path``) in its address space."""
        return find_mapping(self.pid, self.cfg.mem_path)

    def _drive(self, serial: str) -> Drive:
        drive = next((d for d in self.cfg.drives if d.serial == serial), None)
        if drive is None:
            raise MachineError(f"vm {self.cfg.name}: no drive with serial {serial!r}")
        return drive

    async def checkpoint_disk(self, serial: str, new_overlay: Path, prepared: bool = False) -> float:
        """Freeze the current top image of drive ``serial`` and send further writes to a new
        qcow2 overlay on top of it. The frozen image can then back the disks of forks.
        ``prepared``: ``new_overlay`` exists already, empty, its header naming the current top
        (:func:`disk.overlay_with_backing`); it is opened and put on top (``blockdev-add`` +
        ``blockdev-snapshot``, a few ms). Otherwise QEMU creates it (``blockdev-snapshot-sync``,
        10-50 ms under TCG: it writes and syncs a new image). Returns ms."""
        drive = self._drive(serial)
        t0 = time.perf_counter()
        if prepared:
            node = "ov-" + new_overlay.name.replace(".", "-")
            cache = {"no-flush": drive.no_flush}
            file = {"driver": "file", "filename": str(new_overlay), "cache": cache}
            await self.execute(
                "blockdev-add", {"driver": "qcow2", "node-name": node, "file": file, "backing": None, "cache": cache}
            )
            await self.execute("blockdev-snapshot", {"node": drive.drive_id, "overlay": node})
        else:
            await self.execute(
                "blockdev-snapshot-sync",
                {"device": drive.drive_id, "snapshot-file": str(new_overlay), "format": "qcow2"},
            )
        self._owned.append(new_overlay)
        return _ms(t0)

    async def retarget_root(self, serial: str, backing: Path) -> float:
        """Before a restore: give drive ``serial`` (an empty qcow2 overlay, as spawned) the backing
        image ``backing`` (a snapshot's disk) in place of the one it was started with, so that a
        process spawned ahead of time for a template can restore any snapshot of it. The caller
        renames the backing in the overlay's header too (:func:`disk.retarget_overlay`); QEMU
        reads it again when the incoming migration activates the image. Returns ms."""
        drive = self._drive(serial)
        t0 = time.perf_counter()
        nodes = await self.execute("query-named-block-nodes", {"flat": True})
        top = next((n for n in nodes if n.get("node-name") == drive.node_name), None)
        file_node = None
        if top is not None:  # its protocol node: the other node opened on the same file
            others = (n for n in nodes if n.get("node-name") != drive.node_name)
            file_node = next((n["node-name"] for n in others if n.get("file") == top.get("file")), None)
        if file_node is None:
            raise MachineError(f"vm {self.cfg.name}: block nodes of drive {serial!r} not found")
        base = f"{drive.node_name}-base"
        await self.execute(
            "blockdev-add",
            {"driver": "qcow2", "node-name": base, "read-only": True,
             "file": {"driver": "file", "filename": str(backing), "read-only": True}},
        )  # fmt: skip
        options: dict[str, Any] = {
            "driver": drive.format, "node-name": drive.node_name, "file": file_node, "backing": base,
            "cache": {"no-flush": drive.no_flush}, "discard": "ignore" if drive.read_only else "unmap",
        }  # fmt: skip
        await self.execute("blockdev-reopen", {"options": [options]})
        return _ms(t0)

    async def restore(
        self, device_state: Path, resume: bool = True, timeout: float = 30.0, ignore_shared: bool = True
    ) -> float:
        """Load ``device_state`` into this ``-incoming defer`` process, then continue. Returns ms.
        ``ignore_shared`` must match how the state was written (``snapshot``: True,
        ``save_full``: False)."""
        if not self.cfg.incoming:
            raise MachineError(f"vm {self.cfg.name}: restore needs a process started with incoming=True")
        if not device_state.is_file():
            raise MachineError(f"vm {self.cfg.name}: no device state at {device_state}")
        t0 = time.perf_counter()
        await self._ignore_shared(ignore_shared)
        await self.execute("migrate-incoming", {"uri": f"exec:cat {shlex.quote(str(device_state))}"})
        async with asyncio.timeout(timeout):
            while (st := await self.status()) == "inmigrate":
                await asyncio.sleep(0.0005)
        if st not in ("paused", "prelaunch", "running"):
            raise MachineError(f"vm {self.cfg.name}: after restore QEMU is {st!r}: {self.stderr_tail()}")
        if resume and st != "running":
            await self.resume()
        self.timings.restore_ms = _ms(t0)
        return self.timings.restore_ms

    async def wait_guest_channel(self, timeout: float = 60.0) -> None:
        """Until the guest has opened its end of the virtio-serial port.

        Bytes the host sends before that are *discarded* by the guest driver (Linux
        virtio_console drops input for ports nobody opened), which would eat the mux HELLO of a
        freshly booted guest. QEMU mirrors the guest's open state as the chardev's
        ``frontend-open``. After a restore the state comes back with the device, so this returns
        at once."""
        async with asyncio.timeout(timeout):
            while True:
                for dev in await self.execute("query-chardev"):
                    if dev.get("label") == "chan" and dev.get("frontend-open"):
                        return
                if not self.alive or self.proc.returncode is not None:
                    raise MachineError(f"vm {self.cfg.name}: QEMU is gone: {self.stderr_tail()}")
                await asyncio.sleep(0.02)

    async def open_channel(self, timeout: float = 5.0) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect to the virtio-serial chardev (one host connection at a time; the caller owns it)."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        return await asyncio.open_unix_connection(str(self.cfg.channel_socket), limit=1 << 20)
                    except (FileNotFoundError, ConnectionRefusedError):
                        if not self.alive:
                            raise MachineError(
                                f"vm {self.cfg.name}: QEMU is gone: {self.stderr_tail()}"
                            ) from None
                        await asyncio.sleep(0.002)
        except TimeoutError as exc:
            raise MachineError(f"vm {self.cfg.name}: channel socket not ready") from exc

    # -- teardown -----------------------------------------------------------------------------------

    async def kill(self, keep: Iterable[Path] = ()) -> None:
        """End the process and remove every owned file except those in ``keep`` (a sandbox
        released to disk keeps its disk overlays). Idempotent; completes under cancellation."""
        if self._killed:
            return
        self._killed = True
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)  # synchronous part first
        await asyncio.shield(self._finish_teardown(frozenset(keep)))

    async def _finish_teardown(self, keep: frozenset[Path] = frozenset()) -> None:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            await self.proc.wait()
        if self.slirp is not None:  # it exits with QEMU anyway (exit fd); this reaps it
            await self.slirp.aclose()
        await self.qmp.disconnect()
        for path in self._owned:
            if path in keep:
                continue
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                path.unlink()

    async def wait(self, timeout: float | None = None) -> int:
        """Wait for QEMU to exit on its own (e.g. guest reboot with -no-reboot)."""
        async with asyncio.timeout(timeout):
            return await self.proc.wait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()
