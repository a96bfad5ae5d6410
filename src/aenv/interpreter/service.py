"""The routes of spec §4 over ``httpserver``: ``/execute`` (NDJSON stream), ``/contexts`` and ``/health``.

Errors become responses here and only here: unknown context → 404 plain text (the SDK raises
``NotFoundException`` with the body), bad input → 400, anything unexpected → 500 via ``httpserver``.

Cancellation: when the client drops the ``/execute`` connection, the running execution is interrupted
(SIGINT to the kernel) if it had started, or dropped if it was still queued behind another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import urllib.error
import urllib.request
from typing import Any

from . import ENVD_PORT
from . import messages as m
from .httpserver import BadRequest, Request, Response
from .kernels import Context, ContextNotFound, ContextStartFailed, UnsupportedLanguage, UnusableCwd
from .registry import Registry, languages

log = logging.getLogger("aenv_interpreter.service")

KEEPALIVE_INTERVAL = 30.0  # long enough that the SDK's per-read ``timeout`` still bounds short runs
ENVD_TIMEOUT = 2.0
_CONTEXT_ROUTE = re.compile(r"^/contexts/([^/]+)(/restart)?/?$")
_DISCONNECTED = object()


def fetch_envd_envs(token: str | None, port: int = ENVD_PORT) -> dict[str, str]:
    """The sandbox's global env vars from envd (``GET /envs``); {} when envd is absent or refuses.

    Blocking (urllib); call through ``asyncio.to_thread``."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/envs")
    if token:
        req.add_header("X-Access-Token", token)
    try:
        with urllib.request.urlopen(req, timeout=ENVD_TIMEOUT) as resp:
            data = json.loads(resp.read(1 << 20))
    except (OSError, ValueError, urllib.error.URLError) as exc:
        log.debug("envd /envs unavailable: %s", exc)
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


class Service:
    """Owns the context registry and the background executions; ``aclose`` stops both."""

    def __init__(
        self, registry: Registry, *, envd_port: int = ENVD_PORT, keepalive: float = KEEPALIVE_INTERVAL
    ) -> None:
        self.registry = registry
        self.envd_port = envd_port
        self.keepalive = keepalive
        self._tasks: set[asyncio.Task[Any]] = set()

    async def warm_up(self) -> None:
        """Start the default python and javascript contexts now (E2B's service has both from the start),
        so the first ``run_code`` does not pay for them; javascript only where the template has Node."""
        there = languages()
        for language in ("python", "javascript"):
            if language not in there:
                continue
            try:
                await self.registry.default(language)
            except Exception:
                log.exception("could not start the default %s context (it is retried on first use)", language)

    async def aclose(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t
        await self.registry.aclose()

    async def __call__(self, req: Request, resp: Response) -> None:
        try:
            await self._route(req, resp)
        except ContextNotFound as exc:
            await resp.send(404, str(exc.args[0]).encode())
        except (UnsupportedLanguage, UnusableCwd) as exc:
            await resp.send(400, str(exc).encode())
        except ContextStartFailed as exc:
            await resp.send(500, str(exc).encode())

    async def _route(self, req: Request, resp: Response) -> None:
        path = req.path.rstrip("/") or "/"
        if path == "/health":
            await resp.send_json(200, "OK")
        elif path == "/execute" and req.method == "POST":
            await self.execute(req, resp)
        elif path == "/contexts" and req.method == "POST":
            body = _object(req.json())
            ctx = await self.registry.create(_opt_str(body, "language"), _opt_str(body, "cwd"))
            await resp.send_json(200, ctx.info.to_json())
        elif path == "/contexts" and req.method == "GET":
            await resp.send_json(200, [c.info.to_json() for c in self.registry.contexts.values()])
        elif match := _CONTEXT_ROUTE.match(path):
            cid, restart = match.group(1), match.group(2)
            if restart and req.method == "POST":
                await self.registry.get(cid).restart()
                await resp.send(204)
            elif not restart and req.method == "DELETE":
                await self.registry.remove(cid)
                await resp.send(204)
            else:
                await resp.send(405, b"method not allowed")
        else:
            await resp.send(404, f"no route {req.method} {req.path}".encode())

    async def execute(self, req: Request, resp: Response) -> None:
        body = _object(req.json())
        code = body.get("code")
        if not isinstance(code, str):
            raise BadRequest("'code' must be a string")
        context_id, language = _opt_str(body, "context_id"), _opt_str(body, "language")
        if context_id and language:
            raise BadRequest("Only one of context_id or language can be provided")
        env_vars = body.get("env_vars") or {}
        if not isinstance(env_vars, dict):
            raise BadRequest("'env_vars' must be an object")
        temp_env = {str(k): str(v) for k, v in env_vars.items()}
        ctx = self.registry.get(context_id) if context_id else await self.registry.default(language)
        global_env = await asyncio.to_thread(
            fetch_envd_envs, req.headers.get("x-access-token"), self.envd_port
        )

        lines: asyncio.Queue[Any] = asyncio.Queue()
        started = asyncio.Event()
        task = asyncio.create_task(self._run(ctx, code, global_env, temp_env, lines, started))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

        async def on_disconnect() -> None:
            await resp.disconnected.wait()
            lines.put_nowait(_DISCONNECTED)

        watcher = asyncio.create_task(on_disconnect())
        try:
            await resp.start(200, "application/x-ndjson")
            while True:
                try:
                    line = await asyncio.wait_for(lines.get(), self.keepalive)
                except TimeoutError:
                    line = m.KEEPALIVE
                if line is None:
                    break
                if line is _DISCONNECTED:
                    raise ConnectionResetError("client went away")
                await resp.write(json.dumps(line).encode() + b"\n")
            await resp.end()
        except (ConnectionError, asyncio.CancelledError):
            await self._abandon(ctx, task, started)
            raise
        finally:
            watcher.cancel()

    async def _abandon(self, ctx: Context, task: asyncio.Task[None], started: asyncio.Event) -> None:
        """The client is gone: stop its execution without waiting for the kernel to settle."""
        if task.done():
            return
        if started.is_set():
            log.info("context %s: client disconnected, interrupting", ctx.info.id)
            await ctx.abandon()
        else:
            task.cancel()

    async def _run(
        self,
        ctx: Context,
        code: str,
        global_env: dict[str, str],
        temp_env: dict[str, str],
        lines: asyncio.Queue[Any],
        started: asyncio.Event,
    ) -> None:
        """One execution, detached from the HTTP handler; ``None`` in the queue marks its end."""
        try:
            async with ctx.lock:
                started.set()
                ctx.current = asyncio.current_task()
                try:
                    await ctx.run(code, global_env, temp_env, lines.put_nowait)
                    lines.put_nowait(m.END)
                except asyncio.CancelledError:
                    lines.put_nowait(m.UNEXPECTED_END)
                    raise
                except Exception as exc:
                    log.exception("context %s: execution failed", ctx.info.id)
                    lines.put_nowait(m.error_line(type(exc).__name__, str(exc), []))
                    lines.put_nowait(m.UNEXPECTED_END)
                finally:
                    ctx.current = None
        finally:
            lines.put_nowait(None)


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest("the body must be a JSON object")
    return value


def _opt_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise BadRequest(f"'{key}' must be a string")
    return value
