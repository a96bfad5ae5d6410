"""CI smoke of the benchmark suite: ``python -m bench --smoke`` on ns runs every scenario and writes results of
the documented shape. Only shapes are checked (samples taken, numbers positive and ordered), never timings.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aenv.runtime.ns import criu
from bench.__main__ import GROUPS

REPO = Path(__file__).resolve().parents[2]
PERCENTILES = ("min", "p50", "p95", "p99", "max")


def _by_name(tmp_path: Path, scenario: str, *args: str, timeout: float = 280,  # type: ignore[type-arg]
             stderr_to: str | None = None) -> dict:
    """``python -m bench --smoke --scenarios SCENARIO ARGS`` of this checkout; the results' JSON (its stderr,
    what the run printed, written to ``stderr_to``)."""
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "PYTHONPATH": str(REPO / "src")}
    out = tmp_path / f"{scenario}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--scenarios", scenario, *args, "--json", str(out),
         "--out", str(tmp_path / "out")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    if stderr_to is not None:
        Path(stderr_to).write_text(proc.stderr)
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:  # type: ignore[type-arg]
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    tmp = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
           "PYTHONPATH": str(REPO / "src")}  # this checkout's aenv, not the one the venv installed
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--runtime", "ns", "--json", str(tmp / "smoke.json"),
         "--out", str(tmp / "out")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, f"bench failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads((tmp / "smoke.json").read_text()), tmp / "out"


@pytest.mark.timeout(300)
def test_every_scenario_ran_on_ns(smoke: tuple[dict, Path]) -> None:  # type: ignore[type-arg]
    results, _ = smoke
    run = results["runs"]["ns"]
    assert run["errors"] == {}
    assert set(run["scenarios"]) == set(GROUPS["all"])  # every scenario (rl-groups' rows are rl's)
    for name, sc in run["scenarios"].items():
        if name == "released" and not criu.probe().usable:
            continue  # resume from disk needs CRIU: the scenario says so in its notes, with no rows
        assert sc["title"] and sc["rows"], name
        assert any(r["system"] == "aenv-ns" for r in sc["rows"]), name


@pytest.mark.timeout(300)
def test_rows_have_samples_and_sane_numbers(smoke: tuple[dict, Path]) -> None:  # type: ignore[type-arg]
    results, _ = smoke
    for name, sc in results["runs"]["ns"]["scenarios"].items():
        for r in sc["rows"]:
            where = f"{name}: {r['metric']} [{r['system']}]"
            assert r["n"] > 0, where
            assert r["unit"] in {"ms", "MB", "/s", "count"}, where
            values = [r[k] for k in PERCENTILES]
            assert all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values), where
            assert values == sorted(values), where


@pytest.mark.timeout(300)
def test_fork_counts_and_meta(smoke: tuple[dict, Path]) -> None:  # type: ignore[type-arg]
    results, out = smoke
    metrics = {r["metric"] for r in results["runs"]["ns"]["scenarios"]["fork"]["rows"]}
    assert {f"fork ×{n} → all children answer" for n in (1, 4, 16)} <= metrics
    meta = results["meta"]
    assert meta["mode"] == "smoke" and meta["command"].startswith("python -m bench")
    assert len(meta["load_before"]) == 3 and meta["machine"]
    assert (out / "results.json").is_file() and "| scenario |" in (out / "results.md").read_text()


@pytest.mark.timeout(300)
def test_scale_scenario_smoke(tmp_path: Path) -> None:
    """``scale`` is run by name (a full run fills half the host's memory); its smoke (6 sandboxes, 4 fork
    children, docker where it can start) has the idle and fork rows, a per-step series, and kills all."""
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    sc = _by_name(tmp_path, "scale", "--runtime", "ns")["runs"]["ns"]["scenarios"]["scale"]
    ours = {r["metric"]: r for r in sc["rows"] if r["system"] == "aenv-ns"}
    assert ours["scale: idle sandboxes reached"]["p50"] == 6
    assert ours["scale fork: children of one parent"]["p50"] == 4
    assert ours["scale: run `true` in each sandbox at the end"]["n"] == 6
    assert all(r["n"] > 0 for r in sc["rows"])  # memory drops may be negative on a busy host: not checked
    assert [s["count"] for s in sc["series"]["aenv-ns"]] == [3, 6]
    if "docker" in sc["series"]:
        assert any(r["system"] == "docker" for r in sc["rows"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lazy_scenario_smoke(tmp_path: Path) -> None:
    """``lazy`` is run by name (its own registry and servers): its smoke has lazy and full-pull rows."""
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    results = _by_name(tmp_path, "lazy", "--baseline", "none", "--runtime", "ns", timeout=580)
    sc = results["runs"]["ns"]["scenarios"]["lazy"]
    if not sc["rows"]:
        assert any("skipped" in n for n in sc["notes"])
        return
    systems = {r["system"] for r in sc["rows"]}
    assert systems == {"aenv-ns lazy", "full pull (aenv-ns)"}
    assert all(r["n"] > 0 and r["p50"] > 0 for r in sc["rows"])


@pytest.mark.timeout(300)
def test_cluster_sim_scenario_smoke(tmp_path: Path) -> None:
    """``cluster-sim`` is run by name; its smoke (Redis, 10 simulated nodes, 1 then 3 gateways, no aenv
    server) has its rows, each with samples, and writes its chart."""
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    sc = _by_name(tmp_path, "cluster-sim")["runs"]["ns"]["scenarios"]["cluster-sim"]
    metrics = {(r["metric"], r["system"]) for r in sc["rows"]}
    assert ("10 nodes: creates/s (8 clients)", "sim, 3 gateways") in metrics
    assert ("10 nodes: node killed → fenced (dead) on every gateway", "sim, 3 gateways") in metrics
    assert ("Redis used_memory at 1,000 live sandboxes (10 nodes)", "sim directory") in metrics
    assert all(r["n"] > 0 for r in sc["rows"])
    if (tmp_path / "out" / "chart.png").exists():  # matplotlib installed: the cluster chart too
        assert (tmp_path / "out" / "cluster-sim.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_console_sim_scenario_smoke(tmp_path: Path) -> None:
    """``console-sim`` is run by name (Redis, 3 simulated nodes, a gateway, Chromium; ~30 s): its smoke fills
    through the SDK, paints the list, shows every live create's row, and pages at 1,000 live."""
    import shutil

    from tests.fixtures.browser import CHROMIUM

    if shutil.which("redis-server") is None or not Path(CHROMIUM).exists():
        pytest.skip("redis-server or chromium is not installed")
    sc = _by_name(tmp_path, "console-sim")["runs"]["ns"]["scenarios"]["console-sim"]
    rows = {(r["metric"], r["system"]): r for r in sc["rows"]}
    assert rows[("console fill: live sandboxes", "gateway + sim")]["p50"] == 20
    assert rows[("console: first page of the list", "gateway + sim console, logged in")]["n"] > 0
    assert rows[("console live: rows not shown within 10 s", "gateway + sim console")]["p50"] == 0
    assert rows[("console live: a new sandbox", "gateway + sim console")]["n"] > 0
    assert rows[("console at 1,000 live: first page of the list", "JSON GET /v2/sandboxes?limit=50")]["n"] == 20


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_chaos_scenario_smoke(tmp_path: Path) -> None:
    """``chaos`` is run by name (its own 3-node cluster, root, Ray); its smoke (2 groups × 3 rollouts per
    fault) prints the counts table, and its rows and per-rollout fates are in the JSON."""
    import importlib.util
    import shutil

    if os.geteuid() != 0 or importlib.util.find_spec("ray") is None or shutil.which("redis-server") is None:
        pytest.skip("chaos needs root, Ray and redis-server")
    stderr = (tmp_path / "chaos.stderr").as_posix()
    sc = _by_name(tmp_path, "chaos", timeout=580, stderr_to=stderr)["runs"]["ns"]["scenarios"]["chaos"]
    stderr = Path(stderr).read_text()
    assert "| fault | rollouts | ok | infra-failed | by reason | error | wrong | lost |" in stderr
    metrics = {r["metric"] for r in sc["rows"]}
    for fault in ("redis", "gateway", "node", "all"):
        label = "all faults" if fault == "all" else f"{fault} fault"
        assert f"chaos, {label}: lost (hung, raised or unscored)" in metrics
    assert sc["chaos"]["counts"]["all"]["rollouts"] == len(sc["chaos"]["rollouts"]) == 18


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compose_scenario_smoke(tmp_path: Path) -> None:
    """``compose`` is run by name (its own registry and server; the docker template): its smoke has the
    compose-up row (aenv, and the host's docker compose where the private dockerd starts) and, where the
    runtime forks a compose sandbox, the fork ×4 rows; otherwise a note says why."""
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    from bench.compose import compose_plugin

    if compose_plugin() is None:
        pytest.skip("the docker template is not built (aenv template build docker)")
    run = _by_name(tmp_path, "compose", "--runtime", "ns", timeout=580)["runs"]["ns"]
    sc = run["scenarios"]["compose"]
    rows = {(r["metric"], r["system"]): r for r in sc["rows"]}
    assert rows[("compose up → services healthy", "aenv-ns")]["n"] == 1
    if not any("docker baseline unavailable" in n for n in run.get("notes", [])):
        assert rows[("compose up → services healthy", "docker")]["n"] == 1
    fork = ("compose fork ×4 → both services answer in every child", "aenv-ns")
    assert fork in rows or any("fork of a compose sandbox refused" in n for n in sc["notes"]), sc
    assert all(r["n"] > 0 and r["p50"] > 0 for r in sc["rows"])
