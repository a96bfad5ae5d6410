"""Run the code-interpreter SDK's own test suite (python/tests of e2b-dev/code-interpreter) against aenv.

    .venv/bin/python scripts/code_interpreter_suite.py --checkout /path/to/code-interpreter \\
        [--python /path/to/venv/bin/python] [--runtime ns|vm] [-- extra pytest args]

As ``e2b_sdk_suite.py`` does for the E2B SDK: ``aenv serve`` on the runtime over HTTPS, the clients
given only ``E2B_DOMAIN`` (``<port>-<id>.aenv.localhost``), the ``code-interpreter-v1`` template built
(or found in the cache) and registered, then pytest on the suite, unmodified, with the exemptions
below deselected. The tests are copied out of the checkout first and run from there: run inside the
checkout, ``python -m pytest`` puts the checkout's ``e2b_code_interpreter`` package ahead of the
installed one, and the SDK under test would silently be the checkout's, not the one ``--python``
has. Which SDK ran is printed. Exit status is pytest's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT), str(ROOT / "scripts")]

from e2b_sdk_suite import copy_tests, domain_env, domain_tls  # noqa: E402

from aenv.testing.procs import unwind_on_signals  # noqa: E402
from aenv.testing.server import free_port, reap_vms, start_server, stop_server  # noqa: E402

# Deselected: node ID (or file) -> reason.
EXEMPT: dict[str, str] = {}  # every test of the suite runs: all five languages are in the template


def register_template(server_env: dict[str, str]) -> None:
    """``code-interpreter-v1`` built (or found) and put in the server's store, as
    ``aenv template build code-interpreter`` does."""
    from aenv.config import load_settings
    from aenv.core.templates import TemplateCatalog
    from aenv.images.interpreter import ensure_interpreter_layers
    from aenv.store.sqlite import Store

    settings = load_settings(environ=server_env)
    layers = ensure_interpreter_layers(settings, log=lambda line: print(line, file=sys.stderr))
    TemplateCatalog(settings, Store(settings.db_path)).register_interpreter(layers)


def run(args: argparse.Namespace, tmp: Path) -> int:
    suite = copy_tests(args.checkout / "python", tmp)
    tls = domain_tls(tmp)
    port = free_port()
    server = start_server(tmp, args.runtime, {"PYTHONPATH": str(ROOT / "src")}, port=port, tls=tls)
    try:
        register_template(server.env)
        env = domain_env(port, tls)
        version = subprocess.run([args.python, "-c", "import e2b, e2b_code_interpreter as c; "
                                  "from importlib.metadata import version as v; "
                                  "print('e2b', v('e2b'), '| e2b-code-interpreter', v('e2b-code-interpreter'), c.__file__)"],
                                 cwd=suite, env=env, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        print(f"aenv {args.runtime} at https://127.0.0.1:{port}; SDK under test: {version}", file=sys.stderr)
        deselect = [] if args.no_exempt else [f"--deselect={node}" for node in EXEMPT]
        # the suite's addopts ask for pytest-xdist; one process here (2 cores, a shared server)
        cmd = [args.python, "-m", "pytest", "-p", "no:cacheprovider", "-p", "e2b_sdk_localhost",
               "-o", "addopts=--import-mode=importlib", *deselect, *args.pytest_args]
        return subprocess.call(cmd, cwd=suite, env=env)
    finally:
        stop_server(server)
        if args.runtime == "vm":
            reap_vms(server.state_dir)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", type=Path, help="checkout of e2b-dev/code-interpreter")
    ap.add_argument("--python", default=sys.executable,
                    help="a Python with e2b-code-interpreter, pytest and pytest-asyncio [this one]")
    ap.add_argument("--runtime", choices=("ns", "vm"), default="ns")
    ap.add_argument("--no-exempt", action="store_true", help="run the exempt tests too")
    ap.add_argument("--list-exempt", action="store_true", help="print the exemptions and exit")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (default: tests)")
    args = ap.parse_args()
    if args.list_exempt:
        for node, why in EXEMPT.items():
            print(f"deselected\t{node}\t{why}")
        return 0
    if args.checkout is None:
        ap.error("--checkout is required")
    args.pytest_args = args.pytest_args or ["tests"]
    unwind_on_signals()
    with tempfile.TemporaryDirectory(prefix="aenv-ci-suite-") as tmp:
        return run(args, Path(tmp))


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        raise SystemExit(130) from None
