"""envd driven by the real e2b SDK (sync and async) in debug mode.

With ``E2B_DEBUG=true`` the SDK makes no control-plane calls and talks to envd
at ``http://localhost:49983``, so this module runs our envd there as a
subprocess and exercises the SDK surface end to end.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import pwd
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

PORT = 49983
BASE = f"http://127.0.0.1:{PORT}"
_ENV = {
    "E2B_DEBUG": "true",
    # A server fixture elsewhere in the session may have set these; debug mode must not follow them.
    "E2B_SANDBOX_URL": BASE,
    "E2B_API_URL": "http://127.0.0.1:1",
    "E2B_API_KEY": "e2b_" + "0" * 40,
    "NO_PROXY": "localhost,127.0.0.1",
    "no_proxy": "localhost,127.0.0.1",
}


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _default_user() -> str:
    try:
        pwd.getpwnam("user")
        return "user"
    except KeyError:
        return "root"


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy (fails the test otherwise)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail("condition not reached")
        time.sleep(interval)


@pytest.fixture(scope="module")
def envd() -> Iterator[subprocess.Popen[bytes]]:
    if os.geteuid() != 0:
        pytest.skip("envd integration tests run as root")
    if _port_busy(PORT):
        pytest.skip(f"port {PORT} is busy")
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(_ENV)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aenv.envd",
            "--host",
            "127.0.0.1",
            "--port",
            str(PORT),
            "--default-user",
            _default_user(),
        ],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 20
        while not _port_busy(PORT):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("envd did not start")
            time.sleep(0.05)
        yield proc
    finally:
        proc.kill()
        proc.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def sbx(envd: subprocess.Popen[bytes]) -> Any:
    from e2b import Sandbox

    return Sandbox.create()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


# --------------------------------------------------------------------------- commands


def test_run_captures_stdout_stderr_and_exit_code(sbx: Any) -> None:
    result = sbx.commands.run("echo out; echo err >&2")
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert result.exit_code == 0
    assert result.error is None


def test_nonzero_exit_raises_with_status(sbx: Any) -> None:
    from e2b import CommandExitException

    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("echo partial; exit 3")
    assert info.value.exit_code == 3
    assert info.value.error == "exit status 3"
    assert info.value.stdout == "partial\n"


def test_envs_cwd_user_and_sandbox_env(sbx: Any, workdir: Path) -> None:
    result = sbx.commands.run(
        'echo "$FOO|$E2B_SANDBOX|$USER|$HOME"; pwd; id -un',
        envs={"FOO": "bar baz"},
        cwd=str(workdir),
        user="root",
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "bar baz|true|root|/root"
    assert lines[1] == str(workdir)
    assert lines[2] == "root"


def test_missing_cwd_is_invalid_argument(sbx: Any) -> None:
    from e2b import InvalidArgumentException

    with pytest.raises(InvalidArgumentException, match="does not exist"):
        sbx.commands.run("true", cwd="/definitely/not/here")


def test_unknown_user_is_authentication_error(sbx: Any) -> None:
    from e2b import AuthenticationException

    with pytest.raises(AuthenticationException, match="invalid username"):
        sbx.commands.run("true", user="no-such-user-xyz")


def test_large_output_arrives_complete(sbx: Any) -> None:
    result = sbx.commands.run("head -c 300000 /dev/zero | tr '\\0' 'a'")
    assert result.stdout == "a" * 300000


def test_background_kill_reports_signal(sbx: Any) -> None:
    from e2b import CommandExitException

    handle = sbx.commands.run("sleep 60", background=True)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    assert handle.kill() is True
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == -1
    assert info.value.error == "signal: killed"
    assert handle.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(handle.pid) is False  # unknown pid ⇒ not_found ⇒ False


def test_disconnect_keeps_process_and_connect_reattaches(sbx: Any, workdir: Path) -> None:
    go = workdir / "go"
    handle = sbx.commands.run(f"while [ ! -e {go} ]; do sleep 0.05; done; echo after", background=True)
    handle.disconnect()
    time.sleep(0.2)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    again = sbx.commands.connect(handle.pid)
    go.touch()
    result = again.wait()
    assert result.exit_code == 0
    assert result.stdout == "after\n"


def test_connect_to_finished_process_gets_retained_exit(sbx: Any) -> None:
    handle = sbx.commands.run("exit 0", background=True)
    handle.wait()
    again = sbx.commands.connect(handle.pid)
    assert again.wait().exit_code == 0


def test_list_shows_config(sbx: Any) -> None:
    handle = sbx.commands.run("sleep 60", background=True, envs={"K": "V"})
    try:
        info = next(p for p in sbx.commands.list() if p.pid == handle.pid)
        assert info.cmd == "/bin/bash"
        assert info.args == ["-l", "-c", "sleep 60"]
        assert info.envs == {"K": "V"}
    finally:
        handle.kill()


def test_send_stdin_and_close_stdin(sbx: Any) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "hello ")
    sbx.commands.send_stdin(handle.pid, b"world")
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "hello world"


def test_stream_input(sbx: Any) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.stream_input(handle.pid, iter([b"a", "b", b"c\n"]))
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "abc\n"


def test_stdin_disabled_rejects_input(sbx: Any) -> None:
    from e2b import SandboxException

    handle = sbx.commands.run("sleep 60", background=True)
    try:
        with pytest.raises(SandboxException):
            sbx.commands.send_stdin(handle.pid, "x")
    finally:
        handle.kill()


def test_connect_timeout_kills_background_command(sbx: Any) -> None:
    from e2b import CommandExitException, TimeoutException

    handle = sbx.commands.run("sleep 60", background=True, timeout=1)
    with pytest.raises((CommandExitException, TimeoutException)):
        handle.wait()
    wait_until(lambda: handle.pid not in [p.pid for p in sbx.commands.list()])


def test_pty_create_send_resize_kill(sbx: Any) -> None:
    from e2b import PtySize

    chunks: list[bytes] = []
    handle = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
    try:
        sbx.pty.resize(handle.pid, PtySize(rows=40, cols=132))
        sbx.pty.send_stdin(handle.pid, b"stty size; echo mark$((40+2))\n")
        sbx.pty.send_stdin(handle.pid, b"exit\n")
        result = handle.wait(on_pty=lambda data: chunks.append(bytes(data)))
        assert result.exit_code == 0
    finally:
        sbx.pty.kill(handle.pid)
    output = b"".join(chunks).decode(errors="replace")
    assert "40 132" in output
    assert "mark42" in output


def test_pty_kill_reports_signal(sbx: Any) -> None:
    from e2b import CommandExitException, PtySize

    handle = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
    assert sbx.pty.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == -1


# --------------------------------------------------------------------------- files


def test_write_read_text_and_bytes(sbx: Any, workdir: Path) -> None:
    target = workdir / "sub" / "dir" / "a.txt"
    info = sbx.files.write(str(target), "hello ünïcode")
    assert info.path == str(target)
    assert info.name == "a.txt"
    assert target.read_text() == "hello ünïcode"
    assert sbx.files.read(str(target)) == "hello ünïcode"
    blob = os.urandom(200_000)
    sbx.files.write(str(target), blob)
    assert bytes(sbx.files.read(str(target), format="bytes")) == blob


def test_write_files_multipart_full_paths(sbx: Any, workdir: Path) -> None:
    infos = sbx.files.write_files(
        [
            {"path": str(workdir / "x" / "one.txt"), "data": "1"},
            {"path": str(workdir / "y" / "two.txt"), "data": b"22"},
        ]
    )
    assert sorted(i.path for i in infos) == [str(workdir / "x" / "one.txt"), str(workdir / "y" / "two.txt")]
    assert (workdir / "x" / "one.txt").read_text() == "1"
    assert (workdir / "y" / "two.txt").read_text() == "22"


def test_write_gzip_and_stream(sbx: Any, workdir: Path) -> None:
    payload = b"zipped " * 10000
    sbx.files.write(str(workdir / "g.bin"), payload, gzip=True)
    assert (workdir / "g.bin").read_bytes() == payload
    sbx.files.write(str(workdir / "s.bin"), io.BytesIO(payload))
    assert (workdir / "s.bin").read_bytes() == payload
    sbx.files.write(str(workdir / "it.bin"), iter([b"a" * 70000, b"b" * 3]))
    assert (workdir / "it.bin").read_bytes() == b"a" * 70000 + b"b" * 3


def test_write_metadata_round_trip(sbx: Any, workdir: Path) -> None:
    target = workdir / "meta.txt"
    try:
        os.setxattr(workdir, "user.probe", b"1")
    except OSError:
        pytest.skip("filesystem has no user xattrs")
    sbx.files.write(str(target), "m", metadata={"Owner": "alice"})
    assert sbx.files.get_info(str(target)).metadata == {"owner": "alice"}


def test_disk_full_is_not_enough_space(sbx: Any) -> None:
    from e2b import NotEnoughSpaceException

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with pytest.raises(NotEnoughSpaceException):
        sbx.files.write("/dev/full", "x" * 10000, user="root")


def test_read_as_stream(sbx: Any, workdir: Path) -> None:
    blob = os.urandom(300_000)
    (workdir / "big.bin").write_bytes(blob)
    assert b"".join(sbx.files.read(str(workdir / "big.bin"), format="stream")) == blob


def test_read_missing_and_directory(sbx: Any, workdir: Path) -> None:
    from e2b import FileNotFoundException, InvalidArgumentException

    with pytest.raises(FileNotFoundException):
        sbx.files.read(str(workdir / "missing"))
    with pytest.raises(InvalidArgumentException):
        sbx.files.read(str(workdir))


def test_list_depth_exists_info(sbx: Any, workdir: Path) -> None:
    (workdir / "d1" / "d2").mkdir(parents=True)
    (workdir / "d1" / "f1").write_text("x")
    (workdir / "d1" / "d2" / "f2").write_text("yy")
    (workdir / "link").symlink_to(workdir / "d1")
    names1 = [e.name for e in sbx.files.list(str(workdir))]
    assert names1 == ["d1", "link"]
    paths2 = [e.path for e in sbx.files.list(str(workdir), depth=2)]
    assert paths2 == [
        str(workdir / "d1"),
        str(workdir / "d1" / "d2"),
        str(workdir / "d1" / "f1"),
        str(workdir / "link"),
    ]
    via_link = [e.path for e in sbx.files.list(str(workdir / "link"))]
    assert via_link == [str(workdir / "link" / "d2"), str(workdir / "link" / "f1")]
    assert sbx.files.exists(str(workdir / "d1" / "f1"))
    assert not sbx.files.exists(str(workdir / "nope"))
    info = sbx.files.get_info(str(workdir / "d1" / "d2" / "f2"))
    assert info.size == 2 and info.type.value == "file" and info.permissions.startswith("-")
    link = sbx.files.get_info(str(workdir / "link"))
    assert link.type.value == "symlink"
    assert link.symlink_target == str(workdir / "d1")


def test_make_dir_rename_remove(sbx: Any, workdir: Path) -> None:
    from e2b import FileNotFoundException

    new = workdir / "a" / "b"
    assert sbx.files.make_dir(str(new)) is True
    assert new.is_dir()
    assert sbx.files.make_dir(str(new)) is False
    (new / "f").write_text("z")
    moved = sbx.files.rename(str(new / "f"), str(workdir / "c" / "g"))
    assert moved.path == str(workdir / "c" / "g")
    assert (workdir / "c" / "g").read_text() == "z"
    with pytest.raises(FileNotFoundException):
        sbx.files.rename(str(workdir / "nope"), str(workdir / "nope2"))
    sbx.files.remove(str(workdir / "a"))
    assert not (workdir / "a").exists()
    sbx.files.remove(str(workdir / "never-existed"))  # not an error


def test_watch_dir_sync_recursive(sbx: Any, workdir: Path) -> None:
    from e2b import FilesystemEventType

    seen: list[Any] = []
    handle = sbx.files.watch_dir(str(workdir), recursive=True)
    try:
        (workdir / "new.txt").write_text("hi")
        sub = workdir / "sub"
        sub.mkdir()
        # Let the watcher register the new subdirectory before writing into it.
        wait_until(lambda: any(e.name == "sub" for e in _collect(handle, seen)), timeout=10)
        (sub / "deep.txt").write_text("x")
        wait_until(lambda: any(e.name == "sub/deep.txt" for e in _collect(handle, seen)), timeout=10)
    finally:
        handle.stop()
    kinds = {(e.name, e.type) for e in seen}
    assert ("new.txt", FilesystemEventType.CREATE) in kinds
    assert ("new.txt", FilesystemEventType.WRITE) in kinds
    assert ("sub/deep.txt", FilesystemEventType.CREATE) in kinds


def _collect(handle: Any, into: list[Any]) -> list[Any]:
    into.extend(handle.get_new_events())
    return into


async def test_watch_dir_async_stream(envd: Any, workdir: Path) -> None:
    import asyncio

    from e2b import AsyncSandbox, FilesystemEventType

    sandbox = await AsyncSandbox.create()
    events: list[Any] = []
    handle = await sandbox.files.watch_dir(
        str(workdir), on_event=events.append, recursive=True, include_entry=True
    )
    try:
        (workdir / "w.txt").write_text("abc")
        for _ in range(200):
            if any(e.name == "w.txt" and e.type == FilesystemEventType.WRITE for e in events):
                break
            await asyncio.sleep(0.05)
    finally:
        await handle.stop()
    created = [e for e in events if e.name == "w.txt" and e.type == FilesystemEventType.CREATE]
    assert created
    assert any(e.name == "w.txt" and e.type == FilesystemEventType.WRITE for e in events)


async def test_async_commands(envd: Any) -> None:
    from e2b import AsyncSandbox

    sandbox = await AsyncSandbox.create()
    out: list[str] = []
    result = await sandbox.commands.run("echo one; echo two", on_stdout=out.append)
    assert result.stdout == "one\ntwo\n"
    assert "".join(out) == "one\ntwo\n"
    handle = await sandbox.commands.run("cat", background=True, stdin=True)
    await sandbox.commands.send_stdin(handle.pid, "ping")
    await sandbox.commands.close_stdin(handle.pid)
    assert (await handle.wait()).stdout == "ping"


# --------------------------------------------------------------------------- raw protocol robustness


def _envelope(payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


def _frames(body: bytes) -> list[tuple[int, dict[str, Any]]]:
    out = []
    while body:
        flags, length = struct.unpack(">BI", body[:5])
        out.append((flags, json.loads(body[5 : 5 + length])))
        body = body[5 + length :]
    return out


def test_bad_input_gets_clean_connect_errors(envd: Any) -> None:
    with httpx.Client(base_url=BASE, trust_env=False) as client:
        r = client.post(
            "/process.Process/List", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
        r = client.post(
            "/process.Process/SendSignal", json={"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"}
        )
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        r = client.post(
            "/process.Process/SendSignal", json={"process": {"pid": 1}, "signal": "SIGNAL_UNSPECIFIED"}
        )
        assert r.json()["code"] in ("not_found", "unimplemented")
        r = client.post(
            "/filesystem.Filesystem/Stat",
            content=b"x" * (17 * 1024 * 1024),
            headers={"content-type": "application/json"},
        )
        assert r.json()["code"] == "resource_exhausted"
        truncated = _envelope(b'{"process":{"cmd":"/bin/true"}}')[:-5]
        r = client.post(
            "/process.Process/Start", content=truncated, headers={"content-type": "application/connect+json"}
        )
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/connect+json"
        frames = _frames(r.content)
        assert frames[-1][0] == 2 and frames[-1][1]["error"]["code"] == "invalid_argument"
        r = client.post(
            "/process.Process/Start",
            content=_envelope(b"[1,2]"),
            headers={"content-type": "application/connect+json"},
        )
        assert _frames(r.content)[-1][1]["error"]["code"] == "invalid_argument"
        assert client.get("/health").status_code == 204


def test_start_stream_wire_format(envd: Any) -> None:
    body = _envelope(
        json.dumps(
            {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "printf hi"]}, "stdin": False}
        ).encode()
    )
    with httpx.Client(base_url=BASE, trust_env=False) as client:
        r = client.post(
            "/process.Process/Start", content=body, headers={"content-type": "application/connect+json"}
        )
    frames = _frames(r.content)
    assert "start" in frames[0][1]["event"]
    data = b"".join(
        base64.b64decode(f["event"]["data"]["stdout"]) for _, f in frames if "data" in f.get("event", {})
    )
    assert data == b"hi"
    assert frames[-2][1]["event"]["end"] == {"exitCode": 0, "exited": True, "status": "exit status 0"}
    assert frames[-1] == (2, {})


def test_access_token_and_signatures(envd: Any, workdir: Path) -> None:
    from aenv.envd.auth import compute_signature

    token = uuid.uuid4().hex
    target = workdir / "signed.txt"
    target.write_text("secret")
    with httpx.Client(base_url=BASE, trust_env=False) as client:
        assert (
            client.post("/init", json={"accessToken": token, "envVars": {"GLOBAL_X": "1"}}).status_code == 204
        )
        try:
            r = client.post("/process.Process/List", json={})
            assert r.status_code == 401
            assert r.json() == {
                "code": 401,
                "message": "unauthorized access, please provide a valid access token or method signing if supported",
            }
            assert (
                client.post("/process.Process/List", json={}, headers={"X-Access-Token": token}).status_code
                == 200
            )
            assert client.get("/envs", headers={"X-Access-Token": token}).json()["GLOBAL_X"] == "1"
            assert client.get("/health").status_code == 204
            assert client.get("/files", params={"path": str(target)}).status_code == 401
            sig = compute_signature(str(target), "read", "", token)
            r = client.get("/files", params={"path": str(target), "signature": sig})
            assert r.status_code == 200 and r.text == "secret"
            expired = compute_signature(str(target), "read", "", token, 1)
            r = client.get(
                "/files", params={"path": str(target), "signature": expired, "signature_expiration": "1"}
            )
            assert r.status_code == 401
            wrong_op = compute_signature(str(target), "write", "", token)
            assert (
                client.get("/files", params={"path": str(target), "signature": wrong_op}).status_code == 401
            )
            r = client.get("/files", params={"path": str(target)}, headers={"X-Access-Token": token})
            assert r.status_code == 200
        finally:
            client.post("/init", json={"accessToken": ""}, headers={"X-Access-Token": token})
        assert client.post("/process.Process/List", json={}).status_code == 200


def test_files_error_shapes(envd: Any, workdir: Path) -> None:
    with httpx.Client(base_url=BASE, trust_env=False) as client:
        r = client.get("/files", params={"path": str(workdir / "missing")})
        assert r.status_code == 404
        assert r.json() == {"code": 404, "message": f"path '{workdir / 'missing'}' does not exist"}
        r = client.post("/files", params={"path": str(workdir)}, files={"file": ("x", b"1")})
        assert r.status_code == 400
        r = client.post("/files", content=b"abc", headers={"content-type": "application/octet-stream"})
        assert r.status_code == 400
        r = client.post(
            "/files",
            params={"path": str(workdir / "u")},
            files={"file": ("x", b"1")},
            headers={"X-Metadata-Bad": "\x7f"},
        )
        assert r.status_code == 400
        r = client.get("/files", params={"path": str(workdir), "username": "no-such-user-xyz"})
        assert r.status_code == 401


def test_runs_and_writes_as_another_user(sbx: Any, workdir: Path) -> None:
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' account")
    os.chmod(workdir, 0o777)
    result = sbx.commands.run("id -un; touch mine", user="nobody", cwd=str(workdir))
    assert result.stdout == "nobody\n"
    assert (workdir / "mine").stat().st_uid == nobody.pw_uid
    sbx.files.write(str(workdir / "deep" / "f.txt"), "x", user="nobody")
    assert (workdir / "deep" / "f.txt").stat().st_uid == nobody.pw_uid
    assert (workdir / "deep").stat().st_uid == nobody.pw_uid
    assert sbx.files.make_dir(str(workdir / "nd"), user="nobody")
    assert (workdir / "nd").stat().st_uid == nobody.pw_uid


def test_metrics_shape(envd: Any) -> None:
    with httpx.Client(base_url=BASE, trust_env=False) as client:
        body = client.get("/metrics").json()
    assert set(body) == {
        "ts",
        "cpu_count",
        "cpu_used_pct",
        "mem_total",
        "mem_used",
        "mem_cache",
        "mem_total_mib",
        "mem_used_mib",
        "disk_used",
        "disk_total",
    }
    assert body["mem_total"] > 0 and body["disk_total"] > 0


def test_gzip_octet_stream_raw(envd: Any, workdir: Path) -> None:
    with httpx.Client(base_url=BASE, trust_env=False) as client:
        r = client.post(
            "/files",
            params={"path": str(workdir / "raw.gz.txt")},
            content=gzip.compress(b"raw gz"),
            headers={"content-type": "application/octet-stream", "content-encoding": "gzip"},
        )
    assert r.status_code == 200
    assert r.json() == [{"path": str(workdir / "raw.gz.txt"), "name": "raw.gz.txt", "type": "file"}]
    assert (workdir / "raw.gz.txt").read_bytes() == b"raw gz"


# --------------------------------------------------------------------------- JS SDK

JS_CHECK = r"""
import { Sandbox } from 'e2b'
const dir = process.argv[2]
const s = await Sandbox.create()
const out = {}
const r = await s.commands.run('echo js-$((1+1)); echo e >&2')
out.stdout = r.stdout; out.stderr = r.stderr
try { await s.commands.run('exit 4') } catch (e) { out.exit = e.exitCode }
await s.files.write(`${dir}/a/js.txt`, 'from-js')
out.back = await s.files.read(`${dir}/a/js.txt`)
out.list = (await s.files.list(dir, { depth: 2 })).map(e => e.path.slice(dir.length))
const events = []
const w = await s.files.watchDir(dir, ev => events.push(`${ev.type}:${ev.name}`), { recursive: true })
await s.files.write(`${dir}/a/w.txt`, 'x')
for (let i = 0; i < 100 && !events.some(e => e.includes('a/w.txt')); i++) await new Promise(r => setTimeout(r, 50))
await w.stop()
out.watched = events.some(e => e.includes('a/w.txt'))
const h = await s.commands.run('sleep 30', { background: true })
out.killed = await h.kill()
try { await h.wait() } catch (e) { out.killExit = e.exitCode }
out.missingKill = await s.commands.kill(999999)
const chunks = []
const p = await s.pty.create({ cols: 80, rows: 24, onData: d => chunks.push(Buffer.from(d).toString()), timeoutMs: 0 })
await s.pty.sendInput(p.pid, new TextEncoder().encode('echo pty$((40+2)); exit\n'))
await p.wait()
out.pty = chunks.join('').includes('pty42')
try { await s.files.read(`${dir}/nope`) } catch (e) { out.notFound = e.constructor.name }
out.running = await s.isRunning()
console.log(JSON.stringify(out))
"""


def test_js_sdk_against_envd(envd: Any, workdir: Path) -> None:
    """The JS SDK (connect-web, WatchDir stream, pty) against envd, when node and the SDK are present."""
    import shutil

    from tests.fixtures.js import js_sdk_dir

    cache = js_sdk_dir()
    node = shutil.which("node") or "node"
    script = cache / f"envd_check_{uuid.uuid4().hex}.mjs"
    script.write_text(JS_CHECK)
    try:
        res = subprocess.run(
            [node, str(script), str(workdir)],
            check=False,
            cwd=cache,
            capture_output=True,
            text=True,
            timeout=120,
            env=os.environ,
        )
    finally:
        script.unlink()
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {
        "stdout": "js-2\n",
        "stderr": "e\n",
        "exit": 4,
        "back": "from-js",
        "list": ["/a", "/a/js.txt"],
        "watched": True,
        "killed": True,
        "killExit": -1,
        "missingKill": False,
        "pty": True,
        "notFound": "FileNotFoundError",
        "running": True,
    }
