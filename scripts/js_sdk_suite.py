"""Run the E2B JS SDK's own test suite (packages/js-sdk/tests of e2b-dev/E2B, vitest) against aenv.

    .venv/bin/python scripts/js_sdk_suite.py --checkout /path/to/E2B [--runtime ns|vm] [-- vitest args]

As ``e2b_sdk_suite.py`` does for the Python SDK: a local registry with aenv's fixture images as the
docker.io mirror, ``aenv serve`` on the runtime over HTTPS, the tests given only ``E2B_DOMAIN`` and
``E2B_API_KEY``. What is Node's own:

- **The SDK under test is the checkout's source**: the tests import ``../src``, so the version is the
  checkout's (printed; compare ``npm view e2b version`` for the newest on the registry).
- **Dependencies** (vitest, msw, ...) are installed once per ``package.json`` with the host's npm
  (``--legacy-peer-deps``: the pinned TypeScript 6 and openapi-typescript's peer range disagree;
  ``--ignore-scripts``: no install script runs) into the cache, ``<cache>/js-sdk-suite/<digest>``.
- **DNS and TLS**: ``node_localhost.cjs`` is preloaded so ``<port>-<id>.aenv.localhost`` resolves to
  127.0.0.1 (E2B's wildcard record, which glibc lacks); ``NODE_EXTRA_CA_CERTS`` trusts the run's CA.
- **Projects**: ``unit``, ``template`` and ``connectionConfig``. The ``browser`` project (one file) is
  left out: its config asks Playwright for its own Chromium build, from Playwright's CDN, which this
  machine cannot reach (Debian's ``chromium`` could stand in through a config of the runner's own: not
  done yet).

The tests are copied out of the checkout and run there, unmodified. ``KNOWN`` lists the failures this
machine explains, each with its reason; the exit status is 1 when any other test fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT), str(ROOT / "scripts")]

from e2b_sdk_suite import domain_env, domain_tls, one_node  # noqa: E402

from aenv.testing.procs import unwind_on_signals  # noqa: E402
from aenv.testing.server import free_port  # noqa: E402

PROJECTS = ("unit", "template", "connectionConfig")
PUBLIC = ("needs the public internet; this machine has none (its host's egress is a TLS-intercepting proxy: "
          "curl https://1.1.1.1 fails with exit 60, certificate 'sandboxing-tproxy-egress'): ")
# test full name (vitest's describe and test titles joined by spaces) -> reason. The same rules are
# enforced against test hosts of aenv's own in tests/integration/test_network_policy.py.
KNOWN: dict[str, str] = {
    "MCP gateway start failure kills the created sandbox": PUBLIC + "E2B's hosted MCP gateway image",
    "internet access enabled internet access enabled": PUBLIC + "curl to a public site",
    "internet access default internet access default": PUBLIC + "curl to a public site",
    "allow only 1.1.1.1 allow specific IP with deny all traffic": PUBLIC + "https://1.1.1.1 must answer",
    "deny specific IP address deny specific IP address": PUBLIC + "a public address must answer first",
    "allow takes precedence over deny allow takes precedence over deny": PUBLIC + "https://1.1.1.1 must answer",
    "firewall transform injects headers injected header is reflected by the httpbin sidecar":
        PUBLIC + "E2B's hosted httpbin template",
    "updateNetwork applies new egress rules denies a previously reachable IP after update":
        PUBLIC + "a public address must be reachable before the update",
    "updateNetwork clears existing rules when fields are omitted omitting fields replaces all egress rules":
        PUBLIC + "a public address must be reachable after the rules are cleared",
}


def cache_dir() -> Path:
    from aenv.config import load_settings

    return Path(load_settings().cache_dir) / "js-sdk-suite"


def install_deps(sdk: Path) -> Path:
    """``node_modules`` for this ``package.json``, installed once into the cache (see the docstring)."""
    manifest = (sdk / "package.json").read_bytes()
    final = cache_dir() / hashlib.sha256(manifest).hexdigest()[:16]
    if (final / "node_modules").is_dir():
        return final / "node_modules"
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("npm is not installed: the JS SDK suite needs Node and npm (scripts/setup.sh installs them)")
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        shutil.copy2(sdk / "package.json", staging / "package.json")
        print(f"installing the JS SDK's test dependencies into {final} (once)", file=sys.stderr)
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--ignore-scripts", "--legacy-peer-deps",
                        "--no-package-lock"], cwd=staging, check=True)
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final / "node_modules"


def copy_sdk(checkout: Path, into: Path) -> Path:
    """``packages/js-sdk`` (its sources and tests) and ``spec`` beside it, without ``node_modules``."""
    repo = checkout if (checkout / "packages" / "js-sdk").is_dir() else checkout.parent.parent
    sdk = repo / "packages" / "js-sdk"
    if not (sdk / "tests").is_dir():
        raise SystemExit(f"{checkout}: no packages/js-sdk/tests (a checkout of e2b-dev/E2B?)")
    dest = into / "e2b" / "packages" / "js-sdk"
    shutil.copytree(sdk, dest, ignore=shutil.ignore_patterns("node_modules", "dist", ".env"))
    if (repo / "spec").is_dir():
        shutil.copytree(repo / "spec", into / "e2b" / "spec")
    (dest / "node_modules").symlink_to(install_deps(sdk))
    return dest


def summarise(results: Path) -> tuple[dict[str, int], list[str]]:
    """Counts by status and the full names of the failed tests, from vitest's JSON report."""
    data = json.loads(results.read_text())
    counts: dict[str, int] = {}
    failed: list[str] = []
    for suite in data.get("testResults", []):
        for test in suite.get("assertionResults", []):
            status = test.get("status", "unknown")
            counts[status] = counts.get(status, 0) + 1
            if status == "failed":
                failed.append(test.get("fullName") or test.get("title", "?"))
    return counts, failed


def run(args: argparse.Namespace, tmp: Path) -> int:
    sdk = copy_sdk(args.checkout, tmp)
    version = json.loads((sdk / "package.json").read_text()).get("version")
    tls = domain_tls(tmp)
    port = free_port()
    with one_node(args, tmp, tls, port):
        env = domain_env(port, tls)
        env.pop("PYTHONPATH", None)
        env |= {"NODE_EXTRA_CA_CERTS": str(tls.ca),
                "NODE_OPTIONS": f"--require {ROOT / 'scripts' / 'node_localhost.cjs'}"}
        print(f"aenv {args.runtime} at https://127.0.0.1:{port}; SDK under test: e2b {version} (the checkout's "
              "source)", file=sys.stderr)
        report = tmp / "vitest.json"
        cmd = [str(sdk / "node_modules" / ".bin" / "vitest"), "run", *(f"--project={p}" for p in PROJECTS),
               "--reporter=default", "--reporter=json", f"--outputFile.json={report}", *args.vitest_args]
        rc = subprocess.call(cmd, cwd=sdk, env=env)
    if not report.exists():
        return rc or 1
    counts, failed = summarise(report)
    unexplained = [name for name in failed if name not in KNOWN]
    print("JS SDK suite: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), file=sys.stderr)
    for name in failed:
        print(f"  {'KNOWN' if name in KNOWN else 'FAILED'}: {name}" + (f" ({KNOWN[name]})" if name in KNOWN else ""),
              file=sys.stderr)
    return 1 if unexplained else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", type=Path, help="checkout of e2b-dev/E2B (or its packages/js-sdk)")
    ap.add_argument("--runtime", choices=("ns", "vm"), default="ns")
    ap.add_argument("--list-known", action="store_true", help="print the known failures and exit")
    ap.add_argument("vitest_args", nargs="*", help="after --: passed to vitest (e.g. a test file)")
    args = ap.parse_args()
    if args.list_known:
        for name, why in KNOWN.items():
            print(f"known\t{name}\t{why}")
        return 0
    if args.checkout is None:
        ap.error("--checkout is required")
    unwind_on_signals()
    with tempfile.TemporaryDirectory(prefix="aenv-js-suite-") as tmp:
        return run(args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
