"""The template catalog: registering built-in templates and the runtime's view of a pulled image."""

from __future__ import annotations

from pathlib import Path

from aenv.config import Settings
from aenv.core.templates import TemplateCatalog
from aenv.images import interpreter as it
from aenv.store.sqlite import Store


def test_register_and_register_if_built(tmp_path: Path) -> None:
    s = Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c")
    s.state_dir.mkdir()
    catalog = TemplateCatalog(s, Store(s.db_path))
    assert catalog.register_interpreter_if_built() is None  # nothing built: nothing registered, nothing built
    layers = it.InterpreterLayers(tmp_path / "svc", tmp_path / "pkgs", tmp_path / "base")
    row = catalog.register_interpreter(layers)
    assert row.id == row.alias == "code-interpreter-v1"
    assert row.lowers == [str(tmp_path / "svc"), str(tmp_path / "pkgs"), str(tmp_path / "base")]
    image = catalog.image(catalog.resolve("code-interpreter-v1"))
    assert image.start_cmd == it.START_CMD and image.rootfs == tmp_path / "base"
