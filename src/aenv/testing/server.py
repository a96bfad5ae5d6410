"""Start and stop a real ``aenv serve`` process on a free port: shared by the integration tests and bench/."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from aenv.testing.procs import exit_with_parent

API_KEY = "e2b_" + "0" * 40
# extra_env of a test server whose sandboxes must outlive a graceful stop (a test of adoption across a
# restart); test servers otherwise end them (``stop_sandboxes_on_exit``)
KEEP_SANDBOXES = {"AENV_STOP_SANDBOXES_ON_EXIT": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Tls:
    """What an HTTPS test server serves (``cert``, ``key``) and what its clients trust (``ca``)."""

    cert: Path
    key: Path
    ca: Path


@dataclass
class Server:
    url: str
    state_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str]
    ca: Path | None = None  # the CA of an HTTPS server's certificate
    node_state_dirs: dict[str, Path] = field(default_factory=dict)  # a gateway's: each node's, by node ID

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def start_server(
    tmp: Path, runtime: str, extra_env: dict[str, str] | None = None, port: int | None = None, tls: Tls | None = None,
    ready_s: float = 240,
) -> Server:
    """``tls``: serve HTTPS (the certificate must name 127.0.0.1); the health check trusts ``tls.ca``.
    ``ready_s``: how long it may take to answer ``/health`` (a first start may build a guest kernel)."""
    port = port or free_port()
    state = tmp / "state"
    log_path = tmp / "server.log"
    # The server runs the aenv this process imported (a worktree's src under pytest), not whatever the
    # venv has installed.
    src = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p),
        "AENV_STATE_DIR": str(state),
        "AENV_RUNTIME": runtime,
        "AENV_PORT": str(port),
        "AENV_POOL_SIZE": os.environ.get("AENV_TEST_POOL_SIZE", "2"),
        "AENV_LOG_LEVEL": "info",
        "AENV_STOP_SANDBOXES_ON_EXIT": "1",  # a throwaway server: a graceful stop ends its sandboxes
        # nothing marked mergeable: ksmd takes no CPU from a test suite on 2 cores (the KSM tests and
        # the bench ask for the default, auto)
        "AENV_KSM": "off",
        **({"AENV_TLS_CERT": str(tls.cert), "AENV_TLS_KEY": str(tls.key)} if tls else {}),
        **(extra_env or {}),
    }
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aenv.cli.main", "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=exit_with_parent(),  # SIGTERMed (a graceful stop) if this process dies, even by SIGKILL
        )
    scheme = "https" if tls else "http"
    server = Server(f"{scheme}://127.0.0.1:{port}", state, proc, log_path, env, tls.ca if tls else None)
    return healthy_or_stopped(server, ready_s, "aenv serve", stop_server)


def healthy_or_stopped(server: Server, seconds: float, what: str, stop: Callable[[Server], None]) -> Server:
    """``server`` once it answers ``/health`` (trusting its CA, if it has one); otherwise, or when this
    process is interrupted meanwhile (SIGTERM, Ctrl-C), it is stopped with ``stop`` and the call raises."""
    try:
        healthy = wait_healthy(server, seconds, what, trust(server))
    except BaseException:  # it exited, or this process is being stopped
        stop(server)
        raise
    if not healthy:
        stop(server)
        raise RuntimeError(f"{what} did not become healthy:\n{server.log_tail()}")
    return server


def trust(server: Server) -> ssl.SSLContext | bool:
    """What a client of ``server`` verifies its certificate with: its own CA for an HTTPS test server."""
    return ssl.create_default_context(cafile=str(server.ca)) if server.ca else True


def wait_healthy(server: Server, seconds: float, what: str, verify: ssl.SSLContext | bool = True) -> bool:
    """Whether ``server`` answered ``/health`` within ``seconds``; raises if its process exited first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=1, trust_env=False, verify=verify).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def release_ns_volume(state_dir: Path) -> None:
    """Unmount the ns runtime's sandboxes volume of ``state_dir`` unless a running server holds it.

    A server unmounts it itself at a clean shutdown; this covers one that was SIGKILLed (tests do
    that on purpose), so a temp state dir never leaves a mount behind."""
    from aenv.runtime.ns.disk import DiskQuota

    DiskQuota(state_dir, state_dir / "sandboxes").release()


def kill_sandboxes(server: Server) -> None:
    """Kill every sandbox ``server`` lists, through its API; best effort (a server that is gone or
    stuck answers nothing). For servers that keep their sandboxes across a stop."""
    headers = {"X-API-KEY": API_KEY}
    try:
        with httpx.Client(headers=headers, trust_env=False, verify=trust(server), timeout=60) as client:
            for s in client.get(server.url + "/v2/sandboxes").json():
                client.delete(f"{server.url}/sandboxes/{s['sandboxID']}")
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass


def stop_server(server: Server, sig: int = signal.SIGTERM) -> None:
    _stop(server, sig)
    release_ns_volume(server.state_dir)


def reap_vms(state_dir: Path) -> list[int]:
    """SIGKILL every QEMU that belongs to ``state_dir`` (its run dirs, template RAM or state paths
    on the command line). VMs outlive their server on purpose (a restart adopts them); a test or
    bench server whose state is thrown away must not leave them running, and one killed in the
    middle of a template build or pool refill never got to end them itself."""
    import hashlib

    from aenv.runtime.vm.reconcile import qemu_cmdlines
    from aenv.runtime.vm.runtime import shm_dir_for

    state = str(Path(state_dir).absolute())
    markers = [
        state.encode(),
        f"/{shm_dir_for(Path(state)).name}/".encode(),  # its template RAM dir
        f"/aenv-vm-{hashlib.sha256((state + '/vm/run').encode()).hexdigest()[:10]}/".encode(),  # short run root
    ]
    killed = []
    for pid, cmd in qemu_cmdlines().items():
        if any(m in cmd for m in markers):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def discard_vm_state(state_dir: Path) -> None:
    """For a stopped server whose state is thrown away: kill its QEMUs (:func:`reap_vms`), remove its
    VMs' short run root from the temp dir (if it has one) and its template RAM from /dev/shm,
    unmounting the frozen-RAM ramfs (see ``VmRuntime.shm_dir``), only if that directory's owner file
    names this state dir. Not part of :func:`stop_server`: a restart on the same state dir adopts the
    running VMs and templates."""
    import contextlib

    from aenv.runtime.vm.frozen import remove_tree
    from aenv.runtime.vm.reconcile import OWNER_FILE
    from aenv.runtime.vm.runtime import run_root_for, shm_dir_for

    reap_vms(state_dir)
    state = Path(state_dir).absolute()
    run_root = run_root_for(state)  # a short dir in the temp dir when the state dir's path is long
    if not run_root.is_relative_to(state):
        import shutil

        shutil.rmtree(run_root, ignore_errors=True)  # its VMs' sockets and run dirs: the VMs are gone
    shm = shm_dir_for(state)
    with contextlib.suppress(OSError):
        if (shm / OWNER_FILE).read_text().strip() == str(state):
            remove_tree(shm)


def discard_lazy_state(state_dir: Path) -> None:
    """For a stopped server whose state is thrown away: unmount its lazy roots and stop its ``aenv-lazyd``
    (both outlive the server on purpose, as its sandboxes do). Only once its sandboxes are gone."""
    from aenv.images.lazy.lazyd import LazyDaemon

    lazy = Path(state_dir) / "lazy"
    if not (lazy / "daemon.pid").exists():
        return
    for root in sorted((lazy / "roots").glob("*")):
        subprocess.run(["umount", str(root)], check=False, capture_output=True)
    LazyDaemon(lazy, 0).stop()


def _stop(server: Server, sig: int) -> None:
    if server.proc.poll() is None:
        try:
            os.killpg(server.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(timeout=10)
