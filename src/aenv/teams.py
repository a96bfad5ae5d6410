"""Teams: who an API key acts for, what it may see, and the quotas its team lives within.

Every object the server makes (sandbox, snapshot, template, volume, lease, secret, webhook delivery)
records the team that made it, as ``owner``. A key acts for exactly one team:

- a key listed in ``api_keys`` and in no team is a team of its own, whose ID is the key's SHA-256
  digest (the safe default: two keys handed to two people share nothing unless the operator says so);
- ``teams.<name>.keys`` groups keys into the team ``<name>``;
- ``admin_keys`` act for the team ``admin`` and see and act on every team's objects;
- a server with one team and no ``admin_keys`` has nothing to keep apart: its keys are admins.

With no keys configured at all the server is open: every request acts as an admin of team ``""``.
Keys are held as SHA-256 digests only (a configured value may already be one, ``sha256:<hex>``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

ADMIN_TEAM = "admin"
TEAM_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


class Quota(BaseModel):
    """Limits of one team; unset = unlimited. Concurrency limits answer 429 (freed by a kill), a
    single request larger than the whole limit answers 403 (no kill would make it fit)."""

    model_config = ConfigDict(extra="forbid")

    max_sandboxes: int | None = Field(default=None, gt=0, description="live + starting sandboxes")
    max_vcpus: int | None = Field(default=None, gt=0, description="vCPUs of live + starting sandboxes")
    max_memory_mb: int | None = Field(default=None, gt=0, description="memory (MiB) of live + starting sandboxes")
    creates_per_second: float | None = Field(default=None, gt=0, description="sustained create rate (a burst of one second's worth passes)")
    max_disk_mb: int | None = Field(default=None, gt=0, description="snapshots, templates and volumes the team keeps (MiB)")

    def merged(self, fallback: Quota) -> Quota:
        """This quota, its unset limits taken from ``fallback``."""
        return Quota(**{k: v if v is not None else getattr(fallback, k) for k, v in self.model_dump().items()})


class TeamSpec(Quota):
    """One configured team: its keys (plain or ``sha256:<hex>``) and its own limits."""

    keys: list[str] = Field(default_factory=list, description="API keys acting for the team")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def configured_digest(value: str) -> str:
    """A configured key's digest: ``sha256:<hex>`` is taken as it is, anything else is hashed."""
    return value[len("sha256:"):].lower() if value.startswith("sha256:") else digest(value)


def label(team: str) -> str:
    """How a team is shown (metrics, CLI, logs): a key's own team by a short digest prefix."""
    return f"key-{team[:12]}" if len(team) == 64 and all(c in "0123456789abcdef" for c in team) else team


@dataclass(frozen=True)
class Principal:
    """Who a request acts for. ``admin`` sees and acts on every team's objects."""

    team: str
    admin: bool = False

    def sees(self, owner: str) -> bool:
        return self.admin or owner == self.team


OPEN = Principal(team="", admin=True)  # a server without keys


class TeamDirectory:
    """Keys → principals, and each team's quota, from the settings (built once per server)."""

    def __init__(self, api_keys: list[str], teams: dict[str, TeamSpec], admin_keys: list[str],
                 defaults: Quota, key_quotas: dict[str, int] | None = None) -> None:
        self._by_digest: dict[str, Principal] = {}
        self._quotas: dict[str, Quota] = {}
        self.defaults = defaults
        for name, spec in teams.items():
            if not TEAM_NAME.match(name) or name == ADMIN_TEAM:
                raise ValueError(f"teams.{name}: a team name is 1-63 of a-z 0-9 _ . - (and not '{ADMIN_TEAM}')")
            limits = Quota(**spec.model_dump(exclude={"keys"}))
            self._quotas[name] = limits.merged(defaults)
            for key in spec.keys:
                self._add(configured_digest(key), Principal(name), f"teams.{name}.keys")
        for key in admin_keys:
            self._add(configured_digest(key), Principal(ADMIN_TEAM, admin=True), "admin_keys")
        for key in api_keys:
            d = configured_digest(key)
            if d not in self._by_digest:
                self._by_digest[d] = Principal(d)  # a team of its own
        if not admin_keys and len({p.team for p in self._by_digest.values()}) == 1:
            # one team and no admin named: nothing to keep apart, its keys are the operators too (as
            # every key was before teams), so a one-key server answers exactly as it always did
            self._by_digest = {d: Principal(p.team, admin=True) for d, p in self._by_digest.items()}
        for key, n in (key_quotas or {}).items():  # the older per-key concurrency quota
            team = self._by_digest.get(configured_digest(key), Principal(configured_digest(key))).team
            self._quotas[team] = Quota(max_sandboxes=n).merged(self._quotas.get(team, defaults))

    def _add(self, d: str, who: Principal, where: str) -> None:
        known = self._by_digest.get(d)
        if known is not None and known != who:
            raise ValueError(f"{where}: a key is already given to team '{known.team}'")
        self._by_digest[d] = who

    @property
    def open(self) -> bool:
        """No keys configured: auth is off, everyone is an admin."""
        return not self._by_digest

    @property
    def digests(self) -> list[str]:
        return list(self._by_digest)

    def resolve(self, presented: str | None) -> Principal | None:
        """The principal of a presented key, None if it is not valid. Looked up by the key's digest:
        what a lookup's timing could tell is about a hash, not about the key."""
        if self.open:
            return OPEN
        if not presented:
            return None
        return self._by_digest.get(digest(presented))

    def quota(self, team: str) -> Quota:
        return self._quotas.get(team, self.defaults)

    def teams(self) -> list[str]:
        """Every team known from the settings (a key's own team included)."""
        return sorted({p.team for p in self._by_digest.values()} | set(self._quotas))
