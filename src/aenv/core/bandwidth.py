"""Per-sandbox bandwidth limits: what a create asked for, kept in its row, registered with the runtime.

E2B's create has no bandwidth setting, so this is aenv's extension ``bandwidth: {egressMbit,
ingressMbit}`` (Mbit/s, 10^6 bit/s). A field left out takes the server's default
(``egress_bandwidth_mbit``/``ingress_bandwidth_mbit``), 0 is unlimited; the operator's
``max_bandwidth_mbit`` caps both (and then unlimited is refused). What was asked is kept in the row's
``network`` record under ``bandwidth`` (no new column: the record already travels with fork children
and published pauses, and the API shows it), only what the create named: a field left out follows the
server's default as it is at each start. ``core/network.py`` registers it with the runtime wherever it
registers the egress policy, before the sandbox's first network namespace and again on adoption; the
runtime keeps it for every namespace it makes for the sandbox (``runtime/shaping.py``).
"""

from __future__ import annotations

from typing import Any

from aenv.config import Settings
from aenv.core.models import BandwidthRequest
from aenv.errors import InvalidRequest
from aenv.runtime.base import BandwidthCapable, Runtime
from aenv.runtime.shaping import SHAPER, Bandwidth, of

KEY = "bandwidth"  # in SandboxRow.network
MIN_MBIT = 0.1  # tc's token bucket is no use below ~100 kbit/s with the tap's 64 KiB packets
MAX_MBIT = 100_000.0
_FIELDS = (("egressMbit", "egress_mbit"), ("ingressMbit", "ingress_mbit"))


class BandwidthError(RuntimeError):
    """The server's default limits cannot be enforced on this host (a start-up error)."""


def configure(settings: Settings) -> None:
    """The server's default for every sandbox (and pool) from now on; refused at start where the
    host cannot shape traffic, rather than running sandboxes without the limits it was told to set."""
    default = of(*settings.default_bandwidth())
    if not default.unlimited:
        reason = SHAPER.unavailable()
        if reason is not None:
            raise BandwidthError(f"egress/ingress_bandwidth_mbit: {reason}")
    SHAPER.configure(default)


def record(req: BandwidthRequest | None, settings: Settings) -> dict[str, float] | None:
    """The row's ``bandwidth`` for ``req``, checked: a 400 names the field that is out of range."""
    if req is None:
        return None
    top = settings.max_bandwidth_mbit
    out: dict[str, float] = {}
    for name, attr in _FIELDS:
        value = getattr(req, attr)
        if value is None:
            continue
        if value < 0 or (0 < value < MIN_MBIT) or value > MAX_MBIT:
            raise InvalidRequest(f"bandwidth.{name}: {value} Mbit/s is out of range (0 = unlimited, or "
                                 f"{MIN_MBIT}-{MAX_MBIT:.0f})")
        if top and (value == 0 or value > top):
            raise InvalidRequest(f"bandwidth.{name}: {'unlimited' if value == 0 else f'{value} Mbit/s'} is "
                                 f"above this server's maximum of {top} Mbit/s")
        out[name] = float(value)
    return out or None


def of_row(network: dict[str, Any]) -> Bandwidth | None:
    """The limits a row's ``network`` record asks for, the default filling what it leaves out;
    None: it names none (the server's default, whatever that is when the namespace is made)."""
    rec = network.get(KEY)
    if not isinstance(rec, dict) or not rec:
        return None
    default = SHAPER.default
    egress = rec.get("egressMbit", default.egress_mbit or 0)
    ingress = rec.get("ingressMbit", default.ingress_mbit or 0)
    return of(float(egress), float(ingress))


async def register(runtime: Runtime, sandbox_id: str, network: dict[str, Any]) -> None:
    """The row's own limits registered with the runtime (before a namespace is made for it)."""
    bw = of_row(network)
    if isinstance(runtime, BandwidthCapable):
        await runtime.set_bandwidth(sandbox_id, bw)
    elif bw is not None and not bw.unlimited:
        raise InvalidRequest(f"bandwidth: the {runtime.name} runtime cannot limit bandwidth")
