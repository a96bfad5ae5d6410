"""Tree search over sandboxes: expand a node k ways by fork, score the children, prune, roll back.

An agent exploring actions (MCTS, beam search, best-first over tool calls) needs what a group needs,
repeated: branch the current state, try something in each branch, drop the bad branches, and go back
to a good state to try again. aenv's fork copies a running sandbox, memory included where the runtime
can; its snapshots and rollback return a sandbox to an earlier state under the same ID. ``SearchTree``
holds the bookkeeping (which sandbox is which node, their depth, score and checkpoint) and ends every
live node on exit; ``beam_search`` is the common loop on top of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Self

from aenv.client import ConflictError
from aenv.rl._connection import client
from aenv.rl._episode import Episode
from aenv.rl._kill import deadline as kill_deadline
from aenv.rl._kill import kill_until
from aenv.rl._lease import Lease


@dataclass(eq=False)
class Node:
    sandbox_id: str
    depth: int
    parent: Node | None = None
    score: float | None = None
    checkpoint: str | None = None  # the snapshot ``SearchTree.checkpoint`` took of it
    alive: bool = True
    children: list[Node] = field(default_factory=list)


class SearchTree:
    """``with SearchTree(root_sandbox_id) as tree:`` — every node still alive is killed on exit."""

    def __init__(self, root_sandbox_id: str, *, timeout: int = 300, lease: Lease | None = None,
                 **connection: Any) -> None:
        self.timeout, self.lease, self.connection = timeout, lease, connection
        self.root = Node(root_sandbox_id, 0)
        self.nodes: list[Node] = [self.root]
        self.fork_mode: str | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.prune([n for n in self.nodes if n.alive])

    def episode(self, node: Node, label: str = "") -> Episode:
        """An episode attached to ``node``'s sandbox (kept alive while open, not killed on exit)."""
        return Episode(rollout_id=f"{node.sandbox_id}{label}", sandbox_id=node.sandbox_id, kill=False,
                       timeout=self.timeout, **self.connection)

    def expand(self, node: Node, k: int) -> list[Node]:
        """Fork ``node`` into ``k`` children (fewer if some forks fail: the errors are not nodes)."""
        with client(self.connection) as c:
            result = c.fork(node.sandbox_id, k, timeout=self.timeout)
        self.fork_mode = result.mode
        children = [Node(sid, node.depth + 1, node) for sid in result.sandbox_ids]
        node.children += children
        self.nodes += children
        return children

    def checkpoint(self, node: Node, name: str | None = None) -> str:
        """Snapshot ``node`` (processes too where the runtime can) to come back to with ``rollback``."""
        with client(self.connection) as c:
            try:
                snap = c.snapshot(node.sandbox_id, name=name, mode="full")
            except ConflictError:  # a runtime here without process snapshots: files only
                snap = c.snapshot(node.sandbox_id, name=name, mode="filesystem")
        node.checkpoint = snap.snapshot_id
        return snap.snapshot_id

    def rollback(self, node: Node, snapshot_id: str | None = None) -> None:
        """Put ``node``'s sandbox back to ``snapshot_id`` (default: its own checkpoint), same ID."""
        target = snapshot_id or node.checkpoint
        if target is None:
            raise ValueError(f"node {node.sandbox_id} has no checkpoint: call checkpoint() first")
        with client(self.connection) as c:
            c.rollback(node.sandbox_id, target)

    def prune(self, nodes: list[Node]) -> None:
        """Kill these nodes' sandboxes (their descendants live on: they are sandboxes of their own)."""
        from e2b import Sandbox

        until = kill_deadline()
        for n in nodes:
            if n.alive:
                kill_until(functools.partial(Sandbox.kill, n.sandbox_id, **self.connection), until)
                n.alive = False

    def keep_best(self, nodes: list[Node], k: int) -> list[Node]:
        """The ``k`` best scored of ``nodes`` (unscored ones count as worst); the others are pruned."""
        ranked = sorted(nodes, key=lambda n: (n.score is not None, n.score or 0.0), reverse=True)
        self.prune(ranked[k:])
        return ranked[:k]

    def score(self, nodes: list[Node], fn: Callable[[Episode, Node], float]) -> None:
        """Run ``fn(episode, node) -> score`` on every node at once; a failure leaves its score None."""
        def one(n: Node) -> None:
            try:
                with self.episode(n, f"-d{n.depth}") as ep:
                    n.score = fn(ep, n)
            except Exception:  # noqa: BLE001 - one branch's failure is that branch's, not the search's
                n.score = None

        with ThreadPoolExecutor(max(1, len(nodes))) as pool:
            list(pool.map(one, nodes))


def beam_search(template: str, step: Callable[[Episode, Node], float], *, width: int = 2, branch: int = 4,
                depth: int = 2, prepare: Callable[[Episode], None] | None = None, timeout: int = 300,
                lease: Lease | None = None, **connection: Any) -> tuple[Node, SearchTree]:
    """Prepare a root, then ``depth`` times: expand each of the ``width`` best nodes ``branch`` ways,
    score every child with ``step``, keep the ``width`` best. Returns the best leaf (left running:
    kill it when done) and the tree (every other node already killed)."""
    root_ep = Episode(template, rollout_id=f"beam-{id(step):x}", timeout=timeout, kill=False, suppress_infra=False,
                      lease=lease, **connection)
    with root_ep:
        if prepare is not None:
            prepare(root_ep)
    tree = SearchTree(root_ep.sandbox.sandbox_id, timeout=timeout, lease=lease, **connection)
    frontier = [tree.root]
    try:
        for _ in range(depth):
            children = [c for n in frontier for c in tree.expand(n, branch)]
            tree.prune(frontier)  # their children carry the state on
            tree.score(children, step)
            frontier = tree.keep_best(children, width)
        best = frontier[0]
        tree.prune(frontier[1:])
        return best, tree
    except BaseException:
        tree.prune([n for n in tree.nodes if n.alive])
        raise
