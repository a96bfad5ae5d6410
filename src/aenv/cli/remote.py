"""The ``aenv`` commands that talk to a running server over HTTP only (``--server`` / AENV_SERVER, default
http://127.0.0.1:8000). They import nothing of the server side (an import-linter contract); the commands
that act on this machine (``serve``, ``setup``, ``doctor``, ``bench``, ``template build``) are in
``local.py``, and ``main.py`` puts both together."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

from aenv.cli.client import ServerClient
from aenv.cli.output import ExitStatus, Printer

app = typer.Typer(
    help="aenv: E2B-compatible agent environments (namespace sandboxes and microVMs).\n\n"
    "Quick start: `aenv serve` in one terminal, then `aenv start base` for a shell, or point the E2B SDK at it:\n"
    "E2B_API_URL=http://127.0.0.1:8000 E2B_SANDBOX_URL=http://127.0.0.1:8000.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
template_app = typer.Typer(help="Templates: list and remove (`aenv pull` makes them from images).", no_args_is_help=True)
app.add_typer(template_app, name="template")

ServerOpt = typer.Option(None, "--server", envvar="AENV_SERVER", help="aenv server URL [default: http://127.0.0.1:8000]")
KeyOpt = typer.Option(None, "--api-key", help="API key (else AENV_API_KEY or E2B_API_KEY)")


def _client(server: str | None, api_key: str | None, quiet: bool = False) -> ServerClient:
    return ServerClient.from_env(server, api_key, Printer(quiet=quiet))


# ---- sandbox commands ----------------------------------------------------------------------------
@app.command()
def start(
    template: str = typer.Argument("base", help="template name or ID"),
    detach: bool = typer.Option(False, "-d", "--detach", help="only create it and print the ID"),
    timeout: int = typer.Option(300, help="sandbox TTL in seconds"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """Create a sandbox and attach an interactive shell (or print its ID with -d)."""
    client = _client(server, api_key)
    resp = client.request("POST", "/v2/sandboxes", json={"templateID": template, "timeout": timeout})
    sandbox_id = resp.json()["sandboxID"]
    if detach:
        client.printer.data(sandbox_id)
        return
    client.printer.info(f"sandbox {sandbox_id} (exit the shell to leave it running; `aenv rm {sandbox_id}` to remove)")
    from aenv.cli.shell import attach_shell

    raise SystemExit(attach_shell(client.sdk_connect(sandbox_id)))


@app.command("exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exec_(
    sandbox_id: str = typer.Argument(..., help="sandbox ID"),
    command: list[str] = typer.Argument(..., help="command to run (after --)"),
    user: Optional[str] = typer.Option(None, "--user", "-u", help="run as this user (root or user)"),
    cwd: Optional[str] = typer.Option(None, "--cwd", help="working directory"),
    timeout: int = typer.Option(0, help="kill the command after this many seconds (0 = never)"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """Run a command in a sandbox, streaming its output; exits with the command's exit code."""
    import shlex

    from e2b import CommandExitException

    client = _client(server, api_key)
    sbx = client.sdk_connect(sandbox_id)
    cmd = command[0] if len(command) == 1 else shlex.join(command)
    try:
        result = sbx.commands.run(
            cmd,
            user=user,
            cwd=cwd,
            timeout=timeout,
            on_stdout=lambda s: (sys.stdout.write(s), sys.stdout.flush()),
            on_stderr=lambda s: (sys.stderr.write(s), sys.stderr.flush()),
        )
        raise SystemExit(result.exit_code)
    except CommandExitException as exc:
        raise SystemExit(exc.exit_code if 0 <= exc.exit_code < 256 else 137) from None


@app.command("ls")
def ls(
    output: str = typer.Option("table", "--output", "-o", help="table | json"),
    state: str = typer.Option("running,paused", help="comma list of states"),
    metadata: list[str] = typer.Option([], "--metadata", "-m", help="only sandboxes with this KEY=VALUE (repeatable)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print only the IDs, one a line"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """List sandboxes like `docker ps`: full IDs, relative times; `aenv rm $(aenv ls -q -m run=X)`."""
    from aenv.cli import listing

    client = _client(server, api_key)
    try:
        wanted = listing.parse_metadata(metadata)
    except ValueError as exc:
        client.printer.fail(str(exc), hint="e.g. --metadata run=r1", status=ExitStatus.USAGE)
    items: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        params: dict[str, Any] = {"state": state, "limit": 100, **({"nextToken": token} if token else {})}
        if wanted:
            params["metadata"] = listing.metadata_query(wanted)
        resp = client.request("GET", "/v2/sandboxes", params=params)
        items += resp.json()
        token = resp.headers.get("x-next-token")
        if not token:
            break
    if output == "json":
        client.printer.json(items)
        return
    if quiet:
        for s in items:
            client.printer.data(s["sandboxID"])
        return
    client.printer.table(listing.COLUMNS, listing.rows(items), whole=(0,))
    if len(items) > listing.COUNT_LINE_AFTER:
        client.printer.data(listing.count_line(items))


@app.command()
def pause(sandbox_id: str, server: Optional[str] = ServerOpt, api_key: Optional[str] = KeyOpt) -> None:
    """Pause a sandbox (processes and memory are kept)."""
    client = _client(server, api_key)
    client.request("POST", f"/sandboxes/{sandbox_id}/pause", json={})
    client.printer.info(f"paused {sandbox_id}")


@app.command()
def resume(
    sandbox_id: str,
    timeout: int = typer.Option(300, help="new TTL in seconds"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """Resume a paused sandbox."""
    client = _client(server, api_key)
    client.request("POST", f"/v2/sandboxes/{sandbox_id}/connect", json={"timeout": timeout})
    client.printer.info(f"running {sandbox_id}")


@app.command()
def rm(
    sandbox_ids: Optional[list[str]] = typer.Argument(None, help="sandbox IDs"),
    metadata: list[str] = typer.Option([], "--metadata", "-m",
                                       help="also every sandbox with this KEY=VALUE (repeatable: all must match)"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """Kill and remove sandboxes: by ID, or all a run tagged (`aenv rm --metadata run=X`)."""
    from aenv.cli import listing

    client = _client(server, api_key)
    if not sandbox_ids and not metadata:
        client.printer.fail("nothing to remove", hint="give sandbox IDs or --metadata KEY=VALUE", status=ExitStatus.USAGE)
    try:
        wanted = listing.parse_metadata(metadata)
    except ValueError as exc:
        client.printer.fail(str(exc), hint="e.g. --metadata run=r1", status=ExitStatus.USAGE)
    for sid in sandbox_ids or []:
        client.request("DELETE", f"/sandboxes/{sid}")
        client.printer.info(f"removed {sid}")
    if wanted:
        report = client.request("POST", "/aenv/sandboxes/kill", json={"metadata": wanted}).json()
        for sid in report["killed"]:
            client.printer.data(sid)
        tag = ",".join(f"{k}={v}" for k, v in wanted.items())
        client.printer.info(f"removed {len(report['killed'])} sandboxes tagged {tag}")
        if report["failed"]:
            client.printer.fail(f"{len(report['failed'])} sandboxes tagged {tag} could not be removed",
                                causes=[f"{f['sandboxID']}: {f['message']}" for f in report["failed"][:5]])


@app.command("timeout")
def set_timeout(
    sandbox_id: str, seconds: int, server: Optional[str] = ServerOpt, api_key: Optional[str] = KeyOpt
) -> None:
    """Set a sandbox's TTL to SECONDS from now."""
    client = _client(server, api_key)
    client.request("POST", f"/sandboxes/{sandbox_id}/timeout", json={"timeout": seconds})


@app.command()
def upload(
    sandbox_id: str,
    local: Path = typer.Argument(..., exists=True, dir_okay=False, help="local file"),
    remote: str = typer.Argument(..., help="destination path in the sandbox"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """Copy a local file into a sandbox."""
    client = _client(server, api_key)
    sbx = client.sdk_connect(sandbox_id)
    with local.open("rb") as fh:
        info = sbx.files.write(remote, fh)
    client.printer.info(f"wrote {info.path}")


@app.command()
def download(
    sandbox_id: str,
    remote: str = typer.Argument(..., help="path in the sandbox"),
    local: Path = typer.Argument(..., help="local destination ('-' for stdout)"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """Copy a file out of a sandbox."""
    client = _client(server, api_key)
    sbx = client.sdk_connect(sandbox_id)
    from e2b import NotFoundException

    try:
        data = sbx.files.read(remote, format="bytes")
    except NotFoundException as exc:
        client.printer.fail(f"{remote}: no such file in {sandbox_id}", causes=[str(exc)], status=ExitStatus.NOT_FOUND)
    if str(local) == "-":
        sys.stdout.buffer.write(bytes(data))
    else:
        local.write_bytes(bytes(data))


# ---- images and templates ------------------------------------------------------------------------
@app.command("pull")
def pull_cmd(
    image: str = typer.Argument(..., help="image reference, e.g. ubuntu:22.04 or host:5000/team/app@sha256:..."),
    name: Optional[str] = typer.Option(None, "--name", help="template name [default: from the image]"),
    start_cmd: Optional[str] = typer.Option(None, "--start-cmd", help="run in the background at sandbox start"),
    ready_cmd: Optional[str] = typer.Option(None, "--ready-cmd", help="sandbox is ready when this exits 0"),
    cpu: Optional[int] = typer.Option(None, "--cpu", help="vCPUs per sandbox"),
    memory_mb: Optional[int] = typer.Option(None, "--memory-mb", help="memory per sandbox in MiB"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print only the template ID"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """Pull an OCI image from a registry and make it a template: `aenv pull ubuntu:22.04 --name ubuntu`."""
    from aenv.cli.pull import pull

    client = _client(server, api_key, quiet=quiet)
    body = {"image": image, "name": name, "startCmd": start_cmd, "readyCmd": ready_cmd, "cpuCount": cpu, "memoryMB": memory_mb}
    result = pull(client, {k: v for k, v in body.items() if v is not None}, quiet)
    tpl = result["template"]
    if quiet:
        client.printer.data(tpl["templateID"])
    else:
        client.printer.data(f"{result.get('summary', '')} → template {','.join(tpl['aliases']) or tpl['templateID']}")


cache_app = typer.Typer(help="The image caches (layers; lazy images' chunks): usage, pins, pruning.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("ls")
def cache_ls(
    output: str = typer.Option("table", "--output", "-o", help="table | json"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """Show the layer cache: usage against the budget and every entry."""
    client = _client(server, api_key)
    data = client.request("GET", "/aenv/cache").json()
    if output == "json":
        client.printer.json(data)
        return
    u = data["usage"]
    client.printer.data(
        f"{u['used'] / 1e6:.1f} MB used of {u['budget'] / 1e6:.0f} MB budget, {u['pinned'] / 1e6:.1f} MB pinned, "
        f"{u['entries']} entries"
    )
    client.printer.table(
        ("DIGEST", "KIND", "SIZE MB", "PINNED BY"),
        (
            (e["digest"][7:19], e["kind"], f"{e['size'] / 1e6:.1f}", ",".join(e["pinned_by"])[:40])
            for e in data["entries"]
        ),
    )
    lazy = data.get("lazy") or {}
    if lazy.get("images"):
        cached = sum(i["cached"] for i in lazy["images"] if not i["pinned"])
        client.printer.data(f"lazy images: {cached / 1e6:.1f} MB cached of {lazy['budget'] / 1e6:.0f} MB budget")
        client.printer.table(
            ("IMAGE", "TEMPLATES", "SIZE MB", "CACHED MB", "FETCHED MB", "LAST USE", "PINNED"),
            (
                (i["name"][:12], ",".join(i["templates"])[:30], f"{i['size'] / 1e6:.0f}", f"{i['cached'] / 1e6:.1f}",
                 f"{i['fetched'] / 1e6:.1f}", _ago(i["last_use"]), "yes" if i["pinned"] else "")
                for i in lazy["images"]
            ),
        )  # fmt: skip


def _ago(ts: float) -> str:
    if not ts:
        return "-"
    s = max(0.0, time.time() - ts)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.0f}h ago"


@cache_app.command("pin")
def cache_pin(
    template: str = typer.Argument(..., help="template ID or alias of a lazy image"),
    unpin: bool = typer.Option(False, "--unpin", help="let its chunks be evicted again"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """Keep a lazy template fully local (every chunk fetched, never evicted): it then starts offline."""
    client = _client(server, api_key)
    data = client.request("POST", f"/aenv/cache/pin/{template}", params={"unpin": str(unpin).lower()}).json()
    state = "pinned" if data["pinned"] else "unpinned"
    client.printer.data(f"{template}: {state}, {data['cached'] / 1e6:.1f} MB of {data['stored'] / 1e6:.1f} MB local")


@cache_app.command("prune")
def cache_prune(
    all_unpinned: bool = typer.Option(False, "--all", help="remove every unpinned entry, not just what exceeds the budget"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """Evict unpinned layers (never what a template or sandbox uses)."""
    client = _client(server, api_key)
    data = client.request("POST", "/aenv/cache/prune", params={"all": str(all_unpinned).lower()}).json()
    client.printer.data(f"removed {len(data['removed'])} entries, freed {data['freed'] / 1e6:.1f} MB")


# ---- templates -----------------------------------------------------------------------------------
@template_app.command("ls")
def template_ls(
    output: str = typer.Option("table", "--output", "-o", help="table | json"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """List templates."""
    client = _client(server, api_key)
    items = client.request("GET", "/v2/templates").json()
    if output == "json":
        client.printer.json(items)
        return
    client.printer.table(
        ("TEMPLATE ID", "NAME", "KIND", "SOURCE", "SIZE MB", "CREATED"),
        (
            (t["templateID"], ",".join(t["aliases"]), t.get("kind", ""), t.get("source") or "", f"{(t.get('sizeBytes') or 0) / 1e6:.0f}", t["createdAt"][:19],)
            for t in items
        ),
    )


def _delete_templates(client: ServerClient, names: list[str]) -> None:
    """Templates and snapshots share one E2B route: ``DELETE /templates/{id}`` (IDs may contain '/')."""
    from urllib.parse import quote

    for name in names:
        client.request("DELETE", f"/templates/{quote(name, safe='')}")
        client.printer.info(f"removed {name}")


@template_app.command("rm")
def template_rm(names: list[str], server: Optional[str] = ServerOpt, api_key: Optional[str] = KeyOpt) -> None:
    """Remove templates (refused while sandboxes use them)."""
    _delete_templates(_client(server, api_key), names)


# ---- snapshots, fork, rollback ---------------------------------------------------------------------
snapshot_app = typer.Typer(help="Snapshots: create, list and remove (start one with `aenv start SNAPSHOT`).",
                           no_args_is_help=True)
app.add_typer(snapshot_app, name="snapshot")


@app.command()
def fork(
    sandbox_id: str,
    count: int = typer.Option(1, "--count", "-n", min=1, help="how many children"),
    timeout: Optional[int] = typer.Option(None, help="children's TTL in seconds"),
    output: str = typer.Option("text", "--output", "-o", help="text | json"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """Fork a running sandbox into COUNT children (the source keeps running); prints one child ID a line."""
    client = _client(server, api_key)
    body: dict[str, Any] = {"count": count, **({"timeout": timeout} if timeout is not None else {})}
    resp = client.request("POST", f"/sandboxes/{sandbox_id}/fork", json=body)
    entries = resp.json()
    if output == "json":
        client.printer.json(entries)
    else:
        for e in entries:
            if "sandbox" in e:
                client.printer.data(e["sandbox"]["sandboxID"])
    failed = [e["error"]["message"] for e in entries if "error" in e]
    mode = resp.headers.get("x-aenv-fork-mode")
    client.printer.info(f"forked {sandbox_id}: {len(entries) - len(failed)}/{count} children"
                        + (f", mode {mode}" if mode else ""))
    if failed:
        client.printer.fail(f"{len(failed)} of {count} children failed to start", causes=failed[:5])


@app.command()
def rollback(
    sandbox_id: str, snapshot_id: str, server: Optional[str] = ServerOpt, api_key: Optional[str] = KeyOpt
) -> None:
    """Put SANDBOX_ID back to SNAPSHOT_ID (an earlier snapshot of its lineage); same ID and token."""
    client = _client(server, api_key)
    client.request("POST", f"/sandboxes/{sandbox_id}/rollback", json={"snapshotID": snapshot_id})
    client.printer.info(f"rolled {sandbox_id} back to {snapshot_id}")


@snapshot_app.command("create")
def snapshot_create(
    sandbox_id: str,
    name: Optional[str] = typer.Option(None, help="a name to start it by"),
    mode: str = typer.Option("full", help="full (files + processes) | filesystem"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """Snapshot a sandbox; prints the snapshot ID (refused if MODE is more than the runtime can do)."""
    client = _client(server, api_key)
    if mode not in ("full", "filesystem"):
        client.printer.fail(f"unknown mode '{mode}'", hint="use --mode full or --mode filesystem", status=ExitStatus.USAGE)
    body: dict[str, Any] = {"mode": mode, **({"name": name} if name else {})}
    resp = client.request("POST", f"/sandboxes/{sandbox_id}/snapshots", json=body, ok=(201, 409))
    if resp.status_code == 409:
        message = resp.json().get("message", resp.text)
        hint = f"take a files-only snapshot: aenv snapshot create {sandbox_id} --mode filesystem" \
            if mode == "full" and "filesystem" in message else None
        client.printer.fail(f"server answered 409: {message}", hint=hint)
    row = resp.json()
    client.printer.data(row["snapshotID"])
    client.printer.info(f"snapshot of {sandbox_id}: mode {row['mode']}, {(row.get('sizeBytes') or 0) / 1e6:.1f} MB")


@snapshot_app.command("ls")
def snapshot_ls(
    sandbox_id: Optional[str] = typer.Option(None, "--sandbox", help="only snapshots of this sandbox"),
    output: str = typer.Option("table", "--output", "-o", help="table | json"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """List snapshots (newest first)."""
    client = _client(server, api_key)
    params = {"sandboxID": sandbox_id} if sandbox_id else {}
    items = client.request("GET", "/snapshots", params=params).json()
    if output == "json":
        client.printer.json(items)
        return
    client.printer.table(
        ("SNAPSHOT ID", "NAME", "MODE", "SANDBOX", "PARENT", "SIZE MB", "CREATED"),
        (
            (r["snapshotID"], ",".join(r["names"]), r["mode"], r["sandboxID"] or "", r["parentID"] or "", f"{(r.get('sizeBytes') or 0) / 1e6:.1f}", r["createdAt"][:19],)
            for r in items
        ),
    )


@snapshot_app.command("rm")
def snapshot_rm(snapshot_ids: list[str], server: Optional[str] = ServerOpt, api_key: Optional[str] = KeyOpt) -> None:
    """Remove snapshots (refused while a sandbox or another snapshot uses them)."""
    _delete_templates(_client(server, api_key), snapshot_ids)
