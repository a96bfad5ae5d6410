"""The template catalog: names → runnable images. Filled by bootstrap (``base``), OCI pulls and snapshots.

Templates are rows in the store pointing at read-only root filesystems in the cache or state dir.
Whatever fills the catalog (``aenv.images``) only calls ``register``; the orchestrator only calls ``resolve``.

Names follow E2B's: ``name`` is ``name:default``, ``name:tag`` a tag, and ``name:<build ID>`` the build
a tag or name of that template points at (what ``Template.get_tags`` returns and Harbor pins sandboxes
to). A built template's rows share the ID of their template (``config.family``; see core/builds.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from aenv.config import Settings
from aenv.core.ids import new_id
from aenv.errors import Conflict, TemplateNotFound
from aenv.images import docker_template, interpreter
from aenv.images.templates import PulledImage
from aenv.kinds import TemplateKind
from aenv.runtime.base import SandboxImage
from aenv.store.sqlite import Store, TemplateRow, now


def sandbox_image_of(
    pulled: PulledImage,
    template_id: str,
    *,
    start_cmd: str | None = None,
    ready_cmd: str | None = None,
    rootfs: Path | None = None,
) -> SandboxImage:
    """The runtime's view of a pulled image. ``lowers`` is the *complete* overlay lowerdir list, top
    first (the ns runtime mounts ``image.lowers or (image.rootfs,)``). ``rootfs`` defaults to the bottom
    layer; pass ``await builder.flat_rootfs(pulled)`` for a runtime that needs one merged tree (vm)."""
    lowers = pulled.lowers
    return SandboxImage(
        template_id=template_id,
        rootfs=rootfs or lowers[-1],
        lowers=lowers,
        env=dict(pulled.config.env),
        workdir=pulled.config.workdir,
        user="user",  # the image's User is recorded in config.user; sandboxes default to `user`
        start_cmd=start_cmd if start_cmd is not None else pulled.config.start_cmd,
        ready_cmd=ready_cmd,
        lazy_file=pulled.lazy_file,
    )


DEFAULT_TAG = "default"


def split_tag(name: str) -> tuple[str, str]:
    """``name[:tag]`` → (name, tag); no tag is E2B's ``default``."""
    plain, _, tag = name.partition(":")
    return plain, tag or DEFAULT_TAG


def alias_for(plain: str, tag: str) -> str:
    """The alias a tag's row carries: the plain name for ``default`` (E2B: ``name`` is ``name:default``)."""
    return plain if tag == DEFAULT_TAG else f"{plain}:{tag}"


def family_of(row: TemplateRow) -> str:
    """The template ID a built row belongs to: every tag of one template shares it (older rows: the
    row a tag was copied from, else the row itself)."""
    return str(row.config.get("family") or row.config.get("tag_of") or row.id)


class TemplateCatalog:
    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store

    def resolve(self, name: str) -> TemplateRow:
        row = self.store.get_template(name)
        if row is None and ":" in name:
            plain, ref = split_tag(name)
            row = self.store.get_template(plain) if ref == DEFAULT_TAG else self._tagged(plain, ref)
        if row is None:
            raise TemplateNotFound(name)
        return row

    def _tagged(self, plain: str, ref: str) -> TemplateRow | None:
        """A row of template ``plain`` (its name or its ID) whose tag or build ID is ``ref``."""
        for row in self.store.list_templates():
            if not row.alias or not row.config.get("built"):
                continue
            name, tag = split_tag(row.alias)
            if plain in (name, family_of(row)) and ref in (tag, row.config.get("build_id")):
                return row
        return None

    def image(self, row: TemplateRow) -> SandboxImage:
        cfg = row.config
        return SandboxImage(
            template_id=row.id,
            rootfs=Path(row.rootfs),
            lowers=tuple(Path(p) for p in row.lowers),
            env=dict(cfg.get("env", {})),
            workdir=cfg.get("workdir"),
            user=cfg.get("user") or "user",
            start_cmd=cfg.get("start_cmd"),
            start_user=cfg.get("start_user"),
            start_cwd=cfg.get("start_cwd"),
            ready_cmd=cfg.get("ready_cmd"),
            lazy_file=Path(cfg["lazy_file"]) if cfg.get("lazy_file") else None,
            nested_containers=bool(cfg.get("nested_containers")),
        )

    def register(
        self,
        *,
        alias: str | None,
        kind: TemplateKind,
        rootfs: Path,
        lowers: list[Path] | None = None,
        config: dict[str, Any] | None = None,
        source: str | None = None,
        cpu_count: int | None = None,
        memory_mb: int | None = None,
        size_bytes: int = 0,
        pinned_layers: list[str] | None = None,
        template_id: str | None = None,
        owner: str = "",
    ) -> TemplateRow:
        if alias:
            held = self.store.get_template(alias)
            if held is not None and held.alias == alias and held.owner != owner:
                # names are one namespace per server: a name moves to a newer template of its team only
                raise Conflict(f"template name '{alias}' is taken by another team; pick another name", template=alias)
        row = TemplateRow(
            id=template_id or new_id(),
            alias=alias,
            kind=kind,
            source=source,
            rootfs=str(rootfs),
            lowers=[str(p) for p in lowers or []],
            config=config or {},
            cpu_count=cpu_count or self.settings.default_cpu_count,
            memory_mb=memory_mb or self.settings.default_memory_mb,
            disk_mb=self.settings.default_disk_mb,
            size_bytes=size_bytes,
            created_at=now(),
            pinned_layers=pinned_layers or [],
            owner=owner,
        )
        self.store.put_template(row)
        return row

    def register_interpreter(self, layers: interpreter.InterpreterLayers) -> TemplateRow:
        """Register (or refresh) ``code-interpreter-v1`` over ``layers``; its ID is its name, like ``base``."""
        return self.register(
            alias=interpreter.TEMPLATE_NAME,
            kind=TemplateKind.BOOTSTRAP,
            rootfs=layers.base,
            lowers=layers.lowers,
            config={"start_cmd": interpreter.START_CMD, "ready_cmd": interpreter.READY_CMD},
            source="aenv:code-interpreter (ipykernel from PyPI)",
            template_id=interpreter.TEMPLATE_NAME,
            size_bytes=interpreter.tree_size(layers.packages),
        )

    def register_interpreter_if_built(self) -> TemplateRow | None:
        """Server start-up: (re)register ``code-interpreter-v1`` when its layers are already in the
        cache, never building anything (that takes PyPI and a minute; ``aenv template build`` does it)."""
        layers = interpreter.interpreter_layers_if_built(self.settings)
        if layers is None:
            return None
        return self._registered_over(interpreter.TEMPLATE_NAME, layers.lowers) or self.register_interpreter(layers)

    def register_docker(self, layers: docker_template.DockerLayers) -> TemplateRow:
        """Register (or refresh) ``docker``: Docker and Compose inside (``nested_containers``)."""
        return self.register(
            alias=docker_template.TEMPLATE_NAME,
            kind=TemplateKind.BOOTSTRAP,
            rootfs=layers.base,
            lowers=layers.lowers,
            config={"start_cmd": docker_template.START_CMD, "ready_cmd": docker_template.READY_CMD,
                    "nested_containers": True},
            source="aenv:docker (docker.io from bookworm, Compose v2 from trixie)",
            template_id=docker_template.TEMPLATE_NAME,
            size_bytes=interpreter.tree_size(layers.base),
        )

    def register_docker_if_built(self) -> TemplateRow | None:
        """Server start-up: (re)register ``docker`` when its layers are already in the cache, never
        building anything (``aenv template build docker`` does)."""
        layers = docker_template.docker_layers_if_built(self.settings)
        if layers is None:
            return None
        return self._registered_over(docker_template.TEMPLATE_NAME, layers.lowers) or self.register_docker(layers)

    def _registered_over(self, name: str, lowers: list[Path]) -> TemplateRow | None:
        """The built-in template ``name`` when its row already names these layers (nothing to refresh)."""
        row = self.store.get_template(name)
        return row if row is not None and row.lowers == [str(p) for p in lowers] else None

    def list_templates(self) -> list[TemplateRow]:
        return self.store.list_templates()

    def delete(self, name: str, *, in_use: set[str]) -> TemplateRow:
        """Remove a template. Refused while a sandbox uses it; files owned by the state dir are removed,
        shared cache content (layers, the bootstrap rootfs) is left to the cache's own eviction."""
        row = self.resolve(name)
        if row.id in in_use:
            raise Conflict(f"template '{name}' is used by running sandboxes", template=name)
        self.store.delete_template(row.id)
        owned = self.settings.templates_dir / row.id
        if owned.exists():
            shutil.rmtree(owned, ignore_errors=True)
        return row
