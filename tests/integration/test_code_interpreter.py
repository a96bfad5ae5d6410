"""The real ``e2b-code-interpreter`` SDK against template ``code-interpreter-v1`` (spec §4), built (or found
in the cache) once per module and registered in the server's store (``tests/fixtures/interpreter.py``);
the module is not marked ``slow``: warm, that costs well under a second.
"""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from aenv.testing.server import Server
from tests.fixtures.interpreter import register_interpreter


@pytest.fixture(scope="module")
def interpreter_template(server: Server) -> str:
    return register_interpreter(server)


@pytest.fixture(scope="module")
def sbx(e2b_env: dict[str, str], interpreter_template: str) -> Iterator[Any]:
    from e2b import SandboxException
    from e2b_code_interpreter import Sandbox

    # vm: the first sandbox of a template boots and snapshots it once its service listens (~1-2 min
    # under TCG); the SDK's default 60 s request timeout is for creates, not for that build.
    sandbox = Sandbox.create(interpreter_template, timeout=600, request_timeout=900)
    yield sandbox
    with contextlib.suppress(SandboxException):
        sandbox.kill()


def test_state_persists_between_runs(sbx: Any) -> None:
    first = sbx.run_code("x = 1")
    assert first.error is None
    second = sbx.run_code("x + 1")
    assert second.text == "2"
    assert second.execution_count is not None and second.execution_count > (first.execution_count or 0)


def test_stdout_and_stderr_stream(sbx: Any) -> None:
    seen: list[str] = []
    execution = sbx.run_code(
        "import sys\nprint('hello')\nprint('oops', file=sys.stderr)", on_stdout=lambda m: seen.append(m.line)
    )
    assert seen == ["hello\n"]
    assert execution.logs.stdout == ["hello\n"]
    assert execution.logs.stderr == ["oops\n"]
    assert execution.error is None


def test_exception_becomes_error(sbx: Any) -> None:
    execution = sbx.run_code("1 / 0")
    assert execution.error is not None
    assert execution.error.name == "ZeroDivisionError"
    assert execution.error.value == "division by zero"
    assert "ZeroDivisionError" in execution.error.traceback


def test_matplotlib_figure_is_png(sbx: Any) -> None:
    execution = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()", timeout=120)
    assert execution.error is None, execution.error
    pngs = [r.png for r in execution.results if r.png]
    assert pngs, execution.results
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")


def test_rich_result_html_from_pandas(sbx: Any) -> None:
    execution = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})", timeout=120)
    assert execution.error is None, execution.error
    main = [r for r in execution.results if r.is_main_result]
    assert main and main[0].html and "<table" in main[0].html


def test_contexts_keep_separate_state(sbx: Any) -> None:
    ctx = sbx.create_code_context()
    assert ctx.language == "python" and ctx.cwd == "/home/user"
    assert sbx.run_code("only_here = 41", context=ctx).error is None
    assert sbx.run_code("only_here + 1", context=ctx).text == "42"
    default = sbx.run_code("only_here")
    assert default.error is not None and default.error.name == "NameError"
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    sbx.restart_code_context(ctx)
    assert sbx.run_code("only_here", context=ctx).error.name == "NameError"
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]


def test_unknown_context_is_not_found(sbx: Any) -> None:
    from e2b import NotFoundException
    from e2b_code_interpreter import Context

    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=Context(context_id="nope", language="python", cwd="/home/user"))


def test_env_vars_apply_to_one_run(sbx: Any) -> None:
    code = "import os\nos.environ.get('AENV_CI_FOO', 'unset')"
    assert sbx.run_code(code, envs={"AENV_CI_FOO": "bar"}).text == "bar"  # a string shows unquoted, as E2B's
    assert sbx.run_code(code).text == "unset"


def test_bash_language(sbx: Any) -> None:
    execution = sbx.run_code("echo hi from $0", language="bash")
    assert execution.logs.stdout == ["hi from bash\n"]


def test_client_timeout_interrupts_the_kernel(sbx: Any) -> None:
    from e2b import TimeoutException

    with pytest.raises(TimeoutException):
        sbx.run_code("import time\ntime.sleep(60)", timeout=2)
    started = time.monotonic()
    after = sbx.run_code("'still alive'", timeout=30)
    assert after.text == "still alive"
    assert time.monotonic() - started < 20  # the sleep was interrupted, not waited out


def test_packages_visible_to_commands(sbx: Any) -> None:
    result = sbx.commands.run("python3 -c 'import numpy, pandas; print(numpy.__name__)'")
    assert result.stdout.strip() == "numpy"


def test_kernel_runs_as_root_in_the_users_home(sbx: Any) -> None:
    """As E2B's: its kernels run as root (a context may be made in /root), starting in /home/user."""
    assert (
        sbx.run_code("import os, pwd\n(pwd.getpwuid(os.getuid()).pw_name, os.getcwd())").text
        == "('root', '/home/user')"
    )


def test_a_dataframe_is_data_and_a_figure_is_a_chart(sbx: Any) -> None:
    plain = sbx.run_code("1+1").results
    assert [(r.text, r.data, r.chart) for r in plain] == [("2", None, None)]  # neither for anything else
    frame = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})", timeout=120)
    main = [r for r in frame.results if r.is_main_result]
    assert main and main[0].data == {"a": [1, 2], "b": ["x", "y"]}, frame.results
    figure = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\n"
                          "plt.show()", timeout=120)  # fmt: skip
    charts = [r.chart for r in figure.results if r.chart]
    assert charts and charts[0].type.value == "line" and charts[0].title == "squares", figure.results


def test_a_saved_pil_image_is_displayed(sbx: Any) -> None:
    execution = sbx.run_code("from PIL import Image\nImage.new('RGB', (4, 4), 'red').save('/tmp/red.png')", timeout=60)
    assert execution.error is None, execution.error
    assert [r for r in execution.results if r.png], execution.results


def test_contexts_anywhere_the_template_allows_and_a_clear_error_elsewhere(sbx: Any) -> None:
    from e2b import SandboxException

    ctx = sbx.create_code_context(cwd="/root")
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "/root"
    sbx.remove_code_context(ctx)
    with pytest.raises(SandboxException, match="not a directory"):
        sbx.create_code_context(cwd="/no/such/dir")


def test_the_default_context_exists_as_soon_as_the_sandbox_is_created(interpreter_template: str) -> None:
    from e2b_code_interpreter import Sandbox

    fresh = Sandbox.create(interpreter_template, timeout=120, request_timeout=900)
    try:
        assert "python" in [c.language for c in fresh.list_code_contexts()]
    finally:
        fresh.kill()


def test_the_service_comes_back_after_a_kill(sbx: Any) -> None:
    with contextlib.suppress(Exception):
        sbx.commands.run("pkill -9 -f 'python3 -m aenv_interpreter'", user="root")
    deadline = time.monotonic() + 30
    while True:
        try:
            if sbx.run_code("21 * 2", timeout=10).text == "42":
                break
        except Exception:  # noqa: BLE001 - not back yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_r_prints_runs_in_the_users_home_and_keeps_state(sbx: Any) -> None:
    """language='r' is IRkernel (Debian's r-cran-irkernel, in the template's base tree)."""
    assert sbx.run_code('print("Hello, World!")', language="r").logs.stdout == ['[1] "Hello, World!"\n']
    assert sbx.run_code("getwd()", language="r").results[0].text.strip() == '[1] "/home/user"'
    sbx.run_code("n <- 41", language="r")
    assert sbx.run_code("n + 1", language="r").results[0].text.strip() == "[1] 42"
    failed = sbx.run_code("stop('no way')", language="r")
    assert failed.error is not None and "no way" in failed.error.value


def test_r_env_vars_for_one_run_and_for_good(sbx: Any) -> None:
    """Values with quotes, backslashes and non-ASCII text reach R intact; a run's envs end with it."""
    odd = 'a "q" \\ é'
    got = sbx.run_code("cat(Sys.getenv('AENV_R_ODD'))", language="r", envs={"AENV_R_ODD": odd})
    assert got.logs.stdout == [odd]
    after = sbx.run_code("Sys.getenv('AENV_R_ODD', unset = 'default')", language="r")
    assert after.results[0].text.strip() == '[1] "default"'
    ctx = sbx.create_code_context(language="r", cwd="/tmp")
    assert sbx.run_code("getwd()", context=ctx).results[0].text.strip() == '[1] "/tmp"'


def test_java_is_jshell_with_properties_for_envs(sbx: Any) -> None:
    """language='java' is aenv's JShell kernel on Debian's OpenJDK; E2B's "envs" are system properties."""
    printed = sbx.run_code('System.out.println("Hello, World!")', language="java")
    assert printed.logs.stdout[0] == "Hello, World!" and printed.error is None  # as the SDK's suite reads it
    assert sbx.run_code('System.getProperty("user.dir")', language="java").text == "/home/user"
    assert sbx.run_code('System.getProperty("FOO")', language="java", envs={"FOO": "bar"}).text == "bar"
    assert sbx.run_code('System.getProperty("FOO", "default")', language="java").text == "default"
    sbx.run_code("int base = 41;", language="java")
    assert sbx.run_code("base + 1", language="java").text == "42"
    failed = sbx.run_code("1 / 0", language="java")
    assert failed.error is not None and failed.error.name == "ArithmeticException"


def test_an_unknown_language_is_a_400_that_names_those_there_are(sbx: Any) -> None:
    from e2b import SandboxException

    with pytest.raises(SandboxException, match="(?i)cobol.*python, javascript, typescript, r, java, bash"):
        sbx.run_code("DISPLAY 'HI'.", language="cobol")


def test_javascript_keeps_state_awaits_imports_and_fails_clearly(sbx: Any) -> None:
    """language='javascript' is aenv's Node kernel: Node's REPL evaluator over two pipes."""
    assert sbx.run_code("console.log('Hello, World!')", language="js").logs.stdout == ["Hello, World!\n"]
    assert sbx.run_code("process.cwd()", language="javascript").text == "/home/user"
    assert sbx.run_code("const n = await Promise.resolve(41)", language="js").error is None
    assert sbx.run_code("n + 1", language="js").text == "42"
    imported = sbx.run_code("import { readFileSync } from 'fs'\nimport * as path from 'path'\n"
                            "console.log(typeof readFileSync, path.sep)", language="js")
    assert imported.logs.stdout == ["function /\n"]
    failed = sbx.run_code("throw new RangeError('no way')", language="js")
    assert failed.error is not None and (failed.error.name, failed.error.value) == ("RangeError", "no way")
    env = sbx.run_code("process.env.AENV_JS", language="js", envs={"AENV_JS": "once"})
    assert env.text == "once" and sbx.run_code("process.env.AENV_JS || 'gone'", language="js").text == "gone"
    child = sbx.run_code("require('child_process').execSync('echo from a child', {stdio: 'inherit'}); 1",
                         language="js")
    assert child.logs.stdout == ["from a child\n"] and child.text == "1"


def test_typescript_is_transpiled_and_javascript_is_a_default_context(sbx: Any) -> None:
    out = sbx.run_code("const message: string = 'Hello, World!'; console.log(message)", language="ts")
    assert out.logs.stdout == ["Hello, World!\n"] and out.error is None
    assert {"python", "javascript"} <= {c.language for c in sbx.list_code_contexts()}


def test_an_interrupted_javascript_context_starts_again(sbx: Any) -> None:
    from e2b import TimeoutException

    ctx = sbx.create_code_context(language="js")
    sbx.run_code("globalThis.kept = 1", context=ctx)
    with pytest.raises(TimeoutException):
        sbx.run_code("while (true) {}", context=ctx, timeout=2)
    after = sbx.run_code("typeof globalThis.kept", context=ctx)
    assert after.text == "undefined"  # a fresh process: the old one could not be stopped otherwise


def test_kernel_state_survives_pause_fork_and_snapshot(e2b_env: dict[str, str], interpreter_template: str) -> None:
    """A variable set before a pause, a fork or a full snapshot is there after it, in every copy and in
    every language's kernel: they are processes of the sandbox, and those operations keep processes (ns:
    CRIU, the kernels' loopback ZeroMQ connections and pipes included; vm: the RAM)."""
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(interpreter_template, timeout=600, request_timeout=900)
    copies: list[Any] = []
    try:
        sbx.run_code("x = 41")
        sbx.run_code("globalThis.k = 'kept'", language="js")
        sbx.run_code("r <- 40", language="r")
        sbx.run_code("int j = 39;", language="java")

        def holds(box: Any) -> None:
            assert box.run_code("x + 1").text == "42"
            assert box.run_code("globalThis.k", language="js").text == "kept"
            assert box.run_code("r + 2", language="r").results[0].text.strip() == "[1] 42"
            assert box.run_code("j + 3", language="java").text == "42"

        sbx.pause()
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
        holds(resumed)
        children = resumed.fork(count=2)
        copies += [c for c in children if not isinstance(c, Exception)]
        assert len(copies) == 2, children
        for child in copies:
            holds(child)
        snap = resumed.create_snapshot(mode="full")
        restored = Sandbox.create(snap.snapshot_id, timeout=600, request_timeout=900)
        copies.append(restored)
        holds(restored)
        holds(resumed)  # the source runs on after all of it
    finally:
        for box in (*copies, sbx):
            with contextlib.suppress(Exception):
                box.kill()
