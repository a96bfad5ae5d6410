"""``POST /init`` host facts (VM runtime after restore/fork/resume): validation and application."""

from __future__ import annotations

import base64
import os

import pytest
from starlette.testclient import TestClient

from aenv.envd import app as envd_app
from aenv.envd.app import HOST_FACTS_HEADER, build_app, parse_host_facts
from aenv.envd.identity import SandboxState, reseed_rng


def _b64(n: int) -> str:
    return base64.b64encode(os.urandom(n)).decode()


def test_parse_accepts_absent_and_valid_fields() -> None:
    assert parse_host_facts({}) == (None, None)
    t, seed = parse_host_facts({"hostTime": 1_800_000_000.25, "seed": base64.b64encode(b"abc").decode()})
    assert t == 1_800_000_000.25 and seed == b"abc"


@pytest.mark.parametrize(
    "body",
    [
        {"hostTime": "now"},
        {"hostTime": True},
        {"hostTime": -1},
        {"seed": 5},
        {"seed": "***"},
        {"seed": ""},
        {"seed": _b64(513)},
    ],
)
def test_parse_rejects(body: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        parse_host_facts(body)


def test_init_applies_facts_and_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, object] = {}
    monkeypatch.setattr(envd_app, "set_wall_clock", lambda t: calls.setdefault("time", t))
    monkeypatch.setattr(envd_app, "reseed_rng", lambda s: calls.setdefault("seed", s) and ["write"])
    state = SandboxState()
    client = TestClient(build_app(state))
    seed = os.urandom(32)
    r = client.post(
        "/init",
        json={"sandboxId": "s1", "hostTime": 1_800_000_000.5, "seed": base64.b64encode(seed).decode()},
    )
    assert r.status_code == 204
    assert calls == {"time": 1_800_000_000.5, "seed": seed}
    assert r.headers[HOST_FACTS_HEADER] == "hostTime=set,seed=write"
    assert state.sandbox_id == "s1"


def test_bad_facts_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envd_app, "set_wall_clock", lambda t: pytest.fail("clock set on a bad body"))
    state = SandboxState()
    r = TestClient(build_app(state)).post("/init", json={"sandboxId": "s2", "hostTime": 1.0, "seed": "***"})
    assert r.status_code == 400
    assert state.sandbox_id == ""


def test_clock_failure_is_reported_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    def deny(t: float) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(envd_app, "set_wall_clock", deny)
    r = TestClient(build_app(SandboxState())).post("/init", json={"hostTime": 1_800_000_000})
    assert r.status_code == 204
    assert r.headers[HOST_FACTS_HEADER] == "hostTime=failed"


def test_reseed_writes_to_the_device(tmp_path: object) -> None:
    # A plain file stands in for /dev/urandom: the write lands, the ioctls fail quietly (ENOTTY).
    import pathlib

    dev = pathlib.Path(str(tmp_path)) / "urandom"
    dev.write_bytes(b"")
    assert reseed_rng(b"\x01\x02", device=str(dev)) == ["write"]
    assert dev.read_bytes() == b"\x01\x02"
