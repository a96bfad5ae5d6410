"""A node's side of the cluster directory: it registers a new incarnation at start, binds each sandbox in
the same step as its SQLite row (``Store`` calls ``bind`` before it writes the row, ``unbind`` after it
deletes it), and at start keeps only what the directory still binds to it (``claim``).

Synchronous on purpose: the store is, and a bind is one round trip to a local Redis (a script), so the
row and the binding are written in one step, before the create answers. A refused bind (``Fenced``)
fails the create: this node was declared dead or replaced, and must not take sandboxes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import redis

from aenv.directory import keys
from aenv.errors import Conflict, StoreError, StoreUnavailable

log = logging.getLogger("aenv.directory")


class DirectoryError(StoreError):
    """The directory could not be reached or refused a write."""


class DirectoryUnreachable(DirectoryError, StoreUnavailable):
    """Redis did not answer (down, frozen, partitioned): a create is refused with a 503 and nothing is
    written; running sandboxes are not affected (the data plane does not use the directory)."""


class Fenced(DirectoryError):
    """This node's incarnation is no longer current (declared dead, or started again elsewhere)."""


class NotAdoptable(DirectoryError):
    """The sandbox is not lost with a published pause (any more): another node adopted it, or it never was."""


@dataclass(frozen=True)
class PublishedPause:
    """A lost sandbox's published pause, as its binding holds it (``keys.PUBLISH_PAUSE``)."""

    sandbox_id: str
    node: str  # where it was lost
    reason: str
    snapshot_id: str
    row: dict[str, Any]
    raw: str


def connect(url: str) -> redis.Redis:
    """A client for ``redis://HOST:PORT[/DB]`` or ``unix:///path/to.sock``; short timeouts (soft state)."""
    client: redis.Redis = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                               decode_responses=True)  # fmt: skip
    return client


def _translate(exc: redis.RedisError) -> DirectoryError | Conflict:
    if isinstance(exc, redis.ResponseError) and str(exc).startswith(keys.TAKEN):
        return Conflict(str(exc)[len(keys.TAKEN) + 1:])
    if isinstance(exc, redis.ResponseError) and str(exc).startswith(keys.FENCED):
        return Fenced(str(exc))
    if isinstance(exc, redis.ResponseError) and str(exc).startswith("NOTADOPTABLE"):
        return NotAdoptable(str(exc).removeprefix("NOTADOPTABLE "))
    return DirectoryUnreachable(f"cluster directory unreachable: {type(exc).__name__}: {exc}")


class NodeDirectory:
    """One node's bindings. ``register`` first; then ``bind``/``unbind`` per sandbox."""

    def __init__(self, client: redis.Redis, node_id: str, url: str) -> None:
        self.client = client
        self.node_id = node_id
        self.url = url
        self.incarnation = 0
        self._register = client.register_script(keys.REGISTER)
        self._bind = client.register_script(keys.BIND)
        self._unbind = client.register_script(keys.UNBIND)
        self._publish = client.register_script(keys.PUBLISH_PAUSE)
        self._unpublish = client.register_script(keys.UNPUBLISH_PAUSE)
        self._adopt = client.register_script(keys.ADOPT)
        self._give_back = client.register_script(keys.GIVE_BACK)
        self._bind_volume = client.register_script(keys.BIND_VOLUME)
        self._unbind_volume = client.register_script(keys.UNBIND_VOLUME)
        self._adopt_volume = client.register_script(keys.ADOPT_VOLUME)

    def _keys(self, sandbox_id: str) -> list[str]:
        return [keys.node_key(self.node_id), keys.node_sandboxes_key(self.node_id), keys.sandbox_key(sandbox_id)]

    def _run(self, script: Any, ks: list[str], args: list[Any]) -> Any:
        try:
            return script(keys=ks, args=args)
        except redis.RedisError as exc:
            raise _translate(exc) from exc

    def register(self) -> int:
        """A new incarnation of this node, alive; every earlier one is fenced off from now on."""
        inc = self._run(self._register, [keys.node_key(self.node_id), keys.NODES], [self.node_id, self.url, time.time()])
        self.incarnation = int(inc)
        log.info("cluster node %s (%s): incarnation %d", self.node_id, self.url, self.incarnation)
        return self.incarnation

    def bind(self, sandbox_id: str) -> None:
        """Bind ``sandbox_id`` to this node. Raises Fenced (declared dead or replaced) or DirectoryError."""
        self._run(self._bind, self._keys(sandbox_id), [self.node_id, self.incarnation, sandbox_id])

    def unbind(self, sandbox_id: str) -> None:
        """Drop this node's binding of ``sandbox_id``. Never raises: the sandbox is gone here either way,
        and a binding left behind names a node that answers 404 for it."""
        try:
            self._run(self._unbind, self._keys(sandbox_id), [self.node_id, self.incarnation, sandbox_id])
        except DirectoryError as exc:
            log.warning("sandbox=%s: binding not removed: %s", sandbox_id, exc)

    def publish_pause(self, sandbox_id: str, snapshot_id: str, row: dict[str, Any]) -> bool:
        """Record that ``sandbox_id`` is paused with its state in the snapshot store as ``snapshot_id``:
        another node may run it again under the same id once this one is declared dead. False when the
        binding is no longer this node's live one."""
        blob = json.dumps({"snapshot": snapshot_id, "row": row}, separators=(",", ":"))
        return bool(self._run(self._publish, self._keys(sandbox_id), [self.node_id, self.incarnation, sandbox_id, blob]))

    def unpublish_pause(self, sandbox_id: str) -> None:
        """The sandbox runs again here: its published pause is stale. Never raises (a fenced node's
        bindings are lost anyway; an unreachable directory is logged)."""
        try:
            self._run(self._unpublish, self._keys(sandbox_id), [self.node_id, self.incarnation, sandbox_id])
        except DirectoryError as exc:
            log.warning("sandbox=%s: published pause not withdrawn: %s", sandbox_id, exc)

    def published_pause(self, sandbox_id: str) -> PublishedPause | None:
        """The published pause of a sandbox lost on a dead node; None if it is not lost or has none."""
        try:
            rec = keys.strs(self.client.hgetall(keys.sandbox_key(sandbox_id)))
        except redis.RedisError as exc:
            raise _translate(exc) from exc
        if rec.get("state") != "lost" or not rec.get("paused"):
            return None
        paused = json.loads(rec["paused"])
        return PublishedPause(sandbox_id, rec.get("node", ""), rec.get("reason", ""), str(paused["snapshot"]),
                              dict(paused.get("row") or {}), rec["paused"])  # fmt: skip

    def adopt(self, pause: PublishedPause) -> None:
        """Bind the lost sandbox to this node, once (NotAdoptable: another node was first, or it changed)."""
        self._run(self._adopt, self._keys(pause.sandbox_id),
                  [self.node_id, self.incarnation, pause.sandbox_id, pause.snapshot_id])  # fmt: skip

    def give_back(self, pause: PublishedPause) -> None:
        """An adoption failed after ``adopt`` (and the id was unbound again): the binding says lost and
        published as before, so that another node may try."""
        try:
            self._run(self._give_back, [keys.sandbox_key(pause.sandbox_id)],
                      [pause.sandbox_id, pause.node, pause.reason, pause.raw])  # fmt: skip
        except DirectoryError as exc:
            log.warning("sandbox=%s: published pause not given back after a failed adoption: %s", pause.sandbox_id, exc)

    def claim(self, sandbox_ids: list[str]) -> dict[str, str]:
        """At start, after ``register``: bind to this incarnation the local sandboxes the directory still
        binds to this node; return the others, each with why it is no longer this node's."""
        refused: dict[str, str] = {}
        for sid in sandbox_ids:
            try:
                rec = keys.strs(self.client.hgetall(keys.sandbox_key(sid)))
            except redis.RedisError as exc:
                raise _translate(exc) from exc
            if rec.get("node") == self.node_id and rec.get("state") == "live":
                self.bind(sid)
            elif not rec:
                refused[sid] = f"the cluster directory does not bind it to node {self.node_id}"
            elif rec.get("node") != self.node_id:
                refused[sid] = f"the cluster directory binds it to node {rec.get('node')}"
            else:
                refused[sid] = f"node {self.node_id} was declared dead: {rec.get('reason') or 'lost'}"
        try:
            members = self.client.smembers(keys.node_sandboxes_key(self.node_id))
            stale = {str(m) for m in members} - set(sandbox_ids)
        except redis.RedisError as exc:
            raise _translate(exc) from exc
        for sid in stale:  # bound here, gone from this node's store (it crashed between the two)
            self.unbind(sid)
        return refused

    # ---- volumes: bound like sandboxes, but kept by a node declared dead (their files are its) ------
    def _volume_keys(self, volume_id: str, owner: str, name: str) -> list[str]:
        return [keys.node_key(self.node_id), keys.node_volumes_key(self.node_id), keys.volume_key(volume_id),
                keys.volume_name_key(owner, name)]  # fmt: skip

    def bind_volume(self, volume_id: str, owner: str, name: str) -> None:
        """Bind a volume to this node, its name to it. Raises Conflict (another volume of ``owner`` holds
        ``name``, on any node), Fenced or DirectoryError."""
        self._run(self._bind_volume, self._volume_keys(volume_id, owner, name),
                  [self.node_id, self.incarnation, volume_id, owner, name])  # fmt: skip

    def unbind_volume(self, volume_id: str, owner: str, name: str) -> None:
        """Drop this node's binding of a volume it destroyed. Never raises (as ``unbind``)."""
        try:
            self._run(self._unbind_volume, self._volume_keys(volume_id, owner, name),
                      [self.node_id, self.incarnation, volume_id, owner, name])  # fmt: skip
        except DirectoryError as exc:
            log.warning("volume=%s: binding not removed: %s", volume_id, exc)

    def adopt_volume(self, volume_id: str, owner: str, name: str, dead_node: str) -> None:
        """Take over a volume of the dead node ``dead_node`` whose data came with an adopted pause.
        Raises NotAdoptable (bound elsewhere, or that node is not dead), Conflict, Fenced or DirectoryError."""
        ks = [*self._volume_keys(volume_id, owner, name), keys.node_key(dead_node), keys.node_volumes_key(dead_node)]
        self._run(self._adopt_volume, ks, [self.node_id, self.incarnation, volume_id, owner, name, dead_node])

    def claim_volumes(self, volumes: list[tuple[str, str, str]]) -> dict[str, str]:
        """At start: bind to this incarnation every local volume (``(id, owner, name)``) the directory
        binds here or not at all (it is soft state: the node publishes what its disk holds); return the
        others with why. Unlike sandboxes nothing is removed for it: a volume is data, not a process."""
        refused: dict[str, str] = {}
        for vid, owner, name in volumes:
            try:
                got = self.client.hget(keys.volume_key(vid), "node")
                where = str(got) if got is not None else None
            except redis.RedisError as exc:
                raise _translate(exc) from exc
            if where not in (None, self.node_id):
                refused[vid] = f"the cluster directory binds it to node {where}"
                continue
            try:
                self.bind_volume(vid, owner, name)
            except Conflict as exc:
                refused[vid] = exc.message
        try:
            stale = {str(m) for m in self.client.smembers(keys.node_volumes_key(self.node_id))} - {v[0] for v in volumes}
            for vid in stale:  # bound here, gone from this node's store
                rec = keys.strs(self.client.hgetall(keys.volume_key(vid)))
                self.unbind_volume(vid, rec.get("owner", ""), rec.get("name", ""))
        except redis.RedisError as exc:
            raise _translate(exc) from exc
        return refused

    def close(self) -> None:
        self.client.close()


def mark_dead(client: redis.Redis, node_id: str, reason: str) -> int:
    """The controller's fence: ``node_id`` is dead from now on, its live sandboxes lost (their bindings
    say why). Idempotent; returns how many sandboxes it marked lost."""
    script = client.register_script(keys.MARK_DEAD)
    try:
        return int(script(keys=[keys.node_key(node_id), keys.node_sandboxes_key(node_id)],
                          args=[node_id, reason, time.time()]))  # fmt: skip
    except redis.RedisError as exc:
        raise _translate(exc) from exc
