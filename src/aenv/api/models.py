"""Request bodies of the E2B control plane, with E2B's field names. Unknown fields are ignored
(newer SDKs send more), wrong types are a 400 with the field named."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class AutoResume(_Body):
    enabled: StrictBool = False


class NewSandbox(_Body):
    templateID: str = Field(min_length=1, max_length=256)
    timeout: StrictInt | None = None
    metadata: dict[str, str] | None = None
    envVars: dict[str, str] | None = None
    autoPause: StrictBool = False
    autoResume: AutoResume | None = None
    allow_internet_access: StrictBool | None = None
    secure: StrictBool | None = None
    # aenv extensions (E2B sets resources per template; we also accept them per sandbox)
    cpuCount: StrictInt | None = Field(default=None, ge=1, le=64)
    memoryMB: StrictInt | None = Field(default=None, ge=64, le=262144)


class TimeoutBody(_Body):
    timeout: StrictInt


class ConnectBody(_Body):
    timeout: StrictInt | None = None


class PauseBody(_Body):
    memory: StrictBool | None = None
    requireHealthyGuest: StrictBool | None = None
