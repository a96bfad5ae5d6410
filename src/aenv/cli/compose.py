"""``aenv compose up``: a Compose project in one sandbox (``POST /sandboxes-compose``), over HTTP only.

The file is sent as it is; the server interpolates it once, with the variables it references taken as
Compose takes them here (this shell's environment over the project's ``.env``, ``--env`` over both: only
the names the file uses leave this machine). Each service with a ``build:`` sends its context directory
as a tar, less what its ``.dockerignore`` leaves out (``dockerignore.py``), as Docker would send it."""

from __future__ import annotations

import base64
import io
import os
import posixpath
import re
import tarfile
from pathlib import Path
from typing import Any, Optional

import typer
import yaml

from aenv.cli.client import ServerClient
from aenv.cli.dockerignore import DockerIgnore
from aenv.cli.output import ExitStatus, Printer

compose_app = typer.Typer(help="Docker Compose projects in a sandbox (template `docker`; docs/docker.md).",
                          no_args_is_help=True)

DEFAULT_FILES = ("compose.yaml", "compose.yml", "docker-compose.yaml", "docker-compose.yml")
MAX_CONTEXT_BYTES = 64 << 20  # the server's default compose_max_context_bytes
_REFERENCE = re.compile(r"(?<!\$)\$\{?([A-Za-z_][A-Za-z0-9_]*)")
COLUMNS = ("SERVICE", "STATE", "HEALTH", "URLS")


def referenced(text: str) -> set[str]:
    """The variable names a Compose file interpolates (``$$`` is a literal dollar)."""
    return set(_REFERENCE.findall(text.replace("$$", "")))


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (``#`` comments, ``export``, quotes), as Compose reads ``.env``."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.removeprefix("export ").partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def compose_env(text: str, env_file: Path | None, overrides: dict[str, str]) -> dict[str, str]:
    names = referenced(text)
    known = {**(read_env_file(env_file) if env_file and env_file.is_file() else {}), **os.environ}
    return {**{k: v for k, v in known.items() if k in names}, **overrides}


def context_tar(directory: Path, limit: int = MAX_CONTEXT_BYTES, keep: tuple[str, ...] = ()) -> bytes:
    """The directory as a gzip tar (names relative to it), less what its ``.dockerignore`` leaves out
    (``keep``: the Dockerfile, which Docker sends whatever the file says), refused past ``limit`` bytes
    of files."""
    ignore = DockerIgnore.of_context(directory)
    total = 0
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for root, dirs, files in os.walk(directory):
            rel = os.path.relpath(root, directory)
            prefix = "" if rel == "." else f"{rel}/"
            if not ignore.re_includes:  # nothing below an excluded directory can come back: skip it
                dirs[:] = [d for d in dirs if not ignore.excluded(prefix + d)]
            dirs.sort()
            names = [n for n in sorted(files) if prefix + n in keep or not ignore.excluded(prefix + n)]
            for name in names:
                total += (Path(root) / name).lstat().st_size
                if total > limit:
                    raise ValueError(f"build context {directory} holds more than {limit} bytes "
                                     f"(after its {'.dockerignore' if ignore.rules else 'missing .dockerignore'})")
            tar.add(root, arcname=rel, recursive=False)
            for name in names:
                path = Path(root) / name
                tar.add(path, arcname=os.path.relpath(path, directory), recursive=False)
    return buf.getvalue()


def build_contexts(text: str, project_dir: Path) -> dict[str, str]:
    """Service → base64 tar of its build context, for every service with a ``build:``."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not valid YAML: {exc}") from None
    services = doc.get("services") if isinstance(doc, dict) else None
    out: dict[str, str] = {}
    for name, svc in (services or {}).items():
        build = svc.get("build") if isinstance(svc, dict) else None
        if build is None:
            continue
        spec = {"context": build} if isinstance(build, str) else build if isinstance(build, dict) else {}
        if "dockerfile_inline" in spec and "context" not in spec:
            continue
        context = str(spec.get("context") or ".")
        if "$" in context:
            raise ValueError(f"services.{name}.build.context: '{context}' uses a variable; write the path")
        directory = (project_dir / context).resolve()
        if not directory.is_dir():
            raise ValueError(f"services.{name}.build.context: {directory} is not a directory")
        dockerfile = posixpath.normpath(str(spec.get("dockerfile") or "Dockerfile"))
        out[str(name)] = base64.b64encode(context_tar(directory, keep=(dockerfile,))).decode()
    return out


def service_rows(answer: dict[str, Any], scheme: str) -> list[tuple[str, str, str, str]]:
    rows = []
    for svc in answer.get("compose", {}).get("services", []):
        urls = " ".join(f"{scheme}://{p['host']}" if p.get("protocol") == "tcp" else f"{p['port']}/{p['protocol']}"
                        for p in svc.get("ports", []))
        rows.append((svc["name"], svc.get("state") or "", svc.get("health") or "", urls or "-"))
    return rows


def _pairs(items: list[str], what: str, printer: Printer) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            printer.fail(f"{what} '{item}' is not KEY=VALUE", status=ExitStatus.USAGE)
        out[key] = value
    return out


@compose_app.command("up")
def up(
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="the Compose file [default: compose.yaml, "
                                        "compose.yml, docker-compose.yaml or docker-compose.yml here]"),
    template: str = typer.Option("docker", help="the sandbox's template (Docker inside)"),
    timeout: int = typer.Option(300, help="sandbox TTL in seconds, counted once the services are up"),
    startup_timeout: Optional[int] = typer.Option(None, "--startup-timeout",
                                                  help="seconds until every service must be up [default: the server's]"),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE for the file's interpolation (repeatable)"),
    env_file: Optional[Path] = typer.Option(None, "--env-file", help="variables file [default: .env beside the file]"),
    profile: list[str] = typer.Option([], "--profile", help="enable this profile (repeatable)"),
    metadata: list[str] = typer.Option([], "--metadata", "-m", help="sandbox metadata KEY=VALUE (repeatable)"),
    output: str = typer.Option("table", "--output", "-o", help="table | json"),
    server: Optional[str] = typer.Option(None, "--server", envvar="AENV_SERVER",
                                         help="aenv server URL [default: http://127.0.0.1:8000]"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="API key (else AENV_API_KEY or E2B_API_KEY)"),
) -> None:
    """Start a Compose project in a new sandbox; prints the sandbox ID and each service's state and URLs.

    The sandbox answers once `docker compose up --wait` succeeded; if it does not, the server removes the
    sandbox and this prints Compose's output. Afterwards the sandbox is an ordinary one: `aenv exec ID --
    docker compose -p aenv ps`, `aenv rm ID`, or `Sandbox.connect(ID)` from the E2B SDK."""
    client = ServerClient.from_env(server, api_key, Printer())
    printer = client.printer
    path = file or next((Path(n) for n in DEFAULT_FILES if Path(n).is_file()), None)
    if path is None or not path.is_file():
        printer.fail(f"no Compose file {'at ' + str(path) if path else 'here'}", hint="pass -f FILE",
                     status=ExitStatus.USAGE)
    text = path.read_text()
    try:
        contexts = build_contexts(text, path.parent)
    except (ValueError, OSError) as exc:
        printer.fail(f"{path}: {exc}", status=ExitStatus.USAGE)
    body: dict[str, Any] = {
        "templateID": template, "timeout": timeout, "compose": text,
        "composeEnv": compose_env(text, env_file or path.parent / ".env", _pairs(env, "--env", printer)),
        "metadata": _pairs(metadata, "--metadata", printer),
    }
    if profile:
        body["profiles"] = profile
    if contexts:
        body["buildContexts"] = contexts
    if startup_timeout is not None:
        body["startupTimeout"] = startup_timeout
    printer.info(f"starting {path} in a sandbox ({len(contexts)} build context(s))")
    wait = float(startup_timeout or 3600) + 60
    answer = client.request("POST", "/sandboxes-compose", json=body, timeout=wait).json()
    if output == "json":
        printer.json(answer)
        return
    printer.data(answer["sandboxID"])
    printer.table(COLUMNS, service_rows(answer, "https" if client.url.startswith("https") else "http"))
