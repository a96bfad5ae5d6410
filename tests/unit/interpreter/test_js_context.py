"""JsContext and TsContext against the host's Node (the template's is Debian's): aenv's own kernel,
``js_kernel.js``, driven the way the service drives it."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aenv.interpreter import js, registry
from aenv.interpreter.js import JsContext, TsContext
from aenv.interpreter.kernels import ContextInfo, UnsupportedLanguage, r_env_prelude

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="no node on this host")


async def _run(ctx: JsContext, code: str, env: dict[str, str] | None = None,
               temp: dict[str, str] | None = None) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    await asyncio.wait_for(ctx.run(code, env or {}, temp or {}, lines.append), 20)
    return lines


def _of(lines: list[dict[str, Any]], kind: str) -> list[Any]:
    return [x.get("text", x) for x in lines if x["type"] == kind]


@contextlib.asynccontextmanager
async def started(cwd: Path) -> AsyncIterator[JsContext]:
    context = JsContext(ContextInfo("c1", "javascript", str(cwd)), {"PATH": "/usr/bin:/bin"})
    await context.start()
    try:
        yield context
    finally:
        await context.aclose()


async def test_state_results_and_output(tmp_path: Path) -> None:
    async with started(tmp_path) as ctx:
        assert _of(await _run(ctx, "console.log('hi'); console.error('oops')"), "stdout") == ["hi\n"]
        assert _of(await _run(ctx, "process.cwd()"), "result") == [str(tmp_path)]
        await _run(ctx, "const o = {a: [1, 2]}")
        assert _of(await _run(ctx, "o"), "result") == ["{ a: [ 1, 2 ] }"]
        assert _of(await _run(ctx, "await new Promise(r => setTimeout(() => r('late'), 10))"), "result") == ["late"]
        counts = [x["execution_count"] for x in await _run(ctx, "1") if x["type"] == "number_of_executions"]
        assert counts == [6]


async def test_static_imports_become_dynamic(tmp_path: Path) -> None:
    async with started(tmp_path) as ctx:
        code = ("import fs, { readFileSync as read } from 'fs'\nimport * as path from \"path\"\nimport os from 'os';\n"
                "import 'util'\nconsole.log(typeof fs.statSync, typeof read, path.sep, typeof os.cpus)")
        lines = await _run(ctx, code)
        assert _of(lines, "stdout") == ["function function / function\n"], lines


async def test_errors_say_what_and_where(tmp_path: Path) -> None:
    async with started(tmp_path) as ctx:
        [err] = [x for x in await _run(ctx, "null.x") if x["type"] == "error"]
        assert err["name"] == "TypeError" and "null" in err["value"] and "cell" in err["traceback"]
        [err] = [x for x in await _run(ctx, "await Promise.reject(new RangeError('r'))") if x["type"] == "error"]
        assert (err["name"], err["value"]) == ("RangeError", "r")
        [err] = [x for x in await _run(ctx, "function f(") if x["type"] == "error"]
        assert err["name"] == "SyntaxError"
        assert _of(await _run(ctx, "'still here'"), "result") == ["still here"]


async def test_env_for_good_and_for_one_run(tmp_path: Path) -> None:
    async with started(tmp_path) as ctx:
        assert _of(await _run(ctx, "process.env.A + process.env.B", env={"A": "1"}, temp={"B": "2"}), "result") == ["12"]
        assert _of(await _run(ctx, "[process.env.A, process.env.B ?? 'unset'].join()"), "result") == ["1,unset"]
        assert _of(await _run(ctx, "process.env.AENV_EVENTS_FD ?? 'hidden'"), "result") == ["hidden"]


async def test_an_interrupt_ends_the_process_and_the_next_run_starts_fresh(tmp_path: Path) -> None:
    async with started(tmp_path) as ctx:
        await _run(ctx, "globalThis.kept = 1")
        lines: list[dict[str, Any]] = []
        running = asyncio.create_task(ctx.run("while (true) {}", {}, {}, lines.append))
        await asyncio.sleep(0.5)
        await ctx.abandon()
        await asyncio.wait_for(running, 10)
        assert [x["name"] for x in lines if x["type"] == "error"] == ["KeyboardInterrupt"]
        assert _of(await _run(ctx, "typeof globalThis.kept"), "result") == ["undefined"]


async def test_a_process_that_dies_is_reported_and_replaced(tmp_path: Path) -> None:
    async with started(tmp_path) as ctx:
        [err] = [x for x in await _run(ctx, "process.exit(3)") if x["type"] == "error"]
        assert err["name"] == "DeadKernelError"
        assert _of(await _run(ctx, "2 * 21"), "result") == ["42"]


async def test_typescript_needs_its_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(js, "TYPESCRIPT", str(tmp_path / "no-typescript"))
    assert JsContext.available() and not TsContext.available()
    reg = registry.Registry({}, str(tmp_path))
    with pytest.raises(UnsupportedLanguage, match="no TypeScript compiler"):
        reg.normalise("ts")
    with pytest.raises(UnsupportedLanguage, match="IJava .* GitHub"):
        reg.normalise("java")
    assert reg.normalise("JS") == "javascript" and reg.normalise(None) == "python"


def test_r_prelude_writes_values_as_literals_r_reads() -> None:
    before, after = r_env_prelude({"P": 'say "hi"\\n'}, {"T\\x": "é"})
    assert '.aenv_set("P", "say \\"hi\\"\\\\n")' in before
    assert 'Sys.getenv(c("T\\\\x"), unset = NA, names = TRUE)' in before and '.aenv_set("T\\\\x", "\\u00e9")' in before
    assert "Sys.unsetenv" in after and "rm(.aenv_saved)" in after
