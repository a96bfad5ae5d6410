"""Header rules for this server's own sandbox hosts: one sandbox reaching another's public URL.

E2B's SDK tests send a sandbox's ``network.rules`` transform to a sidecar sandbox's
``get_host(port)`` (``<port>-<id>.<sandbox domain>``), which on E2B is a public address. Here that name
is this server, and from inside a sandbox it names no address the sandbox may reach: ``*.localhost``
is the sandbox's own loopback to curl, and a real domain resolves to the host, which the base filter
refuses. So, only for a sandbox with a rule naming such a host, TCP to loopback and to the host's
addresses on the public port goes to the egress proxy (``netpolicy.render``: ``own_ports``), and the
proxy sends a connection whose name is one of this server's sandbox hosts to the server's own public
listener, exactly as an internet client would come: through the sandbox proxy, its traffic token and
``allowPublicTraffic`` rules. The control plane stays closed: only names of the sandbox-host pattern
of the configured ``sandbox_domain`` are routed, and every request must carry that name as its
``Host`` (one, origin-form target, no ``E2b-Sandbox-*`` routing headers), so the server routes it to
that sandbox port and nowhere else (``refusal``).

Off unless the operator set ``sandbox_domain`` (the names must be this server's, not a client's
guess of them).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from aenv.config import Settings
from aenv.runtime.egress_rules import DEFAULT_PORTS, HeaderRule

_ROUTING_HEADERS = (b"e2b-sandbox-id", b"e2b-sandbox-port")


@dataclass(frozen=True)
class OwnHosts:
    """This server's sandbox hosts and where its public listener is."""

    domain: str  # lowercase host part of sandbox_domain
    public_port: int  # the port sandbox URLs name (sandbox_domain's, else 443/80)
    addr: str  # where the proxy connects: the listener's address
    port: int  # and its port
    tls: bool  # the listener speaks TLS

    @classmethod
    def of(cls, settings: Settings) -> OwnHosts | None:
        """From the server's settings; None without a ``sandbox_domain``."""
        if not settings.sandbox_domain:
            return None
        host, sep, port_s = settings.sandbox_domain.strip().lower().rstrip("/").rpartition(":")
        if not sep or not port_s.isdigit():
            host, port_s = settings.sandbox_domain.strip().lower().rstrip("/"), ""
        tls = settings.tls_cert is not None
        public = int(port_s) if port_s else (443 if tls else 80)
        try:
            bound = ipaddress.ip_address(settings.host)
            addr = "127.0.0.1" if bound.is_unspecified or bound.version != 4 else str(bound)
        except ValueError:
            addr = "127.0.0.1"
        return cls(host.rstrip("."), public, addr, settings.port, tls)

    @property
    def _pattern(self) -> re.Pattern[str]:
        return re.compile(rf"^\d{{1,5}}-[a-z0-9][a-z0-9-]{{0,63}}\.{re.escape(self.domain)}$")

    def names(self, host: str) -> bool:
        """Whether ``host`` is one of this server's sandbox hosts (``<port>-<id>.<domain>``)."""
        return bool(self._pattern.match(host.lower().rstrip(".")))

    def ports(self, rules: Sequence[HeaderRule]) -> tuple[int, ...]:
        """The ports to loopback and the host that go to the proxy for ``rules``: those of rules naming
        one of this server's sandbox hosts (a rule without a port: the public port and 80/443)."""
        out: set[int] = set()
        for r in rules:
            if not r.pattern.startswith("*.") and self.names(r.pattern):
                out.update((r.port,) if r.port is not None else (self.public_port, *DEFAULT_PORTS))
        return tuple(sorted(out))


def refusal(method: bytes, target: bytes, headers: Sequence[tuple[bytes, bytes]], name: str,
            port: int) -> str | None:
    """Why a request on a connection to ``name`` (one of this server's sandbox hosts, reached on
    ``port``) may not go to the server's listener, or None: its ``Host`` must be ``name`` (optionally
    with ``:port``), its only one, with an origin-form target and no routing headers of aenv's."""
    if method == b"CONNECT" or not target.startswith(b"/"):
        return "only origin-form requests (GET /path) go to another sandbox's URL"
    hosts = [v for n, v in headers if n.lower() == b"host"]
    want = {name.lower().encode(), f"{name.lower()}:{port}".encode()}
    if len(hosts) != 1 or hosts[0].strip().lower().rstrip(b".") not in want:
        return f"the request's Host must be {name}, the name of the sandbox URL the rule is for"
    if any(n.lower() in _ROUTING_HEADERS for n, _ in headers):
        return "E2b-Sandbox-Id/Port headers are not let through to another sandbox's URL"
    return None
