"""Template keys, manifests and the restore-side config derived from a template (no QEMU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aenv.runtime.base import SandboxImage
from aenv.runtime.vm import template as templates
from aenv.runtime.vm.accel import AccelChoice
from aenv.runtime.vm.artifacts import GuestArtifacts
from aenv.runtime.vm.cmdline import build_argv
from aenv.runtime.vm.sandbox import child_config

ART = GuestArtifacts(Path("/bin/sh"), Path("/bin/ls"), Path("/bin/cat"))  # any existing files
TCG = AccelChoice("tcg", "test", 2100000)
SHAPE = templates.Shape(2, 512, 2048)


def _tpl(**kw: object) -> SandboxImage:
    base: dict[str, object] = {"template_id": "base", "rootfs": Path("/r/base"), "env": {"A": "1"}}
    base.update(kw)
    return SandboxImage(**base)  # type: ignore[arg-type]


def test_key_changes_with_inputs() -> None:
    k = templates.template_key(_tpl(), SHAPE, TCG, ART)
    assert k.startswith("base-") and k == templates.template_key(_tpl(), SHAPE, TCG, ART)
    assert k != templates.template_key(_tpl(env={"A": "2"}), SHAPE, TCG, ART)
    assert k != templates.template_key(_tpl(), templates.Shape(1, 512, 2048), TCG, ART)
    assert k != templates.template_key(_tpl(), SHAPE, AccelChoice("kvm", "x", None), ART)
    assert k != templates.template_key(_tpl(start_cmd="sleep 1"), SHAPE, TCG, ART)


def test_key_changes_with_the_qemu_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(templates.compat, "qemu_version", lambda: "7.2")
    old = templates.template_key(_tpl(), SHAPE, TCG, ART)
    monkeypatch.setattr(templates.compat, "qemu_version", lambda: "10.0")
    assert templates.template_key(_tpl(), SHAPE, TCG, ART) != old


def test_agent_args() -> None:
    assert templates.agent_args(_tpl(user="user", start_cmd="run")) == [
        "--env-json", '{"A": "1"}', "--default-user", "user", "--log", "/dev/console", "--start-cmd", "run",
    ]  # fmt: skip


def _built(tmp_path: Path) -> templates.FrozenTemplate:
    key = "base-abc"
    tdir = tmp_path / key
    (tdir / "boot").mkdir(parents=True)
    cfg = templates._boot_config(key, tdir, SHAPE, TCG, ART, tmp_path / "shm", tdir / "boot")
    tpl = templates.FrozenTemplate(key, tdir, cfg)
    for p in (tpl.device_state, tpl.disk, tpl.empty_overlay, tdir / "config.raw", tpl.ram_image):
        p.write_bytes(b"x")
    (tmp_path / "shm").mkdir()
    tpl.mem_path.write_bytes(b"")
    templates._save(tpl)
    return tpl


def test_manifest_roundtrip_and_completeness(tmp_path: Path) -> None:
    tpl = _built(tmp_path)
    loaded = templates.load(tmp_path, tpl.key)
    assert loaded is not None and loaded.cfg == tpl.cfg
    assert json.loads((tpl.dir / "manifest.json").read_text())["version"] == templates.MANIFEST_VERSION
    assert tpl.mem_path.name.startswith(f"{tpl.key}.") and tpl.ram_id == tpl.mem_path.name[: -len(".mem")]
    tpl.mem_path.unlink()  # /dev/shm was wiped (reboot): the RAM comes back from ram.img
    assert templates.load(tmp_path, tpl.key) is not None
    tpl.ram_image.unlink()  # and without that image the template must be rebuilt
    assert templates.load(tmp_path, tpl.key) is None
    assert templates.load(tmp_path, "other") is None


def test_child_config_same_shape_own_paths(tmp_path: Path) -> None:
    tpl = _built(tmp_path)
    run = tmp_path / "run" / "sb1"
    child = child_config(tpl.cfg, "sb1", run, allow_internet=False)
    assert child.shape() == tpl.cfg.shape()
    assert child.mem_path == tpl.mem_path and not child.mem_share and child.incoming
    assert child.qmp_socket.parent == run and child.channel_socket.parent == run
    roots = [d for d in child.drives if d.serial == "root"]
    assert roots[0].path == run / "root.qcow2"
    assert [d.path for d in child.drives if d.serial != "root"] == [ART.tools_image, tpl.dir / "config.raw"]
    assert child.network == "restricted"
    assert child_config(tpl.cfg, "sb2", run, allow_internet=True).network == "user"
    argv = build_argv(child)
    assert argv[-2:] == ["-incoming", "defer"]
    assert len(str(child.qmp_socket)) < 108


def test_prune_tools_images(tmp_path: Path) -> None:
    import os

    from aenv.runtime.vm.artifacts import prune_tools_images

    paths = []
    for i in range(5):
        p = tmp_path / f"tools-{i}.ext4"
        p.write_bytes(b"x")
        os.utime(p, (1000 + i, 1000 + i))
        paths.append(p)
    removed = prune_tools_images(tmp_path, keep=paths[0], spare=2)
    assert sorted(p.name for p in removed) == ["tools-1.ext4", "tools-2.ext4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tools-0.ext4", "tools-3.ext4", "tools-4.ext4"]


async def test_template_cache_forgets_the_templates_of_one_id(tmp_path: Path) -> None:
    """Keys keep the id and a hash: another id that starts the same is another template."""
    cache = templates.TemplateCache(tmp_path / "templates", tmp_path / "frozen", tmp_path / "run")
    ids = ("code-interpreter", "code-interpreter-v1")
    keys = {i: templates.template_key(_tpl(template_id=i), SHAPE, TCG, ART) for i in ids}
    assert templates.built_from(keys["code-interpreter"], "code-interpreter")
    assert not templates.built_from(keys["code-interpreter-v1"], "code-interpreter")
    cfg = _built(tmp_path).cfg
    for i in ids:
        cache._templates[keys[i]] = templates.FrozenTemplate(keys[i], tmp_path, cfg)
    assert cache.forget("code-interpreter") == [keys["code-interpreter"]]
    assert cache.get(keys["code-interpreter-v1"]).key == keys["code-interpreter-v1"]
    with pytest.raises(KeyError):
        cache.get(keys["code-interpreter"])
