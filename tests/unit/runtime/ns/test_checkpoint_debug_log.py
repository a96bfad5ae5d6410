"""The debug log every sandbox process holds open with ``log_level = debug`` travels with the images:
kept while the tree is frozen (contents, mode, owner) and put in the new run dir before CRIU opens it."""

from __future__ import annotations

import os
from pathlib import Path

from aenv.runtime.ns import checkpoint


def test_the_log_is_kept_with_the_images_as_it_was(tmp_path: Path) -> None:
    run, images = tmp_path / "run", tmp_path / "images"
    run.mkdir()
    images.mkdir()
    log = run / checkpoint.DEBUG_LOG
    log.write_text("envd started\n")
    log.chmod(0o600)
    if os.geteuid() == 0:  # a sandbox root's mapped uid
        os.chown(log, 1234, 1234)
    checkpoint.keep_debug_log(run, images)
    kept = images / checkpoint.DEBUG_LOG
    assert kept.read_text() == "envd started\n"
    assert (kept.stat().st_mode & 0o777, kept.stat().st_uid) == (0o600, log.stat().st_uid)


def test_no_log_no_copy(tmp_path: Path) -> None:
    checkpoint.keep_debug_log(tmp_path, tmp_path / "images")  # at info level there is none: nothing to keep
    assert not (tmp_path / "images").exists()
