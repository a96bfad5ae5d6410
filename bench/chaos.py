"""``chaos``: a GRPO-shaped run through a 3-node ``aenv cluster local`` while its parts fail (issue 39, 5).

The workload is the RL bench's: groups prepared once and forked into rollouts (``aenv.rl.run_group``), each
rollout writing its guess, holding for a while (the policy's "thinking") and scoring it in its sandbox,
under a heartbeat lease. Groups are pipelined as an asynchronous trainer runs them: each starts once the
one before is rolling out. One step per fault, each landing at its point of group 1 while group 0 rolls out:

- ``redis``, while group 1 creates its sandbox: Redis (the directory and Ray's GCS store) stops and starts
  again a few seconds later;
- ``gateway``, while group 1 forks: the gateway crashes (SIGKILL) and is started again at once;
- ``node``, while group 1 rolls out: the machine of the node holding the most in-flight rollouts loses
  power (its Ray processes, its ``aenv serve`` and every process of its sandboxes SIGKILLed together).
  Last, so that it also shows Ray still fencing a dead node after the other two faults.

Every rollout must come back ``ok`` (its score checked against the one the scripted policy implies: a
wrong score is counted, never trusted), ``command_failed``, or ``infra_failed`` with a reason; one whose
group never answered (a hang past the step's deadline) or raised is *lost*. The counts table (ok /
infra-failed by reason / wrong / lost, per fault) is printed and kept in the results. Not in ``all``
(root, Ray, Redis, network namespaces): ``python -m bench --scenarios chaos`` (``--smoke``: 2 groups of 3
per fault).
"""

from __future__ import annotations

import collections
import contextlib
import sys
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
FAULTS = ("redis", "gateway", "node")  # the node last: Ray still fences it after the other two
# Where each fault lands, with group 0 rolling out: (the event, of which group): group 1 creating, forking, rolling out
POINTS = {"redis": ("started", 1), "gateway": ("prepared", 1), "node": ("rolling", 1)}
POINT_WORDS = {"started": "creating its sandbox", "prepared": "forking", "rolling": "rolling out"}
SUBNET = "10.213.39.0/24"
HOLD_S = 4.0  # each rollout's in-flight command: where the fault lands
REDIS_DOWN_S = 3.0
FORK_IN_FLIGHT_S = 0.2  # after a group's preparation: its fork request sent, the node still forking
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
        (("node_down", "which is down since", "declared dead", "took no connection"), "its node is down"),
        (("store_unavailable", "cluster directory unreachable"), "cluster directory unavailable (503)"),
        (("killed or reached its end of life",), "sandbox gone mid-call (killed, or its node died)"),
        (("connection reset", "unexpected eof", "ended before", "remoteprotocolerror", "broken pipe"),
         "connection dropped mid-call"),
        (("connection refused",), "connection refused"),
        (("deadline", "timed out", "timeoutexception"), "timed out"),
        (("not found",), "not found"),
    ]
    for needles, label in table:
        if any(n in low for n in needles):
            return ("fork: " if low.startswith("fork:") else "") + label
    return error.split("\n", 1)[0][:80] or "no reason given"


class Flight:
    """What a step's groups are doing: per group, events for started (its parent's create is in flight),
    prepared (its fork is in flight) and rolling (half its rollouts are inside their held command); and
    which sandboxes hold a rollout in flight right now."""

    def __init__(self, groups: int, size: int) -> None:
        self.size = size
        self.events = {what: [threading.Event() for _ in range(groups)] for what in ("started", "prepared", "rolling")}
        self.ended = [threading.Event() for _ in range(groups)]
        self.now: dict[str, int] = {}  # sandbox -> group
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def holding(self, g: int, sandbox_id: str) -> Any:
        with self._lock:
            self.now[sandbox_id] = g
            if sum(1 for x in self.now.values() if x == g) >= max(1, self.size // 2):
                self.events["rolling"][g].set()
        try:
            yield
        finally:
            with self._lock:
                self.now.pop(sandbox_id, None)

    def sandboxes(self) -> list[str]:
        with self._lock:
            return list(self.now)

    def wait(self, what: str, g: int, timeout: float) -> bool:
        """Until group ``g`` reached ``what`` or ended (then False), at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.events[what][g].wait(0.05):
                return True
            if self.ended[g].is_set():
                return False
        return False


def expected_score(prompt: int, member: int) -> float:
    guess = grpo_loop.policy(prompt, member)
    return max(0.0, float(100 - (guess - grpo_loop.answer(prompt)) ** 2)) / 100


def make_rollout(prompt: int, g: int, flight: Flight) -> Callable[[Any, int], float]:
    def one(ep: Any, member: int) -> float:
        ep.run(f"echo {grpo_loop.policy(prompt, member)} > /tmp/task/guess")
        with flight.holding(g, ep.sandbox_id):
            ep.run(f"sleep {HOLD_S}")
        out = ep.run(SCORE).stdout.strip()
        return max(0.0, float(out)) / 100
    return one


def run_step(fault: str, groups: int, size: int, inject: Callable[[Flight], str], run: str,
             lease: Any) -> tuple[list[Rollout], str]:
    """``groups`` groups of ``size`` rollouts, pipelined as an asynchronous trainer runs them: each group
    starts once the one before is rolling out. The fault lands at its point (``POINTS``) of group 1 (of
    group 0 when there is one group), with group 0 rolling out. Returns each rollout's fate and what the
    fault did."""
    from aenv.rl import run_group

    flight = Flight(groups, size)
    results: dict[int, Any] = {}

    def one(g: int) -> None:
        prompt = FAULTS.index(fault) * 10 + g
        if g > 0:
            flight.wait("rolling", g - 1, STEP_DEADLINE_S)

        def prepare(ep: Any) -> None:
            ep.run(grpo_loop.prepare_command(prompt))
            flight.events["prepared"][g].set()

        flight.events["started"][g].set()
        try:
            results[g] = (prompt, run_group("base", size, make_rollout(prompt, g, flight), keep=0, run=run,
                                            group_id=f"{run}-{fault}-g{g}", timeout=120, lease=lease, prepare=prepare))
        except BaseException as exc:  # noqa: BLE001 - counted: the group's rollouts are lost
            results[g] = (prompt, exc)
        finally:
            flight.ended[g].set()

    threads = [threading.Thread(target=one, args=(g,), name=f"chaos-{fault}-g{g}", daemon=True) for g in range(groups)]
    deadline = time.monotonic() + STEP_DEADLINE_S
    for t in threads:
        t.start()
    point, at = POINTS[fault] if groups > 1 else ("rolling", 0)
    on_time = (groups == 1 or flight.wait("rolling", 0, 120)) and flight.wait(point, at, 120)
    time.sleep(FORK_IN_FLIGHT_S if point == "prepared" else 0.0)
    done = inject(flight)
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
    where = f"group {at} {POINT_WORDS[point]}" + ("" if on_time else " (missed: that point never came)")
    return out, f"at {where}: {done}"


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

    def __call__(self, fault: str) -> Callable[[Flight], str]:
        return {"node": self.node, "gateway": self.gateway, "redis": self.redis}[fault]

    def node(self, flight: Flight) -> str:
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

    def gateway(self, flight: Flight) -> str:
        n = len(flight.sandboxes())
        self.c.restart_gateway(hard=True)
        back = _wait(lambda: _node_state(self.c, None) == "up", 120)
        return f"gateway SIGKILLed with {n} rollouts in flight, started again: answering after {back:.1f} s"

    def redis(self, flight: Flight) -> str:
        n = len(flight.sandboxes())
        t0 = time.monotonic()
        self.c.restart_redis(down=REDIS_DOWN_S)
        return f"Redis stopped with {n} rollouts in flight, started again after {time.monotonic() - t0:.1f} s"


def left_running(url: str, run: str) -> list[str] | None:
    """The ``rollout`` tags of the run's sandboxes the gateway still lists (on live nodes); None: it did not
    answer. A group ends every sandbox it knows of; the children of a fork whose answer was cut off carry
    their parent's tag (``<group>-parent``) and end with their timeout or the lease."""
    try:
        got = httpx.get(f"{url}/v2/sandboxes", params={"metadata": f"run={run}"}, headers=KEY, timeout=30,
                        trust_env=False)  # fmt: skip
        return [str((s.get("metadata") or {}).get("rollout")) for s in got.json()] if got.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


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
    from bench.cluster import _missing

    if (missing := _missing()) is not None:
        return scenario("chaos: GRPO-shaped run through a 3-node cluster under faults", [], [f"skipped: {missing}"])
    from aenv.cluster.local import LocalCluster
    from aenv.rl import Lease
    from aenv.testing.gateway import sdk_env

    groups, size = (2, 3) if ctx.smoke else (3, 8)
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
            left = left_running(c.url, run)  # before the lease ends: what the groups did not kill
    finally:
        c.close()
    notes.append(f"sandboxes of the run still running after its last group, before its lease ended: "
                 f"{'?' if left is None else len(left)}" + (f" (tagged {sorted(set(left))}: children of a fork whose "
                                                            "answer was cut off; the lease ended them)" if left else ""))
    t = tally(rollouts)
    table = counts_table(t)
    print(table, file=sys.stderr, flush=True)  # as it is, unwrapped
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
    notes.append(f"{groups} groups × {size} rollouts per fault, each holding {HOLD_S:.0f} s in flight; a group starts "
                 "once the one before is rolling out; lease ttl 30 s")
    out = scenario("chaos: GRPO-shaped run through a 3-node cluster while a node dies, the gateway and Redis restart",
                   rows, notes)
    out["chaos"] = {"counts": t, "table": table, "left_running": left, "rollouts": [asdict(r) for r in rollouts]}
    return out
