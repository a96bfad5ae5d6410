"""``python -m aenv.envd --host 127.0.0.1 --port 49983 [--default-user user]``."""

from __future__ import annotations

import argparse
import logging

from aenv.envd import ENVD_VERSION


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="aenv.envd", description=f"E2B-compatible envd {ENVD_VERSION}")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=49983)
    parser.add_argument(
        "--default-user", default="user", help="user for requests that name none (root if absent)"
    )
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import uvicorn

    from aenv.envd.app import build_app
    from aenv.envd.identity import SandboxState

    app = build_app(SandboxState(default_user=args.default_user))
    uvicorn.run(
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
    )


if __name__ == "__main__":
    main()
