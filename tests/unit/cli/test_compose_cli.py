"""``aenv compose up``'s client side: which variables leave the machine, the build contexts it sends, what it prints."""

from __future__ import annotations

import base64
import io
import tarfile
from pathlib import Path

import pytest

from aenv.cli import compose as cli


def test_only_the_variables_the_file_uses_are_sent_shell_over_env_file_and_flags_over_both(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = "services:\n  a:\n    image: busybox:${TAG}\n    command: echo $GREETING $$HOME ${MISSING:-x}\n"
    assert cli.referenced(text) == {"TAG", "GREETING", "MISSING"}
    env_file = tmp_path / ".env"
    env_file.write_text("# comment\nTAG=1.36\nexport GREETING='from file'\nSECRET=no\n")
    monkeypatch.setenv("GREETING", "from shell")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "never sent")
    assert cli.compose_env(text, env_file, {}) == {"TAG": "1.36", "GREETING": "from shell"}
    assert cli.compose_env(text, env_file, {"TAG": "2"})["TAG"] == "2"
    assert cli.compose_env(text, tmp_path / "none", {}) == {"GREETING": "from shell"}


def test_services_with_a_build_send_their_context_as_a_tar(tmp_path: Path) -> None:
    (tmp_path / "api" / "src").mkdir(parents=True)
    (tmp_path / "api" / "Dockerfile").write_text("FROM busybox\n")
    (tmp_path / "api" / "src" / "main.sh").write_text("echo hi\n")
    text = ("services:\n  api:\n    build: ./api\n  web:\n    build: {context: api, dockerfile: Dockerfile}\n"
            "  inline:\n    build: {dockerfile_inline: 'FROM busybox'}\n  db:\n    image: redis\n")
    contexts = cli.build_contexts(text, tmp_path)
    assert set(contexts) == {"api", "web"}
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(contexts["api"]))) as tar:
        assert {n for n in tar.getnames() if not tar.getmember(n).isdir()} == {"Dockerfile", "src/main.sh"}
        assert tar.extractfile("src/main.sh").read() == b"echo hi\n"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="uses a variable"):
        cli.build_contexts("services:\n  a:\n    build: ${CTX}\n", tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        cli.build_contexts("services:\n  a:\n    build: ./nope\n", tmp_path)
    with pytest.raises(ValueError, match="more than 10 bytes"):
        cli.context_tar(tmp_path / "api", limit=10)


def test_the_table_shows_each_services_urls() -> None:
    answer = {"sandboxID": "abc", "compose": {"services": [
        {"name": "web", "state": "running", "health": None,
         "ports": [{"port": 8080, "target": 80, "protocol": "tcp", "host": "8080-abc.localhost:8000"},
                   {"port": 5353, "target": 53, "protocol": "udp", "host": "5353-abc.localhost:8000"}]},
        {"name": "db", "state": "running", "health": "healthy", "ports": []}]}}
    assert cli.service_rows(answer, "http") == [
        ("web", "running", "", "http://8080-abc.localhost:8000 5353/udp"), ("db", "running", "healthy", "-")]
