from __future__ import annotations

import pytest

from aenv.images import manifest as m
from aenv.images.errors import RegistryProtocolError

D1, D2, D3 = ("sha256:" + c * 64 for c in "123")


def test_select_linux_amd64_prefers_no_variant() -> None:
    doc = {
        "manifests": [
            {"digest": D1, "size": 1, "platform": {"os": "linux", "architecture": "arm64"}},
            {"digest": D2, "size": 1, "platform": {"os": "linux", "architecture": "amd64", "variant": "v3"}},
            {"digest": D3, "size": 1, "platform": {"os": "linux", "architecture": "amd64"}},
            {"digest": D1, "size": 1, "platform": {"os": "unknown", "architecture": "unknown"}},
        ]
    }
    assert m.select_platform(doc, "x").digest == D3


def test_select_names_available_platforms() -> None:
    doc = {"manifests": [{"digest": D1, "size": 1, "platform": {"os": "linux", "architecture": "arm64"}}]}
    with pytest.raises(RegistryProtocolError, match="linux/arm64"):
        m.select_platform(doc, "img")


def test_config_and_start_cmd() -> None:
    cfg = m.parse_config(
        {
            "config": {
                "Env": ["PATH=/bin", "A=b=c"],
                "WorkingDir": "/w",
                "User": "app",
                "Entrypoint": ["/entry"],
                "Cmd": ["run", "it now"],
            },
            "rootfs": {"diff_ids": [D1]},
        },
        "x",
    )
    assert cfg.env == {"PATH": "/bin", "A": "b=c"}
    assert cfg.workdir == "/w" and cfg.user == "app"
    assert cfg.start_cmd == "/entry run 'it now'"
    assert cfg.diff_ids == (D1,)
    assert m.parse_config({}, "x").start_cmd is None


def test_manifest_parsing_and_rejections() -> None:
    doc = {
        "schemaVersion": 2,
        "mediaType": m.DOCKER_MANIFEST,
        "config": {"mediaType": m.DOCKER_CONFIG, "digest": D1, "size": 2},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", "digest": D2, "size": 3}],
    }
    man = m.parse_manifest(doc, "x")
    assert man.layers[0].compression == "zstd"
    with pytest.raises(RegistryProtocolError, match="schemaVersion"):
        m.parse_manifest({**doc, "schemaVersion": 1}, "x")
    bad = {**doc, "layers": [{"mediaType": "application/weird", "digest": D2, "size": 3}]}
    with pytest.raises(RegistryProtocolError, match="media type"):
        m.parse_manifest(bad, "x")
    with pytest.raises(RegistryProtocolError, match="JSON"):
        m.load_json(b"{nope", "x")


def test_detect_media_type() -> None:
    assert m.detect_media_type({"manifests": []}, None) == m.OCI_INDEX
    assert m.detect_media_type({}, m.DOCKER_LIST + "; charset=utf-8") == m.DOCKER_LIST
    assert m.detect_media_type({"config": {}, "layers": []}, "application/json") == m.OCI_MANIFEST
