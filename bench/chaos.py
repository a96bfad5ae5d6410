"""``chaos``: a GRPO-shaped run through a 3-node ``aenv cluster local`` while its parts fail (issue 39, 5).

The workload is the RL bench's: groups prepared once and forked into rollouts (``aenv.rl.run_group``), each
rollout writing its guess, holding for a while (the policy's "thinking") and scoring it in its sandbox,
under a heartbeat lease, a few groups at once with staggered starts so that some prepare and fork while
others roll out. One step per fault, each fault injected once that step's rollouts are in flight:

- ``node``: the machine of the node holding the most in-flight rollouts loses power (its Ray processes,
  its ``aenv serve`` and every process of its sandboxes SIGKILLed together);
- ``gateway``: the gateway crashes (SIGKILL) and is started again at once;
- ``redis``: Redis (the directory and Ray's GCS store) stops and starts again a few seconds later.

Every rollout must come back ``ok`` (its score checked against the one the scripted policy implies: a
wrong score is counted, never trusted), ``command_failed``, or ``infra_failed`` with a reason; one whose
group never answered (a hang past the step's deadline) or raised is *lost*. The counts table (ok /
infra-failed by reason / wrong / lost, per fault) is printed and kept in the results. Not in ``all``
(root, Ray, Redis, network namespaces): ``python -m bench --scenarios chaos`` (``--smoke``: 1 group of 4
per fault).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from aenv.testing.server import API_KEY, free_port
from bench.context import Ctx
from bench.rows import Row, scenario, value_row
from examples import grpo_loop

KEY = {"X-API-KEY": API_KEY}
FAULTS = ("node", "gateway", "redis")
SUBNET = "10.213.39.0/24"
HOLD_S = 4.0  # each rollout's in-flight command: where the fault lands
STAGGER_S = 2.0  # between the starts of a step's groups
REDIS_DOWN_S = 3.0
STEP_DEADLINE_S = 300.0  # a group not back by then is a hang: its rollouts count as lost
SCORE = "echo $(( 100 - ( $(cat /tmp/task/guess) - $(cat /tmp/task/.answer) ) ** 2 ))"


@dataclass
class Rollout:
    """One rollout's fate."""

    fault: str
    group: int
    member: int
    status: str  # ok | command_failed | infra_failed | error | wrong | lost
    reason: str = ""  # infra_failed, error, wrong, lost: why
    error: str = ""  # the raw error, as the outcome or the group's exception said it


def reason_of(error: str) -> str:
    """A short category for an infrastructure failure's message (the raw message is kept beside it)."""
    low = error.lower()
    table: list[tuple[tuple[str, ...], str]] = [
        (("node_down", "which is down since", "declared dead"), "its node is down"),
        (("store_unavailable", "cluster directory unreachable"), "cluster directory unavailable (503)"),
        (("killed or reached its end of life",), "sandbox gone mid-call (killed, or its node died)"),
        (("connection refused",), "connection refused"),
        (("connection reset", "unexpected eof", "ended before", "remoteprotocolerror", "broken pipe"),
         "connection dropped mid-call"),
        (("deadline", "timed out", "timeoutexception"), "timed out"),
        (("not found",), "not found"),
    ]
    for needles, label in table:
        if any(n in low for n in needles):
            return ("fork: " if low.startswith("fork:") else "") + label
    return error.split("\n", 1)[0][:80] or "no reason given"


class InFlight:
    """Counts rollouts inside their held command, and which sandboxes they run in; ``reached`` is set once
    ``want`` of them are in flight together."""

    def __init__(self, want: int) -> None:
        self.want = want
        self.now: dict[str, int] = {}
        self.reached = threading.Event()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def holding(self, sandbox_id: str) -> Any:
        with self._lock:
            self.now[sandbox_id] = 1
            if len(self.now) >= self.want:
                self.reached.set()
        try:
            yield
        finally:
            with self._lock:
                self.now.pop(sandbox_id, None)

    def sandboxes(self) -> list[str]:
        with self._lock:
            return list(self.now)


def expected_score(prompt: int, member: int) -> float:
    guess = grpo_loop.policy(prompt, member)
    return max(0.0, float(100 - (guess - grpo_loop.answer(prompt)) ** 2)) / 100


def make_rollout(prompt: int, flight: InFlight) -> Callable[[Any, int], float]:
    def one(ep: Any, member: int) -> float:
        ep.run(f"echo {grpo_loop.policy(prompt, member)} > /tmp/task/guess")
        with flight.holding(ep.sandbox_id):
            ep.run(f"sleep {HOLD_S}")
        out = ep.run(SCORE).stdout.strip()
        return max(0.0, float(out)) / 100
    return one


def run_step(fault: str, groups: int, size: int, inject: Callable[[InFlight], str], run: str,
             lease: Any) -> tuple[list[Rollout], str]:
    """``groups`` groups of ``size`` rollouts, staggered; ``inject`` once half a group is in flight (or after
    a minute, whatever is then in flight). Returns every rollout's fate and what the fault did."""
    from aenv.rl import run_group

    flight = InFlight(max(1, size // 2))  # the first group rolls out, the next ones prepare and fork
    results: dict[int, Any] = {}

    def one(g: int) -> None:
        time.sleep(g * STAGGER_S)
        prompt = hash((fault, g)) % 97
        try:
            results[g] = (prompt, run_group("base", size, make_rollout(prompt, flight), keep=0, run=run,
                                            group_id=f"{run}-{fault}-g{g}", timeout=120, lease=lease,
                                            prepare=lambda ep: ep.run(grpo_loop.prepare_command(prompt))))
        except BaseException as exc:  # noqa: BLE001 - counted: the group's rollouts are lost
            results[g] = (prompt, exc)

    threads = [threading.Thread(target=one, args=(g,), name=f"chaos-{fault}-g{g}", daemon=True) for g in range(groups)]
    deadline = time.monotonic() + STEP_DEADLINE_S
    for t in threads:
        t.start()
    flight.reached.wait(60)
    what = inject(flight)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    out: list[Rollout] = []
    for g in range(groups):
        got = results.get(g)
        if got is None:
            out += [Rollout(fault, g, i, "lost", f"hang: the group did not answer in {STEP_DEADLINE_S:.0f} s")
                    for i in range(size)]
        elif isinstance(got[1], BaseException):
            err = f"{type(got[1]).__name__}: {got[1]}"
            out += [Rollout(fault, g, i, "lost", "the group raised", err) for i in range(size)]
        else:
            out += [_fate(fault, g, got[0], m) for m in got[1].members]
            out += [Rollout(fault, g, i, "lost", "no member for this rollout")
                    for i in range(size) if i not in {m.index for m in got[1].members}]
    return out, what


def _fate(fault: str, g: int, prompt: int, m: Any) -> Rollout:
    status, error = m.outcome.status, m.outcome.error or ""
    if status == "infra_failed":
        return Rollout(fault, g, m.index, status, reason_of(error), error)
    if status == "ok" and (m.score is None or abs(m.score - expected_score(prompt, m.index)) > 1e-9):
        return Rollout(fault, g, m.index, "wrong", f"score {m.score}, expected {expected_score(prompt, m.index)}")
    if status == "error":
        return Rollout(fault, g, m.index, status, error.split("\n", 1)[0][:120] or "no reason given", error)
    return Rollout(fault, g, m.index, status, "", error)


class Injector:
    """The faults, on a running ``LocalCluster``; each returns what it did, for the notes."""

    def __init__(self, c: Any) -> None:
        self.c = c
        self.killed: list[str] = []

    def __call__(self, fault: str) -> Callable[[InFlight], str]:
        return {"node": self.node, "gateway": self.gateway, "redis": self.redis}[fault]

    def node(self, flight: InFlight) -> str:
        import redis

        from aenv.directory import keys

        r = redis.Redis.from_url(self.c.redis.url, decode_responses=True)
        held = flight.sandboxes()
        try:
            where = collections.Counter(str(r.hget(keys.sandbox_key(s), "node")) for s in held)
        finally:
            r.close()
        live = [self.c.topo.name(i) for i in range(self.c.nodes) if self.c.topo.name(i) not in self.killed]
        name = max(live, key=lambda n: (where.get(n, 0), n))
        i = [self.c.topo.name(k) for k in range(self.c.nodes)].index(name)
        procs = self.c.kill_machine(i)
        self.killed.append(name)
        fenced = _wait(lambda: _node_state(self.c, name) == "dead", 120)
        return (f"node {name} (with {where.get(name, 0)} of {len(held)} rollouts in flight) lost "
                f"power: {procs} processes SIGKILLed; fenced after {fenced:.1f} s")

    def gateway(self, flight: InFlight) -> str:
        n = len(flight.sandboxes())
        self.c.restart_gateway(hard=True)
        back = _wait(lambda: _node_state(self.c, None) == "up", 120)
        return f"gateway SIGKILLed with {n} rollouts in flight, started again: answering after {back:.1f} s"

    def redis(self, flight: InFlight) -> str:
        n = len(flight.sandboxes())
        t0 = time.monotonic()
        self.c.restart_redis(down=REDIS_DOWN_S)
        return f"Redis stopped with {n} rollouts in flight, started again after {time.monotonic() - t0:.1f} s"


def _node_state(c: Any, name: str | None) -> str:
    """A node's state as the gateway reports it; ``name=None``: "up" when the gateway answers with every
    live node up."""
    try:
        nodes = httpx.get(c.url + "/nodes", headers=KEY, timeout=2, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return "unreachable"
    if name is None:
        return "up" if nodes and all(n["state"] in ("up", "dead") for n in nodes) else "starting"
    return next((str(n["state"]) for n in nodes if n["nodeID"] == name), "unknown")


def _wait(cond: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``cond`` held (``timeout`` if it never did)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and not cond():
        time.sleep(0.1)
    return time.monotonic() - t0


def tally(rollouts: list[Rollout]) -> dict[str, Any]:
    """Counts overall and per fault: ok, command_failed, infra_failed (by reason), error, wrong, lost."""
    def counts(rs: list[Rollout]) -> dict[str, Any]:
        by = collections.Counter(r.status for r in rs)
        reasons = collections.Counter(r.reason for r in rs if r.status == "infra_failed")
        return {"rollouts": len(rs), "ok": by["ok"], "command_failed": by["command_failed"],
                "infra_failed": by["infra_failed"], "infra_reasons": dict(reasons.most_common()),
                "error": by["error"], "wrong": by["wrong"], "lost": by["lost"],
                "unexplained": sum(1 for r in rs if r.status != "ok" and r.status != "command_failed" and not r.reason)}
    return {"all": counts(rollouts), **{f: counts([r for r in rollouts if r.fault == f]) for f in FAULTS}}


def counts_table(t: dict[str, Any]) -> str:
    lines = ["| fault | rollouts | ok | infra-failed | by reason | error | wrong | lost |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for name in (*FAULTS, "all"):
        c = t[name]
        why = "; ".join(f"{k}: {v}" for k, v in c["infra_reasons"].items()) or "-"
        lines.append(f"| {name} | {c['rollouts']} | {c['ok']} | {c['infra_failed']} | {why} | {c['error']} | "
                     f"{c['wrong']} | {c['lost']} |")
    return "\n".join(lines)


def chaos(ctx: Ctx) -> dict[str, Any]:
    """A GRPO-shaped run (groups × forked rollouts) through a 3-node cluster while a node dies, the gateway
    restarts and Redis restarts: every rollout ok or an infra failure with a reason; lost must be 0."""
    from rich.console import Console

    from bench.cluster import _missing

    if (missing := _missing()) is not None:
        return scenario("chaos: GRPO-shaped run through a 3-node cluster under faults", [], [f"skipped: {missing}"])
    from aenv.cluster.local import LocalCluster
    from aenv.rl import Lease
    from aenv.testing.gateway import sdk_env

    groups, size = (1, 4) if ctx.smoke else (3, 8)
    port = free_port()
    c = LocalCluster(3, port, Path(f"/tmp/aenv-chaos{port}"), SUBNET, {"AENV_API_KEYS": API_KEY, "AENV_POOL_SIZE": "1"})
    rollouts: list[Rollout] = []
    notes: list[str] = []
    t0 = time.perf_counter()
    c.start(timeout=600)
    try:
        start_ms = (time.perf_counter() - t0) * 1000
        inject = Injector(c)
        run = f"chaos-{uuid.uuid4().hex[:6]}"
        with sdk_env(c.url), Lease(ttl=30, name=run) as lease:
            for fault in FAULTS:
                t1 = time.perf_counter()
                got, what = run_step(fault, groups, size, inject(fault), run, lease)
                rollouts += got
                notes.append(f"{fault}: {what}; step {time.perf_counter() - t1:.1f} s")
    finally:
        c.close()
    t = tally(rollouts)
    table = counts_table(t)
    Console(stderr=True).print(table, markup=False, highlight=False)
    system = f"{ctx.system} cluster ×3"
    rows: list[Row] = [value_row("chaos: cluster local start → every node up", system, start_ms, 1, "ms")]
    for name in (*FAULTS, "all"):
        cnt = t[name]
        label = "all faults" if name == "all" else f"{name} fault"
        why = "; ".join(f"{k}: {v}" for k, v in cnt["infra_reasons"].items())
        rows += [value_row(f"chaos, {label}: rollouts ok", system, cnt["ok"], cnt["rollouts"], "count"),
                 value_row(f"chaos, {label}: infra-failed with a reason", system, cnt["infra_failed"], cnt["rollouts"],
                           "count", why),
                 value_row(f"chaos, {label}: lost (hung, raised or unscored)", system,
                           cnt["lost"] + cnt["error"] + cnt["wrong"] + cnt["unexplained"], cnt["rollouts"], "count")]
    notes.append(f"{groups} groups × {size} rollouts per fault, each holding {HOLD_S:.0f} s in flight; groups start "
                 f"{STAGGER_S:.0f} s apart; lease ttl 30 s")
    out = scenario("chaos: GRPO-shaped run through a 3-node cluster while a node dies, the gateway and Redis restart",
                   rows, notes)
    out["chaos"] = {"counts": t, "table": table, "rollouts": [asdict(r) for r in rollouts]}
    return out
