"""The pipe kernels against the host's Node and JDK (the template's are Debian's): aenv's own
``js_kernel.js`` and ``JavaKernel.java``, driven the way the service drives them."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aenv.interpreter import pipe_kernels, registry
from aenv.interpreter.kernels import ContextInfo, UnsupportedLanguage, r_env_prelude
from aenv.interpreter.pipe_kernels import JavaContext, JsContext, PipeKernelContext, TsContext

needs_node = pytest.mark.skipif(shutil.which("node") is None, reason="no node on this host")
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="no JDK on this host")


async def _run(ctx: PipeKernelContext, code: str, env: dict[str, str] | None = None,
               temp: dict[str, str] | None = None) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    await asyncio.wait_for(ctx.run(code, env or {}, temp or {}, lines.append), 60)
    return lines


def _of(lines: list[dict[str, Any]], kind: str) -> list[Any]:
    return [x.get("text", x) for x in lines if x["type"] == kind]


@contextlib.asynccontextmanager
async def started(cwd: Path, kind: type[PipeKernelContext] = JsContext) -> AsyncIterator[PipeKernelContext]:
    context = kind(ContextInfo("c1", kind.LANGUAGE, str(cwd)), {"PATH": "/usr/bin:/bin"})
    await context.start()
    try:
        yield context
    finally:
        await context.aclose()


@needs_node
async def test_state_results_and_output(tmp_path: Path) -> None:
    async with started(tmp_path) as ctx:
        assert _of(await _run(ctx, "console.log('hi'); console.error('oops')"), "stdout") == ["hi\n"]
        assert _of(await _run(ctx, "process.cwd()"), "result") == [str(tmp_path)]
        await _run(ctx, "const o = {a: [1, 2]}")
        assert _of(await _run(ctx, "o"), "result") == ["{ a: [ 1, 2 ] }"]
        assert _of(await _run(ctx, "await new Promise(r => setTimeout(() => r('late'), 10))"), "result") == ["late"]
        counts = [x["execution_count"] for x in await _run(ctx, "1") if x["type"] == "number_of_executions"]
        assert counts == [6]


@needs_node
async def test_static_imports_become_dynamic(tmp_path: Path) -> None:
    async with started(tmp_path) as ctx:
        code = ("import fs, { readFileSync as read } from 'fs'\nimport * as path from \"path\"\nimport os from 'os';\n"
                "import 'util'\nconsole.log(typeof fs.statSync, typeof read, path.sep, typeof os.cpus)")
        lines = await _run(ctx, code)
        assert _of(lines, "stdout") == ["function function / function\n"], lines


@needs_node
async def test_errors_say_what_and_where(tmp_path: Path) -> None:
    async with started(tmp_path) as ctx:
        [err] = [x for x in await _run(ctx, "null.x") if x["type"] == "error"]
        assert err["name"] == "TypeError" and "null" in err["value"] and "cell" in err["traceback"]
        [err] = [x for x in await _run(ctx, "await Promise.reject(new RangeError('r'))") if x["type"] == "error"]
        assert (err["name"], err["value"]) == ("RangeError", "r")
        [err] = [x for x in await _run(ctx, "function f(") if x["type"] == "error"]
        assert err["name"] == "SyntaxError"
        assert _of(await _run(ctx, "'still here'"), "result") == ["still here"]


@needs_node
async def test_env_for_good_and_for_one_run(tmp_path: Path) -> None:
    async with started(tmp_path) as ctx:
        assert _of(await _run(ctx, "process.env.A + process.env.B", env={"A": "1"}, temp={"B": "2"}), "result") == ["12"]
        assert _of(await _run(ctx, "[process.env.A, process.env.B ?? 'unset'].join()"), "result") == ["1,unset"]
        assert _of(await _run(ctx, "process.env.AENV_EVENTS_FD ?? 'hidden'"), "result") == ["hidden"]


@pytest.mark.parametrize(("kind", "keep", "spin", "probe", "gone"), [
    pytest.param(JsContext, "globalThis.kept = 1", "while (true) {}", "typeof globalThis.kept", "undefined",
                 marks=needs_node, id="javascript"),
    pytest.param(JavaContext, "int kept = 1;", "while (true) { }", "kept == 1", None, marks=needs_java, id="java"),
])
async def test_an_interrupt_ends_the_process_and_the_next_run_starts_fresh(
        tmp_path: Path, kind: type[PipeKernelContext], keep: str, spin: str, probe: str, gone: str | None) -> None:
    async with started(tmp_path, kind) as ctx:
        await _run(ctx, keep)
        lines: list[dict[str, Any]] = []
        running = asyncio.create_task(ctx.run(spin, {}, {}, lines.append))
        await asyncio.sleep(1)
        await ctx.abandon()
        await asyncio.wait_for(running, 20)
        assert [x["name"] for x in lines if x["type"] == "error"] == ["KeyboardInterrupt"]
        after = await _run(ctx, probe)
        if gone is None:  # Java: `kept` no longer exists, a compile error
            assert [x["name"] for x in after if x["type"] == "error"] == ["CompilationException"]
        else:
            assert _of(after, "result") == [gone]


@needs_node
async def test_a_process_that_dies_is_reported_and_replaced(tmp_path: Path) -> None:
    async with started(tmp_path) as ctx:
        [err] = [x for x in await _run(ctx, "process.exit(3)") if x["type"] == "error"]
        assert err["name"] == "DeadKernelError"
        assert _of(await _run(ctx, "2 * 21"), "result") == ["42"]


@needs_node
async def test_typescript_needs_its_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipe_kernels, "TYPESCRIPT", str(tmp_path / "no-typescript"))
    assert JsContext.available() and not TsContext.available()
    reg = registry.Registry({}, str(tmp_path))
    with pytest.raises(UnsupportedLanguage, match="no TypeScript compiler"):
        reg.normalise("ts")
    monkeypatch.setattr(pipe_kernels.JavaContext, "available", classmethod(lambda cls: False))
    with pytest.raises(UnsupportedLanguage, match="without a JDK"):
        reg.normalise("java")
    assert reg.normalise("JS") == "javascript" and reg.normalise(None) == "python"


def test_r_prelude_writes_values_as_literals_r_reads() -> None:
    before, after = r_env_prelude({"P": 'say "hi"\\n'}, {"T\\x": "é"})
    assert '.aenv_set("P", "say \\"hi\\"\\\\n")' in before
    assert 'Sys.getenv(c("T\\\\x"), unset = NA, names = TRUE)' in before and '.aenv_set("T\\\\x", "\\u00e9")' in before
    assert "Sys.unsetenv" in after and "rm(.aenv_saved)" in after


@needs_java
async def test_output_values_and_state(tmp_path: Path) -> None:
    async with started(tmp_path, JavaContext) as ctx:
        # println's text and its line break are two writes, as IJava shows them (E2B's test reads stdout[0])
        assert _of(await _run(ctx, 'System.out.println("Hello, World!")'), "stdout") == ["Hello, World!", "\n"]
        assert _of(await _run(ctx, 'System.getProperty("user.dir")'), "result") == [str(tmp_path)]  # the string, not its literal
        await _run(ctx, "import java.util.*;\nint base = 40;\nint next(int n) { return n + 1; }")
        assert _of(await _run(ctx, "List.of(next(base), 2).get(0) + 1"), "result") == ["42"]


@needs_java
async def test_envs_are_system_properties(tmp_path: Path) -> None:
    async with started(tmp_path, JavaContext) as ctx:
        assert _of(await _run(ctx, 'System.getProperty("FOO")', temp={"FOO": "bar"}), "result") == ["bar"]
        assert _of(await _run(ctx, 'System.getProperty("FOO", "default")'), "result") == ["default"]
        assert _of(await _run(ctx, 'System.getProperty("G") + "!"', env={"G": 'gé " x'}), "result") == ['gé " x!']


@needs_java
async def test_errors_name_what_went_wrong(tmp_path: Path) -> None:
    async with started(tmp_path, JavaContext) as ctx:
        [err] = [x for x in await _run(ctx, "1 / 0") if x["type"] == "error"]
        assert (err["name"], err["value"]) == ("ArithmeticException", "/ by zero")
        [err] = [x for x in await _run(ctx, 'int z = "s";') if x["type"] == "error"]
        assert err["name"] == "CompilationException" and "incompatible types" in err["value"]
        assert _of(await _run(ctx, "2 + 2"), "result") == ["4"]


@pytest.mark.parametrize(("kind", "code"), [
    pytest.param(JsContext, "require('child_process').execSync('echo from a child', {stdio: 'inherit'}); 1",
                 marks=needs_node, id="javascript"),
    pytest.param(JavaContext, 'new ProcessBuilder("echo", "from a child").inheritIO().start().waitFor()',
                 marks=needs_java, id="java"),
])
async def test_a_childs_output_on_the_inherited_streams_belongs_to_its_run(
        tmp_path: Path, kind: type[PipeKernelContext], code: str) -> None:
    """It travels on the process's own stdout, not the events pipe: each run waits for the kernel's
    end-of-run mark on both streams, so it is never cut off (10 runs: the race was 1 in a few)."""
    async with started(tmp_path, kind) as ctx:
        for _ in range(10):
            lines = await _run(ctx, code)
            assert "from a child\n" in _of(lines, "stdout"), lines
            assert not any("aenv-run-end" in str(x) for x in lines), lines
