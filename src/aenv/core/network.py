"""E2B's network settings of a sandbox, kept in its row and enforced by the runtime.

The row keeps what the API shows (``SandboxRow.network``: allowOut, denyOut, dnsServers,
allowPublicTraffic, maskRequestHost), the traffic token and whether the sandbox was made with a way
out at all (``has_network``: fixed at create, unlike ``allow_internet``, which an update switches);
from it come the egress policy the runtime enforces (``egress_of``) and what the proxy checks on
inbound traffic (``ingress_of``). The policy is registered with the runtime before a sandbox's
first network namespace exists (create, fork children) and again after a restart (``adopt``, which
fails closed); the runtime keeps it for every namespace it makes for the sandbox (restores into new
QEMUs, cold starts) and ``update`` replaces it live. The orchestrator only calls these steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aenv.config import Settings
from aenv.core import bandwidth
from aenv.core.ids import new_token
from aenv.core.models import NetworkRequest, SandboxState, require_state
from aenv.core.secrets import Secrets
from aenv.errors import InvalidRequest
from aenv.runtime import allowlist
from aenv.runtime.base import EgressCapable, Runtime, RuntimeState, SandboxSpec
from aenv.runtime.egress import ENFORCER
from aenv.runtime.egress_own import OwnHosts
from aenv.runtime.egress_rules import masked
from aenv.runtime.envd_client import ENVD_PORT, egress_trust
from aenv.runtime.envd_client import request as envd_request
from aenv.runtime.netpolicy import EgressPolicy, from_record, parse
from aenv.runtime.network import (
    BLOCKED_RANGES,
    configure_dns,
    configure_own,
    configure_private,
    private_allowlist,
)
from aenv.store.secrets import CaLog
from aenv.store.sqlite import SandboxRow, Store

Bind = Callable[[str], str]

__all__ = ["NetworkRequest", "adopt", "configure", "configure_rules", "egress_of", "enforce", "ingress_of", "private_info",
           "row_fields", "shown", "update"]

log = logging.getLogger("aenv.network")


def configure(settings: Settings) -> None:
    """The server's ``sandbox_dns`` (where every sandbox's queries go, and the egress proxy asks) and
    ``private_egress`` (what sandboxes may reach beyond the internet; host names resolved now), and
    the default bandwidth limits. A bad entry is an ``AllowlistError`` naming it, limits the host
    cannot enforce a ``BandwidthError``: the server does not start."""
    configure_dns(settings.sandbox_dns)
    bandwidth.configure(settings)
    configure_private(allowlist.parse(settings.private_egress, settings.service_ports, allowlist.resolve_on_host))


def private_info(settings: Settings) -> dict[str, Any]:
    """What ``/aenv/info`` shows of the allowlist in force and the package mirrors."""
    return {"privateEgress": private_allowlist().describe(), "hostServices": allowlist.HOST_SERVICES,
            "packageMirrors": dict(settings.package_mirrors)}


def configure_rules(settings: Settings, secrets: Secrets, store: Store) -> None:
    """What the egress proxy's header rules read: secret values (by the ID a rule was bound to), the
    sandboxes' CAs (kept in the store), the operator's extra CA bundle for upstream servers, and this
    server's sandbox hosts (``sandbox_domain``), which a rule may name (``runtime/egress_own.py``)."""
    extra = str(settings.egress_extra_ca) if settings.egress_extra_ca else None
    ENFORCER.configure_rules(secrets.value_of, CaLog(store), extra)
    configure_own(OwnHosts.of(settings))


def row_fields(req: NetworkRequest | None, allow_internet: bool, bind: Bind | None = None,
               limits: dict[str, float] | None = None) -> dict[str, Any]:
    """The network columns of a new sandbox's row (``req`` validated: a 400 names what aenv cannot
    enforce). ``allowOut`` gives a way out even without internet access (``needs_internet``).
    ``bind``: secret name -> ID for the rules' placeholders (the creating owner's secrets).
    ``limits``: aenv's bandwidth of the create (``bandwidth.record``), kept in the same record."""
    record = record_of(req, bind=bind)
    if limits:
        record[bandwidth.KEY] = limits
    return {
        "allow_internet": allow_internet,
        "network": record,
        "traffic_token": new_token() if req is not None and req.allow_public_traffic is False else None,
        "has_network": allow_internet or bool(record.get("allowOut")),
    }


def record_of(req: NetworkRequest | None, keep: dict[str, Any] | None = None, bind: Bind | None = None) -> dict[str, Any]:
    """The row's ``network`` for ``req`` (validated: a 400 names what aenv cannot enforce). ``keep``:
    the settings of the old record an update does not touch (inbound ones). The header rules are kept
    as sent (placeholders, never values) with the secret IDs their names were bound to."""
    if req is None:
        return {}
    if req.rules is not None and bind is None:
        raise InvalidRequest("network.rules: not accepted here")
    policy = parse(req.allow_out, req.deny_out, req.dns_servers, BLOCKED_RANGES, private=private_allowlist(),
                   rules=req.rules, bind=bind)
    out: dict[str, Any] = {}
    if policy.rules:
        out["rules"] = policy.record["rules"]
        out["secretIDs"] = policy.record["secretIDs"]
    if req.allow_out is not None:
        out["allowOut"] = policy.record["allowOut"]
    if req.deny_out is not None:
        out["denyOut"] = policy.record["denyOut"]
    if req.dns_servers is not None:
        out["dnsServers"] = policy.record["dnsServers"]
    for key in ("allowPublicTraffic", "maskRequestHost", bandwidth.KEY):
        if keep and key in keep:
            out[key] = keep[key]
    if req.allow_public_traffic is not None:
        out["allowPublicTraffic"] = req.allow_public_traffic
    if req.mask_request_host is not None:
        if not req.mask_request_host or len(req.mask_request_host) > 253 or any(
            c in req.mask_request_host for c in "\r\n\0 "
        ):
            raise InvalidRequest("network.maskRequestHost: a host name (with ${PORT} where the port goes)")
        out["maskRequestHost"] = req.mask_request_host
    return out


def shown(record: dict[str, Any]) -> dict[str, Any]:
    """A row's ``network`` as API answers show it: the rules' domains and header names, their values
    masked (a value may be a credential given in clear), the bound secret IDs left out."""
    out = {k: v for k, v in record.items() if k != "secretIDs"}
    if isinstance(rules := out.get("rules"), dict):
        out["rules"] = masked(rules)
    return out


def needs_internet(row: SandboxRow) -> bool:
    """Whether the sandbox needs a way out at all: ``allowOut`` keeps its entries reachable even
    with ``allow_internet_access: false`` (E2B: that is the same as denying 0.0.0.0/0)."""
    return row.allow_internet or bool(row.network.get("allowOut"))


def egress_of(row: SandboxRow) -> EgressPolicy | None:
    """The policy the runtime enforces for ``row``; None for none (nothing denied). Without
    internet access it denies everything: a sandbox that has a network (it was made with one, and an
    update took it away) keeps only what ``allowOut`` names."""
    policy = from_record(row.network, BLOCKED_RANGES, private_allowlist())
    if not row.allow_internet:
        policy = policy.with_deny_all()
    return None if policy.empty else policy


def ingress_of(row: SandboxRow) -> tuple[str | None, str | None]:
    """(the traffic token user ports require, or None; the Host to show the sandbox, or None)."""
    mask = row.network.get("maskRequestHost")
    return row.traffic_token, mask if isinstance(mask, str) else None


async def enforce(runtime: Runtime, row: SandboxRow) -> None:
    """Register ``row``'s egress policy and bandwidth limits with the runtime (and apply the policy
    where the sandbox runs)."""
    await bandwidth.register(runtime, row.id, row.network)
    if row.allow_internet and not row.network:
        return  # the common case: no rules
    policy = egress_of(row)
    if not isinstance(runtime, EgressCapable):
        if policy is not None and needs_internet(row):
            raise InvalidRequest(f"network: the {runtime.name} runtime cannot enforce egress rules")
        return
    await runtime.set_egress(row.id, policy)


async def update(runtime: Runtime, store: Any, sbx: Any, req: NetworkRequest, allow_internet: bool | None,
                 bind: Bind | None = None) -> None:
    """``PUT /sandboxes/{id}/network``: the body replaces the egress settings (a field left out is
    cleared; ``allow_internet_access`` left out means true; E2B: ``rules`` "replaces all existing rules
    when provided", and so does aenv), inbound ones stay. Under the sandbox's lock, running or paused;
    a paused sandbox resumes with the new policy in its filter."""
    async with sbx.lock:
        require_state(sbx.id, sbx.state, SandboxState.RUNNING, SandboxState.PAUSED, action="update the network of")
        await _update_locked(runtime, store, sbx, req, allow_internet, bind)
    if sbx.state is SandboxState.RUNNING and (trust := egress_trust(sbx.id, sbx.row.env_vars)):
        await _trust(runtime, sbx.id, trust)


async def _trust(runtime: Runtime, sandbox_id: str, trust: dict[str, Any]) -> None:
    """A running sandbox given header rules trusts its egress CA from now on (an ``/init`` with only
    that: the create's and every restore's ``/init`` carry it too). A sandbox that cannot be told
    keeps running: its TLS to rule domains then fails verification, closed."""
    try:
        stream = await runtime.open_stream(sandbox_id, ENVD_PORT)
        try:
            status, _ = await envd_request(stream, "POST", "/init", trust)
        finally:
            await stream.aclose()
        if status >= 300:
            log.warning("sandbox=%s its envd refused the egress CA (%d)", sandbox_id, status)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.warning("sandbox=%s the egress CA could not be installed: %r", sandbox_id, exc)


async def _update_locked(runtime: Runtime, store: Any, sbx: Any, req: NetworkRequest, allow_internet: bool | None,
                         bind: Bind | None) -> None:
    if not isinstance(runtime, EgressCapable):
        raise InvalidRequest(f"network: the {runtime.name} runtime cannot enforce egress rules")
    row: SandboxRow = sbx.row
    new = replace(row, network=record_of(req, keep=row.network, bind=bind), allow_internet=allow_internet is not False)
    if needs_internet(new) and not sbx.spec.allow_internet:  # the spec says whether it has a network
        raise InvalidRequest(
            "network: this sandbox was created with allow_internet_access: false and has no network; aenv "
            'cannot add one to a running sandbox (create it with denyOut: ["0.0.0.0/0"] instead)'
        )
    policy = egress_of(new)
    row.network, row.allow_internet = new.network, new.allow_internet
    store.update_sandbox(row.id, network=row.network, allow_internet=row.allow_internet)
    await runtime.set_egress(row.id, policy)


async def adopt(runtime: Runtime, row: SandboxRow, spec: SandboxSpec, stopped: bool) -> bool:
    """After a restart: the runtime adopts what survived of the sandbox, then its policy is back in
    force. False when either fails: such a sandbox must not run on without its policy (the caller
    removes it: fail closed)."""
    try:
        await bandwidth.register(runtime, row.id, row.network)  # a slirp4netns started again has them
        if not await runtime.adopt(row.id, spec, RuntimeState(row.runtime_state), stopped=stopped):
            return False
    except Exception:  # noqa: BLE001 - whatever it was, the sandbox was not adopted
        return False
    try:
        await enforce(runtime, row)
        return True
    except Exception as exc:  # noqa: BLE001 - any failure means the policy is not in force
        log.warning("sandbox=%s recovery: its network policy could not be applied (%r); removing", row.id, exc)
        return False
