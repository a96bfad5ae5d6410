"""E2B's ``network.rules``: per-domain transforms the egress proxy applies to a sandbox's HTTP(S)
requests. Pure: validation, matching and header rewriting; the proxy is ``egress_mitm.py``.

Wire form (E2B's ``SandboxNetworkConfigRules``)::

    {"api.example.com": [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.openai}"}}}]}

A key is a domain (``*.example.com``: any subdomain, as in ``allowOut``), optionally with ``:port``
(that port only; without one the rule applies on every port the proxy sees, 80 and 443 and the ones
keys name). Each header replaces one of the same name, or is added. A value may hold
``${e2b.secrets.<name>}`` placeholders (the SDK's ``Secret.fill``): the proxy puts in the secret's
current value for each request; the sandbox never sees it. The name is bound to the secret's ID when
the rules are set (``bind``: an unknown name is a 400 then), so a rule cannot reach another owner's
secret, and a secret deleted later makes the proxy answer 502 rather than send the request without
it. Other ``${e2b.…}`` placeholders (E2B's workload identity tokens) and any field besides
``transform.headers`` are refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aenv.errors import InvalidRequest

MAX_DOMAINS = 64
MAX_HEADERS = 32
MAX_VALUE = 8 * 1024
DEFAULT_PORTS = (80, 443)
SECRET_PREFIX = "e2b.secrets."
_PLACEHOLDER = re.compile(r"\$\{(e2b\.[^{}]*)\}")
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}$")
_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_DOMAIN = re.compile(rf"^(\*\.)?{_LABEL}(\.{_LABEL})+$")
# Headers that frame or route the message: the proxy owns them, a rule may not set them.
_RESERVED = frozenset({"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer",
                       "keep-alive", "proxy-connection", "expect"})  # fmt: skip


@dataclass(frozen=True)
class SecretRef:
    name: str
    id: str | None  # None: the secret was not bound (a record from before it was deleted)


Part = str | SecretRef


@dataclass(frozen=True)
class HeaderRule:
    pattern: str  # lowercase domain, "*.x" for below x
    port: int | None  # None: any port
    headers: tuple[tuple[str, tuple[Part, ...]], ...]  # (name as sent, value parts)

    def matches(self, host: str, port: int) -> bool:
        if self.port is not None and port != self.port:
            return False
        if self.pattern.startswith("*."):
            return host.endswith(self.pattern[1:]) and len(host) > len(self.pattern) - 1
        return host == self.pattern


class UnresolvedSecret(Exception):
    """A placeholder's secret is gone: the request must not go out without it."""


def _key(raw: Any, where: str) -> tuple[str, int | None]:
    if not isinstance(raw, str):
        raise InvalidRequest(f"{where}: a domain name")
    host, sep, port_s = raw.strip().lower().rstrip(".").rpartition(":")
    if not sep:
        host, port_s = port_s, ""
    port = None
    if sep:
        if not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise InvalidRequest(f"{where}: {raw!r}: the port after ':' is 1-65535")
        port = int(port_s)
    if not _DOMAIN.match(host) or host.replace(".", "").isdigit():
        raise InvalidRequest(f"{where}: {raw!r} is not a domain name (api.example.com, *.example.com, "
                             "optionally :port); rules take domains, not addresses")
    return host, port


def _value(raw: Any, where: str, bind: Callable[[str], str] | None, bound: dict[str, str]) -> tuple[Part, ...]:
    if not isinstance(raw, str):
        raise InvalidRequest(f"{where}: a string")
    if len(raw.encode()) > MAX_VALUE or any(c in raw for c in "\r\n\0"):
        raise InvalidRequest(f"{where}: at most {MAX_VALUE} bytes, without CR, LF or NUL")
    parts: list[Part] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(raw):
        ref = m.group(1)
        if not ref.startswith(SECRET_PREFIX) or len(ref) == len(SECRET_PREFIX):
            raise InvalidRequest(f"{where}: ${{{ref}}}: aenv resolves only ${{e2b.secrets.<name>}} placeholders "
                                 "(E2B's workload identity tokens are not supported)")
        name = ref[len(SECRET_PREFIX):].lower()
        if name not in bound and bind is not None:
            bound[name] = bind(name)
        if m.start() > pos:
            parts.append(raw[pos:m.start()])
        parts.append(SecretRef(name, bound.get(name)))  # unbound (a stored record's): the proxy answers 502
        pos = m.end()
    if pos < len(raw):
        parts.append(raw[pos:])
    return tuple(parts)


def _fields(obj: Any, where: str, known: set[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{where}: an object")
    extra = sorted(set(obj) - known)
    if extra:
        raise InvalidRequest(f"{', '.join(f'{where}.{e}' for e in extra)}: not supported by aenv "
                             "(a rule's transform takes headers only)")
    return obj


def parse(rules: Any, prefix: str = "network.", bind: Callable[[str], str] | None = None,
          bound: dict[str, str] | None = None) -> tuple[tuple[HeaderRule, ...], dict[str, str]]:
    """Validate E2B's rules: (the rules, secret name -> ID of every placeholder). ``bind`` turns a
    secret name into its ID (raising a 400 or 404 for an unknown one); ``bound``: names already bound
    (a stored record's), used before ``bind``."""
    if rules is None:
        return (), {}
    where = f"{prefix}rules"
    if not isinstance(rules, dict):
        raise InvalidRequest(f"{where}: an object of domain -> list of rules")
    if len(rules) > MAX_DOMAINS:
        raise InvalidRequest(f"{where}: at most {MAX_DOMAINS} domains")
    names = dict(bound or {})
    out: list[HeaderRule] = []
    for raw_key, entries in rules.items():
        here = f"{where}[{raw_key!r}]"
        host, port = _key(raw_key, here)
        if not isinstance(entries, list):
            raise InvalidRequest(f"{here}: a list of rules")
        headers: dict[str, tuple[str, tuple[Part, ...]]] = {}
        for i, entry in enumerate(entries):
            rule = _fields(entry, f"{here}[{i}]", {"transform"})
            transform = _fields(rule.get("transform") or {}, f"{here}[{i}].transform", {"headers"})
            given = transform.get("headers") or {}
            if not isinstance(given, dict):
                raise InvalidRequest(f"{here}[{i}].transform.headers: an object of header name -> value")
            for name, value in given.items():
                if not isinstance(name, str) or not _TOKEN.match(name):
                    raise InvalidRequest(f"{here}[{i}].transform.headers: {name!r} is not a header name")
                if name.lower() in _RESERVED:
                    raise InvalidRequest(f"{here}[{i}].transform.headers: {name!r} frames or routes the request; "
                                         "the proxy does not let a rule set it")
                headers[name.lower()] = (name, _value(value, f"{here}[{i}].transform.headers[{name!r}]", bind, names))
        if len(headers) > MAX_HEADERS:
            raise InvalidRequest(f"{here}: at most {MAX_HEADERS} headers")
        out.append(HeaderRule(host, port, tuple(headers.values())))
    return tuple(out), names


def ports(rules: Sequence[HeaderRule]) -> tuple[int, ...]:
    """The TCP ports the proxy must see for these rules."""
    return tuple(sorted({*DEFAULT_PORTS, *(r.port for r in rules if r.port is not None)})) if rules else ()


def matching(rules: Sequence[HeaderRule], host: str, port: int) -> list[HeaderRule]:
    host = host.lower().rstrip(".")
    return [r for r in rules if r.matches(host, port)]


def resolve(rules: Sequence[HeaderRule], lookup: Callable[[str], str | None]) -> list[tuple[bytes, bytes]]:
    """The headers to set, values filled in (``lookup``: secret ID -> current value). Raises
    UnresolvedSecret naming the secret (never a value) if one is gone."""
    out: dict[bytes, tuple[bytes, bytes]] = {}
    for rule in rules:
        for name, parts in rule.headers:
            value = ""
            for part in parts:
                if isinstance(part, SecretRef):
                    got = lookup(part.id) if part.id else None
                    if got is None:
                        raise UnresolvedSecret(part.name)
                    value += got
                else:
                    value += part
            out[name.lower().encode()] = (name.encode(), value.encode())
    return list(out.values())


def rewrite(headers: Sequence[tuple[bytes, bytes]], add: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` with every header of ``add``'s names dropped and ``add`` appended."""
    drop = {name.lower() for name, _ in add}
    return [(n, v) for n, v in headers if n.lower() not in drop] + list(add)


def masked(record: dict[str, Any]) -> dict[str, Any]:
    """The rules as an API answer shows them: domains and header names, every value ``***``."""
    return {domain: [{"transform": {"headers": {k: "***" for k in ((r or {}).get("transform") or {}).get("headers") or {}}}}
                     for r in entries] for domain, entries in record.items()}  # fmt: skip
