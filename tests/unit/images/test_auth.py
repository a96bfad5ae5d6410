from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from aenv.images.auth import load_credentials, parse_challenge


def test_parse_bearer_challenge() -> None:
    c = parse_challenge(
        'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
        'scope="repository:library/ubuntu:pull"'
    )
    assert c is not None and c.scheme == "bearer"
    assert c.params == {
        "realm": "https://auth.docker.io/token",
        "service": "registry.docker.io",
        "scope": "repository:library/ubuntu:pull",
    }
    b = parse_challenge('Basic realm="Registry Realm"')
    assert b is not None and b.scheme == "basic" and b.params["realm"] == "Registry Realm"
    assert parse_challenge("") is None


def test_credentials_from_docker_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    (tmp_path / ".docker").mkdir()
    (tmp_path / ".docker/config.json").write_text(
        json.dumps(
            {
                "auths": {
                    "https://index.docker.io/v1/": {"auth": base64.b64encode(b"hub:secret:colon").decode()},
                    "reg.example:5000": {"username": "u", "password": "p"},
                }
            }
        )
    )
    hub = load_credentials("docker.io")
    assert hub is not None and (hub.username, hub.password) == ("hub", "secret:colon")
    other = load_credentials("reg.example:5000")
    assert other is not None and other.username == "u"
    assert load_credentials("nothing.example") is None


def test_explicit_file_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    f = tmp_path / "auth.json"
    f.write_text(json.dumps({"auths": {"r.example": {"auth": base64.b64encode(b"a:b").decode()}}}))
    c = load_credentials("r.example", f)
    assert c is not None and c.password == "b"
