"""Path resolution (spec §3.1), users and process environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.envd.errors import InvalidArgument, Unauthenticated
from aenv.envd.identity import SandboxState, User, resolve_path

HOME = "/home/user"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("", HOME),
        ("~", HOME),
        ("~/a/b", "/home/user/a/b"),
        ("rel/x", "/home/user/rel/x"),
        ("/abs/./x/../y", "/abs/y"),
        ("../../etc/passwd", "/etc/passwd"),
        ("../../../../../etc", "/etc"),
        ("//double//slash/", "/double/slash"),
    ],
)
def test_resolve_path(given: str, expected: str) -> None:
    assert resolve_path(given, HOME) == expected


def test_empty_path_prefers_workdir() -> None:
    assert resolve_path("", HOME, "/work") == "/work"
    assert resolve_path("x", HOME, "/work") == "/home/user/x"


def test_tilde_other_user_rejected() -> None:
    with pytest.raises(InvalidArgument):
        resolve_path("~bob/x", HOME)


def test_unknown_user_unauthenticated_and_default_fallback() -> None:
    state = SandboxState(default_user="no-such-user-xyz")
    with pytest.raises(Unauthenticated, match="invalid username: 'ghost-xyz'"):
        state.resolve_user("ghost-xyz")
    assert state.resolve_user(None).uid == 0  # missing default user ⇒ root


def test_process_env_order() -> None:
    state = SandboxState(
        env_vars={"G": "global", "E2B_SANDBOX_ID": "override"}, sandbox_id="sb1", template_id="t"
    )
    user = User("u", 1000, 1000, "/home/u")
    env = state.process_env(user, {"G": "request", "HOME": "/elsewhere"})
    assert env["USER"] == env["LOGNAME"] == "u"
    assert env["HOME"] == "/elsewhere"
    assert env["G"] == "request"
    assert env["E2B_SANDBOX"] == "true"
    assert env["E2B_SANDBOX_ID"] == "override"
    assert env["E2B_TEMPLATE_ID"] == "t"
    assert "PATH" in env


def test_user_lookup_is_cached_until_passwd_or_group_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pwd as pwd_mod

    from aenv.envd import identity

    passwd, group = tmp_path / "passwd", tmp_path / "group"
    passwd.write_text("user:x:1000:1000::/home/user:/bin/bash\n")
    group.write_text("user:x:1000:\n")
    monkeypatch.setattr(identity, "_ACCOUNT_FILES", (str(passwd), str(group)))
    monkeypatch.setattr(identity, "_USERS", {})
    calls: list[str] = []

    def getpwnam(name: str) -> pwd_mod.struct_passwd:
        calls.append(name)
        home = "/home/user2" if "renamed" in passwd.read_text() else "/home/user"
        return pwd_mod.struct_passwd((name, "x", 1000, 1000, "", home, "/bin/bash"))

    monkeypatch.setattr(identity.pwd, "getpwnam", getpwnam)
    monkeypatch.setattr(identity.os, "getgrouplist", lambda name, gid: [gid, 27])
    first = identity.User.lookup("user")
    assert identity.User.lookup("user") == first and calls == ["user"]
    assert first.groups == (1000, 27)
    passwd.write_text("user:x:1000:1000:renamed:/home/user2:/bin/bash\n")  # useradd/usermod
    assert identity.User.lookup("user").home == "/home/user2" and calls == ["user", "user"]
    group.write_text("user:x:1000:\nextra:x:2000:user\n")
    identity.User.lookup("user")
    assert calls == ["user", "user", "user"]
