"""Just enough HTTP/1.1 to talk to envd over a runtime's stream, for both runtimes: start-up
(``/health``, ``/init``), the pool warm-ups and a template's ready command.

The runtime must not depend on the server's HTTP stack (it knows nothing about HTTP by design), and
these requests are tiny: one request per stream with ``Connection: close``, read to EOF (or, for
the ns hand-out's ``/init``, until the answer is complete: ``Content-Length``, a bodiless status or the
end of a chunked body). One builder (:func:`build_request`), one parser (:func:`parse_response`),
one bounded reader; :func:`init_payload` is the ``/init`` body both runtimes send.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aenv.envd.trust import ENV as CA_ENV
from aenv.runtime.egress import ENFORCER

if TYPE_CHECKING:
    from aenv.runtime.base import SandboxSpec

ENVD_PORT = 49983  # envd's port inside every sandbox (the in-sandbox side has its own copy)
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


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str] = field(default_factory=dict)  # names lower-case; the last of a repeated one
    body: bytes = b""


def build_request(method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                  content_type: str = "application/json") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", "Connection: close"]
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    if body is not None:
        lines.append(f"Content-Type: {content_type}")
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def _split(raw: bytes) -> tuple[list[bytes], dict[str, str], bytes] | None:
    """(status line words, headers, body so far), or None while the head is incomplete."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.split(b"\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return lines[0].split(), headers, body


def parse_response(raw: bytes) -> Response:
    parts = _split(raw)
    if parts is None:
        raise EnvdError("incomplete HTTP response", body=raw)
    status_line, headers, body = parts
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/"):
        raise EnvdError("malformed HTTP status line", body=raw)
    return Response(int(status_line[1]), headers, body)


async def send_request(stream: _Stream, method: str, path: str, payload: Any = None,
                       headers: dict[str, str] | None = None) -> None:
    """Write one request; :func:`read_response` collects the answer (callers overlap work between)."""
    body = None if payload is None else json.dumps(payload).encode()
    await stream.write(build_request(method, path, body, headers))


def response_complete(raw: bytes) -> bool:
    """Whether ``raw`` holds a whole HTTP/1.1 response (False when only EOF can tell)."""
    parts = _split(raw)
    if parts is None:
        return False
    status_line, headers, body = parts
    if len(status_line) >= 2 and status_line[1] in (b"204", b"304"):
        return True
    if "content-length" in headers:
        try:
            return len(body) >= int(headers["content-length"])
        except ValueError:
            return False
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return body.endswith(b"0\r\n\r\n")
    return False


async def _read(stream: _Stream, *, to_eof: bool, limit: int = _MAX_RESPONSE) -> bytes:
    """The answer's bytes (at most ``limit``), then the stream is closed."""
    try:
        raw = bytearray()
        while chunk := await stream.read(65536):
            raw += chunk
            if len(raw) > limit:
                raise EnvdError("response too large")
            if not to_eof and response_complete(bytes(raw)):
                break
    finally:
        await stream.aclose()
    return bytes(raw)


async def read_response(stream: _Stream, *, to_eof: bool = False) -> tuple[int, bytes]:
    """Read one answer, then close the stream (envd closes its side itself: ``Connection: close``).

    By default the read stops at a complete answer: the ns hand-out's ``/init`` (on a direct envd
    connection) does not wait for envd's close. ``to_eof`` waits for it, so no frame of this stream
    is still on its way when the call returns: over the vm runtime's serial mux, a guest's late
    frames for an early-closed stream were seen to stall the next session after a pause/resume."""
    response = parse_response(await _read(stream, to_eof=to_eof))
    return response.status, response.body


async def exchange(stream: _Stream, raw_request: bytes, limit: int = _MAX_RESPONSE) -> Response:
    """Write one built request (:func:`build_request`), read its answer to EOF, close the stream."""
    try:
        await stream.write(raw_request)
    except BaseException:
        await stream.aclose()
        raise
    return parse_response(await _read(stream, to_eof=True, limit=limit))


async def request(stream: _Stream, method: str, path: str, payload: Any = None,
                  headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One JSON request (``payload``: any JSON value, None for none): (status, body)."""
    body = None if payload is None else json.dumps(payload).encode()
    response = await exchange(stream, build_request(method, path, body, headers))
    return response.status, response.body


def as_user(user: str) -> dict[str, str]:
    """The header by which the SDK names the user a call runs as (Basic auth, empty password)."""
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


def process_body(cmd: str, args: list[str], envs: dict[str, str] | None = None, cwd: str | None = None) -> bytes:
    """The Connect envelope (flags 0, 4-byte length) of ``Process.Start`` of ``cmd args``."""
    process: dict[str, Any] = {"cmd": cmd, "args": args}
    if envs:
        process["envs"] = envs
    if cwd:
        process["cwd"] = cwd
    msg = json.dumps({"process": process}).encode()
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


async def run_process(stream: _Stream, cmd: str, args: list[str], user: str = "root",
                      token: str | None = None) -> int | None:
    """Run ``cmd args`` through envd's ``Process.Start`` on ``stream`` and wait for its end: the
    exit code, or None if the answer had no end event (envd refused or the stream broke).
    ``token``: the sandbox's envd access token, once ``/init`` has set one."""
    headers = as_user(user) | ({"X-Access-Token": token} if token else {})
    raw_request = build_request("POST", "/process.Process/Start", process_body(cmd, args), headers, CONNECT_JSON)
    try:
        response = await exchange(stream, raw_request)
    except EnvdError:
        return None
    if response.status != 200:
        return None
    chunked = "chunked" in response.headers.get("transfer-encoding", "").lower()
    return exit_code(dechunk(response.body) if chunked else response.body)


async def until_ready(open_stream: Callable[[], Awaitable[_Stream]], ready_cmd: str, timeout: float,
                      interval: float, token: str | None = None) -> None:
    """Run a template's ready command (``/bin/sh -c``, as root) until it exits 0: what E2B promises of a
    sandbox whose template has one. ``TimeoutError`` past ``timeout`` s."""
    async with asyncio.timeout(timeout):
        while await run_process(await open_stream(), "/bin/sh", ["-c", ready_cmd], token=token) != 0:
            await asyncio.sleep(interval)


@dataclass(frozen=True)
class CommandResult:
    exit_code: int | None  # None: no end event (envd refused, or the stream broke)
    stdout: bytes
    stderr: bytes
    error: str = ""  # envd's end-of-stream error, if any: "unauthenticated: invalid username: 'x'"


async def run_command(stream: _Stream, cmd: str, *, user: str = "root", envs: dict[str, str] | None = None,
                      cwd: str | None = None, limit: int = 64 << 20, token: str | None = None) -> CommandResult:
    """``/bin/sh -c cmd`` through envd as ``user`` with ``envs`` in ``cwd``; waits for its end and
    returns its output (a template build step; ``limit`` bounds the whole answer). ``token``: the
    sandbox's envd access token, once ``/init`` has set one."""
    headers = as_user(user) | ({"X-Access-Token": token} if token else {})
    raw_request = build_request("POST", "/process.Process/Start", process_body("/bin/sh", ["-c", cmd], envs, cwd),
                                headers, CONNECT_JSON)
    response = await exchange(stream, raw_request, limit=limit)
    if response.status != 200:
        return CommandResult(None, b"", b"", f"envd answered {response.status}: {response.body[:300]!r}")
    chunked = "chunked" in response.headers.get("transfer-encoding", "").lower()
    return _command_result(dechunk(response.body) if chunked else response.body)


def _command_result(stream_body: bytes) -> CommandResult:
    code: int | None = None
    out, err, error = bytearray(), bytearray(), ""
    for flags, msg in _envelopes(stream_body):
        if flags & 0x02:  # end of stream: an error, if any, as Connect prints one ("code: message")
            e = msg.get("error") or {}
            error = ": ".join(str(part) for part in (e.get("code"), e.get("message")) if part)
            continue
        event = msg.get("event") or {}
        data = event.get("data") or {}
        out += base64.b64decode(data.get("stdout") or "")
        err += base64.b64decode(data.get("stderr") or "")
        end = event.get("end")
        if isinstance(end, dict):
            code = int(end.get("exitCode", 0) or 0)
    return CommandResult(code, bytes(out), bytes(err), error)


def _envelopes(stream_body: bytes) -> list[tuple[int, dict[str, Any]]]:
    out: list[tuple[int, dict[str, Any]]] = []
    pos = 0
    while pos + 5 <= len(stream_body):
        flags, size = stream_body[pos], int.from_bytes(stream_body[pos + 1 : pos + 5], "big")
        try:
            msg = json.loads(stream_body[pos + 5 : pos + 5 + size] or b"{}")
        except ValueError:
            break
        out.append((flags, msg if isinstance(msg, dict) else {}))
        pos += 5 + size
    return out


async def upload(stream: _Stream, path: str, data: bytes, user: str = "root", token: str | None = None) -> None:
    """Write ``data`` to ``path`` in the sandbox through envd's ``/files`` (octet-stream upload);
    ``token``: the sandbox's envd access token, if it has one."""
    from urllib.parse import quote

    headers = as_user(user) | ({"X-Access-Token": token} if token else {})
    raw_request = build_request("POST", f"/files?path={quote(path)}&username={quote(user)}", data,
                                headers, "application/octet-stream")
    response = await exchange(stream, raw_request)
    if not 200 <= response.status < 300:
        raise EnvdError(f"upload to {path} failed: envd answered {response.status}", response.status, response.body)


async def upload_stream(stream: _Stream, path: str, size: int, chunks: AsyncIterator[bytes], user: str = "root",
                        token: str | None = None) -> None:
    """Write ``size`` bytes from ``chunks`` to ``path`` in the sandbox through envd's ``/files``, without
    holding them in memory (an image archive of hundreds of MB). The stream is closed either way."""
    from urllib.parse import quote

    headers = as_user(user) | ({"X-Access-Token": token} if token else {}) | {
        "Content-Type": "application/octet-stream", "Content-Length": str(size)}
    sent = 0
    try:
        await stream.write(build_request("POST", f"/files?path={quote(path)}&username={quote(user)}", None, headers))
        async for chunk in chunks:
            sent += len(chunk)
            if sent > size:
                raise EnvdError(f"upload to {path}: more than the {size} bytes announced")
            await stream.write(chunk)
    except BaseException:
        await stream.aclose()
        raise
    if sent != size:
        await stream.aclose()
        raise EnvdError(f"upload to {path}: {sent} of the {size} bytes announced")
    response = parse_response(await _read(stream, to_eof=True))
    if not 200 <= response.status < 300:
        raise EnvdError(f"upload to {path} failed: envd answered {response.status}", response.status, response.body)


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


def init_payload(spec: SandboxSpec) -> dict[str, Any]:
    """The ``POST /init`` body that gives envd a sandbox's identity: ID, template, env vars, access
    token, default user and directory (the vm runtime adds host facts and limits to it)."""
    payload: dict[str, Any] = {
        "envVars": dict(spec.env_vars),
        "accessToken": spec.access_token,
        "defaultUser": spec.template.user or None,
        "defaultWorkdir": spec.template.workdir,
        "sandboxId": spec.sandbox_id,
        "templateId": spec.template.template_id,
    }
    return payload | egress_trust(spec.sandbox_id, spec.env_vars)


def egress_trust(sandbox_id: str, env_vars: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``/init`` fields that make the sandbox trust its egress CA (``envd/trust.py``), where its
    policy has header rules: the certificate, and the variables that point clients with bundles of
    their own at it (the sandbox's own envVars win). Empty otherwise."""
    pem = ENFORCER.ca_pem(sandbox_id)
    if pem is None:
        return {}
    return {"aenvEgressCa": pem.decode(), "envVars": {**CA_ENV, **(env_vars or {})}}
