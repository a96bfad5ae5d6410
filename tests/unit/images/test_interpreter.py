"""The code-interpreter template builder's pure parts: pip command line, layer names, registration."""

from __future__ import annotations

from pathlib import Path

from aenv.config import Settings
from aenv.images import interpreter as it


def test_pip_argv_targets_the_base_python_with_wheels_only(tmp_path: Path) -> None:
    argv = it.pip_argv(tmp_path, ["numpy"], python="/py")
    assert argv[:4] == ["/py", "-m", "pip", "install"]
    assert argv[argv.index("--target") + 1] == str(tmp_path)
    assert argv[argv.index("--python-version") + 1] == "3.11"
    assert "--only-binary=:all:" in argv
    platforms = [argv[i + 1] for i, a in enumerate(argv) if a == "--platform"]
    assert "manylinux_2_36_x86_64" in platforms and "manylinux_2_17_x86_64" in platforms
    assert "manylinux_2_38_x86_64" not in platforms  # newer than bookworm's glibc
    assert argv[-1] == "numpy"


def test_layer_names_follow_their_inputs(tmp_path: Path) -> None:
    s = Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c")
    a = it.packages_layer_path(s, ["numpy", "ipykernel"])
    assert a == it.packages_layer_path(s, ["ipykernel", "numpy"])  # order does not matter
    assert a != it.packages_layer_path(s, ["numpy"])
    assert a.parent == tmp_path / "c" / "rootfs" and a.name.startswith("interpreter-")
    assert it.service_layer_path(s).name.startswith("interpreter-svc-")


def test_service_hash_changes_with_the_sources(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    h1 = it.service_hash(tmp_path)
    (tmp_path / "a.py").write_text("x = 2\n")
    assert it.service_hash(tmp_path) != h1


def test_move_scripts_rewrites_the_shebang(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "bin").mkdir(parents=True)
    (site / "bin" / "jupyter").write_text("#!/host/venv/bin/python3.11\nimport sys\n")
    it._move_scripts(site, tmp_path / "usr/local/bin")
    assert (tmp_path / "usr/local/bin/jupyter").read_text() == "#!/usr/bin/python3\nimport sys\n"
    assert not (site / "bin").exists()
