"""The CLI reference: every command of ``aenv`` (src/aenv/cli/main.py's Typer app) as Markdown.

Walked from the Click command Typer builds, so a new command, option or argument shows up without a
line of docs. Duck-typed over Click's objects: Typer ≥ 0.20 carries a private copy of Click, whose
classes are not ``click.Group`` and friends.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import typer


@dataclass(frozen=True)
class Command:
    """One command (or group) of the tree: its full path (``aenv cache ls``) and Click's object."""

    path: str
    obj: Any

    @property
    def is_group(self) -> bool:
        return isinstance(getattr(self.obj, "commands", None), dict)


def walk(app: typer.Typer, prog: str = "aenv") -> Iterator[Command]:
    """Every visible command and group below the root, depth first, in the order they were added."""
    root = typer.main.get_command(app)

    def below(obj: Any, path: str) -> Iterator[Command]:
        for name, sub in getattr(obj, "commands", {}).items():
            if getattr(sub, "hidden", False):
                continue
            cmd = Command(f"{path} {name}", sub)
            yield cmd
            yield from below(sub, cmd.path)

    yield from below(root, prog)


def prose(text: str) -> str:
    """Terminal help as Markdown text: ``<`` outside code spans escaped, so ``<state_dir>`` is shown
    rather than read as an HTML tag."""
    parts = text.split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def _cell(text: object) -> str:
    """Text that stays in one Markdown table cell."""
    return prose(" ".join(str(text).split()).replace("|", "\\|"))


def _default(param: Any) -> str:
    default = getattr(param, "default", None)
    if getattr(param, "is_flag", False):
        return "on" if default else ""
    if default in (None, [], ()) or callable(default):
        return ""
    return f"`{' '.join(str(default).split())}`"


def _options(params: list[Any]) -> list[str]:
    rows = []
    for p in params:
        if getattr(p, "param_type_name", "") != "option" or getattr(p, "hidden", False):
            continue
        names = ", ".join(f"`{o}`" for o in [*p.opts, *getattr(p, "secondary_opts", [])])
        extra = []
        if getattr(p, "multiple", False) and "repeatable" not in (getattr(p, "help", None) or ""):
            extra.append("repeatable")
        if getattr(p, "required", False):
            extra.append("required")
        if env := getattr(p, "envvar", None):
            extra.append("env " + ", ".join(f"`{e}`" for e in ([env] if isinstance(env, str) else env)))
        help_text = _cell(getattr(p, "help", None) or "") + (f" ({'; '.join(extra)})" if extra else "")
        rows.append(f"| {names} | {help_text} | {_default(p)} |")
    if not rows:
        return []
    return ["| option | what it does | default |", "|---|---|---|", *rows, ""]


def _arguments(params: list[Any]) -> list[str]:
    rows = []
    for p in params:
        if getattr(p, "param_type_name", "") != "argument":
            continue
        name = (p.name or "").upper() + ("…" if getattr(p, "nargs", 1) == -1 else "")
        need = "required" if getattr(p, "required", False) else "optional"
        rows.append(f"| `{name}` | {_cell(getattr(p, 'help', None) or '')} | {need} |")
    if not rows:
        return []
    return ["| argument | what it is | |", "|---|---|---|", *rows, ""]


def _help(text: str) -> list[str]:
    """The first paragraph as prose, the rest as written for a terminal (line breaks and ``<names>``
    kept, no Markdown read into ``*`` or ``_``)."""
    first, _, rest = text.strip().partition("\n\n")
    lines = [prose(first), ""] if first else []
    if rest.strip():
        lines += ["```text", rest.strip(), "```", ""]
    return lines


def _usage(cmd: Command) -> str:
    args = [p for p in cmd.obj.params if getattr(p, "param_type_name", "") == "argument"]
    words = [cmd.path, "[OPTIONS]"]
    for p in args:
        name = (p.name or "").upper() + ("…" if getattr(p, "nargs", 1) == -1 else "")
        words.append(name if getattr(p, "required", False) else f"[{name}]")
    if cmd.is_group:
        words.append("COMMAND")
    return " ".join(words)


def render(app: typer.Typer, prog: str = "aenv") -> str:
    """The whole reference page: the root's help, then one section per command."""
    root = typer.main.get_command(app)
    lines = [
        "# CLI reference",
        "",
        f"Generated from the `{prog}` Typer app when the site is built (`src/aenv/refdocs/cli.py`); "
        f"`{prog} COMMAND --help` prints the same.",
        "",
        *_help(root.help or ""),
        *_options(root.params),
    ]
    for cmd in walk(app, prog):
        level = "#" * min(2 + cmd.path.count(" ") - 1, 4)
        lines += [f"{level} `{cmd.path}`", "", "```text", _usage(cmd), "```", ""]
        lines += _help(cmd.obj.help or "")
        if cmd.is_group:
            subs = [f"`{c.path}`" for c in walk_children(cmd)]
            lines += ["Commands: " + ", ".join(subs) + ".", ""]
        lines += _arguments(cmd.obj.params) + _options(cmd.obj.params)
    return "\n".join(lines).rstrip() + "\n"


def walk_children(group: Command) -> Iterator[Command]:
    """The direct, visible subcommands of a group."""
    for name, sub in group.obj.commands.items():
        if not getattr(sub, "hidden", False):
            yield Command(f"{group.path} {name}", sub)
