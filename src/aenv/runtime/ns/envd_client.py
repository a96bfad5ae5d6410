"""Just enough HTTP/1.1 to talk to envd over a mux stream during start-up (``/health``, ``/init``).

The runtime must not depend on the server's HTTP stack (it knows nothing about HTTP by design), and
these two requests are tiny: one request per stream with ``Connection: close``, read to EOF (or, for
the ns hand-out's ``/init``, until the answer is complete: ``Content-Length``, a bodiless status or the
end of a chunked body), parse the status line. Reads are bounded.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Protocol

ENVD_PORT = 49983
_MAX_RESPONSE = 1 << 20


class _Stream(Protocol):
    async def read(self, n: int = ...) -> bytes: ...
    async def write(self, data: bytes) -> None: ...
    async def write_eof(self) -> None: ...
    async def aclose(self) -> None: ...


class EnvdError(RuntimeError):
    def __init__(self, message: str, status: int | None = None, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.body = body[:512]


CONNECT_JSON = "application/connect+json"


def build_request(method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                  content_type: str = "application/json") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", "Connection: close"]
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    if body is not None:
        lines.append(f"Content-Type: {content_type}")
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def parse_status(raw: bytes) -> tuple[int, bytes]:
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise EnvdError("incomplete HTTP response", body=raw)
    status_line = head.split(b"\r\n", 1)[0].split()
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/"):
        raise EnvdError("malformed HTTP status line", body=raw)
    return int(status_line[1]), body


async def send_request(stream: _Stream, method: str, path: str, payload: Any = None,
                       headers: dict[str, str] | None = None) -> None:
    """Write one request; :func:`read_response` collects the answer (callers overlap work between)."""
    body = None if payload is None else json.dumps(payload).encode()
    await stream.write(build_request(method, path, body, headers))


def response_complete(raw: bytes) -> bool:
    """Whether ``raw`` holds a whole HTTP/1.1 response (False when only EOF can tell)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    lines = head.split(b"\r\n")
    status = lines[0].split()
    if len(status) >= 2 and status[1] in (b"204", b"304"):
        return True
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            try:
                return len(body) >= int(value.strip())
            except ValueError:
                return False
        if name == b"transfer-encoding" and b"chunked" in value.lower():
            return body.endswith(b"0\r\n\r\n")
    return False


async def read_response(stream: _Stream, *, to_eof: bool = False) -> tuple[int, bytes]:
    """Read one answer, then close the stream (envd closes its side itself: ``Connection: close``).

    By default the read stops at a complete answer: the ns hand-out's ``/init`` (on a direct envd
    connection) does not wait for envd's close. ``to_eof`` waits for it, so no frame of this stream
    is still on its way when the call returns: over the vm runtime's serial mux, a guest's late
    frames for an early-closed stream were seen to stall the next session after a pause/resume."""
    try:
        raw = b""
        while chunk := await stream.read(65536):
            raw += chunk
            if len(raw) > _MAX_RESPONSE:
                raise EnvdError("response too large")
            if not to_eof and response_complete(raw):
                break
    finally:
        await stream.aclose()
    return parse_status(raw)


async def request(stream: _Stream, method: str, path: str, payload: Any = None,
                  headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        await send_request(stream, method, path, payload, headers)
    except BaseException:
        await stream.aclose()
        raise
    return await read_response(stream, to_eof=True)


def as_user(user: str) -> dict[str, str]:
    """The header by which the SDK names the user a call runs as (Basic auth, empty password)."""
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


def process_body(cmd: str, args: list[str]) -> bytes:
    """The Connect envelope (flags 0, 4-byte length) of ``Process.Start`` of ``cmd args``."""
    msg = json.dumps({"process": {"cmd": cmd, "args": args}}).encode()
    return len(msg).to_bytes(5, "big") + msg


def first_call_body() -> bytes:
    """The Connect envelope of ``Process.Start`` of ``bash -l -c true``: the SDK's first call."""
    return process_body("/bin/bash", ["-l", "-c", "true"])


def dechunk(body: bytes) -> bytes:
    """The payload of a ``Transfer-Encoding: chunked`` body (what arrived of it)."""
    out = bytearray()
    while body:
        size_line, sep, rest = body.partition(b"\r\n")
        if not sep:
            break
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return bytes(out)


async def run_process(stream: _Stream, cmd: str, args: list[str], user: str = "root") -> int | None:
    """Run ``cmd args`` through envd's ``Process.Start`` on ``stream`` and wait for its end: the
    exit code, or None if the answer had no end event (envd refused or the stream broke)."""
    request = build_request("POST", "/process.Process/Start", process_body(cmd, args), as_user(user), CONNECT_JSON)
    try:
        await stream.write(request)
        raw = b""
        while len(raw) <= _MAX_RESPONSE and (chunk := await stream.read(65536)):
            raw += chunk
    finally:
        await stream.aclose()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    if len(lines[0].split()) < 2 or lines[0].split()[1] != b"200":
        return None
    chunked = any(
        ln.lower().startswith(b"transfer-encoding:") and b"chunked" in ln.lower() for ln in lines[1:]
    )
    return exit_code(dechunk(body) if chunked else body)


def exit_code(stream_body: bytes) -> int | None:
    """The exit code in a ``Process.Start`` answer (its Connect envelopes, de-chunked), or None
    when the process's end event is not in it."""
    code = None
    pos = 0
    while pos + 5 <= len(stream_body):
        size = int.from_bytes(stream_body[pos + 1 : pos + 5], "big")
        chunk = stream_body[pos + 5 : pos + 5 + size]
        pos += 5 + size
        try:
            end = json.loads(chunk or b"{}").get("event", {}).get("end")
        except (ValueError, AttributeError):
            return None
        if isinstance(end, dict):
            code = int(end.get("exitCode", 0))
    return code


def warm_up_request(user: str = "user") -> bytes:
    """The SDK's first call in every sandbox, as ``user``. A pool runs it once per entry before
    hand-out: the first spawn in a fresh envd pays for lazy imports, page-cache and dynamic-linker
    misses (~3 ms), which then no client sees."""
    return build_request("POST", "/process.Process/Start", first_call_body(), as_user(user), CONNECT_JSON)


def init_payload(*, sandbox_id: str, template_id: str, env_vars: dict[str, str], access_token: str | None,
                 default_user: str | None, default_workdir: str | None) -> dict[str, Any]:
    return {
        "envVars": env_vars,
        "accessToken": access_token,
        "defaultUser": default_user,
        "defaultWorkdir": default_workdir,
        "sandboxId": sandbox_id,
        "templateId": template_id,
    }
