"""Build steps without a sandbox: validation, the cache key chain, the state the steps leave, and the
COPY script run by the host's own sh on a real tar (as it runs in a sandbox)."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from aenv.core.build_spec import (
    BuildSpec,
    BuildState,
    Step,
    chain_keys,
    copy_script,
    env_references,
    expand_env,
    final_key,
    first_forced,
    lookup_script,
)
from aenv.errors import InvalidRequest

HASH = "a" * 64


def test_a_build_needs_exactly_one_base_and_sane_steps() -> None:
    with pytest.raises(InvalidRequest, match="exactly one"):
        BuildSpec()
    with pytest.raises(InvalidRequest, match="exactly one"):
        BuildSpec(from_image="x", from_template="base")
    bad = [
        (Step("FROM", ("x",)), "unknown step type"),
        (Step("RUN", ()), "args must be"),
        (Step("COPY", ("a", "/b")), "filesHash"),
        (Step("COPY", ("a", "/b", "bad owner!"), HASH), "bad owner"),
        (Step("COPY", ("a", "/b", "", "999"), HASH), "bad mode"),
        (Step("ENV", ("ONLY_A_NAME",)), "pairs"),
        (Step("ENV", ("1BAD", "v")), "pairs"),
        (Step("WORKDIR", ("relative",)), "absolute"),
        (Step("USER", ("root; rm -rf /",)), "bad user"),
    ]
    for step, why in bad:
        with pytest.raises(InvalidRequest, match=why):
            BuildSpec(from_template="base", steps=(Step("RUN", ("true",)), step))
    BuildSpec(from_template="base", steps=(Step("COPY", ("src/*.py", "/app/", "user:user", "0755"), HASH),))


def test_each_key_covers_everything_before_it() -> None:
    a = BuildSpec(from_template="base", steps=(Step("RUN", ("one",)), Step("RUN", ("two",))))
    b = BuildSpec(from_template="base", steps=(Step("RUN", ("one",)), Step("RUN", ("three",))))
    ka, kb = chain_keys("base", a), chain_keys("base", b)
    assert len(ka) == 3 and ka[:2] == kb[:2] and ka[2] != kb[2]  # only the changed step's key moves
    assert chain_keys("other", a)[1] != ka[1]  # another base: nothing is shared
    forced = BuildSpec(from_template="base", steps=(Step("RUN", ("one",)), Step("RUN", ("two",), force=True)))
    assert chain_keys("base", forced) == ka  # force is not part of the key, it skips the cache
    assert first_forced(forced) == 2 and first_forced(a) is None
    assert first_forced(BuildSpec(from_template="base", force=True)) == 0
    assert final_key(ka[-1], a) != final_key(ka[-1], BuildSpec(from_template="base", start_cmd="srv"))


def test_metadata_steps_set_the_state_for_what_follows() -> None:
    s = BuildState()
    s = s.after(Step("ENV", ("A", "1", "B", "2")))
    s = s.after(Step("WORKDIR", ("/w",)))
    s = s.after(Step("USER", ("user",)))
    s = s.after(Step("RUN", ("true",)))
    assert (s.env, s.workdir, s.user, s.default_user) == ({"A": "1", "B": "2"}, "/w", "user", "user")
    assert BuildState.from_json(s.to_json()) == s
    assert BuildState.from_json({}) == BuildState()


def _tar(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _run_copy(tmp_path: Path, step: Step, files: dict[str, str]) -> subprocess.CompletedProcess[str]:
    archive = tmp_path / "upload.tar"
    archive.write_bytes(_tar(files))
    script = copy_script(step, str(archive))
    return subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, check=False)


def test_copy_puts_a_directory_file_or_pattern_where_docker_would(tmp_path: Path) -> None:
    root = tmp_path / "root"
    files = {"app/a.txt": "A", "app/sub/b.txt": "B", "one.txt": "1", "x.py": "x", "y.py": "y"}
    assert _run_copy(tmp_path, Step("COPY", ("app", str(root / "srv") + "/"), HASH), files).returncode == 0
    assert (root / "srv" / "a.txt").read_text() == "A" and (root / "srv" / "sub" / "b.txt").read_text() == "B"
    assert _run_copy(tmp_path, Step("COPY", ("one.txt", str(root / "etc" / "renamed.txt")), HASH), files).returncode == 0
    assert (root / "etc" / "renamed.txt").read_text() == "1"
    assert _run_copy(tmp_path, Step("COPY", ("one.txt", str(root / "into") + "/"), HASH), files).returncode == 0
    assert (root / "into" / "one.txt").read_text() == "1"
    assert _run_copy(tmp_path, Step("COPY", ("*.py", str(root / "py"), "", "0700"), HASH), files).returncode == 0
    assert sorted(os.listdir(root / "py")) == ["x.py", "y.py"]
    assert (root / "py" / "x.py").stat().st_mode & 0o777 == 0o700
    assert not (tmp_path / "upload.tar").exists() and not (tmp_path / "upload.tar.d").exists()  # cleaned up


def test_copy_changes_only_what_it_copies_and_fails_on_no_match(tmp_path: Path) -> None:
    dest = tmp_path / "bin"
    dest.mkdir()
    (dest / "existing").write_text("keep")
    os.chmod(dest / "existing", 0o600)
    assert _run_copy(tmp_path, Step("COPY", ("tool", str(dest) + "/", "", "0755"), HASH), {"tool": "t"}).returncode == 0
    assert (dest / "tool").stat().st_mode & 0o777 == 0o755
    assert (dest / "existing").stat().st_mode & 0o777 == 0o600  # the destination's other files are untouched
    failed = _run_copy(tmp_path, Step("COPY", ("missing*", str(dest)), HASH), {"tool": "t"})
    assert failed.returncode != 0 and "nothing matches" in failed.stderr


def test_env_values_expand_references_as_envsubst_does_with_what_a_shell_sees() -> None:
    """The SDK sends ``ENV PATH=/opt/bin:$PATH`` as written; the builder looks the names up with a
    shell in the sandbox and expands ``$NAME`` / ``${NAME}`` only (unset: empty)."""
    step = Step("ENV", ("PATH", "/opt/tools/bin:$PATH", "B", "${A}/bin:$NOPE:$$:${A:-x}:$(id)", "PLAIN", "a b"))
    names = env_references(step)
    assert names == ["PATH", "A", "NOPE"]
    env = {"PATH": "/usr/bin:/bin", "A": "/x y", "HOME": "/root"}
    res = subprocess.run(["/bin/sh", "-c", lookup_script(names)], env=env, capture_output=True, check=True)
    values = dict(zip(names, res.stdout.decode().split("\0"), strict=False))
    assert values == {"PATH": "/usr/bin:/bin", "A": "/x y", "NOPE": ""}
    out = expand_env(step, values)
    assert out.args == ("PATH", "/opt/tools/bin:/usr/bin:/bin", "B", "/x y/bin::$$:${A:-x}:$(id)", "PLAIN", "a b")
    assert env_references(Step("ENV", ("A", "no references"))) == []
