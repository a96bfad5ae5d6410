"""``.dockerignore`` read as Docker reads it (the examples of Docker's own documentation), and the build
context ``aenv compose up`` sends without what it leaves out."""

from __future__ import annotations

import base64
import io
import tarfile
from pathlib import Path

import pytest

from aenv.cli import compose as cli
from aenv.cli.dockerignore import DockerIgnore


@pytest.mark.parametrize(("patterns", "path", "excluded"), [
    ("*/temp*", "somedir/temporary.txt", True),
    ("*/temp*", "somedir/temp", True),
    ("*/temp*", "temp", False),  # one element before it, exactly
    ("*/*/temp*", "somedir/subdir/temporary.txt", True),
    ("*/*/temp*", "somedir/temporary.txt", False),
    ("temp?", "tempa", True),
    ("temp?", "temp/x", False),
    ("**/*.go", "main.go", True),  # "**/" also matches no directory at all
    ("**/*.go", "a/b/c/main.go", True),
    ("**/*.go", "main.gox", False),
    ("node_modules", "node_modules/a/b.js", True),  # a matched directory covers everything under it
    ("/build/", "build/out.o", True),  # cleaned: the leading and trailing slashes go
    ("./dist", "dist/x", True),
    ("# a comment\n\n*.log", "# a comment", False),
    ("file[0-9].txt", "file7.txt", True),
    ("file[!0-9].txt", "file7.txt", False),
    ("file[!0-9].txt", "filea.txt", True),
    ("*.md\n!README.md", "README.md", False),
    ("*.md\n!README.md", "CHANGES.md", True),
    ("*.md\n!README*.md\nREADME-secret.md", "README-secret.md", True),  # the last matching line decides
    ("*.md\n!README*.md\nREADME-secret.md", "README-public.md", False),
    ("a\\*b", "a*b", True),
    ("a\\*b", "axb", False),
])
def test_patterns_match_as_docker_documents_them(patterns: str, path: str, excluded: bool) -> None:
    assert DockerIgnore.parse(patterns).excluded(path) is excluded


def test_no_file_leaves_everything_in(tmp_path: Path) -> None:
    ignore = DockerIgnore.of_context(tmp_path)
    assert ignore.rules == () and not ignore.excluded("anything/at/all")


def _files(b64: str) -> set[str]:
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(b64))) as tar:
        return {m.name for m in tar.getmembers() if not m.isdir()}


def test_the_context_sent_leaves_out_what_its_dockerignore_names(tmp_path: Path) -> None:
    ctx = tmp_path / "app"
    for rel, data in {"Dockerfile": "FROM busybox\n", "main.sh": "echo hi\n", "debug.log": "x",
                      "keep.log": "y", "node_modules/big/index.js": "z" * 4096, ".git/HEAD": "ref"}.items():
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        (ctx / rel).write_text(data)
    (ctx / ".dockerignore").write_text("node_modules\n.git\n*.log\n!keep.log\nDockerfile\n")
    contexts = cli.build_contexts("services:\n  app:\n    build: ./app\n", tmp_path)
    # the Dockerfile travels whatever the file says (Docker needs it to build)
    assert _files(contexts["app"]) == {".dockerignore", "Dockerfile", "main.sh", "keep.log"}
    # what is left out does not count against the size limit
    assert cli.context_tar(ctx, limit=1024, keep=("Dockerfile",))
    (ctx / ".dockerignore").write_text(".git\n")
    with pytest.raises(ValueError, match="more than 1024 bytes"):
        cli.context_tar(ctx, limit=1024)
