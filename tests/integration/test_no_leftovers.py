"""Nothing outlives what started it: the bench and the SDK-suite runner, stopped mid-run with SIGTERM
(what ``timeout`` and CI runners send) or Ctrl-C (SIGINT to the whole foreground process group), leave
no process, mount or temp dir behind; a throwaway server (``stop_sandboxes_on_exit``) takes its
sandboxes with it on a graceful stop.

Each run gets a temp dir of its own (``TMPDIR``): everything it makes is under it, so what it left
is found by name (:meth:`Proc.mentions`: command line, environment or an ns sandbox's overlay root),
whatever else the machine runs. The ns runtime, real processes, the real docker engine."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from aenv.testing.leftovers import Found, Proc, Record, clean, find, processes, wait_clean
from aenv.testing.server import API_KEY, start_server, stop_server

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the ns runtime needs root")


@pytest.fixture
def run_tmp() -> Iterator[Path]:
    """A short private temp dir (socket paths stay short); whatever a failed test left goes with it."""
    before = Record.now()
    tmp = Path(tempfile.mkdtemp(prefix="lo-", dir="/tmp"))
    yield tmp
    left = find(before, roots=[str(tmp)], under=str(tmp))
    left.temps = [str(tmp)]
    clean(left)  # processes killed, mounts detached, then the dir (never through a live mount)


def _ours(tmp: Path) -> Callable[[], list[Proc]]:
    return lambda: [p for p in processes() if p.kind is not None and p.mentions(str(tmp))]


def _wait_for(what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes], seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {seconds:.0f} s")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes], sig: int) -> int:
    """SIGTERM to the process (``timeout``, a CI runner); SIGINT to its process group (Ctrl-C)."""
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"still running 180 s after {signal.Signals(sig).name}") from None


def _assert_nothing_left(before: Record, tmp: Path, log: Path, made_here: tuple[str, ...] = ()) -> None:
    """``made_here``: names in ``tmp`` the test made itself (checked for mounts, not listed)."""
    found: Found = wait_clean(before, 20, roots=[str(tmp)], under=str(tmp))
    left = sorted(str(p.relative_to(tmp)) for p in tmp.iterdir() if p != log and p.name not in made_here)
    assert not found and not left, (
        "left behind:\n" + "\n".join([*found.lines(), *(f"file {x}" for x in left)])
        + f"\n--- its output:\n{log.read_text(errors='replace')[-4000:]}"
    )


def _spawn(argv: list[str], tmp: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    with log.open("wb") as out:  # its own process group: a SIGINT to it is a Ctrl-C in its terminal
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip


def _bench_server_url(ours: list[Proc]) -> str | None:
    for p in ours:
        if "aenv.cli.main" in p.argv and "serve" in p.argv:
            environ = Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0")
            port = next((e.split(b"=", 1)[1] for e in environ if e.startswith(b"AENV_PORT=")), None)
            return f"http://127.0.0.1:{port.decode()}" if port else None
    return None


def _docker_ready(tmp: Path) -> dict[str, str] | None:
    """The bench's private engine, once it has the bench's image: its environment for the docker CLI."""
    for sock in tmp.glob("aenv-bench-docker-*/docker.sock"):
        env = {**os.environ, "DOCKER_HOST": f"unix://{sock}"}
        res = subprocess.run(["docker", "image", "inspect", "aenv-bench:base"], env=env, capture_output=True)
        if res.returncode == 0:
            return env
    return None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_bench_stopped_mid_run_leaves_nothing(run_tmp: Path, sig: int) -> None:
    """Stopped while its server runs sandboxes (a warm pool and one a scenario holds: agent + envd +
    slirp4netns each) and its private dockerd runs a container (containerd and a shim)."""
    from e2b import Sandbox

    if not shutil.which("dockerd"):
        pytest.skip("docker.io is not installed (scripts/setup.sh installs it)")
    log = run_tmp / "bench.log"
    before = Record.now()
    bench = _spawn([sys.executable, "-m", "bench", "--smoke", "--scenarios", "create,roundtrip", "--baseline",
                    "docker", "--out", str(run_tmp / "results")], run_tmp, log)  # fmt: skip
    ours = _ours(run_tmp)
    _wait_for("the bench's server", lambda: _bench_server_url(ours()) is not None, bench)
    _wait_for("the bench's docker engine with its image", lambda: _docker_ready(run_tmp) is not None, bench)
    url = _bench_server_url(ours())
    docker_env = _docker_ready(run_tmp)
    assert url is not None and docker_env is not None
    # what a scenario holds while it measures: a running sandbox and a running container
    held = Sandbox.create("base", timeout=600, api_url=url, sandbox_url=url, api_key=API_KEY)
    assert held.commands.run("echo held").stdout == "held\n"
    subprocess.run(["docker", "run", "-d", "--network", "none", "aenv-bench:base", "sleep", "infinity"],
                   env=docker_env, check=True, capture_output=True)  # fmt: skip
    assert any("containerd-shim" in p.argv[0] for p in ours())
    code = _stop(bench, sig)
    assert code in (143, 130, -signal.SIGINT), log.read_text(errors="replace")[-4000:]
    _assert_nothing_left(before, run_tmp, log)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_sdk_suite_runner_stopped_mid_run_leaves_nothing(run_tmp: Path, sig: int) -> None:
    """Stopped while its registry, its HTTPS server and a sandbox the client created run (``--exec``
    stands in for the SDK's pytest: a client that creates a sandbox and waits)."""
    log = run_tmp / "suite.log"
    sdk = run_tmp / "sdk"
    sdk.mkdir()
    client = ("from e2b import Sandbox; import time; s = Sandbox.create('base', timeout=600); "
              "s.commands.run('true'); print('sandbox-up', flush=True); time.sleep(600)")  # fmt: skip
    before = Record.now()
    runner = _spawn([sys.executable, str(REPO / "scripts" / "e2b_sdk_suite.py"), "--sdk", str(sdk), "--python",
                     sys.executable, "--runtime", "ns", "--exec", f"{sys.executable} -c \"{client}\""],
                    run_tmp, log)  # fmt: skip
    _wait_for("the client's sandbox", lambda: "sandbox-up" in log.read_text(errors="replace"), runner)
    assert any("aenv.agent" in p.argv for p in _ours(run_tmp)())
    code = _stop(runner, sig)
    assert code in (143, 130, -signal.SIGINT), log.read_text(errors="replace")[-4000:]
    _assert_nothing_left(before, run_tmp, log, made_here=("sdk",))


def test_a_throwaway_server_ends_its_sandboxes_on_a_graceful_stop(run_tmp: Path) -> None:
    """``AENV_STOP_SANDBOXES_ON_EXIT=0`` (the default of ``aenv serve``): a running sandbox outlives a
    graceful stop and the next server adopts it; with 1 (the test servers' default) the stop ends it,
    paused ones and the warm pool too."""
    from e2b import Sandbox

    keep = {"AENV_POOL_SIZE": "1", "AENV_STOP_SANDBOXES_ON_EXIT": "0"}
    before = Record.now()
    srv = start_server(run_tmp, "ns", keep)
    url = {"api_url": srv.url, "sandbox_url": srv.url, "api_key": API_KEY}
    try:
        running = Sandbox.create("base", timeout=600, **url)  # type: ignore[arg-type]
        paused = Sandbox.create("base", timeout=600, **url)  # type: ignore[arg-type]
        paused.pause()
        stop_server(srv)
        agents = [p for p in find(before, under=str(run_tmp)).procs if "aenv.agent" in p.argv]
        assert agents, "the kept sandbox's agent should outlive the server"

        srv = start_server(run_tmp, "ns", {"AENV_POOL_SIZE": "1"}, port=int(srv.url.rsplit(":", 1)[1]))
        listed = httpx.get(srv.url + "/v2/sandboxes", headers={"X-API-KEY": API_KEY}, trust_env=False).json()
        assert {s["sandboxID"] for s in listed} == {running.sandbox_id, paused.sandbox_id}
        assert running.commands.run("echo adopted").stdout == "adopted\n"
    finally:
        stop_server(srv)
    found = wait_clean(before, 20, roots=[str(run_tmp)], under=str(run_tmp))
    assert not found, "left behind:\n" + "\n".join(found.lines()) + f"\n--- server log:\n{srv.log_tail()}"


PYTEST_RUN = '''
import time
import pytest
from aenv.testing.server import API_KEY, start_server, stop_server


@pytest.fixture(scope="session")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("srv"), "ns", {"AENV_POOL_SIZE": "1"})
    yield server
    stop_server(server)


def test_holds_a_sandbox(srv, local_registry):
    from e2b import Sandbox
    sbx = Sandbox.create("base", timeout=600, api_url=srv.url, sandbox_url=srv.url, api_key=API_KEY)
    sbx.commands.run("true")
    print("sandbox-up", flush=True)
    time.sleep(600)
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_pytest_stopped_mid_test_tears_its_fixtures_down(run_tmp: Path, sig: int) -> None:
    """The test command (``scripts/setup.sh test``) is pytest: stopped in the middle of a test (a CI timeout sends SIGTERM),
    its session fixtures still end their server (and its sandboxes) and registry (``plugin.py``)."""
    tests = run_tmp / "t"
    tests.mkdir()
    (tests / "test_hold.py").write_text(PYTEST_RUN)
    log = run_tmp / "pytest.log"
    before = Record.now()
    run = _spawn([sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", "-p", "tests.fixtures.plugin",
                  "--rootdir", str(tests), "--basetemp", str(run_tmp / "base"), str(tests)], run_tmp, log)  # fmt: skip
    _wait_for("the test's sandbox", lambda: "sandbox-up" in log.read_text(errors="replace"), run)
    assert {"registry", "slirp4netns"} <= {(p.kind or "").split()[0] for p in _ours(run_tmp)()}
    code = _stop(run, sig)
    assert code == 2, log.read_text(errors="replace")[-4000:]  # pytest: interrupted
    _assert_nothing_left(before, run_tmp, log, made_here=("t", "base"))  # base: pytest keeps its basetemp
