"""HTTP access to a running aenv server for the CLI: control plane via httpx, envd via the e2b SDK."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import httpx

from aenv.cli.output import ExitStatus, Printer

DEFAULT_SERVER = "http://127.0.0.1:8000"
PLACEHOLDER_KEY = "e2b_" + "0" * 40


@dataclass
class ServerClient:
    url: str
    api_key: str | None
    printer: Printer

    @classmethod
    def from_env(cls, url: str | None, api_key: str | None, printer: Printer) -> ServerClient:
        url = (url or os.environ.get("AENV_SERVER") or os.environ.get("E2B_API_URL") or DEFAULT_SERVER).rstrip("/")
        key = api_key or os.environ.get("AENV_API_KEY") or os.environ.get("E2B_API_KEY")
        return cls(url=url, api_key=key, printer=printer)

    @property
    def headers(self) -> dict[str, str]:
        return {"X-API-KEY": self.api_key or PLACEHOLDER_KEY}

    def request(self, method: str, path: str, *, ok: tuple[int, ...] = (200, 201, 204), **kw: Any) -> httpx.Response:
        try:
            with httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 120.0), trust_env=False) as c:
                resp = c.request(method, path, **kw)
        except httpx.ConnectError as exc:
            self.printer.fail(
                f"cannot reach the aenv server at {self.url}",
                causes=[str(exc)],
                hint="start it with `aenv serve` (or set AENV_SERVER)",
                status=ExitStatus.UNREACHABLE,
            )
        if resp.status_code not in ok:
            self.fail_response(resp)
        return resp

    def fail_response(self, resp: httpx.Response) -> None:
        try:
            message = resp.json().get("message", resp.text)
        except Exception:
            message = resp.text or resp.reason_phrase
        status = ExitStatus.NOT_FOUND if resp.status_code == 404 else ExitStatus.ERROR
        hint = None
        if resp.status_code == 401:
            hint = "pass --api-key or set AENV_API_KEY / E2B_API_KEY"
        elif resp.status_code == 404 and "template" in message:
            hint = "list templates with `aenv template ls`, or pull one with `aenv pull IMAGE`"
        self.printer.fail(f"server answered {resp.status_code}: {message}", hint=hint, status=status)

    def sdk_connect(self, sandbox_id: str) -> Any:
        """An e2b SDK Sandbox bound to this server (envd traffic goes through our proxy)."""
        from e2b import Sandbox

        os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
        os.environ.setdefault("no_proxy", "127.0.0.1,localhost")
        return Sandbox.connect(
            sandbox_id, api_key=self.api_key or PLACEHOLDER_KEY, api_url=self.url, sandbox_url=self.url
        )
