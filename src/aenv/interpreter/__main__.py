"""``python3 -m aenv_interpreter``: the template's start command.

Started by the sandbox agent as root; it drops to ``--user`` (the sandbox's default user, so files written
by code and by ``sbx.files`` have one owner), starts the default python kernel in the background, and
serves until SIGTERM, when it shuts every kernel down before exiting.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import pwd
import signal
import sys

from . import DEFAULT_CWD, DEFAULT_PORT, ENVD_PORT
from .httpserver import HttpServer
from .registry import Registry
from .service import KEEPALIVE_INTERVAL, Service

log = logging.getLogger("aenv_interpreter")
WARM_UP_TIMEOUT = 120.0  # the default kernel, before the port opens; past it the port opens anyway


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="aenv_interpreter", description=__doc__)
    ap.add_argument("--host", default="127.0.0.1", help="bind address [%(default)s]")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help="port [%(default)s]")
    ap.add_argument("--envd-port", type=int, default=ENVD_PORT, help="envd port for GET /envs [%(default)s]")
    ap.add_argument("--user", default="user", help="drop to this user when started as root [%(default)s]")
    ap.add_argument("--cwd", default=DEFAULT_CWD, help="default context directory [%(default)s]")
    ap.add_argument(
        "--keepalive", type=float, default=KEEPALIVE_INTERVAL, help="seconds between keepalive lines"
    )
    ap.add_argument("--no-warm-up", action="store_true", help="start the default kernel on first use only")
    ap.add_argument("--log", default=None, help="log file [stderr]")
    return ap.parse_args(argv)


def drop_privileges(user: str) -> None:
    """Become ``user`` (uid, gid, supplementary groups, HOME…) if we are root; otherwise do nothing."""
    if os.geteuid() != 0:
        return
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        log.warning("user %r does not exist; staying root", user)
        return
    os.initgroups(pw.pw_name, pw.pw_gid)
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    os.environ.update(
        {"HOME": pw.pw_dir, "USER": pw.pw_name, "LOGNAME": pw.pw_name, "SHELL": pw.pw_shell or "/bin/sh"}
    )


async def amain(args: argparse.Namespace) -> None:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    cwd = args.cwd if os.path.isdir(args.cwd) else os.environ.get("HOME", "/")
    service = Service(Registry(env, cwd), envd_port=args.envd_port, keepalive=args.keepalive)
    server = HttpServer(service, args.host, args.port)
    if not args.no_warm_up:  # the default context exists before the port opens (what readiness probes)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(service.warm_up(), WARM_UP_TIMEOUT)
    await server.start()
    log.info("listening on %s:%d", args.host, server.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = asyncio.create_task(server.serve_forever())
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        serving.cancel()
        await server.aclose()
        await service.aclose()
        with contextlib.suppress(BaseException):
            await serving


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    handler: logging.Handler = (
        logging.FileHandler(args.log) if args.log else logging.StreamHandler(sys.stderr)
    )
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", handlers=[handler]
    )
    drop_privileges(args.user)
    asyncio.run(amain(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
