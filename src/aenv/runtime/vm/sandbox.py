"""One VM sandbox: a :class:`Machine`, its run directory and its mux session to the guest agent.

The run directory holds everything per-process (QMP and channel sockets, the root overlay, the
console log); :meth:`VmSandbox.aclose` kills the machine and removes the directory. The mux
session is re-established on demand: the agent keeps the virtio-serial port open across host
disconnects, restores and forks, and a new host session starts with HELLO. envd is spoken to
through the runtimes' shared client (``aenv.runtime.envd_client``) over streams of that session.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from aenv.errors import RuntimeFailure
from aenv.mux import MuxError, MuxSession, MuxStream
from aenv.runtime import network
from aenv.runtime.base import SandboxSpec, VolumeBind
from aenv.runtime.egress import ENFORCER
from aenv.runtime.envd_client import (
    CONNECT_JSON,
    ENVD_PORT,
    EnvdError,
    Response,
    as_user,
    build_request,
    exchange,
    first_call_body,
    init_payload,
    request,
    run_command,
)
from aenv.runtime.process import proc_start_time

from .config import VmConfig, config_to_json
from .machine import Machine
from .volumes import GUEST_STATE, check_guest_state, hello_facts, holders_command

log = logging.getLogger(__name__)

SEED_BYTES = 64
GUEST_MEMORY_RESERVE_MB = 16  # of the guest's available RAM, kept outside the sandbox cgroup


def host_facts() -> dict[str, Any]:
    """What every restored, forked or resumed guest needs from the host: its wall time (the guest
    clock stands still while its snapshot or its stopped VM waits) and fresh random bytes (forks
    of one snapshot share the kernel CRNG state until reseeded). Sent in each new session's HELLO
    and in ``POST /init``."""
    return {"hostTime": time.time(), "seed": base64.b64encode(os.urandom(SEED_BYTES)).decode()}


def loopback_relay(sandbox_id: str) -> dict[str, Any]:
    """The ``/init`` field that has envd pipe the guest's loopback on the ports of the sandbox's header rules
    for this server's own sandbox hosts to slirp's gateway (``envd/relay.py``): there the jail's filter
    sends them to the egress proxy, as an ns sandbox's filter sends its loopback (``egress_own.py``). The
    whole set, every time (empty: none), so a restored guest drops relays its snapshot had."""
    own, policy = network.own_hosts(), ENFORCER.policies.get(sandbox_id)
    ports = own.ports(policy.rules) if own is not None and policy is not None else ()
    return {"aenvLoopbackRelay": {"to": network.SLIRP_GATEWAY, "ports": list(ports)}}


def run_paths(run_dir: Path) -> dict[str, Path]:
    """Short fixed names: unix socket paths must stay under 108 bytes."""
    return {
        "qmp": run_dir / "q.sock",
        "chan": run_dir / "c.sock",
        "console": run_dir / "console.log",
        "stderr": run_dir / "qemu.stderr",
        "root": run_dir / "root.qcow2",
    }


def own_ram_file(shm_dir: Path, sandbox_id: str) -> Path:
    """The RAM file of a VM restored from a full save: its own (``share=on``), in tmpfs."""
    return shm_dir / f"sbx-{sandbox_id}.mem"


async def spawn_on_own_ram(base: VmConfig, mem: Path, run_dir: Path) -> Machine:
    """A QEMU that waits for a full migration stream, on a new, empty RAM file ``mem``: the stream
    skips zero pages, so the target must read as zeros (never map a template's file here)."""
    with contextlib.suppress(FileNotFoundError):
        mem.unlink()
    cfg = replace(base, mem_share=True, mem_path=mem)
    return await Machine.spawn(cfg, stderr_path=run_paths(run_dir)["stderr"], owned=[mem])


async def spawn_on_frozen_ram(base: VmConfig, ram: Path, run_dir: Path) -> Machine:
    """A QEMU that maps the frozen RAM file ``ram`` ``share=off`` and waits for the pages a layered
    save changed (``memlayer.apply``) and its device state (a stream with no configuration section)."""
    cfg = replace(base, mem_path=ram, send_configuration=False)
    return await Machine.spawn(cfg, stderr_path=run_paths(run_dir)["stderr"])


def child_config(tpl_cfg: VmConfig, name: str, run_dir: Path, allow_internet: bool,
                 share: Path | None = None) -> VmConfig:
    """The restore-side config of a template: own sockets and root overlay, same shape. ``share``:
    the sandbox's own volume export (``volumes.VolumeExports``), served read-write (its binds say
    which volumes are read-only); None keeps the template's empty, read-only one."""
    p = run_paths(run_dir)
    drives = tuple(
        replace(d, path=p["root"], no_flush=True) if d.serial == "root" else d for d in tpl_cfg.drives
    )
    network = tpl_cfg.network
    if network != "none":
        network = "user" if allow_internet else "restricted"
    return tpl_cfg.for_restore(
        name=name,
        qmp_socket=p["qmp"],
        channel_socket=p["chan"],
        serial_log=p["console"],
        drives=drives,
        network=network,
        **({"share_dir": share, "share_read_only": False} if share is not None and tpl_cfg.share_dir else {}),
    )


class VmSandbox:
    """Owns a machine and its run dir; ``aclose`` is idempotent and finishes under cancellation."""

    def __init__(self, name: str, machine: Machine, run_dir: Path, template_key: str) -> None:
        self.name = name
        self.machine = machine
        self.run_dir = run_dir
        self.template_key = template_key
        self._session: MuxSession | None = None
        self._session_lock = asyncio.Lock()
        self.last_cpu: tuple[float, float] | None = None
        self.restored = False
        self.host_facts = ""  # envd's answer to the last clock/RNG refresh, e.g. "hostTime=set,seed=write+addentropy+reseed"
        self.disk_generation = 0  # root overlays stacked by snapshots: root.qcow2, root.1.qcow2, ...
        self.channel_timeout = 180.0  # a booting guest needs seconds under TCG to open its port
        self.first_ping = 1.5  # a new session's PING is answered in ms (a cold restore: ~100s of ms)
        # Layered RAM (memlayer): the frozen file this VM maps share=off, and the on-disk image of
        # the same contents (a template's ram.img or a snapshot's base RAM). None: the VM owns its
        # RAM file (restored from a full save), and a snapshot must stream all of it.
        self.base_ram: Path | None = None
        self.ram_image: Path | None = None
        # The RAM layers (oldest first, links in the run dir) this VM was restored from: the parent
        # a later snapshot stores its changes against. Empty: restored from the template itself.
        self.mem_chain: list[Path] = []
        # Streams to envd opened ahead of time (pool entries): the first requests after a create
        # (its /init, the client's first call) skip the OPEN round trip (~10-20 ms under TCG).
        self.spare: list[MuxStream] = []
        # The E2B volumes the guest mounts from this QEMU's 9p export (volumes.py), sent in every
        # HELLO with :meth:`epoch`; set before the first session of a new QEMU.
        self.volumes: tuple[VolumeBind, ...] = ()
        self._epoch: str | None = None
        # Why this VM must stay in RAM while paused (its volumes were in use when it paused), or None.
        self.keep_in_ram: str | None = None
        self._closed = False

    def epoch(self) -> str:
        """This QEMU process, as the guest's volume mounts know it: pid and start time (a restart of
        the server keeps it; any other QEMU, even one with the same pid, differs)."""
        if self._epoch is None:
            self._epoch = f"{self.machine.pid}-{proc_start_time(self.machine.pid) or 0}"
        return self._epoch

    def hello(self) -> bytes:
        """A HELLO's extension: clock and seed, and the volumes when the VM has a 9p export."""
        facts = host_facts()
        if self.machine.cfg.share_dir is not None:
            facts["volumes"] = hello_facts(self.volumes, self.epoch())
        return json.dumps(facts).encode()

    async def volume_holders(self, token: str | None) -> list[str]:
        """What in the running guest uses a volume mount (``/proc/<pid>/cwd -> /data``, at most 5).
        A copy of this VM in another QEMU must mount the export again, and the guest's 9p channel
        takes one mount at a time: while an old mount is held, the new one fails (EBUSY)."""
        if not self.volumes:
            return []
        result = await run_command(await self.open_envd(), holders_command(self.volumes), token=token, limit=1 << 16)
        if result.exit_code != 0:
            raise RuntimeFailure(f"sandbox {self.name}: could not ask the guest what uses its volumes "
                                 f"({result.error or result.exit_code})", sandbox_id=self.name)
        return result.stdout.decode(errors="replace").split("\n")[:-1] if result.stdout else []

    async def check_volumes(self, token: str | None) -> None:
        """Raise unless the guest has mounted every volume from this QEMU (its agent's report,
        read as root through envd with the sandbox's envd ``token``: the HELLO that asks for the
        mounts gets no answer)."""
        if not self.volumes:
            return
        answer = await self.envd_call("GET", f"/files?path={GUEST_STATE}&username=root",
                                      headers={"X-Access-Token": token} if token else None)
        problem = check_guest_state(answer.body, self.epoch(), self.volumes) if answer.status == 200 else (
            f"no volume state from the guest (envd answered {answer.status})")
        if problem is not None:
            raise RuntimeFailure(f"sandbox {self.name}: volumes: {problem}", sandbox_id=self.name)

    async def session(self) -> MuxSession:
        """The live mux session, reconnecting if the previous one ended."""
        async with self._session_lock:
            if self._session is None or self._session.closed:
                self._session = await self._connect()
            return self._session

    async def _connect(self) -> MuxSession:
        """A new session whose guest end has answered a PING.

        QEMU's virtio-serial port stops passing guest data for good (``throttled``) when the guest
        writes in the moment after the host left: a write that fails on the closed socket throttles
        the port, and a new connection does not unthrottle it; only the host closing again does.
        That happens whenever the guest answers something while a pause, a server stop or a dropped
        session disconnects (seen: 2 in 25 resumes hung 10 s). So a session that gets no PONG in
        time is closed and opened again, which also gives an agent reader stuck mid-frame a fresh
        start (agent.serial_readers). The wait doubles each time (``first_ping``, then 2x,
        4x, ...) until ``channel_timeout``: a guest that is merely slow (16 forks translating their
        code on 2 cores answer after seconds) must not be cut off on every attempt, since each cut
        can throttle the port again; one wait that never ends would hang on a throttled port."""
        deadline = time.monotonic() + self.channel_timeout
        wait = self.first_ping
        for attempt in itertools.count(1):
            await self.machine.wait_guest_channel(max(0.1, deadline - time.monotonic()))
            reader, writer = await self.machine.open_channel()
            # The guest applies the HELLO's clock and seed before it serves any stream of this
            # session (agent.channel.apply_host_facts): a resume needs no request of its own.
            session = await MuxSession(
                reader, writer, name=f"vm-{self.name}", hello_extra=self.hello()
            ).start()
            try:
                await session.ping(timeout=min(wait, max(0.1, deadline - time.monotonic())))
                return session
            except (TimeoutError, MuxError) as exc:
                await session.aclose()
                if time.monotonic() >= deadline:
                    raise
                log.warning("vm %s: guest did not answer new session %d in %.1f s (%r); reconnecting",
                            self.name, attempt, wait, exc)  # fmt: skip
                wait *= 2
        raise AssertionError("unreachable")

    async def open_stream(self, port: int, timeout: float = 10.0) -> MuxStream:
        """A stream to ``port`` in the guest: a spare one (envd) when there is one, else a new one."""
        if port == ENVD_PORT and (spare := self.take_spare()) is not None:
            return spare
        s = await self.session()
        return await s.open(port, timeout=timeout)

    async def open_spares(self, count: int) -> None:
        """Open ``count`` envd streams now and keep them for :meth:`open_stream` (best effort)."""
        for _ in range(count):
            with contextlib.suppress(MuxError, TimeoutError, OSError):
                self.spare.append(await (await self.session()).open(ENVD_PORT))

    def take_spare(self) -> MuxStream | None:
        while self.spare:
            stream = self.spare.pop()
            if not (stream.closed or stream.at_eof or stream.buffered):
                return stream
        return None

    async def envd_request(
        self, method: str, path: str, payload: Any = None, timeout: float = 30.0
    ) -> tuple[int, bytes]:
        """One JSON request to envd over a fresh stream (start-up: ``/health``)."""
        async with asyncio.timeout(timeout):
            stream = await self.open_stream(ENVD_PORT, timeout=timeout)
            return await request(stream, method, path, payload)

    async def open_envd(self, first_timeout: float = 15.0, timeout: float = 30.0) -> MuxStream:
        """A stream to envd. An OPEN the guest has not answered within ``first_timeout`` gets a second
        chance on a fresh channel: when the host leaves, QEMU discards what the guest had queued (which
        unthrottles a port stalled by a guest write after an earlier departure), the agent drops any
        half frame (agent.serial_readers), and the next HELLO resets the agent's streams. Used where no
        other stream of the sandbox is in use: ``/init`` after a restore, resume or fork, and the pool
        warm-up."""
        try:
            return await self.open_stream(ENVD_PORT, timeout=first_timeout)  # a spare one if it has one
        except (TimeoutError, MuxError) as exc:
            status = "unknown"
            with contextlib.suppress(Exception):
                status = await self.machine.status()
            log.warning("vm %s: envd stream not opened (%r, machine %s); retrying on a fresh channel",
                        self.name, exc, status)
            await self.drop_session()
            await asyncio.sleep(0.05)
            return await self.open_stream(ENVD_PORT, timeout=timeout)

    async def envd_call(
        self, method: str, path: str, body: bytes | None = None, *, content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> Response:
        """One request to envd on a stream from :meth:`open_envd`, its answer read to EOF."""
        async with asyncio.timeout(60):
            stream = await self.open_envd()
            return await exchange(stream, build_request(method, path, body, headers, content_type))

    async def init_envd(self, spec: SandboxSpec, pids_limit: int) -> None:
        """``POST /init``: this sandbox's identity (ID, env vars, token; the restored guest has the
        template's or the source's), the host's clock and random bytes, and the pids and memory
        limits inside the guest (envd.limits: a bomb stays in its cgroup). envd's
        ``X-Aenv-Host-Facts`` answer says whether clock and RNG were really set (kept in
        :attr:`host_facts`, a warning when not)."""
        payload = init_payload(spec) | host_facts() | loopback_relay(spec.sandbox_id)
        payload["limits"] = {"pids": pids_limit, "memoryReserveMB": GUEST_MEMORY_RESERVE_MB}
        answer = await self.envd_call("POST", "/init", json.dumps(payload).encode())
        sid = spec.sandbox_id
        if not 200 <= answer.status < 300:
            raise RuntimeFailure(f"envd /init answered {answer.status}: {answer.body[:200]!r}", sandbox_id=sid)
        self.host_facts = answer.headers.get("x-aenv-host-facts", "")
        if "relay=failed" in self.host_facts:  # a guest program listens on a rule's port of its loopback
            log.warning("sandbox %s: the guest could not relay every port of its own-host rules (console log)", sid)
        if "limits=failed" in self.host_facts:
            log.warning("sandbox %s: the guest could not set its pids/memory limits (see its console log)", sid)
        if "hostTime=set" not in self.host_facts or "reseed" not in self.host_facts:
            log.warning("sandbox %s: guest clock/RNG not fully refreshed after restore: %r", sid, self.host_facts)

    async def update_relay(self, sandbox_id: str) -> None:
        """The running guest's loopback relays follow its new rules (:func:`loopback_relay`). A guest
        that cannot be told keeps its old set: a curl to a new rule's sandbox URL stays on its loopback."""
        try:
            answer = await self.envd_call("POST", "/init", json.dumps(loopback_relay(sandbox_id)).encode())
            if answer.status >= 300 or "relay=failed" in answer.headers.get("x-aenv-host-facts", ""):
                log.warning("sandbox %s: envd did not take every loopback relay (%d)", sandbox_id, answer.status)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("sandbox %s: loopback relays not updated: %r", sandbox_id, exc)

    async def warm_paths(self) -> None:
        """Run the request paths a new sandbox's first calls take (``/init`` with clock and seed,
        start a process as ``user`` the way the SDK does, read a file) once in a pool entry, so
        that TCG has translated that guest code before a create hands the entry out (a first
        ``commands.run`` otherwise costs ~1 s more than later ones). The hand-out's own ``/init``
        replaces what this one set. Best effort: a failure only costs the speed-up."""
        t0 = time.perf_counter()
        try:
            await self.envd_call("POST", "/init", json.dumps(host_facts()).encode())
            for headers in (as_user("user"), None):
                await self.envd_call("POST", "/process.Process/Start", first_call_body(), content_type=CONNECT_JSON,
                                     headers=headers)
            await self.envd_call("GET", "/files?path=/etc/hostname&username=root")
        except (MuxError, OSError, EnvdError, RuntimeFailure) as exc:
            log.debug("vm %s: warm-up request failed: %s", self.name, exc)
        self.machine.timings.extra["warm_paths_ms"] = (time.perf_counter() - t0) * 1000

    async def wait_envd(self, timeout: float) -> None:
        """Until ``GET /health`` answers 2xx (the agent itself retries envd's port for a while)."""
        last: object = "no answer"
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        status, _ = await self.envd_request("GET", "/health", timeout=min(timeout, 20.0))
                    except (MuxError, OSError, ValueError) as exc:  # TimeoutError is an OSError
                        last = exc
                        if isinstance(exc, TimeoutError):
                            await self.drop_session()  # a stuck session: start a fresh one
                        log.debug("vm %s: envd not ready: %s", self.name, exc)
                    else:
                        if 200 <= status < 300:
                            return
                        last = f"HTTP {status}"
                    await asyncio.sleep(0.1)
        except TimeoutError:
            raise TimeoutError(f"envd did not answer /health within {timeout:.0f} s (last: {last})") from None

    def quiesce(self) -> None:
        """Before the vCPUs stop (pause): no stream may outlive the pause, since the proxy would
        reuse an idle keep-alive one into the stopped guest and hang. The channel itself stays
        connected: a host that disconnects as the guest stops leaves QEMU a departure to report
        after ``cont``, and a guest write in the moment after it left throttles the port (see
        :meth:`_connect`)."""
        self.spare.clear()
        if self._session is not None:
            self._session.abort_streams("sandbox paused")

    async def refresh(self) -> None:
        """After the vCPUs run again (resume): the kept session restarts with a HELLO carrying the
        clock and seed, which the guest applies before any later stream. A session that ended
        meanwhile is simply dropped; the next one's HELLO carries them too."""
        session = self._session
        if session is None or session.closed:
            await self.drop_session()
            return
        try:
            await session.restart(self.hello())
        except MuxError:
            await self.drop_session()

    async def drop_session(self) -> None:
        self.spare.clear()  # streams of the session that ends
        s, self._session = self._session, None
        if s is not None:
            with contextlib.suppress(Exception):
                await s.aclose()

    def disk_top(self) -> Path:
        """The root image QEMU currently writes to."""
        root = run_paths(self.run_dir)["root"]
        return root if self.disk_generation == 0 else root.with_name(f"root.{self.disk_generation}.qcow2")

    def state(self) -> dict[str, Any]:
        cfg = self.machine.cfg
        return {
            "name": self.name,
            "pid": self.machine.pid,
            "run_dir": str(self.run_dir),
            "qmp": str(cfg.qmp_socket),
            "channel": str(cfg.channel_socket),
            "template_key": self.template_key,
            "host_facts": self.host_facts,
            "config": config_to_json(cfg),
            "base_ram": str(self.base_ram) if self.base_ram else None,
            "ram_image": str(self.ram_image) if self.ram_image else None,
            "mem_chain": [str(p) for p in self.mem_chain],
        }

    async def aclose(self, extra_dir: Path | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        await self.drop_session()
        await self.machine.kill()
        await asyncio.shield(asyncio.to_thread(remove_dirs, self.run_dir, extra_dir))


def remove_dirs(*dirs: Path | None) -> None:
    for d in dirs:
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)
