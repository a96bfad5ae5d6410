"""The docker template's pure parts: the private apt configuration and the group file edit."""

from __future__ import annotations

from pathlib import Path

from aenv.images import docker_template as dt


def test_user_joins_the_docker_group_once_and_nothing_else_changes() -> None:
    text = "root:x:0:\ndocker:x:101:\nsudo:x:27:user\n"
    once = dt.with_member(text, "docker", "user")
    assert once == "root:x:0:\ndocker:x:101:user\nsudo:x:27:user\n"
    assert dt.with_member(once, "docker", "user") == once
    assert dt.with_member("docker:!:alice:bob\n", "docker", "user") == "docker:!:alice:bob,user\n"  # gshadow


def test_apt_runs_on_a_configuration_of_its_own(tmp_path: Path) -> None:
    opts = dt.apt_options(tmp_path)
    pairs = dict(opt.split("=", 1) for opt in opts if "=" in opt)
    assert pairs["Dir::Etc::sourcelist"] == f"{tmp_path}/sources.list"
    assert pairs["Dir::Etc::sourceparts"] == "-"  # the host's sources.list.d is not read
    assert pairs["Dir::State::Lists"].startswith(str(tmp_path)) and pairs["Dir::Cache"].startswith(str(tmp_path))


def test_the_start_script_runs_dockerd_rootless_only_in_a_user_namespace() -> None:
    script = dt.START_SCRIPT_TEXT
    assert '"0:4294967295"' in script and "--rootless" in script  # the host's (a vm guest's) map: plain root
    assert dt.START_CMD == f"/{dt.START_SCRIPT}" and "docker info" in dt.READY_CMD
