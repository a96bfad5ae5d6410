"""``aenv build -f Dockerfile --name N [CONTEXT]``: a Dockerfile built into a template through the
server's E2B template-build API, the same path as ``Template.build`` (it is the E2B SDK's own
Dockerfile reader and build client, pointed at this server). Each step's progress is printed as the
server reports it. Instructions a template cannot have are refused before anything is uploaded."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, Optional

import typer

from aenv.cli.client import PLACEHOLDER_KEY, ServerClient
from aenv.cli.output import ExitStatus, Printer

# What the E2B Dockerfile reader turns into steps, and what it may skip (it only prints a warning for
# anything else: here that is an error naming the instruction, before any upload).
SUPPORTED = {"FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "CMD", "ENTRYPOINT"}
IGNORED = {"EXPOSE", "VOLUME", "LABEL", "MAINTAINER"}
_HEREDOC = re.compile(r"<<-?\s*[\"']?([A-Za-z_][A-Za-z0-9_]*)[\"']?")


def instructions(text: str) -> list[tuple[int, str]]:
    """(line number, instruction keyword) of each instruction: continuation lines, comments, parser
    directives and heredoc bodies are skipped."""
    out: list[tuple[int, str]] = []
    lines = text.splitlines()
    i, continued = 0, False
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not continued and line and not line.startswith("#"):
            word = line.split(None, 1)[0].upper()
            out.append((i, word))
            for tag in _HEREDOC.findall(line):
                while i < len(lines) and lines[i].strip() != tag:
                    i += 1
                i += 1
        continued = line.endswith("\\") if line and not line.startswith("#") else continued
    return out


def unsupported(text: str) -> list[tuple[int, str]]:
    return [(n, w) for n, w in instructions(text) if w not in SUPPORTED | IGNORED]


def build(
    context: Path = typer.Argument(Path("."), help="the build context: COPY/ADD sources are relative to it"),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="the Dockerfile [default: CONTEXT/Dockerfile]"),
    name: str = typer.Option(..., "--name", "-n", help="template name (or name:tag); `aenv start NAME` starts it"),
    cpu: Optional[int] = typer.Option(None, "--cpu", help="vCPUs of the template's sandboxes"),
    memory: Optional[int] = typer.Option(None, "--memory", help="MiB of memory of the template's sandboxes"),
    no_cache: bool = typer.Option(False, "--no-cache", help="run every step again, ignoring cached ones"),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="print only the template ID"),
    server: Optional[str] = typer.Option(None, "--server", envvar="AENV_SERVER", help="aenv server URL"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="API key (else AENV_API_KEY or E2B_API_KEY)"),
) -> None:
    """Build a template from a Dockerfile (FROM, RUN, COPY/ADD of local files, ENV, ARG, WORKDIR, USER,
    CMD/ENTRYPOINT as its start command). Steps are cached: a rebuild redoes only what changed."""
    printer = Printer(quiet=quiet)
    dockerfile = file or context / "Dockerfile"
    try:
        text = dockerfile.read_text()
    except OSError as exc:
        printer.fail(f"cannot read {dockerfile}", causes=[str(exc)], status=ExitStatus.USAGE)
    bad = unsupported(text)
    if bad:
        printer.fail(
            "the Dockerfile has instructions a template build cannot run",
            causes=[f"line {n}: {w}" for n, w in bad],
            hint=f"supported: {', '.join(sorted(SUPPORTED))}; ignored: {', '.join(sorted(IGNORED))}",
            status=ExitStatus.USAGE,
        )
    client = ServerClient.from_env(server, api_key, printer)
    from e2b import BuildException, Template
    from e2b.exceptions import SandboxException

    try:
        template = Template(file_context_path=str(context)).from_dockerfile(text)
    except Exception as exc:  # the SDK's DockerfileSyntaxError and friends
        printer.fail(f"cannot read {dockerfile}", causes=[str(exc)], status=ExitStatus.USAGE)
    t0 = time.monotonic()
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")

    def on_logs(entry: Any) -> None:
        message = str(getattr(entry, "message", entry))
        if message:
            printer.info(message)

    try:
        info = Template.build(
            template, name, cpu_count=cpu, memory_mb=memory, skip_cache=no_cache, on_build_logs=on_logs,
            api_key=client.api_key or PLACEHOLDER_KEY, api_url=client.url,
        )
    except BuildException as exc:
        printer.fail(f"the build of {name} failed", causes=[str(exc)], status=ExitStatus.ERROR)
    except SandboxException as exc:
        printer.fail(f"the server refused the build of {name}", causes=[str(exc)], status=ExitStatus.ERROR)
    printer.info(f"built {name} in {time.monotonic() - t0:.1f} s")
    printer.data(info.template_id)
