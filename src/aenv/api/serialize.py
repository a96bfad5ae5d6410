"""Domain objects → E2B JSON shapes (spec §2.1). The only place that knows those field names."""

from __future__ import annotations

import datetime as dt
from typing import Any

from aenv.core.table import LiveSandbox
from aenv.envd import ENVD_VERSION
from aenv.runtime.base import ResourceSample

CLIENT_ID = "aenv"


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def sandbox(sbx: LiveSandbox) -> dict[str, Any]:
    row = sbx.row
    out: dict[str, Any] = {
        "templateID": row.template_id,
        "sandboxID": row.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "domain": None,
        "trafficAccessToken": None,
    }
    if row.alias:
        out["alias"] = row.alias
    if row.access_token:
        out["envdAccessToken"] = row.access_token
    return out


def _common(sbx: LiveSandbox) -> dict[str, Any]:
    row = sbx.row
    end = row.paused_at if row.state == "paused" and row.paused_at else row.end_at
    out: dict[str, Any] = {
        "templateID": row.template_id,
        "sandboxID": row.id,
        "clientID": CLIENT_ID,
        "startedAt": iso(row.started_at),
        "endAt": iso(end),
        "cpuCount": row.cpu_count,
        "memoryMB": row.memory_mb,
        "diskSizeMB": row.disk_mb,
        "state": row.state,
        "envdVersion": ENVD_VERSION,
        "metadata": row.metadata,
    }
    if row.alias:
        out["alias"] = row.alias
    return out


def detail(sbx: LiveSandbox) -> dict[str, Any]:
    out = _common(sbx)
    row = sbx.row
    out["domain"] = None
    out["allowInternetAccess"] = row.allow_internet
    out["lifecycle"] = {"autoResume": row.auto_resume, "onTimeout": "pause" if row.auto_pause else "kill"}
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
