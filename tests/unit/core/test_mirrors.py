"""The operator's package mirrors: the settings, and what a sandbox gets at create."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from aenv.config import Settings, load_settings
from aenv.core.mirrors import apt_sources, docker_daemon_config, env_for


def test_pip_and_npm_go_into_the_environment_and_apt_into_a_sources_list() -> None:
    s = Settings(package_mirrors={"pip": "http://10.1.2.3:8080/simple", "npm": "https://npm.internal/",
                                  "apt": "http://10.1.2.4/debian/"})
    assert env_for(s) == {"PIP_INDEX_URL": "http://10.1.2.3:8080/simple", "PIP_TRUSTED_HOST": "10.1.2.3",
                          "NPM_CONFIG_REGISTRY": "https://npm.internal/"}
    assert apt_sources(s) == b"deb http://10.1.2.4/debian bookworm main\n"
    assert env_for(Settings()) == {} and apt_sources(Settings()) is None
    assert "PIP_TRUSTED_HOST" not in env_for(Settings(package_mirrors={"pip": "https://pypi.internal/simple"}))


@pytest.mark.parametrize("mirrors", [{"cargo": "http://x/"}, {"pip": "ftp://x/"}, {"npm": "http://a b/"}])
def test_bad_mirrors_are_refused_naming_the_setting(mirrors: dict[str, str]) -> None:
    with pytest.raises(ValidationError, match="package_mirrors"):
        Settings(package_mirrors=mirrors)


def test_allowlist_and_mirrors_from_the_environment(tmp_path: object) -> None:
    s = load_settings(environ={"AENV_STATE_DIR": str(tmp_path), "AENV_PRIVATE_EGRESS": "named:10.1.2.3:8000, localhost:9000",
                               "AENV_PACKAGE_MIRRORS": "pip=http://10.1.2.3:8080/simple"})
    assert s.private_egress == ["named:10.1.2.3:8000", "localhost:9000"]
    assert s.package_mirrors == {"pip": "http://10.1.2.3:8080/simple"}


def test_the_docker_mirror_is_merged_into_dockerds_config() -> None:
    s = Settings(package_mirrors={"docker": "http://10.0.2.2:5000/"})
    current = {"log-driver": "json-file", "registry-mirrors": ["https://other.example"]}
    assert docker_daemon_config(s, current) == {
        "log-driver": "json-file", "registry-mirrors": ["https://other.example", "http://10.0.2.2:5000"],
        "insecure-registries": ["10.0.2.2:5000"]}
    again = docker_daemon_config(s, docker_daemon_config(s, {}) or {})
    assert again == {"registry-mirrors": ["http://10.0.2.2:5000"], "insecure-registries": ["10.0.2.2:5000"]}
    assert docker_daemon_config(Settings(package_mirrors={"docker": "https://hub.internal"}), {}) == {
        "registry-mirrors": ["https://hub.internal"]}
    assert docker_daemon_config(Settings(), {"a": 1}) is None
    assert env_for(s) == {} and apt_sources(s) is None  # only a sandbox with Docker inside gets it
