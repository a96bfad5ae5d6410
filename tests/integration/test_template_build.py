"""Template builds through the unmodified E2B SDK (``Template.build``): steps run in a sandbox of the
server's runtime, COPY sources are uploaded, each step is cached by what came before it, a failing
step fails the build and registers nothing, and the result starts like any template."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from e2b import BuildException, Sandbox, Template


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def _logs() -> tuple[list[str], object]:
    seen: list[str] = []
    return seen, lambda entry: seen.append(str(getattr(entry, "message", entry)))


def test_build_copy_run_env_workdir_user_then_start(e2b_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.txt").write_text("from the build context\n")
    (tmp_path / "notes.txt").write_text("a single file\n")
    template = (
        Template(file_context_path=str(tmp_path))
        .from_template("base")
        .set_envs({"GREETING": "hello-build"})
        .run_cmd("echo $GREETING > /opt/greeting && id -un > /opt/built-by")
        .copy("app", "/srv/app/")
        .copy("notes.txt", "/srv/notes.txt", user="user", mode=0o640)
        .set_workdir("/srv/app")
        .run_cmd("pwd > /srv/where && cat main.txt > copied-check")
        .set_user("user")
        .run_cmd("id -un > /tmp/step-user")
    )
    name = _name("bt")
    seen, on_logs = _logs()
    info = Template.build(template, name, cpu_count=1, memory_mb=512, on_build_logs=on_logs)
    assert info.template_id and info.build_id
    assert any("step 2/" in m for m in seen), seen  # the server's step logs reach the SDK
    for ref in (name, info.template_id):  # by name and by the ID the build returned
        sbx = Sandbox.create(ref, timeout=120)
        try:
            out = sbx.commands.run(
                "cat /opt/greeting /opt/built-by /srv/where /srv/app/main.txt /srv/app/copied-check /tmp/step-user;"
                " stat -c '%U %a' /srv/notes.txt; whoami; pwd; echo ${GREETING:-unset}"
            ).stdout.split("\n")
            assert out[:6] == ["hello-build", "root", "/srv/app", "from the build context", "from the build context",
                               "user"], out
            assert out[6] == "user 640", out
            # USER and WORKDIR are the sandbox's defaults; ENV was for the build only (as E2B documents)
            assert out[7:10] == ["user", "/srv/app", "unset"], out
        finally:
            sbx.kill()
    assert Template.exists(name)


def test_a_failing_step_fails_the_build_and_registers_nothing(e2b_env: dict[str, str]) -> None:
    name = _name("bad")
    template = Template().from_template("base").run_cmd("echo before-fail").run_cmd("echo doomed >&2; exit 7")
    seen, on_logs = _logs()
    with pytest.raises(BuildException, match="step 2.*exit code 7"):
        Template.build(template, name, on_build_logs=on_logs)
    assert any("doomed" in m for m in seen), seen  # the failing step's output is in the logs
    assert not Template.exists(name)


def test_a_step_as_a_user_that_does_not_exist_fails_in_e2b_words(e2b_env: dict[str, str]) -> None:
    name = _name("nouser")
    template = Template().from_template("base").run_cmd("whoami", user="root123")
    with pytest.raises(BuildException) as info:
        Template.build(template, name)
    assert "failed to run command 'whoami': command failed: unauthenticated: invalid username: 'root123'" \
        in str(info.value)  # the E2B SDK's own test_run_command_as_user_that_does_not_exist
    assert not Template.exists(name)


def test_a_rebuild_redoes_only_the_changed_last_step(e2b_env: dict[str, str]) -> None:
    name = _name("cache")
    first = "date +%s%N > /opt/stamp"

    def build(last: str, skip_cache: bool = False) -> list[str]:
        seen, on_logs = _logs()
        Template.build(Template().from_template("base").run_cmd(first).run_cmd(last), name,
                       skip_cache=skip_cache, on_build_logs=on_logs)
        return seen

    def stamp() -> str:
        sbx = Sandbox.create(name, timeout=120)
        try:
            return sbx.commands.run("cat /opt/stamp; cat /opt/last").stdout
        finally:
            sbx.kill()

    build("echo one > /opt/last")
    stamp1, last1 = stamp().split()
    seen = build("echo two > /opt/last")
    assert any("steps 1-1 cached" in m for m in seen), seen
    stamp2, last2 = stamp().split()
    assert (stamp2, last1, last2) == (stamp1, "one", "two")  # step 1 was not run again
    seen = build("echo two > /opt/last", skip_cache=True)
    assert not any("cached" in m for m in seen), seen
    assert stamp().split()[0] != stamp1  # skip_cache ran everything again


def test_tags_name_one_build_and_come_and_go(e2b_env: dict[str, str]) -> None:
    name = _name("tags")
    info = Template.build(Template().from_template("base").run_cmd("echo tagged > /opt/t"), f"{name}:v1",
                          tags=["stable"])
    for ref in (f"{name}:v1", f"{name}:stable"):
        sbx = Sandbox.create(ref, timeout=120)
        try:
            assert sbx.commands.run("cat /opt/t").stdout.strip() == "tagged"
        finally:
            sbx.kill()
    assigned = Template.assign_tags(f"{name}:v1", ["production"])
    assert assigned.tags == ["production"] and assigned.build_id == info.build_id
    assert sorted(t.tag for t in Template.get_tags(info.template_id)) == ["production", "stable", "v1"]
    Template.remove_tags(name, ["stable"])
    assert Template.exists(f"{name}:production") and not Template.exists(f"{name}:stable")


async def test_async_build_and_exists(e2b_env: dict[str, str]) -> None:
    from e2b import AsyncSandbox, AsyncTemplate

    name = _name("async")
    await AsyncTemplate.build(AsyncTemplate().from_template("base").run_cmd("echo async > /opt/a"), name)
    assert await AsyncTemplate.exists(name)
    sbx = await AsyncSandbox.create(name, timeout=120)
    try:
        assert (await sbx.commands.run("cat /opt/a")).stdout.strip() == "async"
    finally:
        await sbx.kill()


def test_env_values_expand_variables_as_docker_and_e2b_do(e2b_env: dict[str, str]) -> None:
    """``ENV PATH=/opt/tools/bin:$PATH`` (as the SDK sends a Dockerfile's ENV, unexpanded) extends the
    PATH the steps run with instead of setting it to the literal text, which lost /usr/sbin and /bin."""
    template = (
        Template().from_template("base")
        .set_envs({"A": "/x", "PATH": "/opt/tools/bin:$PATH"})
        .set_envs({"B": "${A}/bin"})
        .run_cmd("mkdir -p /opt/tools/bin && printf '#!/bin/sh\\necho tool-ok\\n' > /opt/tools/bin/mytool"
                 " && chmod +x /opt/tools/bin/mytool")
        .run_cmd('{ mytool; echo "$B"; command -v useradd; } > /opt/out')
    )  # fmt: skip
    name = _name("envx")
    Template.build(template, name)
    sbx = Sandbox.create(name, timeout=120)
    try:
        assert sbx.commands.run("cat /opt/out").stdout.split("\n")[:3] == ["tool-ok", "/x/bin", "/usr/sbin/useradd"]
    finally:
        sbx.kill()
