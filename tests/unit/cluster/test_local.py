"""``LocalCluster`` refuses a state directory that is not its own, and then removes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.cluster.local import LocalCluster


def test_a_non_empty_state_dir_is_refused_and_kept(tmp_path: Path) -> None:
    (tmp_path / "precious").write_text("keep me")
    c = LocalCluster(1, 18999, tmp_path)
    with pytest.raises(RuntimeError, match="not empty"):
        c.start(timeout=5)
    assert (tmp_path / "precious").read_text() == "keep me"
    assert not c.topo.made  # no network was made either
