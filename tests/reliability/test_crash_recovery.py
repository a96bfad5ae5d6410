"""Crash safety: SIGKILL the server at every fault point, restart it on the same state, check the world.

For each point in ``aenv.faults.POINTS`` the test builds the same scene through the real SDK:

* ``A`` running, with a file and a background process;
* ``P`` paused, with a file and a background process;
* ``V`` the victim, on which the armed action runs and the server dies mid-way.

Then a fresh server (no fault) starts on the same state dir and must show a consistent world: A still
running with its file and process, P paused and resumable with both, V either usable (with its data)
or cleanly gone (404), and nothing on the host that belongs to a gone sandbox: no process, cgroup,
mount or directory. Killing everything afterwards must leave the state dir's footprint empty.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2b import Sandbox, SandboxState

from aenv.faults import POINTS
from aenv.runtime.ns import criu
from aenv.testing.server import Server
from tests.reliability.helpers import (
    ServerFactory,
    api,
    leaks,
    orphan_slirps,
    sdk_kwargs,
    slirps_with_dead_target,
    wait_dead,
)

KEEPER = "sleep 100000"  # a long-running background process


@dataclass
class Member:
    """One sandbox of the scene and the data it must keep."""

    sandbox_id: str
    file_path: str
    content: str
    pid: int


def _populate(sbx: Sandbox, tag: str) -> Member:
    path = f"/home/user/{tag}.txt"
    content = f"data of {tag} " * 50
    sbx.files.write(path, content)
    handle = sbx.commands.run(KEEPER, background=True, timeout=0)
    handle.disconnect()
    return Member(sbx.sandbox_id, path, content, handle.pid)


def _assert_intact(m: Member, conn: dict[str, str], processes: bool = True) -> Sandbox:
    """Connect (resuming if paused) and check the file and the background process survived
    (``processes=False``: a files-only pause or cold start was under way, so the process is gone)."""
    sbx = Sandbox.connect(m.sandbox_id, **conn)
    assert sbx.files.read(m.file_path) == m.content, f"{m.sandbox_id}: file content changed"
    pids = {p.pid for p in sbx.commands.list()}
    if processes:
        assert m.pid in pids, f"{m.sandbox_id}: background process {m.pid} lost (have {sorted(pids)})"
    else:
        assert m.pid not in pids, f"{m.sandbox_id}: process {m.pid} outlived a files-only pause"
    assert sbx.commands.run("echo alive").stdout.strip() == "alive"
    return sbx


def _store_ids(state_dir: Path) -> dict[str, str]:
    """Sandbox rows as the dead server left them (id -> state), read straight from SQLite."""
    db = sqlite3.connect(f"file:{state_dir / 'aenv.db'}?mode=ro", uri=True)
    try:
        return dict(db.execute("SELECT id, state FROM sandboxes").fetchall())
    finally:
        db.close()


def _capabilities(server: Server) -> dict[str, object]:
    with api(server) as c:
        return c.get("/aenv/info").json().get("capabilities", {})


# point -> (action run on the victim, which hit of the point fires given the scene's own actions)
# The scene itself creates A, P (and V unless V is the create) and pauses P (and V for resume).
CASES: dict[str, tuple[str, int]] = {
    "create.stored": ("create", 3),
    "create.started": ("create", 3),
    "pause.stored": ("pause", 2),
    "pause.done": ("pause", 2),
    "pause.fs.stored": ("pause_files", 1),
    "pause.fs.done": ("pause_files", 1),
    "resume.stored": ("resume", 1),
    "resume.done": ("resume", 1),
    "resume.cold.stored": ("resume_cold", 1),
    "resume.cold.done": ("resume_cold", 1),
    "kill.stored": ("kill", 1),
    "kill.done": ("kill", 1),
    "snapshot.stored": ("snapshot", 1),
    "snapshot.done": ("snapshot", 1),
    "fork.stored": ("fork", 1),
    "fork.done": ("fork", 1),
    # ns with CRIU, paused sandboxes released to disk at once: P's release is the first hit
    "ns.release.marked": ("release", 2),
    "ns.release.restored": ("resume", 1),
}
# extra server settings a case needs (both servers of the case run with them)
CASE_ENV: dict[str, dict[str, str]] = {
    "ns.release.marked": {"AENV_NS_RELEASE_PAUSED_AFTER": "0"},
    "ns.release.restored": {"AENV_NS_RELEASE_PAUSED_AFTER": "0"},
}
# where the victim must end up: usable (with its data) or gone; None = either is consistent
EXPECT: dict[str, str | None] = {
    "create.stored": "gone", "create.started": "gone",
    "pause.stored": "usable", "pause.done": "usable",
    "pause.fs.stored": "usable", "pause.fs.done": "usable",
    "resume.stored": "usable", "resume.done": "usable",
    "resume.cold.stored": "usable", "resume.cold.done": "usable",
    "kill.stored": "gone", "kill.done": "gone",
    "snapshot.stored": "usable", "snapshot.done": "usable",
    "fork.stored": "usable", "fork.done": "usable",
    "ns.release.marked": "usable", "ns.release.restored": "usable",
}


def test_every_point_is_covered() -> None:
    """A new fault point without a crash case here is a gap in the proof."""
    # pull.layer: test_crash_pull.py; ns.slirp.started: below; publish.layer: test_crash_publish.py (S3)
    # ns.snapshot.linked: tests/integration/test_ns_criu_incremental.py (its scene needs two full snapshots)
    assert set(POINTS) - set(CASES) == {"pull.layer", "publish.layer", "ns.slirp.started", "ns.snapshot.linked"}


def _trigger(action: str, server: Server, conn: dict[str, str], victim: Sandbox | None) -> None:
    """Run the armed action; the server dies under it, so any client error is expected."""
    with pytest.raises(Exception):  # noqa: B017 - the server dies: any client error
        if action == "create":
            Sandbox.create("base", timeout=600, **conn)
        elif action == "pause":
            assert victim is not None
            victim.pause()
        elif action == "pause_files":
            assert victim is not None
            victim.pause(mode="filesystem")
        elif action == "release":  # the pause answers; the server dies releasing it right after
            assert victim is not None
            victim.pause()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with api(server) as c:
                    c.get("/health")
                time.sleep(0.1)
            raise RuntimeError("the server did not die releasing the sandbox")
        elif action in ("resume", "resume_cold"):
            assert victim is not None
            Sandbox.connect(victim.sandbox_id, **conn)
        elif action == "kill":
            assert victim is not None
            victim.kill()
            # the SDK maps some transport errors to False; a kill that "succeeded" must not pass silently
            raise RuntimeError("kill returned")
        else:
            assert victim is not None
            with api(server) as c:
                # filesystem snapshots work on every runtime; "full" needs CRIU or the vm runtime
                path, body = ("snapshots", {"mode": "filesystem"}) if action == "snapshot" else ("fork", {})
                c.post(f"/sandboxes/{victim.sandbox_id}/{path}", json=body)
            raise RuntimeError("request returned")


@pytest.mark.parametrize("point", sorted(CASES))
def test_crash_at_fault_point(point: str, servers: ServerFactory) -> None:
    action, nth = CASES[point]
    slirps_before = slirps_with_dead_target()
    env = CASE_ENV.get(point)
    if point.startswith("ns.release.") and (servers.runtime != "ns" or not criu.probe().usable):
        pytest.skip("releasing paused sandboxes to disk is the ns runtime's with CRIU")
    first = servers.start(faults=f"{point}:{nth}", extra_env=env)
    if action in ("snapshot", "fork") and not _capabilities(first).get(action):
        pytest.skip(f"the {servers.runtime} runtime has no {action} support yet")
    conn = sdk_kwargs(first)

    a = _populate(Sandbox.create("base", timeout=600, **conn), "running-a")
    p_sbx = Sandbox.create("base", timeout=600, **conn)
    p = _populate(p_sbx, "paused-p")
    assert p_sbx.pause()
    victim: Sandbox | None = None
    v: Member | None = None
    if action != "create":
        victim = Sandbox.create("base", timeout=600, **conn)
        v = _populate(victim, "victim-v")
        if action == "resume":
            assert victim.pause()
        elif action == "resume_cold":
            assert victim.pause(mode="filesystem")  # its resume is a cold start

    if point == "ns.release.restored":  # the victim's resume must be one from disk
        assert victim is not None
        released = servers.state_dir / "sandboxes" / victim.sandbox_id / "ns" / "released" / "released.json"
        deadline = time.monotonic() + 60
        while not released.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert released.exists(), "the paused victim was not released to disk"
    _trigger(action, first, conn, victim)
    assert wait_dead(first) == -9, f"server did not die at {point}:\n{first.log_tail()}"
    assert f"fault point {point} fired" in first.log_tail(200)
    rows = _store_ids(servers.state_dir)
    victim_id = v.sandbox_id if v else next((i for i in rows if i not in (a.sandbox_id, p.sandbox_id)), None)

    second = servers.start(extra_env=env)
    conn = sdk_kwargs(second)
    with api(second) as c:
        states = {s["sandboxID"]: s["state"] for s in c.get("/v2/sandboxes", params={"state": "running,paused"}).json()}
        assert states.get(a.sandbox_id) == "running", states
        assert states.get(p.sandbox_id) == "paused", states
        victim_status = c.get(f"/sandboxes/{victim_id}").status_code if victim_id else 404

    want = EXPECT[point]
    assert victim_status in (200, 404)
    if want == "gone":
        assert victim_status == 404, f"{point}: victim {victim_id} should be gone, is {states.get(victim_id)}"
    elif want == "usable":
        assert victim_status == 200, f"{point}: victim {victim_id} was lost"

    # Leaks right after recovery: nothing of a gone victim, nothing unaccounted for.
    live = set(states)
    dead = {victim_id} if victim_id and victim_status == 404 else set()
    found = leaks(servers.state_dir, dead, live)
    assert not found, f"after recovery from {point}: {found}"

    _assert_intact(a, conn)
    assert Sandbox.get_info(p.sandbox_id, **conn).state == SandboxState.PAUSED
    _assert_intact(p, conn)
    if victim_status == 200 and v is not None:
        # a files-only pause or cold start was under way: recovery settles it paused, files only
        _assert_intact(v, conn, processes=action not in ("pause_files", "resume_cold"))

    # Everything killed: the state dir's footprint on the host is empty again.
    for sid in live:
        assert Sandbox.kill(sid, **conn)
    found = leaks(servers.state_dir, live | dead, ())
    assert not found, f"after killing everything ({point}): {found}"
    parents = {srv.proc.pid for srv in servers.servers}
    assert orphan_slirps(slirps_before, parents) == set(), "orphan slirp4netns processes"


def test_plain_sigkill_keeps_running_and_paused(servers: ServerFactory) -> None:
    """kill -9 of the server (no fault point): running and paused sandboxes survive with their data,
    twice in a row, and the warm pool of the dead server is reaped."""
    slirps_before = slirps_with_dead_target()
    first = servers.start()
    conn = sdk_kwargs(first)
    a = _populate(Sandbox.create("base", timeout=600, **conn), "survivor-a")
    p_sbx = Sandbox.create("base", timeout=600, **conn)
    p = _populate(p_sbx, "survivor-p")
    assert p_sbx.pause()
    time.sleep(0.5)  # let the warm pool refill, so there is an orphan pool sandbox to reap
    servers.sigkill(first)

    second = servers.start()
    found = leaks(servers.state_dir, (), {a.sandbox_id, p.sandbox_id})
    assert not found, f"after kill -9: {found}"
    conn = sdk_kwargs(second)
    _assert_intact(a, conn)
    assert Sandbox.get_info(p.sandbox_id, **conn).state == SandboxState.PAUSED
    servers.sigkill(second)

    third = servers.start()
    conn = sdk_kwargs(third)
    _assert_intact(a, conn)
    _assert_intact(p, conn)  # resumes here, after two crashes
    for m in (a, p):
        assert Sandbox.kill(m.sandbox_id, **conn)
    found = leaks(servers.state_dir, {a.sandbox_id, p.sandbox_id}, ())
    assert not found, f"after killing everything: {found}"
    assert orphan_slirps(slirps_before, {srv.proc.pid for srv in servers.servers}) == set()


def test_second_server_leaves_first_servers_sandboxes_alone(tmp_path: Path, runtime_name: str) -> None:
    """Two servers with separate state dirs share the host's ``aenv`` cgroup parent. Starting the second
    (its start-up reconciliation) must not kill the first one's sandboxes or warm pool."""
    one = ServerFactory(tmp_path / "one", runtime_name, {"AENV_POOL_SIZE": "1"})
    two = ServerFactory(tmp_path / "two", runtime_name, {"AENV_POOL_SIZE": "0"})
    try:
        s1 = one.start()
        sbx = Sandbox.create("base", timeout=600, **sdk_kwargs(s1))
        sbx.files.write("/home/user/mine.txt", "still here")
        two.start()
        assert sbx.is_running()
        assert sbx.files.read("/home/user/mine.txt") == "still here"
        # and a sandbox handed out of the first server's warm pool (made before the second started) works
        other = Sandbox.create("base", timeout=600, **sdk_kwargs(s1))
        assert other.commands.run("echo ok").stdout.strip() == "ok"
    finally:
        one.close()
        two.close()


def test_crash_between_slirp_start_and_its_record(servers: ServerFactory) -> None:
    """The server dies after spawning a sandbox's slirp4netns but before writing its pid to ns.json.
    slirp does not exit with its netns, so the restart must find it by its target pid and kill it."""
    if servers.runtime != "ns":
        pytest.skip("ns runtime only")
    slirps_before = slirps_with_dead_target()
    first = servers.start(faults="ns.slirp.started", extra_env={"AENV_POOL_SIZE": "0"})
    _trigger("create", first, sdk_kwargs(first), None)
    assert wait_dead(first) == -9
    assert "fault point ns.slirp.started fired" in first.log_tail(200)
    second = servers.start(extra_env={"AENV_POOL_SIZE": "0"})
    assert orphan_slirps(slirps_before, {first.proc.pid, second.proc.pid}) == set()
    assert not leaks(servers.state_dir, (), ())
    sbx = Sandbox.create("base", timeout=60, **sdk_kwargs(second))
    assert sbx.commands.run("echo fine").stdout.strip() == "fine"
    sbx.kill()
