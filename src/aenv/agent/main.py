"""``python -m aenv.agent``: PID 1 of a sandbox.

    python -m aenv.agent --channel unix-listen:/.aenv-run/mux.sock      (ns)
    python -m aenv.agent --channel serial:/dev/vport0p1                 (vm)

Starts and supervises envd, reaps zombies, optionally runs the template's start command once, and
serves the mux channel until killed. It never exits on its own: as PID 1 its exit would end the
sandbox.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from aenv.agent.channel import ENVD_PORT, ENVD_SOCKET, make_local_connector, serve
from aenv.agent.supervisor import Reaper, Supervised, spawn
from aenv.envd import mergeable

log = logging.getLogger("aenv.agent")

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LOADER = "ld-linux-x86-64.so.2"
# While the start command comes up, connections to any port wait for it instead of failing.
START_CMD_GRACE = 30.0


def python_argv() -> list[str]:
    """How to start this same interpreter again. Inside the bundle that means going through the
    bundled loader (the image may have no libc at all); elsewhere (tests on the host) plain
    ``sys.executable``."""
    prefix = Path(sys.prefix)
    loader = prefix / "lib" / LOADER
    if loader.exists():
        return [str(loader), "--inhibit-cache", "--library-path", str(prefix / "lib"), sys.executable, "-I"]
    return [sys.executable, "-I"]


def envd_module() -> str:
    """The real envd when the bundle has it, else the health/init-only stand-in."""
    import aenv

    if (Path(aenv.__file__).parent / "envd" / "__main__.py").exists() or "aenv.envd.__main__" in sys.modules:
        return "aenv.envd"
    return "aenv.agent.fallback_envd"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="aenv.agent", description=__doc__)
    ap.add_argument("--channel", required=True, help="unix-listen:PATH or serial:PATH")
    ap.add_argument("--envd-port", type=int, default=ENVD_PORT)
    ap.add_argument("--default-user", default="user")
    ap.add_argument("--env-json", default="{}", help="template environment (JSON object) for envd")
    ap.add_argument("--start-cmd", default=None, help="run once with /bin/sh -c after envd starts")
    ap.add_argument("--start-user", default="", help="the start command's user (default: root)")
    ap.add_argument("--start-cwd", default="", help="the start command's directory (default: /)")
    ap.add_argument("--log", default="/dev/null", help="file for agent and envd logs")
    ap.add_argument("--no-envd", action="store_true", help="do not start envd (tests)")
    ap.add_argument("--checkpointable", action="store_true", help="keep every process CRIU-dumpable (no io_uring)")
    ap.add_argument("--mergeable", action="store_true",
                    help="KSM may merge the pages of this process and of every process of the sandbox")
    ap.add_argument("--merge-idle", type=float, default=0.0, metavar="S",
                    help="with --mergeable: only once a process has been idle S seconds (envd: after /init)")
    return ap.parse_args(argv)


def child_env(template_env: dict[str, str], checkpointable: bool = False) -> dict[str, str]:
    """``checkpointable`` (ns with CRIU): libuv (node's loop) uses io_uring when it may, which CRIU
    cannot dump; UV_USE_IO_URING=0 keeps such processes dumpable, and envd then runs on asyncio's
    loop (uvloop's libuv opens a ring whatever the variable says). A template may still set it."""
    env = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
    if checkpointable:
        env["UV_USE_IO_URING"] = "0"
    env.update({str(k): str(v) for k, v in template_env.items()})
    return env


def envd_args(args: argparse.Namespace) -> list[str]:
    argv = ["--host", "127.0.0.1", "--port", str(args.envd_port), "--default-user", args.default_user]
    kind, _, path = args.channel.partition(":")
    if kind == "unix-listen" and envd_module() == "aenv.envd":
        # Beside the mux socket: the ns host reaches envd there without the agent's relay.
        argv += ["--uds", os.path.join(os.path.dirname(path), ENVD_SOCKET)]
    if args.mergeable and envd_module() == "aenv.envd":
        # envd marks itself (once idle) and again after a restore, on /init
        argv += ["--mergeable", "--merge-idle", str(args.merge_idle)]
    return argv


def fork_envd(args: argparse.Namespace, env: dict[str, str]) -> int:
    """Start envd as a fork of this (zygote-born, already imported) process: no exec, no imports.
    Must run before the event loop exists. Restarts after a crash use the normal exec path."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setsid()
        null = os.open("/dev/null", os.O_RDONLY)
        out = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.environ.clear()
        os.environ.update(env)
        from aenv.envd.__main__ import main as envd_main

        envd_main(envd_args(args))
    except BaseException:  # noqa: BLE001 - the log is the only place a forked envd can report to
        import traceback

        traceback.print_exc()
    finally:
        os._exit(1)


async def amain(args: argparse.Namespace, envd_pid: int | None = None) -> None:
    loop = asyncio.get_running_loop()
    reaper = Reaper(loop)
    reaper.install()
    env = child_env(json.loads(args.env_json), args.checkpointable)
    if not args.no_envd:
        argv = [*python_argv(), "-m", envd_module(), *envd_args(args)]
        reaper.supervise(Supervised("envd", argv, env, stdout=args.log), running_pid=envd_pid)
    grace_until = 0.0
    if args.start_cmd:
        shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        argv = [shell, "-c", args.start_cmd]
        if args.start_user or args.start_cwd:
            argv = [*python_argv(), "-m", "aenv.agent.as_user", args.start_user, args.start_cwd, *argv]
        try:
            spawn(argv, env, stdout=args.log)
            grace_until = time.monotonic() + START_CMD_GRACE
        except OSError as exc:
            log.error("start command failed to spawn: %s", exc)
    accept = make_local_connector(frozenset({args.envd_port}), any_port_until=grace_until)
    await serve(args.channel, accept, on_session=mergeable.rearm)


_INHERITED_IGNORES = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT)


def restore_default_signals() -> list[int]:
    """Undo ignored dispositions inherited from whoever started the server (``nohup`` ignores
    SIGHUP, a shell's ``cmd &`` ignores SIGINT and SIGQUIT). Ignores survive exec, so without this
    every process in the sandbox would start with them: Ctrl-C or a hang-up would do nothing.
    Returns the signals reset."""
    reset = []
    for sig in _INHERITED_IGNORES:
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
            reset.append(int(sig))
    return reset


def main(argv: list[str] | None = None, *, envd_by_fork: bool = False) -> int:
    """``envd_by_fork``: the zygote path, where envd is forked from this already-imported process."""
    restore_default_signals()
    args = parse_args(argv)
    if args.mergeable:
        mergeable.enable(args.merge_idle)  # with no idle wait before envd is forked or spawned: it inherits the mark
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s agent %(levelname)s %(message)s",
        stream=open(args.log, "a", buffering=1) if args.log != "/dev/null" else sys.stderr,  # noqa: SIM115
    )
    envd_pid = None
    if envd_by_fork and not args.no_envd:
        envd_pid = fork_envd(args, child_env(json.loads(args.env_json), args.checkpointable))
    try:
        asyncio.run(amain(args, envd_pid))
    except KeyboardInterrupt:
        return 130
    return 0
