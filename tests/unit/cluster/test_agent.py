"""The node agent's launch and adoption, without Ray: a stand-in server (answers /health) started
detached, adopted by its pidfile, restarted when the directory fenced its node; and the controller's
pure parts (the node table read, the spec template)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from aenv.cluster.agent import ServeSpec, ensure_serving, pid_alive, stop
from aenv.cluster.controller import fill, plan
from aenv.testing.server import free_port

HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def spec(tmp_path: Path) -> ServeSpec:
    port = free_port()
    return ServeSpec(node="n1", argv=[sys.executable, "-c", HEALTH_SERVER, str(port)], url=f"http://127.0.0.1:{port}",
                     pidfile=str(tmp_path / "run/serve.pid"), log=str(tmp_path / "serve.log"))  # fmt: skip


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])


def test_the_server_is_started_detached_then_adopted(spec: ServeSpec) -> None:
    pid, how = ensure_serving(spec)
    try:
        assert how == "started" and pid_alive(pid)
        assert _ppid(pid) != os.getpid()  # not the agent's child: a worker's clean-up cannot reach it
        assert os.getsid(pid) == pid  # a session of its own
        assert ensure_serving(spec) == (pid, "adopted")
    finally:
        stop(pid)
    assert not pid_alive(pid)


def test_a_fenced_node_s_server_is_restarted(spec: ServeSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    pid, _ = ensure_serving(spec)
    monkeypatch.setattr("aenv.cluster.agent.declared_dead", lambda s: True)
    again, how = ensure_serving(spec)
    try:
        assert how == "restarted" and again != pid and not pid_alive(pid)
    finally:
        stop(again)


def test_a_server_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    spec = ServeSpec(node="n1", argv=[sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
                     url="http://127.0.0.1:1", pidfile=str(tmp_path / "p"), log=str(tmp_path / "l"))  # fmt: skip
    with pytest.raises(RuntimeError, match="(?s)exited.*boom"):
        ensure_serving(spec)


def test_plan_reads_the_node_table() -> None:
    table = [
        {"NodeID": "h", "Alive": True, "Labels": {"aenv-role": "control"}},
        {"NodeID": "a1", "Alive": False, "Labels": {"aenv-node": "n1"}},  # n1 died, then came back as a2
        {"NodeID": "a2", "Alive": True, "Labels": {"aenv-node": "n1"}},
        {"NodeID": "b1", "Alive": False, "Labels": {"aenv-node": "n2"}},
    ]
    alive, dead = plan(table)
    assert {k: v["NodeID"] for k, v in alive.items()} == {"n1": "a2"}
    assert {k: v["NodeID"] for k, v in dead.items()} == {"n2": "b1"}


def test_fill_names_the_node() -> None:
    spec = {"url": "http://{ip}:8000", "argv": ["x", "{node}"], "env": {"A": "{node}/s"}, "n": 1}
    assert fill(spec, node="n2", ip="10.0.0.12") == {"url": "http://10.0.0.12:8000", "argv": ["x", "n2"],
                                                     "env": {"A": "n2/s"}, "n": 1}  # fmt: skip
