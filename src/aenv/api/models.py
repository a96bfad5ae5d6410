"""Request bodies of the E2B control plane, with E2B's field names. Wrong types are a 400 with the
field named; so is every field aenv does not implement (``refuse_unsupported``): a client that sends
one relies on it, and ignoring it would give that client a sandbox without what it asked for."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

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


# network: what aenv does today is all-or-nothing egress (``allow_internet_access``). These keys are
# accepted only with the value that changes nothing; any other network setting is refused by name.
_NETWORK_NO_OPS: dict[str, tuple[Any, ...]] = {
    "allowPublicTraffic": (None, True),  # sandbox URLs need no traffic token: aenv issues none
    "allowOut": ([],),
    "denyOut": ([],),
    "rules": ({},),
}


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
    # E2B fields aenv refuses unless empty (refuse_unsupported says why)
    network: dict[str, Any] | None = None
    mcp: Any = None
    iam: dict[str, Any] | None = None
    volumeMounts: list[Any] | None = None
    # aenv extensions (E2B sets resources per template; we also accept them per sandbox)
    cpuCount: StrictInt | None = Field(default=None, ge=1, le=64)
    memoryMB: StrictInt | None = Field(default=None, ge=64, le=262144)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.mcp is not None:
            raise InvalidRequest("mcp: MCP gateways are not supported by aenv")
        if self.iam:
            raise InvalidRequest("iam: workload identity tokens are not supported by aenv")
        if self.volumeMounts:
            raise InvalidRequest("volumeMounts: volumes are not supported by aenv")
        for key, value in (self.network or {}).items():
            if value not in _NETWORK_NO_OPS.get(key, ()):
                raise InvalidRequest(
                    f"network.{key}: egress rules are not supported by aenv yet; "
                    "allow_internet_access (true or false) is"
                )
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
