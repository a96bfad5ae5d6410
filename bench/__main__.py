"""aenv benchmark suite: ``python -m bench`` (or ``aenv bench``).

    python -m bench [--smoke] [--runtime ns|vm|ns,vm] [--scenarios all|core|snapshots|NAME,...]
                    [--baseline docker|runc|none] [--out DIR] [--json FILE] [--server URL]

Each scenario drives a real server through the unmodified e2b SDK (and aenv's REST routes for fork and
snapshots) and, in the same run, the baseline doing the same job: ``docker`` run/exec/cp/pause/commit of
the same rootfs on a private engine the bench starts, ``runc run``, and for the vm runtime a plain QEMU
cold boot. Samples alternate between systems (order flipped every round) so machine drift hits all alike.

Writes ``results.json``, ``results.md`` and ``chart.png`` (needs matplotlib: ``pip install -e '.[bench]'``),
with the ``scale`` scenario also ``scale.png`` (its per-step series), to ``--out`` (default
``bench/results/<UTC time>/``, gitignored) and prints the Markdown table.
Nothing here asserts on numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from aenv.testing.procs import unwind_on_signals
from aenv.testing.server import API_KEY, discard_vm_state, start_server, stop_server
from bench import (
    bandwidth,
    builds,
    chaos,
    cluster,
    cluster_sim,
    compose,
    console_sim,
    core,
    density,
    forks,
    gateway,
    interpreter,
    lazy,
    report,
    rl,
    scale,
    teams,
    volumes,
    ws,
)
from bench import console as console_list  # `console` is this module's rich Console
from bench.context import Ctx

console = Console(stderr=True)

SCENARIOS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "create": core.create_first_command,
    "concurrent": core.concurrent_creates,
    "roundtrip": core.round_trip,
    "files": core.files,
    "pause": core.pause_resume,
    "snapshot": forks.snapshot_dirty,
    "fork": forks.fork,
    "rollback": forks.rollback,
    "released": forks.released_resume,
    "volumes": volumes.volume_mounts,
    "density": density.density,
    "scale": scale.density_at_scale,
    "rl": rl.rl_loop,
    "rl-groups": rl.rl_groups,
    "build": builds.template_build,
    "websocket": ws.websocket_echo,
    "gateway": gateway.gateway_overhead,
    "lazy": lazy.lazy_start,
    "cluster": cluster.cluster_local,
    "cluster-sim": cluster_sim.cluster_sim,
    "chaos": chaos.chaos,
    "interpreter": interpreter.interpreter,
    "bandwidth": bandwidth.bandwidth,
    "teams": teams.teams,
    "console": console_list.console_scale,
    "console-sim": console_sim.console_sim,
    "compose": compose.compose_sandboxes,
}
GROUPS = {
    "core": ["create", "concurrent", "roundtrip", "files", "pause"],
    "snapshots": ["snapshot", "fork", "rollback", "released"],
    # rl-groups' rows are part of rl; lazy brings its own registry and servers (minutes), cluster needs
    # Ray and root, scale fills half the host's memory (a full run takes many minutes), interpreter builds
    # the code-interpreter template's layers on first use (PyPI), bandwidth makes a test host's network
    # namespace (root) and takes tens of seconds of transfers, teams starts a server of its own and bursts
    # 200 creates, console fills 2,000 sandboxes and drives a browser (console-sim too, through a gateway
    # over simulated nodes), cluster-sim starts its own Redis,
    # gateways and simulated nodes, chaos its own 3-node cluster (root, Ray) whose parts it kills, compose its
    # own registry and server and needs the docker template (aenv template build docker): run those by name
    "all": [s for s in SCENARIOS if s not in ("rl-groups", "lazy", "cluster", "cluster-sim", "chaos", "scale",
                                               "interpreter", "bandwidth", "teams", "console", "compose",
                                               "console-sim")],
}
NO_SERVER = {"cluster-sim", "chaos", "console-sim"}  # scenarios that start what they measure (no aenv server, no baselines)


def select(spec: str) -> list[str]:
    """``all``, a group name, or scenario names, comma separated; order of SCENARIOS kept."""
    want: set[str] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part in GROUPS:
            want.update(GROUPS[part])
        elif part in SCENARIOS:
            want.add(part)
        else:
            raise ValueError(f"unknown scenario {part!r} (known: {', '.join([*GROUPS, *SCENARIOS])})")
    return [s for s in SCENARIOS if s in want]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="few iterations, for CI (under a minute on ns)")
    ap.add_argument("--runtime", default="ns", help="ns, vm or ns,vm [default: ns]")
    ap.add_argument("--scenarios", default="all",
                    help=f"all, a group ({', '.join(g for g in GROUPS if g != 'all')}) or names: "
                         f"{', '.join(SCENARIOS)} [default: all]")
    ap.add_argument("--baseline", default="docker", choices=["docker", "runc", "none"],
                    help="docker: docker and runc; runc: runc only; none [default: docker]")
    ap.add_argument("--out", type=Path, help="result directory [default: bench/results/<UTC time>]")
    ap.add_argument("--json", type=Path, help="also write the JSON results here")
    ap.add_argument("--server", help="use a running server (one runtime) instead of starting one")
    ap.add_argument("--quiet-load", type=float, metavar="LOAD",
                    help="first wait (up to --quiet-wait s) until the 1-minute load average is below LOAD")
    ap.add_argument("--quiet-wait", type=float, default=600.0, metavar="S", help="[default: 600]")
    ap.add_argument("--against", metavar="REV",
                    help="also serve git revision REV (e.g. HEAD~3) from a temporary worktree and sample it "
                         "beside this checkout in create and roundtrip: regressions measured in one run")
    ap.add_argument("--network", metavar="JSON",
                    help="create this checkout's sandboxes (create, concurrent, roundtrip) with this E2B network, "
                         'the SDK\'s form, e.g. \'{"deny_out": ["0.0.0.0/0"], "allow_out": ["1.1.1.1", "example.com"]}\': '
                         "what a policy costs; --against's server gets none (older commits refuse it). "
                         '\'{"allow_internet_access": false}\' makes them offline: against --against HEAD, what '
                         "internet access costs (vm: QEMU's network jail and slirp4netns)")
    ap.add_argument("--list", action="store_true", help="list scenarios and exit")
    return ap


def main(argv: list[str] | None = None, prog: str = "python -m bench") -> int:
    ap = _parser()
    ap.prog = prog
    args = ap.parse_args(argv)
    # SIGTERM (timeout, CI) unwinds like Ctrl-C: the server and its sandboxes, the private dockerd and the
    # temp dirs go in the finally blocks below
    unwind_on_signals(lambda line: console.print(f"[yellow]{line}[/]"))
    if args.list:
        for name, fn in SCENARIOS.items():
            print(f"{name:11} {(fn.__doc__ or '').strip().splitlines()[0] if fn.__doc__ else ''}")
        return 0
    try:
        names = select(args.scenarios)
    except ValueError as exc:
        ap.error(str(exc))
    runtimes = [r.strip() for r in args.runtime.split(",") if r.strip()]
    if not runtimes or not set(runtimes) <= {"ns", "vm"}:
        ap.error(f"--runtime: ns, vm or ns,vm (got {args.runtime!r})")
    if args.server and len(runtimes) > 1:
        ap.error("--server serves one runtime; give one --runtime")

    if args.quiet_load is not None:
        _wait_quiet(args.quiet_load, args.quiet_wait)
    out_dir = args.out or Path(__file__).parent / "results" / dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    cmd = " ".join([prog, *(argv if argv is not None else sys.argv[1:])])
    results: dict[str, Any] = {"meta": report.machine_meta(cmd, "smoke" if args.smoke else "full"), "runs": {}}
    t0 = time.perf_counter()
    first = True
    with report.LoadSampler() as load:
        for runtime in runtimes:
            results["runs"][runtime] = _run_runtime(runtime, names, args, with_containers=first)
            first = False
    results["meta"]["load_after"] = report.loadavg()
    results["meta"]["load_during"] = load.summary()
    results["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    md = report.render_markdown(results)
    (out_dir / "results.md").write_text(md)
    chart = report.render_chart(results, out_dir / "chart.png")
    for run in results["runs"].values():
        if series := run.get("scenarios", {}).get("cluster-sim", {}).get("sim_series"):
            title = f"aenv cluster simulation, {results['meta']['date'][:10]}, {results['meta']['mode']} run"
            if not cluster_sim.render_chart(series, out_dir / "cluster-sim.png", title):
                console.print(f"no cluster-sim.png: {report.CHART_MISSING}")
    for run in results["runs"].values():
        if table := run.get("scenarios", {}).get("chaos", {}).get("chaos", {}).get("table"):
            (out_dir / "chaos.md").write_text(table + "\n")  # the counts table, as the run printed it
    if report.scale_series(results) and not report.render_scale_chart(results, out_dir / "scale.png"):
        console.print(f"no scale.png: {report.CHART_MISSING}")
    print(md)
    console.print(f"results in {out_dir}" + ("" if chart else f" (no chart: no row had a baseline beside it, or {report.CHART_MISSING})"))
    failed = [f"{rt}/{s}" for rt, run in results["runs"].items() for s in run.get("errors", {})]
    if failed:
        console.print(f"[red]error:[/] scenarios failed: {', '.join(failed)} (details in results.json)")
        return 1
    return 0


def _run_runtime(runtime: str, names: list[str], args: argparse.Namespace, with_containers: bool) -> dict[str, Any]:
    """Every selected scenario against one server of ``runtime``; a failing scenario is recorded, not fatal."""
    from aenv.client import AenvClient

    run: dict[str, Any] = {"scenarios": {}, "errors": {}}
    if set(names) <= NO_SERVER:
        return _run_serverless(runtime, names, args, run)
    if runtime == "vm":
        reason = _vm_unusable()
        if reason is not None:
            run["skipped"] = reason
            console.print(f"[yellow]warning:[/] vm runtime skipped: {reason}")
            return run
    with contextlib.ExitStack() as stack:
        load = stack.enter_context(report.LoadSampler())
        stack.callback(lambda: run.__setitem__("load_during", load.summary()))
        url, state_dir = stack.enter_context(_server(runtime, args.server, run))
        os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_VOLUME_API_URL=url,
                          E2B_API_KEY=os.environ.get("E2B_API_KEY", API_KEY), NO_PROXY="127.0.0.1,localhost")
        client = stack.enter_context(AenvClient(url, os.environ["E2B_API_KEY"]))
        ctx = Ctx(runtime, url, state_dir, args.smoke, client, network=json.loads(args.network) if args.network else None)
        with console.status(f"{runtime}: first sandbox (template, warm pool)"):
            t0 = time.perf_counter()
            _warm_up()
            run["first_create_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        if with_containers and args.baseline != "none":
            with console.status("starting baselines (private dockerd, runc)"):
                t0 = time.perf_counter()
                _open_containers(ctx, stack, args.baseline, run)
                run["baselines_start_s"] = round(time.perf_counter() - t0, 1)
        if args.smoke and ctx.docker is not None:
            run.setdefault("notes", []).append(
                "smoke run: no docker baseline for concurrent creates, snapshot, fork and the RL loop")
        if args.against:
            from bench.previous import previous_server

            with console.status(f"{runtime}: serving {args.against} beside this checkout"):
                try:  # a commit that cannot be served here costs its rows, not the run's
                    ctx.previous = stack.enter_context(previous_server(args.against, runtime))
                    _warm_up(ctx.previous.url)
                except Exception as exc:  # noqa: BLE001 - recorded in the run's notes
                    ctx.previous = None
                    run.setdefault("notes", []).append(f"--against {args.against} not served: {str(exc)[-600:]}")
                    console.print(f"[yellow]warning:[/] {runtime}: --against {args.against} not served: {exc}")
        if runtime == "vm" and "create" in names and state_dir is not None:
            from bench.vmboot import QemuColdBoot

            try:
                ctx.qemu = QemuColdBoot(state_dir)
            except Exception as exc:
                run.setdefault("notes", []).append(f"qemu cold boot baseline unavailable: {exc}")
        _run_scenarios(runtime, names, ctx, run)
    return run


def _run_scenarios(runtime: str, names: list[str], ctx: Ctx, run: dict[str, Any]) -> None:
    """Each scenario in turn: its rows (and wall time) into ``run``, or its error, which ends no other."""
    for name in names:
        with console.status(f"{runtime}: {name}"):
            t0 = time.perf_counter()
            try:
                run["scenarios"][name] = SCENARIOS[name](ctx)
                run["scenarios"][name]["wall_s"] = round(time.perf_counter() - t0, 1)
            except Exception as exc:
                run["errors"][name] = f"{type(exc).__name__}: {exc}"
                console.print(f"[red]error:[/] {runtime}/{name}: {exc}")
                console.print(traceback.format_exc(), markup=False, highlight=False)
        console.print(f"{runtime}: {name} done in {time.perf_counter() - t0:.1f} s")


def _run_serverless(runtime: str, names: list[str], args: argparse.Namespace, run: dict[str, Any]) -> dict[str, Any]:
    """Scenarios that start what they measure (``NO_SERVER``): no aenv server, warm-up or baselines."""
    ctx = Ctx(runtime, "", None, args.smoke, None)  # type: ignore[arg-type]
    with report.LoadSampler() as load:
        _run_scenarios(runtime, names, ctx, run)
    run["load_during"] = load.summary()
    return run


def _wait_quiet(limit: float, max_wait: float) -> None:
    """Until the 1-minute load average drops below ``limit``, or ``max_wait`` seconds passed (then it says so
    and goes on: the load is recorded in the results either way)."""
    deadline = time.monotonic() + max_wait
    with console.status(f"waiting for load < {limit}") as status:
        while (load := os.getloadavg()[0]) >= limit:
            if time.monotonic() > deadline:
                console.print(f"[yellow]warning:[/] load still {load:.2f} after {max_wait:.0f} s; running anyway")
                return
            status.update(f"waiting for load < {limit} (now {load:.2f})")
            time.sleep(5)
    console.print(f"load {os.getloadavg()[0]:.2f} < {limit}: starting")


def _warm_up(url: str | None = None) -> None:
    """One create + command + kill: builds the template (vm) and lets the warm pool fill."""
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=600) if url is None else Sandbox.create(
        "base", timeout=600, api_url=url, sandbox_url=url)
    sbx.commands.run("true")
    sbx.kill()
    time.sleep(1.0)


def _open_containers(ctx: Ctx, stack: contextlib.ExitStack, which: str, run: dict[str, Any]) -> None:
    from aenv.config import load_settings
    from aenv.images.bootstrap import ensure_base_rootfs
    from bench.baselines import DockerBaseline, RuncBaseline

    rootfs = ensure_base_rootfs(load_settings())
    classes: list[Any] = [DockerBaseline, RuncBaseline] if which == "docker" else [RuncBaseline]
    for cls in classes:
        try:
            b = cls(rootfs)
        except Exception as exc:
            run.setdefault("notes", []).append(f"{cls.name} baseline unavailable: {exc}")
            continue
        stack.callback(b.close)
        if cls is DockerBaseline:
            ctx.docker = b
        else:
            ctx.runc = b


@contextlib.contextmanager
def _server(runtime: str, url: str | None, run: dict[str, Any]) -> Iterator[tuple[str, Path | None]]:
    """The server under test: ``url`` as given, or one started in a temp dir, removed afterwards unless a
    scenario failed (then ``run["server_log"]`` says where its log is)."""
    if url:
        env_state = os.environ.get("AENV_STATE_DIR")
        yield url.rstrip("/"), Path(env_state) if env_state else None
        return
    extra = {"AENV_POOL_SIZE": "4", "AENV_KSM": "auto"}  # the defaults users get (test servers turn KSM off)
    tmp = Path(tempfile.mkdtemp(prefix="aenv-bench-"))
    server = start_server(tmp, runtime, extra)
    try:
        yield server.url, server.state_dir
    finally:
        stop_server(server)
        if runtime == "vm":
            discard_vm_state(server.state_dir)
        if run.get("errors"):
            run["server_log"] = str(server.log_path)
        elif str(tmp) not in Path("/proc/mounts").read_text():  # never rmtree through a live mount
            shutil.rmtree(tmp, ignore_errors=True)


def _vm_unusable() -> str | None:
    from aenv.config import load_settings
    from aenv.runtime.vm.runtime import unavailable_reason

    return unavailable_reason(load_settings())


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: everything was ended on the way out; no traceback
        sys.exit(130)
