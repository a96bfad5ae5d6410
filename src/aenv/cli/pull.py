"""``aenv pull``: stream the server's NDJSON pull events into per-layer progress bars, like ``docker pull``."""

from __future__ import annotations

import json
from typing import Any

import httpx
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn

from aenv.cli.client import ServerClient
from aenv.cli.output import ExitStatus


def pull(client: ServerClient, body: dict[str, Any], quiet: bool) -> dict[str, Any]:
    """Run the pull; return the registered template. Progress goes to stderr and vanishes when done."""
    printer = client.printer
    progress = Progress(
        TextColumn("{task.fields[layer]}"),
        TextColumn("{task.fields[status]:<11}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=printer.err,
        transient=True,
        disable=quiet,
    )
    tasks: dict[str, TaskID] = {}
    result: dict[str, Any] | None = None
    try:
        with progress, httpx.Client(base_url=client.url, headers=client.headers, timeout=None, trust_env=False) as http:
            with http.stream("POST", "/aenv/templates/pull", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    client.fail_response(resp)
                for line in resp.iter_lines():
                    if not line.strip():
                        continue
                    msg = json.loads(line)
                    if "event" in msg:
                        _on_event(progress, tasks, msg["event"], printer)
                    elif "template" in msg:
                        result = msg
                    elif "error" in msg:
                        err = msg["error"]
                        printer.fail(
                            f"pull of {body['image']} failed",
                            causes=[err["message"]],
                            hint=_hint(err),
                            status=ExitStatus.NOT_FOUND if err.get("code") == 404 else ExitStatus.ERROR,
                        )
    except httpx.ConnectError as exc:
        printer.fail(f"cannot reach the aenv server at {client.url}", causes=[str(exc)],
                     hint="start it with `aenv serve`", status=ExitStatus.UNREACHABLE)
    if result is None:
        printer.fail(f"pull of {body['image']} ended without a result", hint="see the server log")
    return result


def _hint(err: dict[str, Any]) -> str | None:
    message = err.get("message", "")
    if "unreachable" in message.lower() or "connect" in message.lower():
        return "is the registry up? mirrors are set with AENV_REGISTRY_MIRRORS=docker.io=http://HOST:PORT"
    if err.get("code") == 404:
        return "check the image name and tag"
    return None


def _on_event(progress: Progress, tasks: dict[str, TaskID], ev: dict[str, Any], printer: Any) -> None:
    layer = ev.get("layer") or ""
    status = ev.get("status", "")
    if not layer:
        if status == "resolved" and progress.disable is False:
            progress.console.print(f"{ev.get('reference', '')}: {ev.get('total', 0)} layers", markup=False)
        return
    short = layer.split(":")[-1][:12]
    total = ev.get("total") or None
    if layer not in tasks:
        tasks[layer] = progress.add_task("", total=total, layer=short, status=status)
    progress.update(tasks[layer], completed=ev.get("current") or 0, total=total, status=status)
    if status in ("done", "cached") and total:
        progress.update(tasks[layer], completed=total)
