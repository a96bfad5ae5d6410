"""Build contexts of compose sandboxes: the uploaded tars checked, the base images of their Dockerfiles."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest

from aenv.core.compose_build import check_context, dockerfile_bases, rewrite_bases
from aenv.errors import InvalidRequest


def tar_of(entries: dict[str, bytes | None], kind: bytes = tarfile.REGTYPE, link: str = "") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.linkname = kind, link
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_context_gives_its_dockerfile_plain_or_gzip() -> None:
    data = tar_of({"Dockerfile": b"FROM busybox\n", "app/main.sh": b"echo hi\n"})
    for body in (data, gzip.compress(data)):
        ctx = check_context("api", body, "Dockerfile", 1 << 20)
        assert ctx.dockerfile == "FROM busybox\n" and ctx.unpacked_bytes == 21 and ctx.data == body
    assert check_context("api", tar_of({"./docker/Dockerfile.dev": b"FROM x\n"}), "docker/Dockerfile.dev",
                         1 << 20).dockerfile == "FROM x\n"
    assert check_context("api", data, "Other", 1 << 20).dockerfile is None


@pytest.mark.parametrize(("body", "match"), [
    (tar_of({"../escape": b"x"}), "points outside the context"),
    (tar_of({"/etc/passwd": b"x"}), "points outside the context"),
    (tar_of({"dev": None}, tarfile.CHRTYPE), "device or fifo"),
    (tar_of({"fifo": None}, tarfile.FIFOTYPE), "device or fifo"),
    (tar_of({"l": None}, tarfile.LNKTYPE, "../../etc/shadow"), "hard link"),
    (tar_of({"big": b"x" * 2000}), "more than 1000 bytes"),
    (b"not a tar at all" * 64, "not a valid tar"),
    (b"\x1f\x8b" + b"garbage" * 10, "not a valid gzip"),
])
def test_bad_contexts_are_refused_naming_the_service(body: bytes, match: str) -> None:
    with pytest.raises(InvalidRequest, match=rf"buildContexts\.api: .*{match}"):
        check_context("api", body, "Dockerfile", 1000)


def test_dockerfile_bases() -> None:
    text = """
# syntax=docker/dockerfile:1
ARG BASE=debian:bookworm
ARG TAG
FROM --platform=linux/amd64 ${BASE} AS build
RUN make
FROM build AS test
FROM scratch
FROM alpine:${TAG:-3.23} \\
    AS final
COPY --from=build /out /out
FROM $UNKNOWN
FROM busybox
FROM busybox
"""
    assert dockerfile_bases(text, {}) == ["debian:bookworm", "alpine:3.23", "busybox"]
    assert dockerfile_bases(text, {"BASE": "ubuntu:22.04", "TAG": "3.20"}) == ["ubuntu:22.04", "alpine:3.20", "busybox"]
    assert dockerfile_bases("", {}) == []


def test_a_from_pinned_by_digest_names_the_tag_it_was_loaded_under() -> None:
    digest = "sha256:" + "ab" * 32
    pinned = f"busybox@{digest}"
    text = (f"# FROM {pinned} in a comment stays\nARG X=1\nFROM --platform=linux/amd64 {pinned} AS base\n"
            f"RUN echo {pinned}\n  from {pinned}\nFROM base\nFROM redis:7\n")
    tags = {pinned: "docker.io/library/busybox:aenv-abababababababab"}
    out = rewrite_bases(text, tags)
    assert out.splitlines() == [
        f"# FROM {pinned} in a comment stays",
        "ARG X=1",
        "FROM --platform=linux/amd64 docker.io/library/busybox:aenv-abababababababab AS base",
        f"RUN echo {pinned}",  # not a FROM: left alone
        "  from docker.io/library/busybox:aenv-abababababababab",
        "FROM base",
        "FROM redis:7",
    ]
    assert dockerfile_bases(out, {}) == ["docker.io/library/busybox:aenv-abababababababab", "redis:7"]
    assert rewrite_bases(text, {}) == text
