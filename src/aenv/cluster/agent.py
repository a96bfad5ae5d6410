"""The node agent: one detached Ray actor per node, pinned to it, that starts or adopts the node's
``aenv serve``.

The server is never the agent's child. It is launched through ``setsid -f``: setsid forks, the server
runs in the grandchild in a session of its own, and the agent's direct child (setsid itself) exits at
once. Ray's worker clean-up (``RAY_kill_child_processes_on_worker_exit``: a worker kills its direct
children when it exits) therefore finds nothing to kill when the actor dies or is restarted, and the
raylet's subreaper option (off by default) must stay off: it would kill grandchildren too, i.e. every
sandbox. The server writes its pid to ``pidfile`` (the shell's ``echo $$`` before it execs), which is how
a restarted agent adopts it: pid alive and ``/health`` answering.

A node the directory declared dead (Ray lost it, then it came back as a new Ray node) has a server
whose incarnation is fenced off: the agent restarts that server, which registers a new incarnation and
kills what the directory no longer binds to it (``aenv.core.recovery``).

The actor class is built by ``actor_class()`` so that importing this module does not import Ray.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

HEALTH_TIMEOUT = 300.0  # seconds a fresh server may take (its first start prepares the base template)


@dataclass
class ServeSpec:
    """How one node's ``aenv serve`` runs: the command, its environment, where its pid and log go, and
    the URL it answers at."""

    node: str
    argv: list[str]
    url: str
    pidfile: str
    log: str
    env: dict[str, str] = field(default_factory=dict)
    redis: str | None = None  # the cluster directory, to see whether this node was declared dead

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (its parent has not reaped it) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def read_pid(pidfile: str) -> int | None:
    try:
        return int(Path(pidfile).read_text().strip())
    except (OSError, ValueError):
        return None


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(url + "/health", timeout=timeout, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def declared_dead(spec: ServeSpec) -> bool:
    """Whether the directory says this node is dead (its server's incarnation is fenced off)."""
    if not spec.redis:
        return False
    from aenv.directory import keys
    from aenv.directory.node import connect

    client = connect(spec.redis)
    try:
        return client.hget(keys.node_key(spec.node), "status") == "dead"
    finally:
        client.close()


def launch(spec: ServeSpec) -> None:
    """Start the server detached (``setsid -f``): not this process's child once setsid has exited."""
    Path(spec.pidfile).parent.mkdir(parents=True, exist_ok=True)
    Path(spec.pidfile).unlink(missing_ok=True)
    env = {**os.environ, **spec.env}
    with open(spec.log, "ab") as log:
        subprocess.run(["setsid", "-f", "sh", "-c", 'echo $$ > "$0"; exec "$@"', spec.pidfile, *spec.argv],
                       env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True)  # fmt: skip


def stop(pid: int, timeout: float = 30.0) -> None:
    """SIGTERM the server (its sandboxes outlive it, as always), SIGKILL after ``timeout``."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_healthy(spec: ServeSpec, timeout: float = HEALTH_TIMEOUT) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = read_pid(spec.pidfile)
        if pid is not None and not pid_alive(pid):
            tail = Path(spec.log).read_text(errors="replace")[-3000:] if Path(spec.log).exists() else ""
            raise RuntimeError(f"aenv serve of node {spec.node} exited:\n{tail}")
        if pid is not None and healthy(spec.url):
            return pid
        time.sleep(0.2)
    raise RuntimeError(f"aenv serve of node {spec.node} did not answer {spec.url}/health in {timeout:.0f} s")


def ensure_serving(spec: ServeSpec) -> tuple[int, str]:
    """Adopt the node's running server, restart it if the directory fenced it off, else start it.
    Returns its pid and what was done (adopted | restarted | started)."""
    pid = read_pid(spec.pidfile)
    if pid is not None and pid_alive(pid):
        if not declared_dead(spec) and healthy(spec.url, timeout=5.0):
            return pid, "adopted"
        stop(pid)
        launch(spec)
        return wait_healthy(spec), "restarted"
    launch(spec)
    return wait_healthy(spec), "started"


class NodeAgent:
    """The actor's body (wrapped by ``actor_class``): it holds no state Ray must keep."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = ServeSpec(**spec)
        self.pid, self.how = ensure_serving(self.spec)

    def status(self) -> dict[str, Any]:
        alive = pid_alive(self.pid)
        return {"node": self.spec.node, "pid": self.pid, "how": self.how, "alive": alive, "url": self.spec.url,
                "healthy": alive and healthy(self.spec.url)}  # fmt: skip

    def ensure(self) -> dict[str, Any]:
        """Start the server again if it is gone (the controller calls this when it sees it down)."""
        if not pid_alive(self.pid):
            self.pid, self.how = ensure_serving(self.spec)
        return self.status()

    def stop_serving(self) -> None:
        stop(self.pid)


def actor_class() -> Any:
    """``NodeAgent`` as a Ray actor class (imports Ray)."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(NodeAgent)
