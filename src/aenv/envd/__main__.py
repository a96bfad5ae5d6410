"""``python -m aenv.envd --host 127.0.0.1 --port 49983 [--uds PATH] [--default-user user]``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
from typing import Any

from aenv.envd import ENVD_VERSION


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="aenv.envd", description=f"E2B-compatible envd {ENVD_VERSION}")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=49983)
    parser.add_argument(
        "--default-user", default="user", help="user for requests that name none (root if absent)"
    )
    parser.add_argument(
        "--uds",
        default=None,
        help="also serve on this unix socket: the ns host connects to it directly, one connection per "
        "request stream, instead of through the agent's mux relay (one process hop less each way)",
    )
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--mergeable", action="store_true",
                        help="KSM may merge this process's pages and those of the processes it starts")
    parser.add_argument("--merge-idle", type=float, default=0.0, metavar="S",
                        help="with --mergeable: only once no request came for S seconds after /init")
    args = parser.parse_args(argv)
    if args.mergeable:
        from aenv.envd import mergeable

        mergeable.enable(args.merge_idle)

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import uvicorn

    from aenv.envd.app import build_app
    from aenv.envd.identity import SandboxState

    app = build_app(SandboxState(default_user=args.default_user))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        workers=1,
        lifespan="off",
        access_log=False,
        server_header=False,
        date_header=False,
        log_level=args.log_level,
        timeout_keep_alive=330,  # longer than the SDK pool's 300 s keep-alive expiry
        # A sandbox that must stay CRIU-dumpable asks for no io_uring; uvloop's libuv opens one anyway.
        loop="asyncio" if os.environ.get("UV_USE_IO_URING") == "0" else "auto",
    )
    sockets = [config.bind_socket()]
    if args.uds:
        sockets.append(bind_unix(args.uds))
    quiet_server(config).run(sockets=sockets)


TICK_S = 1.0  # how often an idle envd wakes up (uvicorn's own loop: every 0.1 s)


def quiet_server(config: Any) -> Any:
    """A uvicorn server whose main loop wakes once a second instead of ten times.

    uvicorn polls ``should_exit`` (set by its signal handlers) every 0.1 s. In one sandbox that is
    nothing; in a thousand idle ones on a node it is ten thousand Python wake-ups a second, a good part
    of a core spent by sandboxes doing nothing. Its tick's once-a-second work (default headers,
    notify callbacks) runs on every tick here, and a SIGTERM is noticed within ``TICK_S``.
    """
    import asyncio

    import uvicorn

    class QuietServer(uvicorn.Server):
        async def main_loop(self) -> None:
            counter = 0
            should_exit = await self.on_tick(counter)
            while not should_exit:
                counter = (counter + 10) % 864000  # a multiple of 10: uvicorn's per-second work each tick
                await asyncio.sleep(TICK_S)
                should_exit = await self.on_tick(counter)

    return QuietServer(config)


def bind_unix(path: str) -> socket.socket:
    """A listening unix socket at ``path`` (a stale one from an earlier envd is replaced), owner-only."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(256)
    return sock

if __name__ == "__main__":
    main()
