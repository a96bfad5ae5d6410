"""A stand-in for envd that only answers ``GET /health`` (204) and ``POST /init`` (204).

Used by the agent only when the bundle holds no real envd (``aenv.envd.__main__``), so the runtime
can be brought up and tested while envd is developed separately. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    identity: dict[str, object] = {}  # noqa: RUF012 - one process, one identity

    def _empty(self, code: int) -> None:
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self._empty(204 if self.path == "/health" else 404)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.path == "/init":
            try:
                _Handler.identity = json.loads(body or b"{}")
            except ValueError:
                self._empty(400)
                return
            self._empty(204)
        else:
            self._empty(404)

    def log_message(self, format: str, *args: object) -> None:
        return


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=49983)
    ap.add_argument("--default-user", default="user")
    args = ap.parse_args()
    ThreadingHTTPServer((args.host, args.port), _Handler).serve_forever()


if __name__ == "__main__":
    main()
