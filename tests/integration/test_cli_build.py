"""``aenv build -f Dockerfile``: an image from the local registry (through the docker.io mirror) plus
Dockerfile steps, built by the server's template-build API and started through the SDK; and an
instruction a template cannot have refused before anything is sent."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from aenv.cli.build import instructions, unsupported
from aenv.testing.server import API_KEY, Server
from tests.fixtures.plugin import PushedImages

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the ns and vm runtimes need root")

DOCKERFILE = """\
# syntax=docker/dockerfile:1
FROM debian:bookworm
ARG GREETING=hello-from-arg
ENV APP_HOME=/srv/app
LABEL org.example=ignored
RUN mkdir -p $APP_HOME && \\
    echo "$GREETING" > $APP_HOME/greeting
COPY site/ /srv/app/site/
WORKDIR /srv/app
RUN python3 -c "print(6 * 7)" > answer
USER user
CMD ["python3", "-m", "http.server", "8123"]
"""


def _aenv(server: Server | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "AENV_API_KEY": API_KEY}
    if server is not None:
        env["AENV_SERVER"] = server.url
    return subprocess.run([sys.executable, "-m", "aenv.cli.main", *args], capture_output=True, text=True, env=env,
                          timeout=900)


def test_the_instruction_scan_skips_continuations_comments_and_heredocs() -> None:
    text = "FROM x\nRUN <<EOF\nHEALTHCHECK not an instruction\nEOF\n# ONBUILD a comment\nRUN a \\\n  SHELL b\nEXPOSE 80\n"
    assert [w for _, w in instructions(text)] == ["FROM", "RUN", "RUN", "EXPOSE"]
    assert unsupported(text) == []
    assert unsupported("FROM x\nHEALTHCHECK CMD true\nSTOPSIGNAL 9\n") == [(2, "HEALTHCHECK"), (3, "STOPSIGNAL")]


def test_an_unsupported_instruction_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM debian:bookworm\nHEALTHCHECK CMD true\n")
    r = _aenv(None, "build", "--name", "never", str(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "line 2: HEALTHCHECK" in r.stderr


def test_build_a_dockerfile_then_start_it(mirror_server: Server, pushed_images: PushedImages, tmp_path: Path) -> None:
    pushed_images.require("debian:bookworm")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "index.html").write_text("built by aenv build\n")
    (tmp_path / "Dockerfile").write_text(DOCKERFILE)
    name = f"df-{secrets.token_hex(3)}"
    r = _aenv(mirror_server, "build", "-f", str(tmp_path / "Dockerfile"), "--name", name, str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 1/" in r.stderr and f"built {name}" in r.stderr  # per-step progress
    template_id = r.stdout.strip().splitlines()[-1]
    from e2b import Sandbox

    sbx = Sandbox.create(name, api_url=mirror_server.url, sandbox_url=mirror_server.url, api_key=API_KEY, timeout=120)
    try:
        out = sbx.commands.run("cat greeting answer site/index.html; whoami; pwd").stdout.split("\n")
        assert out[:5] == ["hello-from-arg", "42", "built by aenv build", "user", "/srv/app"], out
        # CMD is the start command: the server listens in every sandbox of the template
        probe = ("python3 -c \"import time, urllib.request as u\n"
                 "for _ in range(100):\n"
                 "    try: print(u.urlopen('http://127.0.0.1:8123/site/index.html').read().decode(), end=''); break\n"
                 "    except OSError: time.sleep(0.2)\"")
        assert sbx.commands.run(probe).stdout.strip() == "built by aenv build"
    finally:
        sbx.kill()
    again = _aenv(mirror_server, "build", "-f", str(tmp_path / "Dockerfile"), "--name", name, "-q", str(tmp_path))
    assert again.returncode == 0 and again.stdout.strip() == template_id  # same template, steps from the cache
