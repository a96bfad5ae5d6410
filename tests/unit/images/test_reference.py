from __future__ import annotations

import pytest

from aenv.images.errors import InvalidReference
from aenv.images.reference import normalize, parse_reference

D = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ubuntu:22.04", "docker.io/library/ubuntu:22.04"),
        ("ubuntu", "docker.io/library/ubuntu:latest"),
        ("library/ubuntu", "docker.io/library/ubuntu:latest"),
        ("myuser/app:1", "docker.io/myuser/app:1"),
        ("docker.io/ubuntu", "docker.io/library/ubuntu:latest"),
        ("index.docker.io/library/ubuntu:20.04", "docker.io/library/ubuntu:20.04"),
        ("ghcr.io/org/img:v1.2", "ghcr.io/org/img:v1.2"),
        ("localhost/img", "localhost/img:latest"),
        ("host:5000/a/b", "host:5000/a/b:latest"),
        (f"host:5000/a/b@{D}", f"host:5000/a/b@{D}"),
        (f"ubuntu:22.04@{D}", f"docker.io/library/ubuntu:22.04@{D}"),
        ("127.0.0.1:5000/x:tag", "127.0.0.1:5000/x:tag"),
    ],
)
def test_normalise(text: str, expected: str) -> None:
    assert normalize(text) == expected


def test_parts() -> None:
    r = parse_reference("host:5000/a/b:t")
    assert (r.registry, r.repository, r.tag, r.digest) == ("host:5000", "a/b", "t", None)
    assert r.ref == "t"
    assert r.api_host == "host:5000"
    hub = parse_reference("ubuntu")
    assert hub.api_host == "registry-1.docker.io"
    assert hub.short == "ubuntu:latest"
    pinned = parse_reference(f"a/b@{D}")
    assert pinned.tag is None and pinned.ref == D


@pytest.mark.parametrize(
    "bad", ["", "UPPER/case", "a/../b", "img:bad tag", "img@sha256:short", "/img", "a//b", "img:" + "x" * 200]
)
def test_invalid(bad: str) -> None:
    with pytest.raises(InvalidReference) as e:
        parse_reference(bad)
    assert "invalid image reference" in str(e.value)
