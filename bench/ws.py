"""WebSocket echo through the sandbox proxy vs without it: what an RL harness pays per episode (the
connect) and per step (a message round trip) for reaching a server in a sandbox over ``get_host(port)``.

One echo server (``ws_echo_server.py``: the ``websockets`` package, pure Python, shipped in one zip)
runs in a sandbox and, the same zip, on the host. Systems, sampled alternately:

* ``aenv-ns`` / ``aenv-vm``: client → aenv's port (uvicorn, ``E2b-Sandbox-*`` header routing) → the proxy
  → a mux stream → the echo server in the sandbox;
* ``direct (netns)`` (ns only): the same server in the same sandbox, the client's socket opened inside the
  sandbox's network namespace (``setns``), so nothing but the kernel's loopback is between them;
* ``host loopback``: the same server program on the host, over loopback TCP (the floor for the vm runtime,
  whose guest the host cannot reach without the proxy).

Clients are ``websockets``' sync client, compression off on every path (it would run on the proxy's hop
only). The helpers here also start the echo server for the WebSocket integration tests.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.context import Ctx
from bench.rows import alternate, ms_since, row, scenario

PORT = 8765
SERVER = Path(__file__).with_name("ws_echo_server.py")
SANDBOX_PATH = "/tmp/wsecho.pyz"
_CLONE_NEWNET = 0x40000000


def bundle() -> bytes:
    """A runnable zip (``python3 x.pyz PORT``): the echo server as ``__main__`` and the ``websockets``
    package's Python files (its C speedups stay out: they would not import from a zip)."""
    import websockets

    pkg = Path(websockets.__file__).parent
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("__main__.py", SERVER.read_text())
        for path in sorted(pkg.rglob("*.py")):
            z.write(path, f"websockets/{path.relative_to(pkg)}")
    return out.getvalue()


def start_in_sandbox(sbx: Any, port: int = PORT, timeout: float = 60.0) -> Any:
    """Upload and start the echo server in ``sbx`` (an e2b ``Sandbox``) as a background command; returns
    its handle once the server listens."""
    from e2b import CommandExitException

    sbx.files.write(SANDBOX_PATH, bundle())
    log = f"/tmp/wsecho-{port}.log"
    handle = sbx.commands.run(f"python3 {SANDBOX_PATH} {port} > {log} 2>&1", background=True, timeout=0)
    try:
        sbx.commands.run(f"for i in $(seq {int(timeout * 20)}); do grep -q ready {log} 2>/dev/null && exit 0; "
                         f"sleep 0.05; done; cat {log}; exit 1", timeout=timeout + 10)  # fmt: skip
    except CommandExitException as exc:
        raise RuntimeError(f"the echo server did not start in {sbx.sandbox_id}: {exc.stdout[-2000:]}") from None
    return handle


@contextmanager
def on_host(port: int) -> Iterator[int]:
    """The echo server, from the same zip, on the host at ``port``."""
    path = Path(f"/tmp/aenv-bench-wsecho-{os.getpid()}.pyz")
    path.write_bytes(bundle())
    proc = subprocess.Popen([sys.executable, str(path), str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if b"ready" not in line:
            raise RuntimeError(f"the host echo server did not start: {line!r}")
        yield port
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        path.unlink(missing_ok=True)


def netns_socket(state_dir: Path, sandbox_id: str, port: int) -> socket.socket:
    """A TCP connection to ``127.0.0.1:port`` made inside an ns sandbox's network namespace (a thread
    enters it with setns, connects, and leaves; the socket stays in the namespace it was made in)."""
    pid = int(json.loads((state_dir / "sandboxes" / sandbox_id / "ns" / "ns.json").read_text())["pid"])
    libc = ctypes.CDLL(None, use_errno=True)
    result: dict[str, Any] = {}

    def enter_and_connect() -> None:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        try:
            if libc.setns(target, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the sandbox's network namespace")
            try:
                result["sock"] = socket.create_connection(("127.0.0.1", port), timeout=10)
            finally:
                if libc.setns(own, _CLONE_NEWNET) != 0:  # this thread ends next; never leave it astray
                    os._exit(70)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            result["error"] = exc
        finally:
            os.close(own)
            os.close(target)

    t = threading.Thread(target=enter_and_connect)
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    sock: socket.socket = result["sock"]
    sock.settimeout(None)
    return sock


def connector(uri: str, headers: dict[str, str] | None = None,
              sock: Callable[[], socket.socket] | None = None) -> Callable[[], Any]:  # fmt: skip
    """A function that opens one WebSocket connection (the sync client, compression off)."""
    from websockets.sync.client import connect

    def open_one() -> Any:
        extra: dict[str, Any] = {"sock": sock()} if sock is not None else {}
        return connect(uri, additional_headers=headers, proxy=None, compression=None, max_size=None, **extra)

    return open_one


def websocket_echo(ctx: Ctx) -> dict[str, Any]:
    """WebSocket connect and echo round trips (32 B, 64 KiB) through the proxy vs direct."""
    from e2b import Sandbox

    from aenv.testing.server import free_port

    sbx = Sandbox.create("base", timeout=600)
    notes: list[str] = []
    try:
        start_in_sandbox(sbx)
        base = ctx.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        systems = [(ctx.system, connector(f"{base}/", {"E2b-Sandbox-Id": sbx.sandbox_id,
                                                      "E2b-Sandbox-Port": str(PORT)}))]  # fmt: skip
        if ctx.runtime == "ns" and ctx.state_dir is not None:
            state_dir, sid = ctx.state_dir, sbx.sandbox_id
            systems.append(("direct (netns)", connector(f"ws://127.0.0.1:{PORT}/",
                                                        sock=lambda: netns_socket(state_dir, sid, PORT))))
        elif ctx.runtime == "ns":
            notes.append("no direct (netns) row: the sandbox's state dir is unknown (--server without AENV_STATE_DIR)")
        with on_host(free_port()) as host_port:
            systems.append(("host loopback", connector(f"ws://127.0.0.1:{host_port}/")))
            rows = _measure(ctx, systems)
    finally:
        sbx.kill()
    notes.append("WebSocket rows: `aenv-*` = client → aenv's port → proxy → mux → the echo server in the sandbox; "
                 "`direct (netns)` = the same server, the client's socket made in the sandbox's network namespace; "
                 "`host loopback` = the same server program on the host. websockets' sync client, no compression")
    return scenario("WebSocket echo through the proxy vs direct", rows, notes)


def _measure(ctx: Ctx, systems: list[tuple[str, Callable[[], Any]]]) -> list[dict[str, Any]]:
    def connect_once(open_one: Callable[[], Any]) -> Callable[[], float]:
        def once() -> float:
            t0 = time.perf_counter()
            ws = open_one()
            took = ms_since(t0)
            ws.close()
            return took

        return once

    conns = {name: open_one() for name, open_one in systems}
    try:
        for ws in conns.values():  # warm-up
            ws.send("warm")
            ws.recv()
        block = 25

        def echo(name: str, payload: str | bytes) -> Callable[[], list[float]]:
            ws = conns[name]

            def run() -> list[float]:
                out = []
                for _ in range(block):
                    t0 = time.perf_counter()
                    ws.send(payload)
                    got = ws.recv()
                    out.append(ms_since(t0))
                    if len(got) != len(payload):
                        raise RuntimeError(f"{name}: echo of {len(payload)} bytes came back as {len(got)}")
                return out

            return run

        rounds = ctx.n(2, 20, vm=8)
        small = alternate(rounds, [(name, echo(name, "x" * 32)) for name, _ in systems])
        large = alternate(rounds, [(name, echo(name, os.urandom(64 * 1024))) for name, _ in systems])
    finally:
        for ws in conns.values():
            ws.close()
    connects = alternate(ctx.n(5, 50, vm=20), [(name, connect_once(fn)) for name, fn in systems])
    rows = [row("WebSocket connect (handshake)", name, s) for name, s in connects.items()]
    rows += [row("WebSocket echo 32 B", name, [x for b in blocks for x in b]) for name, blocks in small.items()]
    rows += [row("WebSocket echo 64 KiB", name, [x for b in blocks for x in b]) for name, blocks in large.items()]
    return rows
