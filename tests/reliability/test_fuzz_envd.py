"""Hostile input on sandbox traffic: Connect envelopes, multipart ``/files``, routing headers, paths.

Everything goes through the server's proxy to envd inside a real sandbox, exactly as the SDK's traffic
does. Properties:

* no 5xx except the documented proxy answers (``502`` with the E2B body, spec §1.5 rule 4), and the
  sandbox still runs commands afterwards (envd survived);
* ``/files`` never reads or writes outside the sandbox, through ``..`` or through symlinks the
  sandbox itself planted;
* a large upload is streamed: the server's RSS does not grow with the upload size;
* a slow client does not hold up anyone else.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv.testing.server import Server

FUZZ = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
TALLY: dict[str, int] = {}
ENVD = 49983

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def target(shared_server: Server, conn: dict[str, str]) -> Iterator[Sandbox]:
    sbx = Sandbox.create("base", timeout=1800, **conn)
    yield sbx
    print(f"\nmalformed sandbox-traffic requests by kind: {TALLY} (total {sum(TALLY.values())})")
    sbx.kill()


@pytest.fixture(scope="module")
def http(shared_server: Server, target: Sandbox) -> Iterator[httpx.Client]:
    headers = {"E2b-Sandbox-Id": target.sandbox_id, "E2b-Sandbox-Port": str(ENVD),
               "X-Access-Token": target._envd_access_token or ""}  # type: ignore[attr-defined]
    with httpx.Client(base_url=shared_server.url, headers=headers, timeout=60, trust_env=False) as c:
        yield c


def check(resp: httpx.Response, kind: str) -> None:
    """2xx/4xx, or one of the documented 5xx answers; never another.

    Documented: the proxy's ``502`` with the E2B JSON body (spec §1.5 rule 4), and envd's Connect
    ``unimplemented`` (HTTP 501) for the optional protobuf codec (spec §3.3: JSON only)."""
    TALLY[kind] = TALLY.get(kind, 0) + 1
    if resp.status_code == 502:
        body = resp.json()
        assert body.get("code") == 502 and isinstance(body.get("message"), str), body
        return
    if resp.status_code == 501:
        assert resp.json().get("code") == "unimplemented", resp.text
        return
    assert resp.status_code < 500, f"{kind}: {resp.status_code} {resp.text[:300]}"


def alive(sbx: Sandbox) -> None:
    assert sbx.commands.run("echo still-here").stdout.strip() == "still-here"


def envelope(flags: int, payload: bytes, length: int | None = None) -> bytes:
    return struct.pack(">BI", flags & 0xFF, len(payload) if length is None else length) + payload


STREAM_METHODS = ["/process.Process/Start", "/process.Process/Connect", "/filesystem.Filesystem/WatchDir",
                  "/process.Process/StreamInput"]
UNARY_METHODS = ["/process.Process/List", "/process.Process/SendInput", "/process.Process/SendSignal",
                 "/process.Process/CloseStdin", "/process.Process/Update", "/filesystem.Filesystem/Stat",
                 "/filesystem.Filesystem/MakeDir", "/filesystem.Filesystem/ListDir",
                 "/filesystem.Filesystem/CreateWatcher", "/filesystem.Filesystem/GetWatcherEvents",
                 "/filesystem.Filesystem/RemoveWatcher", "/process.Process/Nope", "/nope.Service/X"]
payloads = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={
        "process": st.fixed_dictionaries({}, optional={"cmd": st.sampled_from(["/bin/true", "", "\x00"]) | json_values,
                                                       "args": json_values, "envs": json_values, "cwd": json_values}),
        "process_selector": json_values, "pid": json_values, "tag": json_values, "stdin": json_values,
        "path": json_values, "recursive": json_values, "input": json_values, "signal": json_values,
        "depth": json_values, "watcherId": json_values, "pty": json_values,
    }).map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=300),
)


@FUZZ
@given(method=st.sampled_from(STREAM_METHODS), flags=st.integers(0, 255), payload=payloads,
       length=st.none() | st.integers(0, 2**32 - 1), extra=st.binary(max_size=20),
       ctype=st.sampled_from(["application/connect+json", "application/connect+proto", "application/json",
                              "text/plain", ""]),
       timeout_ms=st.none() | st.text(max_size=8) | st.integers(-5, 10**12).map(str))
def test_connect_stream_envelopes(http: httpx.Client, method: str, flags: int, payload: bytes, length: int | None,
                                  extra: bytes, ctype: str, timeout_ms: str | None) -> None:
    headers = {"Content-Type": ctype, "Connect-Protocol-Version": "1"}
    if timeout_ms is not None and timeout_ms.isascii() and timeout_ms.isprintable():
        headers["Connect-Timeout-Ms"] = timeout_ms
    # A well-formed WatchDir (or a Start of a long process) legitimately streams for ever, so the
    # property is: the response starts promptly with no 5xx; then hang up.
    with http.stream("POST", method, content=envelope(flags, payload, length) + extra, headers=headers,
                     timeout=httpx.Timeout(30, read=15)) as resp:
        if resp.status_code >= 500:
            resp.read()
        check(resp, "stream envelope")


@FUZZ
@given(method=st.sampled_from(UNARY_METHODS), body=payloads,
       ctype=st.sampled_from(["application/json", "application/proto", "application/connect+json", "x/y"]))
def test_connect_unary_bodies(http: httpx.Client, method: str, body: bytes, ctype: str) -> None:
    resp = http.post(method, content=body, headers={"Content-Type": ctype, "Connect-Protocol-Version": "1"})
    check(resp, "unary body")


def test_envd_survived_connect_fuzz(http: httpx.Client, target: Sandbox) -> None:
    alive(target)


part_names = st.sampled_from(["file", "files", "", "file\x00", "x"])
file_names = st.one_of(
    st.sampled_from(["/home/user/fz.txt", "fz.txt", "../../../../tmp/fz.txt", "/", "", ".", "/dev/null",
                     "/home/user/", "a" * 5000, "/proc/self/mem", "/home/user/sub/../fz2.txt"]),
    st.text(max_size=60),
)


def _multipart(boundary: str, parts: list[tuple[str, str | None, bytes]], tail: bytes) -> bytes:
    out = b""
    for name, filename, data in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode("utf-8", "surrogatepass") + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode() + tail


@FUZZ
@given(
    boundary=st.text(st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters='"'), min_size=1,
                     max_size=70),
    parts=st.lists(st.tuples(part_names, st.none() | file_names, st.binary(max_size=200)), max_size=4),
    tail=st.binary(max_size=30), path=st.none() | file_names, username=st.none() | st.sampled_from(["root", "user", "nobody", "x" * 40, ""]),
    declared=st.sampled_from(["same", "other", "missing"]),
)
def test_multipart_files(http: httpx.Client, boundary: str, parts: list[tuple[str, str | None, bytes]], tail: bytes,
                         path: str | None, username: str | None, declared: str) -> None:
    try:
        body = _multipart(boundary, parts, tail)
    except UnicodeEncodeError:
        return
    ctype = {"same": f"multipart/form-data; boundary={boundary}", "other": "multipart/form-data; boundary=zzz",
             "missing": "multipart/form-data"}[declared]
    params = {k: v for k, v in (("path", path), ("username", username)) if v is not None}
    try:
        resp = http.post("/files", params=params, content=body, headers={"Content-Type": ctype})
    except (httpx.InvalidURL, UnicodeEncodeError):
        return  # the client refused the URL (e.g. NUL): nothing reached the server
    check(resp, "multipart")


def test_envd_survived_files_fuzz(target: Sandbox) -> None:
    alive(target)


@FUZZ
@given(sid=st.text(st.characters(min_codepoint=32, max_codepoint=255), min_size=1, max_size=80)
       | st.sampled_from(["..", "a" * 10000]),
       port=st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=12)
       | st.integers(-(2**70), 2**70).map(str),
       path=st.sampled_from(["/health", "/files", "/process.Process/List", "/", "/init", "/%2e%2e/x"]),
       host=st.none() | st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40)
       | st.just("99999999999-abc.localhost"))
def test_routing_header_junk(shared_server: Server, sid: str, port: str, path: str, host: str | None) -> None:
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": port}
    if host is not None:
        headers["Host"] = host
    try:
        resp = httpx.get(shared_server.url + path, headers=headers, trust_env=False, timeout=30)
    except (httpx.LocalProtocolError, UnicodeEncodeError):
        return
    check(resp, "routing headers")


def test_server_still_serves(shared_server: Server, target: Sandbox) -> None:
    assert httpx.get(shared_server.url + "/health", trust_env=False).status_code == 200
    alive(target)


# ---- confinement of /files ---------------------------------------------------------------------
@pytest.fixture
def host_secret(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    secret = secrets.token_hex(16)
    path = tmp_path / f"host-secret-{secrets.token_hex(4)}"
    path.write_text(secret)
    yield path, secret


def test_files_traversal_and_symlinks_confined(http: httpx.Client, target: Sandbox,
                                               host_secret: tuple[Path, str], tmp_path: Path) -> None:
    host_file, secret = host_secret
    rel = str(host_file).lstrip("/")
    # symlinks planted by sandbox root, pointing every way out we can think of
    target.commands.run(
        f"mkdir -p /home/user/esc && ln -sfn / /home/user/esc/root && ln -sfn /proc/1/root /home/user/esc/p1 "
        f"&& ln -sfn ../../../../../../ /home/user/esc/up && ln -sfn /proc/self/cwd /home/user/esc/cwd "
        f"&& ln -sfn /.aenv-run /home/user/esc/run && ln -sfn {host_file} /home/user/esc/direct",
        user="root",
    )
    reads = [str(host_file), f"/../../../../{rel}", f"/home/user/../../../../../{rel}", f"../../../../{rel}",
             f"/home/user/esc/root/{rel}", f"/home/user/esc/p1/{rel}", f"/home/user/esc/up/{rel}",
             f"/home/user/esc/cwd/../../../../{rel}", "/home/user/esc/direct", f"/proc/1/root/{rel}",
             f"/proc/self/root/{rel}", f"/.aenv-run/../{rel}"]
    for p in reads:
        resp = http.get("/files", params={"path": p})
        check(resp, "traversal read")
        assert secret not in resp.text, f"read escaped through {p}"
    # writes aimed at the host's temp dir must land inside the sandbox, or be refused
    name = f"planted-{secrets.token_hex(4)}"
    host_dir = tmp_path
    writes = [str(host_dir / name), f"/../../../{str(host_dir).lstrip('/')}/{name}",
              f"/home/user/esc/root/{str(host_dir).lstrip('/')}/{name}",
              f"/home/user/esc/p1/{str(host_dir).lstrip('/')}/{name}"]
    for p in writes:
        resp = http.post("/files", params={"path": p}, files={"file": ("x", b"planted")})
        check(resp, "traversal write")
    assert not (host_dir / name).exists(), "an upload escaped the sandbox onto the host"
    assert list(host_dir.iterdir()) == [host_file]


# ---- big and slow uploads ----------------------------------------------------------------------
def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _upload_to_devnull(http: httpx.Client, server: Server, mib: int) -> tuple[int, int]:
    """Stream ``mib`` MiB to /dev/null in the sandbox; return (baseline, peak) server RSS in KiB."""
    chunk = b"\0" * (1 << 20)
    peak = base = _rss_kib(server.proc.pid)
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _rss_kib(server.proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        resp = http.post("/files", params={"path": "/dev/null"}, content=(chunk for _ in range(mib)),
                         headers={"Content-Type": "application/octet-stream"}, timeout=600)
    finally:
        stop.set()
        sampler.join()
    check(resp, "big upload")
    assert resp.status_code == 200, resp.text
    return base, peak


@pytest.mark.parametrize("mib", [256, pytest.param(1024, marks=[pytest.mark.slow, pytest.mark.timeout(1800)])])
def test_huge_upload_is_streamed(http: httpx.Client, shared_server: Server, target: Sandbox, mib: int) -> None:
    base, peak = _upload_to_devnull(http, shared_server, mib)
    growth_mib = (peak - base) / 1024
    assert growth_mib < 64, f"server RSS grew {growth_mib:.0f} MiB for a {mib} MiB upload: not streamed"
    alive(target)


def test_slow_client_does_not_block_others(shared_server: Server, target: Sandbox, http: httpx.Client) -> None:
    """A client trickling an upload body (and one that never finishes its headers) holds only its own
    request: health, control-plane calls and commands keep working meanwhile."""
    host, port = shared_server.url.removeprefix("http://").split(":")
    token = target._envd_access_token or ""  # type: ignore[attr-defined]
    slow = socket.create_connection((host, int(port)))
    half = socket.create_connection((host, int(port)))
    try:
        slow.sendall(
            (f"POST /files?path=/home/user/slow.bin HTTP/1.1\r\nHost: {host}\r\nE2b-Sandbox-Id: {target.sandbox_id}\r\n"
             f"E2b-Sandbox-Port: {ENVD}\r\nX-Access-Token: {token}\r\nContent-Type: application/octet-stream\r\n"
             "Content-Length: 1000000\r\n\r\n").encode()
        )
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        for i in range(5):
            slow.sendall(b"x" * 10)
            assert httpx.get(shared_server.url + "/health", trust_env=False, timeout=10).status_code == 200
            assert target.commands.run(f"echo quick-{i}").stdout.strip() == f"quick-{i}"
            assert target.files.read("/etc/hostname") is not None
    finally:
        slow.close()
        half.close()
    alive(target)


def test_upload_to_device_node(http: httpx.Client, target: Sandbox) -> None:
    """Writing to /dev/null works and changes nothing about the node; metadata on it is a clean 400."""
    before = os.stat("/dev/null")
    resp = http.post("/files", params={"path": "/dev/null"}, content=b"discard me",
                     headers={"Content-Type": "application/octet-stream"})
    assert resp.status_code == 200, resp.text
    resp = http.post("/files", params={"path": "/dev/null"}, content=b"x",
                     headers={"Content-Type": "application/octet-stream", "X-Metadata-Owner": "me"})
    check(resp, "metadata on device")
    assert resp.status_code == 400, resp.text
    after = os.stat("/dev/null")
    assert (after.st_uid, after.st_gid, after.st_mode) == (before.st_uid, before.st_gid, before.st_mode)
