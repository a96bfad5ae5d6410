"""Every SDK call of spec §6 through the real synchronous e2b SDK against a real server."""

from __future__ import annotations

import gzip
import io
import threading
import time

import httpx
import pytest
from e2b import (
    CommandExitException,
    FilesystemEventType,
    FileType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)


def test_create_run_files_kill(e2b_env: dict[str, str]) -> None:
    sbx = Sandbox.create("base", metadata={"suite": "sync"}, envs={"GLOBAL_VAR": "g1"})
    try:
        out = sbx.commands.run("echo hello; echo err >&2; echo $GLOBAL_VAR; whoami; pwd")
        assert out.exit_code == 0
        assert out.stdout.split() == ["hello", "g1", "user", "/home/user"]
        assert out.stderr.strip() == "err"
        sbx.files.write("/home/user/hello.txt", "hi there")
        assert sbx.files.read("/home/user/hello.txt") == "hi there"
        assert sbx.is_running()
    finally:
        assert sbx.kill() is True
    assert not sbx.is_running()
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_commands_options_and_failures(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("echo $X; pwd; id -u", envs={"X": "42"}, cwd="/tmp", user="root")
    assert r.stdout.split() == ["42", "/tmp", "0"]
    chunks: list[str] = []
    sandbox.commands.run("for i in 1 2 3; do echo line$i; done", on_stdout=chunks.append)
    assert "".join(chunks).split() == ["line1", "line2", "line3"]
    with pytest.raises(CommandExitException) as exc:
        sandbox.commands.run("echo partial; exit 3")
    assert exc.value.exit_code == 3 and "partial" in exc.value.stdout
    with pytest.raises(Exception, match="cwd"):
        sandbox.commands.run("true", cwd="/does/not/exist")


def test_background_list_connect_kill(sandbox: Sandbox) -> None:
    h = sandbox.commands.run("sleep 1; echo done-bg", background=True)
    assert any(p.pid == h.pid for p in sandbox.commands.list())
    assert h.wait().stdout.strip() == "done-bg"
    long = sandbox.commands.run("while true; do echo tick; sleep 0.2; done", background=True, timeout=0)
    long.disconnect()
    time.sleep(0.3)
    assert any(p.pid == long.pid for p in sandbox.commands.list()), "disconnect must not kill the process"
    again = sandbox.commands.connect(long.pid)
    got: list[str] = []
    t = threading.Thread(target=lambda: _collect(again, got), daemon=True)
    t.start()
    _wait_for(lambda: any("tick" in g for g in got), timeout=30)  # output flows (slow guests: late)
    assert sandbox.commands.kill(long.pid) is True
    t.join(10)
    assert any("tick" in g for g in got)
    assert sandbox.commands.kill(999999) is False


def _collect(handle, sink: list[str]) -> None:  # type: ignore[no-untyped-def]
    try:
        for stdout, _stderr, _pty in handle:
            if stdout:
                sink.append(stdout)
    except Exception:
        pass


def test_stdin_send_close_stream(sandbox: Sandbox) -> None:
    h = sandbox.commands.run("cat", background=True, stdin=True, timeout=0)
    sandbox.commands.send_stdin(h.pid, "abc\n")
    sandbox.commands.close_stdin(h.pid)
    assert h.wait().stdout == "abc\n"
    h2 = sandbox.commands.run("head -c 6", background=True, stdin=True, timeout=0)
    sandbox.commands.stream_input(h2.pid, iter([b"xyz", b"uvw"]))
    assert h2.wait().stdout == "xyzuvw"


def test_command_timeout_kills(sandbox: Sandbox) -> None:
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30", timeout=1)
    # The kill is asynchronous (SIGKILL, reap, table update); a slow guest (TCG) needs longer than 0.3 s.
    _wait_for(lambda: not any("sleep 30" in " ".join(p.args) for p in sandbox.commands.list()), timeout=20)
    assert not any("sleep 30" in " ".join(p.args) for p in sandbox.commands.list())


def test_pty(sandbox: Sandbox) -> None:
    buf: list[bytes] = []
    term = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=0)
    reader = threading.Thread(target=lambda: _wait_quietly(term, buf), daemon=True)
    reader.start()
    sandbox.pty.send_stdin(term.pid, b"stty size; echo pty-$((40+2))\n")
    _wait_for(lambda: b"pty-42" in b"".join(buf))
    assert b"24 80" in b"".join(buf)
    sandbox.pty.resize(term.pid, PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(term.pid, b"stty size\n")
    _wait_for(lambda: b"30 100" in b"".join(buf))
    assert sandbox.pty.kill(term.pid) is True


def _wait_quietly(handle, sink: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    try:
        handle.wait(on_pty=sink.append)
    except Exception:
        pass


def _wait_for(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def _counter(sbx: Sandbox) -> int:
    """The value of /tmp/counter, -1 while the loop has not written it yet."""
    try:
        return int(sbx.files.read("/tmp/counter").strip() or -1)
    except Exception:
        return -1


def test_files_api(sandbox: Sandbox) -> None:
    f = sandbox.files
    info = f.write("/home/user/dir/a.txt", b"\x00\x01bytes")
    assert info.path == "/home/user/dir/a.txt" and info.name == "a.txt"
    assert bytes(f.read("/home/user/dir/a.txt", format="bytes")) == b"\x00\x01bytes"
    f.write("/home/user/dir/stream.bin", io.BytesIO(b"x" * 200_000))
    assert b"".join(f.read("/home/user/dir/stream.bin", format="stream")) == b"x" * 200_000
    f.write("/home/user/dir/gz.txt", "compressed " * 100, gzip=True)
    assert f.read("/home/user/dir/gz.txt", gzip=True) == "compressed " * 100
    written = f.write_files([{"path": "/home/user/m/one.txt", "data": "1"}, {"path": "/home/user/m/two.txt", "data": "2"}])
    assert sorted(w.name for w in written) == ["one.txt", "two.txt"]
    names = {e.name: e for e in f.list("/home/user/m")}
    assert set(names) == {"one.txt", "two.txt"} and names["one.txt"].type == FileType.FILE
    deep = {e.path for e in f.list("/home/user", depth=2)}
    assert "/home/user/m/two.txt" in deep and "/home/user/dir/a.txt" in deep
    assert f.exists("/home/user/m/one.txt") and not f.exists("/home/user/nope")
    assert f.get_info("/home/user/m").type == FileType.DIR
    with pytest.raises(NotFoundException):
        f.get_info("/home/user/nope")
    with pytest.raises(NotFoundException):
        f.read("/home/user/nope")
    assert f.make_dir("/home/user/newdir/sub") is True
    assert f.make_dir("/home/user/newdir/sub") is False
    moved = f.rename("/home/user/m/one.txt", "/home/user/newdir/uno.txt")
    assert moved.path == "/home/user/newdir/uno.txt" and not f.exists("/home/user/m/one.txt")
    f.remove("/home/user/newdir")
    assert not f.exists("/home/user/newdir")
    f.remove("/home/user/never-existed")  # not an error
    assert sandbox.commands.run("stat -c %U /home/user/dir/a.txt").stdout.strip() == "user"


def test_read_a_file_being_rewritten(sandbox: Sandbox) -> None:
    """Reads of a file another process rewrites all the time (a live log, a counter) each answer
    whole: its content at some moment, never a body cut short or longer than its Content-Length."""
    sandbox.commands.run("i=0; while :; do i=$((i+1)); echo $i > /tmp/live; done", background=True, timeout=0)
    _wait_for(lambda: sandbox.files.exists("/tmp/live"), timeout=30)
    seen = set()
    for _ in range(40):
        text = sandbox.files.read("/tmp/live")
        assert text == "" or (text.endswith("\n") and text[:-1].isdigit()), repr(text)
        seen.add(text)
    assert len(seen) > 1, "the writer must have been running meanwhile"


def test_watch_dir_sync(sandbox: Sandbox) -> None:
    sandbox.files.make_dir("/home/user/w")
    handle = sandbox.files.watch_dir("/home/user/w", recursive=True)
    sandbox.files.write("/home/user/w/new.txt", "x")
    sandbox.commands.run("mkdir -p /home/user/w/sub && echo y > /home/user/w/sub/deep.txt")
    events = []
    deadline = time.time() + 30
    while time.time() < deadline and not any(e.name == "sub/deep.txt" for e in events):
        events += handle.get_new_events()
        time.sleep(0.1)
    handle.stop()
    names = {(e.name, e.type) for e in events}
    assert ("new.txt", FilesystemEventType.CREATE) in names
    assert any(n == "sub/deep.txt" for n, _ in names)


def test_signed_urls(sandbox: Sandbox) -> None:
    sandbox.files.write("/home/user/signed.txt", "signed-content")
    url = sandbox.download_url("/home/user/signed.txt")
    assert "signature=" in url
    resp = httpx.get(url, trust_env=False)
    assert resp.status_code == 200 and resp.text == "signed-content"
    bad = httpx.get(url.replace("signature=v1_", "signature=v1_x"), trust_env=False)
    assert bad.status_code in (401, 403, 502)
    up = sandbox.upload_url("/home/user/uploaded.txt")
    resp = httpx.post(up, files={"file": ("uploaded.txt", b"via-url")}, trust_env=False)
    assert resp.status_code == 200, resp.text
    assert sandbox.files.read("/home/user/uploaded.txt") == "via-url"


def test_info_timeout_metrics_list(sandbox: Sandbox, e2b_env: dict[str, str]) -> None:
    info = sandbox.get_info()
    assert info.sandbox_id == sandbox.sandbox_id and info.state == SandboxState.RUNNING
    sandbox.set_timeout(600)
    assert sandbox.get_info().end_at > info.end_at
    sandbox.commands.run("python3 -c 'x = bytearray(30 * 1024 * 1024); import time; time.sleep(0.2)'")
    metrics = sandbox.get_metrics()
    assert metrics and metrics[-1].mem_used > 0 and metrics[-1].mem_total > 0
    page = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING]), limit=1)
    seen = []
    while page.has_next:
        seen += [s.sandbox_id for s in page.next_items()]
    assert sandbox.sandbox_id in seen


def test_pause_keeps_processes_then_connect(e2b_env: dict[str, str]) -> None:
    sbx = Sandbox.create("base")
    try:
        h = sbx.commands.run(
            # written aside and renamed: a pause between the truncate and the write of a plain
            # "echo $i > /tmp/counter" leaves an empty file for the first read after resume
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 0.1; done",
            background=True, timeout=0,
        )
        _wait_for(lambda: _counter(sbx) >= 2, timeout=30)  # the loop runs (slow guests start it late)
        assert sbx.pause() is True
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        assert not sbx.is_running()
        assert sbx.pause() is False  # already paused: 409 → False
        resumed = Sandbox.connect(sbx.sandbox_id)
        c1 = int(resumed.files.read("/tmp/counter").strip())
        _wait_for(lambda: _counter(resumed) > c1, timeout=30)
        c2 = _counter(resumed)
        assert c2 > c1, "the background process must keep running after resume"
        assert any(p.pid == h.pid for p in resumed.commands.list())
    finally:
        sbx.kill()


def test_gzip_upload_raw_http(sandbox: Sandbox, e2b_env: dict[str, str]) -> None:
    """The octet-stream + Content-Encoding: gzip path, straight over HTTP with the access token."""
    url = e2b_env["E2B_SANDBOX_URL"] + "/files"
    headers = {
        "E2b-Sandbox-Id": sandbox.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": sandbox._envd_access_token or "",  # type: ignore[attr-defined]
        "Content-Type": "application/octet-stream",
        "Content-Encoding": "gzip",
    }
    resp = httpx.post(url, params={"path": "/home/user/raw.txt"}, content=gzip.compress(b"raw-gz"), headers=headers, trust_env=False)
    assert resp.status_code == 200, resp.text
    assert sandbox.files.read("/home/user/raw.txt") == "raw-gz"
