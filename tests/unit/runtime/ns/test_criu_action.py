"""The compiled restore action (``criu_action.py``): its configuration and its mount-table check on
mount points the shell form could not name (the behaviour shared with the shell form is tested in
``test_criu.py`` against both)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from aenv.runtime.ns.criu_action import compiled_action, conf_text

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the shell form is used")


def test_conf_escapes_mount_points_as_mountinfo_does() -> None:
    text = conf_text([("/mnt/a b", ["ro", "nodev"]), ("/x\\y", ["ro"])], ["/bin/fix", "-v"], ("10.0.2.100", "mark"))
    assert text.splitlines() == ["lo_up\t10.0.2.100\tmark", "fix\t/bin/fix\t-v", "need\t/mnt/a\\040b\tro nodev",
                                 "need\t/x\\134y\tro"]
    with pytest.raises(ValueError, match="tab"):
        conf_text([], ["/bin/fix", "a\tb"], None)


@needs_cc
def test_one_program_many_configurations(tmp_path: Path) -> None:
    one = compiled_action(tmp_path, conf_text([], ["/bin/true"], None))
    two = compiled_action(tmp_path, conf_text([("/data", ["ro"])], ["/bin/true"], None))
    assert one is not None and two is not None and one != two
    assert one.resolve() == two.resolve()  # both links to the one program
    assert compiled_action(tmp_path, conf_text([], ["/bin/true"], None)) == one
    assert Path(f"{two}.conf").read_text().endswith("need\t/data\tro\n")


@needs_cc
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root for a mount namespace")
@pytest.mark.parametrize(("options", "fixed"), [("ro,nodev", False), ("ro", True), ("rw,nodev", True)])
def test_a_point_with_a_space_is_checked_for_each_option(tmp_path: Path, options: str, fixed: bool) -> None:
    point = tmp_path / "vol a"
    point.mkdir()
    ran = tmp_path / "ran"
    action = compiled_action(tmp_path, conf_text([(str(point), ["ro", "nodev"])], ["/bin/sh", "-c", f"echo fix > {ran}"],
                                                 None))
    assert action is not None
    script = (f"mount --bind -o {options} '{point}' '{point}' && "
              f"CRTOOLS_SCRIPT_ACTION=pre-resume CRTOOLS_INIT_PID=$$ sh -c {action}")
    subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], check=True)
    assert ran.exists() is fixed


@needs_cc
def test_a_missing_configuration_fails_the_stage_that_needs_it(tmp_path: Path) -> None:
    action = compiled_action(tmp_path, conf_text([], ["/bin/true"], None))
    assert action is not None
    Path(f"{action}.conf").unlink()
    env = {"CRTOOLS_INIT_PID": "1"}
    assert subprocess.run([str(action)], env={**env, "CRTOOLS_SCRIPT_ACTION": "post-restore"}).returncode == 0
    failed = subprocess.run([str(action)], env={**env, "CRTOOLS_SCRIPT_ACTION": "pre-resume"}, capture_output=True, text=True)
    assert failed.returncode == 1 and "conf" in failed.stderr
