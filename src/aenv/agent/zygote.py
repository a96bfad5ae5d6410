"""The ns zygote: a fork-server that makes sandbox start cost a fork instead of three interpreter starts.

Starting a sandbox the plain way execs the host Python for the launcher, then the bundled Python for the
agent, then again for envd, which imports starlette and uvicorn: ~0.3–0.5 CPU-seconds per sandbox.
The zygote runs the *bundled* interpreter once with all of that already imported and, per request::

    zygote ──fork──> C1: unshare(pid, mnt, uts, ipc, net) ──fork──> C2 (PID 1 of the new pid ns)
                     C1 exits at once; C2 is re-parented to the zygote (a child subreaper), which reaps it.
    C2: aenv.agent.launch.enter(cfg)  (cgroups, overlay root, /dev, pivot_root, caps, setsid, report)
        → paths rewritten to /.aenv → fork envd (in-process, already imported) → agent main loop.

Sandboxes share the zygote's pages copy-on-write, so idle sandboxes also cost less memory. The protocol
is one JSON config line per connection (the launcher's config); the answer is the launcher's report
line. The zygote must stay single-threaded (``unshare(CLONE_NEWPID)`` and ``fork`` require it) and dies
with its parent (the server); running sandboxes survive it, as they survive the server.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import pkgutil
import signal
import socket
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
MAX_CONFIG = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)

# Modules envd and the agent import lazily (inside handlers); importing them here means no sandbox
# ever pays for them.
PRELOAD = (
    "aenv.agent.main", "aenv.agent.launch", "aenv.envd.__main__", "aenv.envd.app",
    "uvicorn", "uvicorn.config", "uvicorn.server", "uvicorn.lifespan.off", "uvicorn.loops.auto",
    "uvicorn.loops.uvloop", "uvicorn.loops.asyncio", "uvicorn.protocols.http.auto",
    "uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.h11_impl", "uvicorn.protocols.websockets.auto",
    "pty", "tty", "termios", "pwd", "grp", "shutil", "tempfile", "gzip", "base64", "hashlib", "hmac",
    "multipart", "python_multipart", "inotify_simple", "uvloop", "httptools",
)


def preload() -> list[str]:
    """Import everything a sandbox will need; returns what could not be imported (for the log)."""
    missing = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    for pkg in ("aenv.envd", "aenv.agent", "aenv.mux"):
        mod = importlib.import_module(pkg)
        for info in pkgutil.iter_modules(mod.__path__, pkg + "."):
            if info.name.endswith((".__main__", ".zygote")):
                continue
            try:
                importlib.import_module(info.name)
            except ImportError:
                missing.append(info.name)
    try:  # uvicorn resolves its protocol/loop classes lazily in Config.load(): do it once here
        import uvicorn

        uvicorn.Config(app=lambda *a: None, lifespan="off", log_config=None).load()
    except Exception:  # noqa: BLE001 - preloading is an optimisation only
        missing.append("uvicorn.Config.load")
    return missing


def _unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def relocate(host_root: str, mount_point: str = "/.aenv") -> None:
    """After pivot_root the bundle is at /.aenv: point the interpreter's paths there, so later imports
    (and the agent's re-exec of envd after a crash) find it."""
    host_root = host_root.rstrip("/")

    def move(p: str) -> str:
        return mount_point + p[len(host_root) :] if p == host_root or p.startswith(host_root + "/") else p

    sys.path[:] = [move(p) for p in sys.path]
    # Packages remember where their submodules live (``__path__``): lazy imports use that, not sys.path.
    for mod in list(sys.modules.values()):
        search = getattr(mod, "__path__", None)
        if isinstance(search, list):
            search[:] = [move(p) for p in search]
    sys.prefix = sys.exec_prefix = sys.base_prefix = sys.base_exec_prefix = mount_point
    sys.executable = move(sys.executable)
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()


def _close_fds_except(keep: set[int]) -> None:
    for fd_name in os.listdir("/proc/self/fd"):
        fd = int(fd_name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def sandbox_main(cfg: dict, conn: socket.socket) -> None:  # type: ignore[type-arg]
    """C2: become the sandbox's PID 1 and run the agent. Never returns."""
    from aenv.agent import launch
    from aenv.agent import main as agent_main

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.dup2(conn.fileno(), 1)  # the launcher reports on stdout: make that our answer to the server
    launch.enter(cfg)  # stdio now points inside the sandbox
    conn.close()
    _close_fds_except(set())
    relocate(cfg["tools"])
    os.environ.clear()
    os.environ.update(cfg.get("env", {}))
    argv = list(cfg["argv"])
    args = argv[argv.index("aenv.agent") + 1 :] if "aenv.agent" in argv else []
    code = agent_main.main(args, envd_by_fork=True)
    os._exit(code)


def handle(conn: socket.socket) -> None:
    """Fork C1 for one launch request; C1 enters the namespaces and forks the sandbox's PID 1."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
        if len(data) > MAX_CONFIG:
            conn.sendall(b'{"error": "config too large"}\n')
            return
    try:
        cfg = json.loads(data)
    except ValueError as exc:
        conn.sendall((json.dumps({"error": f"bad config: {exc}"}) + "\n").encode())
        return
    pid = os.fork()
    if pid != 0:
        return
    # C1
    try:
        _unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWPID)
        if os.fork() == 0:
            try:
                sandbox_main(cfg, conn)
            except BaseException as exc:  # noqa: BLE001 - everything is reported to the server
                try:
                    os.write(1, (json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n").encode())
                finally:
                    os._exit(1)
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001
        try:
            conn.sendall((json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n").encode())
        finally:
            os._exit(1)


def _reap(*_: object) -> None:
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve(path: str, parent: int | None = None) -> None:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(0)  # the server died before the death signal was armed: nobody will ever ask us
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    missing = preload()
    signal.signal(signal.SIGCHLD, _reap)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(128)
    sys.stdout.write(json.dumps({"ready": True, "pid": os.getpid(), "missing": missing}) + "\n")
    sys.stdout.flush()
    while True:
        try:
            conn, _ = listener.accept()
        except InterruptedError:
            continue
        try:
            pid_before = os.getpid()
            handle(conn)
            if os.getpid() != pid_before:  # pragma: no cover - a child must never get here
                os._exit(1)
        finally:
            conn.close()
        _reap()


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="aenv.agent.zygote", description=__doc__)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--parent", type=int, default=None, help="exit at once unless this is still our parent")
    args = ap.parse_args(argv)
    serve(args.socket, args.parent)


if __name__ == "__main__":
    main()
