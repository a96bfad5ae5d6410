"""LazyImages without a daemon: off unless asked, and the daemon's errors forwarded to the server's log."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.images.lazy.service import LazyImages
from aenv.images.registry import RegistryClient


async def test_off_by_default_and_says_why(tmp_path: Path) -> None:
    async with RegistryClient() as client:
        lazy = LazyImages(Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c"), client)
        assert not lazy.available
        assert lazy.describe() == {"lazy_images": False, "lazy_images_reason": "off (lazy_images = false)"}
        assert lazy.listing() == []


async def test_daemon_errors_reach_the_server_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with RegistryClient() as client:
        lazy = LazyImages(Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c"), client)
        log = lazy.daemon.root / "daemon.log"
        log.parent.mkdir(parents=True)
        log.write_text("t INFO aenv.lazy serving\nt ERROR aenv.lazy lazy fetch failed image=x chunks=1-2: down\n")
        with caplog.at_level(logging.ERROR, "aenv.lazy"):
            assert lazy.forward_errors() == 1
            assert lazy.forward_errors() == 0  # only new lines
            with open(log, "a") as fh:
                fh.write("t ERROR aenv.lazy lazy chunk refused image=x: chunk 3: sha256 …\npartial")
            assert lazy.forward_errors() == 1
        assert "aenv-lazyd: aenv.lazy lazy fetch failed image=x" in caplog.text
        assert "chunk refused" in caplog.text
