"""``AenvClient``: aenv's own REST extensions (snapshots, fork with its mode, rollback) over httpx.

For everything E2B already has (create, commands, files) use the e2b SDK against the same server.
httpx errors are translated here, once, into the tree in ``_errors.py``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Self

import httpx

from aenv.client._errors import ServerUnreachable, error_for

DEFAULT_URL = "http://127.0.0.1:8000"


def _retry_after(resp: httpx.Response) -> float | None:
    """Seconds to wait before sending again a request the server refused without doing anything (a 503
    with ``Retry-After``, not marked ``Should-Retry: false``); None: take the answer as it is."""
    if resp.status_code != 503 or resp.headers.get("should-retry", "").lower() == "false":
        return None
    try:
        return min(5.0, max(0.1, float(resp.headers["retry-after"])))
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class Snapshot:
    snapshot_id: str
    mode: str  # "full" (files + processes) or "filesystem"
    sandbox_id: str | None
    parent_id: str | None
    names: list[str] = field(default_factory=list)
    size_bytes: int = 0
    created_at: str = ""
    paused_ms: float | None = None  # how long the sandbox was stopped to take it (when the runtime says)
    writing: bool = False  # files still being written after the call (usable; size_bytes not final)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Snapshot:
        paused = d.get("pausedMs")
        return cls(snapshot_id=d["snapshotID"], mode=d["mode"], sandbox_id=d.get("sandboxID"),
                   parent_id=d.get("parentID"), names=list(d.get("names") or []),
                   size_bytes=int(d.get("sizeBytes") or 0), created_at=d.get("createdAt", ""),
                   paused_ms=float(paused) if isinstance(paused, (int, float)) else None,
                   writing=bool(d.get("writing", False)), raw=d)


@dataclass(frozen=True)
class ForkResult:
    """One fork call: the children that started, the per-child errors, and what was really copied."""

    mode: str | None  # "full" or "filesystem" (ns without CRIU forks files only)
    sandbox_ids: list[str]
    errors: list[str]
    snapshot_id: str | None  # the internal fork point (GET /snapshots/{id} shows it)
    raw: list[dict[str, Any]] = field(default_factory=list, repr=False, compare=False)


class AenvClient:
    """Synchronous client for an aenv server. Use as a context manager or call ``close()``.

    ``retry_for``: for that many seconds, a request that never reached the server (its connection refused:
    a gateway restarting) is sent again, and so is one the server answered 503 with ``Retry-After`` (it
    changed nothing: the cluster directory away, no live node), after the time it asks (at most 5 s)."""

    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None, *, timeout: float = 120.0,
                 transport: httpx.BaseTransport | None = None, retry_for: float = 0.0) -> None:
        headers = {"X-API-KEY": api_key} if api_key else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout, trust_env=False,
                                  transport=transport)
        self.retry_for = retry_for

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        deadline = time.monotonic() + self.retry_for
        for attempt in itertools.count():
            try:
                resp = self._http.request(method, path, **kw)
            except httpx.ConnectError as exc:  # no connection: nothing was sent
                if time.monotonic() >= deadline:
                    raise ServerUnreachable(f"{method} {path}: {exc}") from exc
                wait = min(1.0, 0.1 * 2**attempt)
            except httpx.TimeoutException as exc:  # sent, maybe done: never again
                raise ServerUnreachable(f"{method} {path}: {exc}") from exc
            else:
                wait = _retry_after(resp)
                if wait is None or time.monotonic() >= deadline:
                    if resp.status_code >= 400:
                        raise error_for(resp)
                    return resp
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
        raise AssertionError("unreachable")

    # ---- snapshots ------------------------------------------------------------------------------
    def snapshot(self, sandbox_id: str, *, name: str | None = None, mode: str = "full") -> Snapshot:
        """Snapshot a sandbox. ``mode="full"`` raises ConflictError where only files can be saved."""
        body: dict[str, Any] = {"mode": mode, **({"name": name} if name else {})}
        return Snapshot.from_json(self._request("POST", f"/sandboxes/{sandbox_id}/snapshots", json=body).json())

    def list_snapshots(self, sandbox_id: str | None = None, name: str | None = None) -> list[Snapshot]:
        params = {k: v for k, v in (("sandboxID", sandbox_id), ("name", name)) if v}
        out: list[Snapshot] = []
        token: str | None = None
        while True:
            resp = self._request("GET", "/snapshots", params={**params, **({"nextToken": token} if token else {})})
            out += [Snapshot.from_json(d) for d in resp.json()]
            token = resp.headers.get("x-next-token")
            if not token:
                return out

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return Snapshot.from_json(self._request("GET", f"/snapshots/{snapshot_id}").json())

    def wait_written(self, snapshot_id: str, timeout: float = 60.0) -> Snapshot:
        """The snapshot once the server has written all its files (``writing`` false): its final
        ``size_bytes``. It is usable before; this is for callers that want the size or the files."""
        deadline = time.monotonic() + timeout
        while (snap := self.get_snapshot(snapshot_id)).writing:
            if time.monotonic() > deadline:
                raise TimeoutError(f"snapshot {snapshot_id}: files still being written after {timeout:g} s")
            time.sleep(0.02)
        return snap

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Raises ConflictError while a sandbox or another snapshot still uses it."""
        self._request("DELETE", f"/templates/{snapshot_id}")

    # ---- fork and rollback ----------------------------------------------------------------------
    def fork(self, sandbox_id: str, count: int = 1, *, timeout: int | None = None) -> ForkResult:
        body: dict[str, Any] = {"count": count, **({"timeout": timeout} if timeout is not None else {})}
        resp = self._request("POST", f"/sandboxes/{sandbox_id}/fork", json=body)
        entries: list[dict[str, Any]] = resp.json()
        ok = [e for e in entries if "sandbox" in e]
        return ForkResult(
            mode=resp.headers.get("x-aenv-fork-mode") or next((e.get("mode") for e in ok), None),
            sandbox_ids=[e["sandbox"]["sandboxID"] for e in ok],
            errors=[e["error"]["message"] for e in entries if "error" in e],
            snapshot_id=next((e.get("snapshotID") for e in ok), None),
            raw=entries,
        )

    def rollback(self, sandbox_id: str, snapshot_id: str) -> dict[str, Any]:
        """Put the sandbox back to an earlier snapshot of its lineage; same ID and access token."""
        return dict(self._request("POST", f"/sandboxes/{sandbox_id}/rollback", json={"snapshotID": snapshot_id}).json())

    # ---- heartbeat leases -----------------------------------------------------------------------
    def create_lease(self, ttl: float, name: str = "") -> dict[str, Any]:
        """A lease (``leaseID``, ``expiresAt``, ...): sandboxes tagged ``aenv.lease=<id>`` end with it."""
        return dict(self._request("POST", "/aenv/leases", json={"ttl": ttl, "name": name}).json())

    def heartbeat(self, lease_id: str) -> dict[str, Any]:
        """Push the lease's expiry to now + ttl. Raises GoneError once it ended (its sandboxes are dead)."""
        return dict(self._request("POST", f"/aenv/leases/{lease_id}/heartbeat").json())

    def end_lease(self, lease_id: str) -> dict[str, Any]:
        """End the lease now and kill its sandboxes; the answer lists them (``killed``, ``failed``)."""
        return dict(self._request("DELETE", f"/aenv/leases/{lease_id}").json())
