"""All three client suites aenv is held to, in one command, each with the SDK version its tests were
written for and once with the newest on the registries:

    .venv/bin/python scripts/sdk_suites.py --e2b /path/to/E2B --code-interpreter /path/to/code-interpreter \\
        [--runtime ns|vm] [--only python,js,interpreter]

- **python**: the E2B Python SDK's suite (``e2b_sdk_suite.py``) with ``e2b==`` the version in
  ``packages/python-sdk/pyproject.toml``, then with the newest ``e2b`` on PyPI;
- **js**: the JS SDK's suite (``js_sdk_suite.py``); its tests import the checkout's own source, so they
  run with the version they were written for only (the newest on npm is printed beside it);
- **interpreter**: the code-interpreter SDK's suite (``code_interpreter_suite.py``) with
  ``e2b-code-interpreter==`` the version in ``python/pyproject.toml``, then with the newest.

Each Python SDK version gets a venv of its own, made once in ``<cache>/sdk-suites/`` with the suites'
test dependencies. Every suite runs against a server of its own (a fresh state dir). A table of the
runs ends the output; the exit status is 1 if any suite failed.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
TEST_DEPS = ("pytest>=9,<10", "pytest-asyncio>=1.3,<2", "pytest-timeout>=2.4,<3", "pytest-dotenv>=0.5,<0.6",
             "python-dotenv>=1,<2", "matplotlib")


def version_in(checkout: Path) -> str:
    """The version an SDK checkout's ``pyproject.toml`` declares (``e2b_sdk_suite.declared_version``)."""
    from e2b_sdk_suite import declared_version

    version = declared_version(checkout)
    if not version:
        raise SystemExit(f"{checkout / 'pyproject.toml'}: no version")
    return version


def venv_with(*packages: str) -> Path:
    """A venv with ``packages`` and the suites' test dependencies, made once per package set."""
    from aenv.config import load_settings

    key = hashlib.sha256("\n".join((*packages, *TEST_DEPS)).encode()).hexdigest()[:12]
    venv = Path(load_settings().cache_dir) / "sdk-suites" / f"venv-{key}"
    done = venv / ".aenv-complete"  # a venv names its own path: made in place, marked when whole
    if not done.exists():
        print(f"making {venv} with {' '.join(packages)}", file=sys.stderr)
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *packages, *TEST_DEPS], check=True)
        done.touch()
    return venv / "bin" / "python"


def newest(package: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package], capture_output=True, text=True)
    found = re.search(rf"^{re.escape(package)} \(([^)]+)\)", out.stdout, re.M)
    if found is None:
        raise SystemExit(f"cannot tell the newest {package} on PyPI: {out.stderr.strip()[-300:]}")
    return found.group(1)


def run(name: str, argv: list[str], rows: list[tuple[str, str, str]]) -> None:
    print(f"\n=== {name}: {' '.join(argv)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    rc = subprocess.call([sys.executable, *argv])
    rows.append((name, "passed" if rc == 0 else f"FAILED (exit {rc})", f"{time.monotonic() - t0:.0f} s"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--e2b", type=Path, help="checkout of e2b-dev/E2B (python and js)")
    ap.add_argument("--code-interpreter", type=Path, help="checkout of e2b-dev/code-interpreter")
    ap.add_argument("--runtime", choices=("ns", "vm"), default="ns")
    ap.add_argument("--only", default="python,js,interpreter", help="which suites [%(default)s]")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if only - {"python", "js", "interpreter"}:
        ap.error(f"--only: unknown suite(s) {', '.join(sorted(only - {'python', 'js', 'interpreter'}))}")
    if {"python", "js"} & only and args.e2b is None:
        ap.error("--e2b is required for the python and js suites")
    if "interpreter" in only and args.code_interpreter is None:
        ap.error("--code-interpreter is required for the interpreter suite")
    rt = ["--runtime", args.runtime]
    rows: list[tuple[str, str, str]] = []
    if "python" in only:
        sdk = args.e2b / "packages" / "python-sdk"
        for label, pin in (("written for", version_in(sdk)), ("newest", newest("e2b"))):
            python = venv_with(f"e2b=={pin}")
            run(f"python SDK suite, e2b {pin} ({label})",
                [str(SCRIPTS / "e2b_sdk_suite.py"), "--sdk", str(sdk), "--python", str(python), *rt], rows)
    if "js" in only:
        npm = shutil.which("npm")
        latest = subprocess.run([npm, "view", "e2b", "version"], capture_output=True, text=True).stdout.strip() if npm else "?"
        run(f"JS SDK suite, the checkout's source (newest on npm: {latest or '?'})",
            [str(SCRIPTS / "js_sdk_suite.py"), "--checkout", str(args.e2b), *rt], rows)
    if "interpreter" in only:
        ci = args.code_interpreter / "python"
        for label, pin in (("written for", version_in(ci)),
                           ("newest", newest("e2b-code-interpreter"))):
            python = venv_with(f"e2b-code-interpreter=={pin}")
            run(f"code-interpreter suite, e2b-code-interpreter {pin} ({label})",
                [str(SCRIPTS / "code_interpreter_suite.py"), "--checkout", str(args.code_interpreter),
                 "--python", str(python), *rt], rows)
    print(f"\n| suite ({args.runtime}) | result | time |\n| --- | --- | --- |", file=sys.stderr)
    for name, result, took in rows:
        print(f"| {name} | {result} | {took} |", file=sys.stderr)
    return 0 if all(r == "passed" for _, r, _ in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())
