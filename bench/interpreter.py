"""The code interpreter: ``e2b-code-interpreter``'s ``run_code`` in a ``code-interpreter-v1`` sandbox
against the same kernel run directly on the host, sampled alternately.

* ``aenv-ns`` / ``aenv-vm``: ``Sandbox.run_code`` (the SDK) → aenv's proxy → the interpreter service in
  the sandbox → its ipykernel, and the NDJSON lines back.
* ``host kernel``: the template's own layers (its packages and ``aenv_interpreter``) on ``PYTHONPATH`` of
  the host's Debian ``python3`` (the sandbox's Python), one ipykernel started by ``jupyter_client`` with
  the same start-up line (``display.install``: the chart and data formatters), the same code executed
  through a ``BlockingKernelClient`` until the kernel is idle again. What a notebook on the host pays:
  the floor of the sandboxed path.

Rows: ``run_code("1+1")``, a matplotlib figure (a PNG and ``Result.chart``), a DataFrame (HTML and
``Result.data``), and create → first ``run_code`` of a fresh sandbox. Needs the template's layers
(built once, like ``aenv template build code-interpreter``); skipped with the reason when they cannot be.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.context import Ctx
from bench.rows import alternate, ms_since, row, scenario

TEMPLATE = "code-interpreter-v1"
CODES = {
    "run_code(\"1+1\")": "1+1",
    "run_code, a matplotlib figure (png + chart)": "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\n"
                                                   "plt.title('squares')\nplt.show()",
    "run_code, a DataFrame (html + data)": "import pandas as pd\npd.DataFrame({'a': list(range(50)), 'b': "
                                           "[str(i) for i in range(50)]})",
}
POOL_SETTLE_S = 8.0  # a pooled code-interpreter sandbox is added once its service is ready (~2-3 s each)
HOST_PYTHON = "/usr/bin/python3"  # Debian bookworm's 3.11, as in the sandbox
HOST_KERNEL = r"""
import json, sys
from jupyter_client.manager import KernelManager
km = KernelManager(kernel_name="python3")
km.start_kernel(extra_arguments=[sys.argv[1]])
kc = km.client(); kc.start_channels(); kc.wait_for_ready(timeout=60)
print("ready", flush=True)
for line in sys.stdin:
    msg_id = kc.execute(json.loads(line), store_history=False)
    kinds = []
    while True:
        m = kc.get_iopub_msg(timeout=60)
        if m["parent_header"].get("msg_id") != msg_id:
            continue
        t = m["msg_type"]
        if t in ("execute_result", "display_data"):
            kinds += sorted(m["content"]["data"])
        if t == "status" and m["content"]["execution_state"] == "idle":
            break
    print(json.dumps(kinds), flush=True)
kc.stop_channels()
km.shutdown_kernel(now=True)
"""


def _layers(ctx: Ctx) -> tuple[Path, Path] | str:
    """The packages and service layers' site dirs, registering the template on the server; or why not."""
    from aenv.config import load_settings
    from aenv.core.templates import TemplateCatalog
    from aenv.images.interpreter import SITE_DIR, InterpreterBuildError, ensure_interpreter_layers
    from aenv.store.sqlite import Store

    if ctx.state_dir is None:
        return "needs the server's state dir (not with --server)"
    settings = load_settings(environ={**os.environ, "AENV_STATE_DIR": str(ctx.state_dir)})
    try:
        layers = ensure_interpreter_layers(settings, log=lambda _line: None)
    except InterpreterBuildError as exc:
        return f"cannot build the code-interpreter layers: {str(exc).splitlines()[0]}"
    TemplateCatalog(settings, Store(settings.db_path)).register_interpreter(layers)
    return layers.packages / SITE_DIR, layers.service / SITE_DIR


class HostKernel:
    """One ipykernel on the host from the template's layers, driven over a pipe."""

    def __init__(self, packages: Path, service: Path) -> None:
        from aenv.interpreter.kernels import INSTALL_DISPLAY

        install = INSTALL_DISPLAY.replace("aenv.interpreter", "aenv_interpreter")  # its name in the template
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
               "PYTHONPATH": f"{service}:{packages}", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
        self.proc = subprocess.Popen([HOST_PYTHON, "-s", "-c", HOST_KERNEL, f"--IPKernelApp.exec_lines={install}"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the host kernel did not start")

    def run(self, code: str) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(code) + "\n")
        self.proc.stdin.flush()
        kinds: list[str] = json.loads(self.proc.stdout.readline())
        return kinds

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def interpreter(ctx: Ctx) -> dict[str, Any]:
    from e2b_code_interpreter import Sandbox  # type: ignore[import-untyped]

    found = _layers(ctx)
    if isinstance(found, str):
        return scenario("code interpreter", [], [f"skipped: {found}"])
    host = HostKernel(*found)
    # vm: the template's first sandbox boots and freezes it (minutes under TCG)
    sbx = Sandbox.create(TEMPLATE, timeout=900, request_timeout=900)
    rows = []
    seen: dict[str, list[str]] = {}
    try:
        for label, code in CODES.items():
            sbx.run_code(code, timeout=120)  # warm: imports, the first figure
            host.run(code)

            def in_sandbox(code: str = code, label: str = label) -> float:
                t0 = time.perf_counter()
                got = sbx.run_code(code, timeout=120)
                took = ms_since(t0)
                seen[label] = sorted(k for r in got.results for k in ("png", "chart", "html", "data", "text")
                                     if getattr(r, k, None))  # fmt: skip
                return took

            def on_host(code: str = code) -> float:
                t0 = time.perf_counter()
                host.run(code)
                return ms_since(t0)

            samples = alternate(ctx.n(3, 30, vm=10), [(ctx.system, in_sandbox), ("host kernel", on_host)])
            note = "result: " + ", ".join(seen.get(label, [])) if label in seen else ""
            rows += [row(label, name, s, note=note if name == ctx.system else "") for name, s in samples.items()]
    finally:
        sbx.kill()
        host.close()

    def create_first(settle: float) -> float:
        time.sleep(settle)
        t0 = time.perf_counter()
        fresh = Sandbox.create(TEMPLATE, timeout=120, request_timeout=900)
        fresh.run_code("1+1", timeout=60)
        took = ms_since(t0)
        fresh.kill()
        return took

    # A sandbox is answered once its template's ready command passes (the service listening, with its
    # default python and javascript contexts): from the warm pool that was before the create; one
    # launched for the create (the pool empty, back to back) waits for the service to start.
    n = ctx.n(2, 10, vm=5)
    rows.append(row("create → first run_code(\"1+1\"), from the pool", ctx.system,
                    [create_first(POOL_SETTLE_S) for _ in range(n)],
                    note=f"a fresh {TEMPLATE} sandbox, {POOL_SETTLE_S:g} s after the last (the pool refilled)"))
    rows.append(row("create → first run_code(\"1+1\"), back to back", ctx.system, [create_first(0) for _ in range(n)],
                    note="the pool (2) empties: the rest start their service for the create"))
    return scenario("code interpreter (run_code vs the same kernel on the host)", rows)
