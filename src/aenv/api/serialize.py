"""Domain objects → E2B JSON shapes (spec §2.1). The only place that knows those field names.

``domain`` in them is what the SDKs build sandbox host names from (``sbx.get_host(port)`` is
``<port>-<id>.<domain>``, and without ``E2B_SANDBOX_URL`` envd is ``https://49983-<id>.<domain>``). It is the
``sandbox_domain`` setting, or else derived from the request (``DOMAIN``, set per request by the app): a
client that reached the API as ``api.<domain>`` (only ``E2B_DOMAIN`` set) gets that domain back, any other
``localhost:<the port it used>``, names under ``localhost`` that the SDK's own resolver, curl and browsers
send to this machine.
"""

from __future__ import annotations

import datetime as dt
from contextvars import ContextVar
from typing import Any

from aenv.core import network as net
from aenv.core.compose import ComposeResult
from aenv.core.table import LiveSandbox
from aenv.envd import ENVD_VERSION
from aenv.kinds import SandboxState
from aenv.runtime.base import ResourceSample
from aenv.store.secrets import SecretRow
from aenv.store.volumes import VolumeRow

CLIENT_ID = "aenv"

# The sandbox domain for the responses of the request being served (see the module docstring).
DOMAIN: ContextVar[str | None] = ContextVar("aenv_sandbox_domain", default=None)


def domain_for(headers: list[tuple[bytes, bytes]], server_port: int | None, configured: str | None) -> str:
    """The sandbox domain to answer a request with: ``configured`` if set, else ``X`` for a request to
    ``api.X`` (E2B's naming), else ``localhost`` with the port the client named (or the one it reached)."""
    if configured:
        return configured
    host = next((v.decode("latin-1").strip().lower() for k, v in headers if k == b"host"), "")
    if host.startswith("api.") and len(host) > 4:
        return host[4:]
    _, sep, port = host.rpartition(":")
    if sep and port.isdigit():  # "[::1]:8000" too; "[::1]" ends in "1]"
        return f"localhost:{port}"
    if host or not server_port:  # a Host with no port: the scheme's own
        return "localhost"
    return f"localhost:{server_port}"


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def sandbox(sbx: LiveSandbox) -> dict[str, Any]:
    row = sbx.row
    out: dict[str, Any] = {
        "templateID": row.template_id,
        "sandboxID": row.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "domain": DOMAIN.get(),
        "trafficAccessToken": row.traffic_token,  # None unless allowPublicTraffic was false
    }
    if row.alias:
        out["alias"] = row.alias
    if row.access_token:
        out["envdAccessToken"] = row.access_token
    return out


_RECORD_KEYS = ("templateID", "sandboxID", "alias", "startedAt", "cpuCount", "memoryMB", "diskSizeMB")


def record(sbx: LiveSandbox) -> dict[str, Any]:
    """E2B's ``SandboxRecord`` of a sandbox this server holds (the detail's fields it shares): its run has
    not ended (``stoppedAt`` null) and nothing of it has passed a retention window."""
    common = _common(sbx)
    return {**{k: common[k] for k in _RECORD_KEYS if k in common}, "retentionExpired": False,
            "eventsRetentionExpired": False, "stoppedAt": None, "domain": DOMAIN.get()}


def compose(result: ComposeResult) -> dict[str, Any]:
    """A compose sandbox's project: each service's state and its published ports, with the host the
    sandbox proxy serves each under (what the SDK's ``sbx.get_host(port)`` says)."""
    sid, domain = result.sandbox.id, DOMAIN.get()
    return {"project": result.project, "services": [
        {"name": s.name, "state": s.state, "health": s.health or None, "exitCode": s.exit_code,
         "ports": [{"port": p.published, "target": p.target, "protocol": p.protocol,
                    "host": f"{p.published}-{sid}.{domain}"} for p in s.ports]}
        for s in result.services]}


def _common(sbx: LiveSandbox) -> dict[str, Any]:
    row = sbx.row
    shown = sbx.state.shown
    end = row.paused_at if shown is SandboxState.PAUSED and row.paused_at else row.end_at
    out: dict[str, Any] = {
        "templateID": row.template_id,
        "sandboxID": row.id,
        "clientID": CLIENT_ID,
        "startedAt": iso(row.started_at),
        "endAt": iso(end),
        "cpuCount": row.cpu_count,
        "memoryMB": row.memory_mb,
        "diskSizeMB": row.disk_mb,
        "state": str(shown),
        "envdVersion": ENVD_VERSION,
        "metadata": row.metadata,
    }
    if row.alias:
        out["alias"] = row.alias
    if row.volume_mounts:
        out["volumeMounts"] = [{"name": m["name"], "path": m["path"]} for m in row.volume_mounts]
    return out


def volume(row: VolumeRow, *, token: bool = True) -> dict[str, Any]:
    """E2B ``VolumeAndToken`` (create, get) or ``Volume`` (list)."""
    out: dict[str, Any] = {"volumeID": row.id, "name": row.name}
    if token:
        out["token"] = row.token
    return out


def secret(row: SecretRow) -> dict[str, Any]:
    """E2B ``Secret``: metadata only (a ``SecretRow`` has no value to show)."""
    return {"secretID": row.id, "name": row.name, "currentVersion": row.version, "metadata": row.metadata,
            "createdAt": iso(row.created_at), "updatedAt": iso(row.updated_at)}


def detail(sbx: LiveSandbox) -> dict[str, Any]:
    out = _common(sbx)
    row = sbx.row
    out["domain"] = DOMAIN.get()
    out["allowInternetAccess"] = row.allow_internet
    if row.network:
        out["network"] = net.shown(row.network)  # header rule values masked
    out["lifecycle"] = {"autoResume": row.auto_resume, "onTimeout": "pause" if row.auto_pause else "kill"}
    if sbx.state is SandboxState.PAUSED and row.pause_mode is not None:
        out["pauseMode"] = str(row.pause_mode)  # what the pause kept: full, or filesystem (files only)
    if row.access_token:
        out["envdAccessToken"] = row.access_token
    return out


def listed(sbx: LiveSandbox) -> dict[str, Any]:
    return _common(sbx)


def metric(s: ResourceSample) -> dict[str, Any]:
    return {
        "timestamp": iso(s.timestamp),
        "timestampUnix": int(s.timestamp),
        "cpuCount": s.cpu_count,
        "cpuUsedPct": round(s.cpu_used_pct, 2),
        "memUsed": s.mem_used,
        "memTotal": s.mem_total,
        "memCache": s.mem_cache,
        "diskUsed": s.disk_used,
        "diskTotal": s.disk_total,
    }
