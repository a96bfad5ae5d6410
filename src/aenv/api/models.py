"""Request bodies of the E2B control plane, with E2B's field names. Wrong types are a 400 with the
field named; so is every field aenv does not implement (``refuse_unsupported``): a client that sends
one relies on it, and ignoring it would give that client a sandbox without what it asked for."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from aenv.core.models import BandwidthRequest
from aenv.core.network import NetworkRequest
from aenv.errors import InvalidRequest


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Strict(BaseModel):
    """A body whose unknown fields are kept (``model_extra``) so ``refuse_unsupported`` names them."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def unsupported(self, prefix: str = "") -> list[str]:
        """Names (dotted, from ``prefix``) of the fields aenv does not implement, nested bodies included."""
        out = [f"{prefix}{name}" for name in sorted(self.model_extra or {})]
        for name, value in self:
            if isinstance(value, _Strict):
                out += value.unsupported(f"{prefix}{name}.")
        return out

    def refuse_unsupported(self) -> None:
        names = self.unsupported()
        if names:
            raise InvalidRequest(f"{', '.join(names)}: not supported by aenv (unknown field)")


class AutoResume(_Strict):
    enabled: StrictBool = False


class NetworkConfig(_Strict):
    """E2B's ``network`` (create) and the body of ``PUT /sandboxes/{id}/network``. What aenv enforces:
    the egress lists, the header rules (``rules``: checked in ``runtime/egress_rules.py``),
    allowPublicTraffic and maskRequestHost (create only), allow_internet_access (update only); a field
    it does not is refused by name unless it asks for nothing."""

    allowOut: list[str] | None = None
    denyOut: list[str] | None = None
    dnsServers: list[str] | None = None
    allowPublicTraffic: StrictBool | None = None
    maskRequestHost: str | None = None
    egressProxy: dict[str, Any] | None = None
    rules: dict[str, Any] | None = None
    httpsPorts: list[int] | None = None

    def request(self, prefix: str = "network.") -> NetworkRequest:
        """The validated settings (the egress lists themselves are checked in ``core/network.py``)."""
        if self.egressProxy is not None:
            raise InvalidRequest(f"{prefix}egressProxy: a SOCKS5 egress proxy is not supported by aenv")
        if self.httpsPorts:
            raise InvalidRequest(f"{prefix}httpsPorts: the proxy reaches sandbox ports over plain HTTP only")
        return NetworkRequest(self.allowOut, self.denyOut, self.dnsServers, self.allowPublicTraffic,
                              self.maskRequestHost, self.rules or None)


class NetworkUpdate(NetworkConfig):
    """``PUT /sandboxes/{id}/network``: replaces the egress rules; inbound settings are create-only."""

    allow_internet_access: StrictBool | None = None

    def request(self, prefix: str = "") -> NetworkRequest:
        for name in ("allowPublicTraffic", "maskRequestHost"):
            if getattr(self, name) is not None:
                raise InvalidRequest(f"{name}: set at create only (E2B's network update does not take it)")
        return super().request(prefix)


class NewSecret(_Strict):
    """``POST /secrets``. The value is write-only (core/secrets.py checks it without repeating it)."""

    name: str = Field(max_length=1024)
    value: str
    metadata: dict[str, str] | None = None


class SecretUpdate(_Strict):
    """``POST /secrets/{id}``: a new value (the next version); metadata, if given, replaces the old."""

    value: str
    metadata: dict[str, str] | None = None


class VolumeMount(_Strict):
    """One of E2B's ``volumeMounts``; ``readOnly`` is aenv's (the SDK says it with ``name:ro``)."""

    name: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=4096)
    readOnly: StrictBool = False


class NewVolume(_Strict):
    name: str = Field(min_length=1, max_length=128)


class VolumeMetadata(_Strict):
    """``PATCH /volumecontent/{id}/path``."""

    uid: StrictInt | None = Field(default=None, ge=0, le=2**32 - 2)
    gid: StrictInt | None = Field(default=None, ge=0, le=2**32 - 2)
    mode: StrictInt | None = Field(default=None, ge=0, le=0o7777)


class BandwidthConfig(_Strict):
    """aenv's ``bandwidth`` of a create (E2B has none): Mbit/s, 0 = unlimited, left out = the server's
    default; ranges and the operator's maximum are checked in ``core/bandwidth.py``."""

    egressMbit: StrictFloat | None = None
    ingressMbit: StrictFloat | None = None

    def request(self) -> BandwidthRequest:
        return BandwidthRequest(self.egressMbit, self.ingressMbit)


class NewSandbox(_Strict):
    templateID: str = Field(min_length=1, max_length=256)
    timeout: StrictInt | None = None
    metadata: dict[str, str] | None = None
    envVars: dict[str, str] | None = None
    autoPause: StrictBool = False
    autoPauseMemory: StrictBool | None = None  # with autoPause: false = the expiry pause keeps files only
    autoResume: AutoResume | None = None
    allow_internet_access: StrictBool | None = None
    secure: StrictBool | None = None
    network: NetworkConfig | None = None
    # E2B fields aenv refuses unless empty (refuse_unsupported says why)
    mcp: Any = None
    iam: dict[str, Any] | None = None
    volumeMounts: list[VolumeMount] | None = None
    # aenv extensions (E2B sets resources per template; we also accept them per sandbox)
    cpuCount: StrictInt | None = Field(default=None, ge=1, le=64)
    memoryMB: StrictInt | None = Field(default=None, ge=64, le=262144)
    bandwidth: BandwidthConfig | None = None

    def unsupported(self, prefix: str = "") -> list[str]:
        out = super().unsupported(prefix)
        for i, m in enumerate(self.volumeMounts or ()):
            out += m.unsupported(f"{prefix}volumeMounts[{i}].")
        return out

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.mcp is not None:
            raise InvalidRequest("mcp: MCP gateways are not supported by aenv")
        if self.iam:
            raise InvalidRequest("iam: workload identity tokens are not supported by aenv")
        if self.network is not None:
            self.network.request()
        resume = bool(self.autoResume and self.autoResume.enabled)
        if self.autoPauseMemory is not None and not self.autoPause:
            raise InvalidRequest("autoPauseMemory is only allowed with autoPause: true")
        if resume and not self.autoPause:
            raise InvalidRequest("autoResume can only be enabled with autoPause: true")
        if resume and self.autoPauseMemory is False:
            raise InvalidRequest(
                "autoResume cannot be combined with autoPauseMemory: false: a filesystem-only pause "
                "cold-starts on resume, so it is resumed only by an explicit connect"
            )


class TimeoutBody(_Strict):
    timeout: StrictInt


class ConnectBody(_Strict):
    timeout: StrictInt | None = None
    memory: StrictBool | None = None  # false: cold-start from the files (on_resume="reboot")


class ResumeBody(ConnectBody):
    """The very old ``POST /sandboxes/{id}/resume`` (Python SDK 1.x, 2.0-2.4)."""

    autoPause: StrictBool | None = None


class PauseBody(_Strict):
    memory: StrictBool | None = None  # false: keep the files only; the resume is a cold start
    requireHealthyGuest: StrictBool | None = None


class NewComposeSandbox(NewSandbox):
    """``POST /sandboxes-compose`` (shaped after AgentENV's): a create's fields (the template defaults to
    ``docker``) plus the Compose project. ``composeEnv``: the variables the file is interpolated with (the
    node's own environment and ``.env`` files are not read); ``profiles``: the profiles to enable;
    ``buildContexts``: per service with a ``build``, its context as a base64 tar (gzip or plain);
    ``startupTimeout``: seconds until every service must be up (the server's ``compose_startup_timeout``)."""

    templateID: str = Field("docker", min_length=1, max_length=256)
    compose: str = Field(min_length=1)
    composeEnv: dict[str, str] | None = None
    profiles: list[str] | None = None
    buildContexts: dict[str, str] | None = None
    startupTimeout: StrictInt | None = Field(default=None, ge=1, le=3600)
