"""The languages a code-interpreter sandbox runs, and its contexts by id (one default per language)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

from .kernels import (
    BashContext,
    Context,
    ContextInfo,
    ContextNotFound,
    ContextStartFailed,
    PythonContext,
    RContext,
    UnsupportedLanguage,
    UnusableCwd,
)
from .pipe_kernels import JavaContext, JsContext, TsContext

BACKENDS: dict[str, type[Context]] = {
    "python": PythonContext, "javascript": JsContext, "typescript": TsContext, "r": RContext, "java": JavaContext,
    "bash": BashContext,
}
ALIASES = {"python3": "python", "ipython": "python", "sh": "bash", "shell": "bash", "js": "javascript",
           "node": "javascript", "ts": "typescript"}
# Why a language E2B's template has is not here (the 400 says it; docs/images.md names them too)
UNAVAILABLE = {
    "r": "this template was built without R",
    "javascript": "this template was built without Node.js",
    "typescript": "this template has no TypeScript compiler (typescript, from npm)",
    "java": "this template was built without a JDK",
}


def languages() -> list[str]:
    """The languages this template runs (R only where it was built with R)."""
    return [name for name, backend in BACKENDS.items() if backend.available()]


class Registry:
    """All contexts by id, plus one default per language (created on first use)."""

    def __init__(self, base_env: dict[str, str], default_cwd: str) -> None:
        self.base_env = base_env
        self.default_cwd = default_cwd
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}
        self._default_lock = asyncio.Lock()

    @staticmethod
    def normalise(language: str | None) -> str:
        lang = ALIASES.get((language or "python").lower(), (language or "python").lower())
        if lang not in BACKENDS or not BACKENDS[lang].available():
            why = UNAVAILABLE.get(lang, "")
            raise UnsupportedLanguage(
                f"language '{language}' is not supported here{f' ({why})' if why else ''} "
                f"(available: {', '.join(languages())})"
            )
        return lang

    async def create(self, language: str | None, cwd: str | None) -> Context:
        lang = self.normalise(language)
        info = ContextInfo(id=str(uuid.uuid4()), language=lang, cwd=cwd or self.default_cwd)
        if not os.path.isdir(info.cwd):
            raise UnusableCwd(f"cwd '{info.cwd}' is not a directory in this sandbox")
        ctx = BACKENDS[lang](info, dict(self.base_env))
        try:
            await ctx.start()
        except BaseException as exc:
            await asyncio.shield(ctx.aclose())
            if isinstance(exc, Exception):
                raise ContextStartFailed(f"could not start a {lang} context in {info.cwd}: "
                                         f"{type(exc).__name__}: {exc}") from exc
            raise
        self.contexts[info.id] = ctx
        return ctx

    async def default(self, language: str | None) -> Context:
        lang = self.normalise(language)
        async with self._default_lock:
            cid = self.defaults.get(lang)
            if cid is None or cid not in self.contexts:
                ctx = await self.create(lang, None)
                self.defaults[lang] = ctx.info.id
            return self.contexts[self.defaults[lang]]

    def get(self, context_id: str) -> Context:
        try:
            return self.contexts[context_id]
        except KeyError:
            raise ContextNotFound(f"Context {context_id} not found") from None

    async def remove(self, context_id: str) -> None:
        ctx = self.get(context_id)
        del self.contexts[context_id]
        if ctx.current is not None:
            ctx.current.cancel()
        await ctx.aclose()

    async def aclose(self) -> None:
        for cid in list(self.contexts):
            with contextlib.suppress(Exception):
                await self.remove(cid)
