"""The controller: one detached, named Ray actor (``aenv-controller``, restarted by Ray anywhere) that
keeps one node agent per aenv node and fences nodes Ray declares dead.

Each round (``period`` seconds) it reads Ray's node table (``ray.nodes()``). A node is an aenv node when
it carries the label ``aenv-node=<name>`` (``ray start --labels aenv-node=n1``).

- for each alive one it makes sure an agent exists: named ``aenv-agent-<name>-<ray node id>``, detached,
  pinned by ``NodeAffinitySchedulingStrategy(soft=False)``, ``num_cpus=0``; a rejoined machine is a new
  Ray node, hence a new agent, which adopts (or, fenced, restarts) the node's ``aenv serve``;
- for a dead one with no alive successor of the same name it calls the directory's ``mark_dead``: the
  node gets no creates, its sandboxes are lost (404 naming it), its incarnation fenced; and it kills
  the dead node's agent handle, so Ray stops trying to restart it.

All state is in Ray's node table and Redis: a restarted controller rebuilds it in one round (agents
are found again with ``get_if_exists``; ``mark_dead`` is idempotent).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("aenv.cluster")

NAMESPACE = "aenv"
CONTROLLER = "aenv-controller"
NODE_LABEL = "aenv-node"


def fill(template: Any, **values: str) -> Any:
    """``template`` (JSON-like) with ``{name}`` placeholders in its strings replaced."""
    if isinstance(template, str):
        return template.format(**values)
    if isinstance(template, list):
        return [fill(t, **values) for t in template]
    if isinstance(template, dict):
        return {k: fill(v, **values) for k, v in template.items()}
    return template


def plan(nodes: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Ray's node table → (alive aenv nodes by name, dead ones by name that have no alive successor)."""
    alive: dict[str, dict[str, Any]] = {}
    dead: dict[str, dict[str, Any]] = {}
    for n in nodes:
        name = (n.get("Labels") or {}).get(NODE_LABEL)
        if not name:
            continue
        if n.get("Alive"):
            alive[name] = n
        else:
            dead[name] = n
    return alive, {k: v for k, v in dead.items() if k not in alive}


class Controller:
    """The actor's body (``actor_class`` wraps it). ``spec`` is a ``ServeSpec`` template whose strings
    may name ``{node}`` (the label's name) and ``{ip}`` (the Ray node's address)."""

    def __init__(self, redis_url: str, spec: dict[str, Any], period: float = 1.0) -> None:
        self.redis_url = redis_url
        self.spec = spec
        self.period = period
        self.agents: dict[str, Any] = {}  # Ray node id -> actor handle
        self.ready: dict[str, Any] = {}  # Ray node id -> status() reference, or its answer
        self.names: dict[str, str] = {}  # Ray node id -> aenv node name
        self.fenced: dict[str, float] = {}  # aenv node name -> when this controller fenced it
        self.errors: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aenv-controller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - one bad round must not end the controller
                log.exception("controller round failed")
                self.errors["round"] = repr(exc)
            self._stop.wait(self.period)

    def tick(self) -> None:
        import ray

        from aenv.directory.node import connect, mark_dead

        alive, dead = plan(ray.nodes())
        for name, n in alive.items():
            self._ensure_agent(name, n)
        self._collect()
        if not dead:
            return
        client = connect(self.redis_url)
        try:
            for name, n in dead.items():
                node_id = n["NodeID"]
                why = n.get("DeathReasonMessage") or "missed its health checks"
                lost = mark_dead(client, name, f"Ray declared node {name} dead (ray node {node_id[:12]}: {why})")
                if lost or name not in self.fenced:
                    log.warning("node %s (ray %s) dead: %d sandboxes lost", name, node_id[:12], lost)
                    self.fenced.setdefault(name, time.time())
                handle = self.agents.pop(node_id, None)
                if handle is not None:
                    ray.kill(handle, no_restart=True)
        finally:
            client.close()

    def _ensure_agent(self, name: str, n: dict[str, Any]) -> None:
        node_id = n["NodeID"]
        if node_id in self.agents:
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from aenv.cluster.agent import actor_class

        spec = fill(self.spec, node=name, ip=n["NodeManagerAddress"])
        handle = actor_class().options(
            name=f"aenv-agent-{name}-{node_id[:12]}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(spec)  # fmt: skip
        self.agents[node_id] = handle
        self.names[node_id] = name
        self.ready[node_id] = handle.status.remote()
        self.fenced.pop(name, None)
        log.info("node %s (ray %s): agent placed", name, node_id[:12])

    def _collect(self) -> None:
        import ray

        refs = [r for r in self.ready.values() if isinstance(r, ray.ObjectRef)]
        if not refs:
            return
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for node_id, ref in list(self.ready.items()):
            if isinstance(ref, ray.ObjectRef) and ref in done:
                try:
                    self.ready[node_id] = ray.get(ref)
                    self.errors.pop(self.names[node_id], None)
                except Exception as exc:  # noqa: BLE001 - the agent's constructor failed: say why, retry later
                    self.errors[self.names[node_id]] = str(exc)[-2000:]
                    self.agents.pop(node_id, None)
                    self.ready.pop(node_id, None)

    def status(self) -> dict[str, Any]:
        """Each node: its Ray node id, its agent's last answer (or 'starting'), and recent errors."""
        out: dict[str, Any] = {"nodes": {}, "fenced": dict(self.fenced), "errors": dict(self.errors)}
        for node_id, name in self.names.items():
            if node_id in self.agents:
                got = self.ready.get(node_id)
                out["nodes"][name] = {"rayNodeID": node_id, "agent": got if isinstance(got, dict) else "starting"}
        return out

    def shutdown(self) -> None:
        self._stop.set()


def actor_class() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=4)(Controller)


def start_controller(redis_url: str, spec: dict[str, Any], period: float = 1.0) -> Any:
    """The singleton (created if missing): call inside ``ray.init``."""
    return actor_class().options(name=CONTROLLER, namespace=NAMESPACE, lifetime="detached",
                                 get_if_exists=True).remote(redis_url, spec, period)  # fmt: skip
