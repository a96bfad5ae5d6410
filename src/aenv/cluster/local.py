"""``aenv cluster local``: a whole cluster on this machine, each node in its own network namespace.

Start order: the network (``netns.Topology``), Redis on the control address (directory and Ray's GCS
store), the Ray head (``RAY_REDIS_ADDRESS``: GCS fault tolerance), one Ray worker node per namespace
(label ``aenv-node=n<i>``), the controller (which places an agent per node; each agent starts that
node's ``aenv serve --cluster-redis``), then the gateway on 127.0.0.1. ``close`` undoes it in reverse:
every sandbox killed through its node, the gateway, the servers (by their pidfiles), the Ray nodes
(``ray start --block`` processes this one started, then whatever still runs from their temp dirs, by
pid), Redis, the namespaces and the bridge, the state directory.

This process makes itself a child subreaper, so the servers that the agents double-fork (and that
Ray's worker clean-up must never own) are reaped here when they exit, not left as zombies.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from aenv.cluster.agent import ServeSpec, launch, pid_alive, read_pid, stop, wait_healthy
from aenv.cluster.controller import fill
from aenv.cluster.netns import Topology
from aenv.cluster.procs import kill_all, machine_pids, stop_process
from aenv.cluster.redis_proc import RedisProc, start_redis

log = logging.getLogger("aenv.cluster")

OBJECT_STORE = 80 << 20  # bytes per Ray node (Ray's minimum is 75 MiB; its default is 30% of RAM per node)
# Ray's node death detection, tightened for one machine: a node is declared dead ~1.5-3 s after it stops
# answering (defaults: 3 s period, 10 s timeout, 5 failures).
HEALTH_ENV = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
              "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"}  # fmt: skip
# The GCS gives up on Redis after 5 failed tries (~2.5 s: 100 ms doubling to 1 s) and exits, which takes the
# whole head down with it (`ray start --block` kills the rest): a Redis restart would end the cluster's
# supervision. 120 tries capped at 1 s ride out about two minutes of Redis being away.
REDIS_PATIENCE_ENV = {"RAY_num_redis_request_retries": "120", "RAY_redis_retry_max_ms": "1000"}
_PR_SET_CHILD_SUBREAPER = 36


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_children() -> None:
    """Reap whatever exited among this process's children and adopted orphans (non-blocking)."""
    with contextlib.suppress(ChildProcessError):
        while True:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return


@dataclass
class LocalCluster:
    nodes: int
    port: int
    root: Path
    subnet: str = "10.213.0.0/24"
    env: dict[str, str] = field(default_factory=dict)  # extra AENV_* for the nodes (api keys, pool size)
    runtime: str = "ns"
    tls: tuple[Path, Path, Path] | None = None  # the gateway's HTTPS: certificate, key, and the CA that signed it

    def __post_init__(self) -> None:
        self.topo = Topology(str(self.port), self.nodes, self.subnet)
        self.redis: RedisProc | None = None
        self.ray_procs: list[subprocess.Popen[bytes]] = []  # head first; None-free
        self.gateway: subprocess.Popen[bytes] | None = None
        self.gcs = ""
        self._head: tuple[list[str], dict[str, str]] = ([], {})
        self.specs: list[ServeSpec] = []
        self._logs: list[Any] = []
        self._owns_root = False

    # ---- start ------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def _verify(self) -> str | bool:
        return str(self.tls[2]) if self.tls else True

    def node_url(self, i: int) -> str:
        return f"http://{self.topo.node_ip(i)}:8000"

    def _popen(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        logf = (self.root / f"{name}.log").open("ab")
        self._logs.append(logf)
        return subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def start(self, timeout: float = 600.0) -> None:
        """Everything, in order; returns once the gateway sees every node up. On failure, closes."""
        try:
            self._start(time.monotonic() + timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, deadline: float) -> None:
        if self.root.exists() and any(self.root.iterdir()):
            raise RuntimeError(f"{self.root} exists and is not empty: remove it or give another state directory")
        self.root.mkdir(parents=True, exist_ok=True)
        self._owns_root = True  # from here on close() removes it
        become_subreaper()
        self.topo.create()
        ctl = self.topo.control_ip
        self.redis = start_redis(self.root / "redis", host=ctl)
        gcs_port = _free_port(ctl)
        self.gcs = f"{ctl}:{gcs_port}"
        ray = str(Path(sys.executable).with_name("ray"))
        common = ["--num-cpus=1", f"--object-store-memory={OBJECT_STORE}", "--disable-usage-stats", "--block"]
        head = [ray, "start", "--head", f"--node-ip-address={ctl}", f"--port={gcs_port}", "--include-dashboard=false",
                f"--temp-dir={self.root / 'ray-head'}", "--labels=aenv-role=control", *common]  # fmt: skip
        self._head = (head, {**HEALTH_ENV, **REDIS_PATIENCE_ENV, "RAY_REDIS_ADDRESS": self.redis.address})
        self.ray_procs.append(self._popen(head, "ray-head", self._head[1]))
        self._wait_gcs(deadline)
        for i in range(self.nodes):
            self.ray_procs.append(self._popen(self._node_argv(i), f"ray-{self.topo.name(i)}"))
        self._run_driver("start", deadline)
        self.start_gateway()
        self._wait_nodes_up(deadline)

    def _node_argv(self, i: int) -> list[str]:
        ray = str(Path(sys.executable).with_name("ray"))
        argv = [ray, "start", f"--address={self.gcs}", f"--node-ip-address={self.topo.node_ip(i)}",
                f"--temp-dir={self.root / ('ray-' + self.topo.name(i))}", "--include-log-monitor=false",
                f"--labels=aenv-node={self.topo.name(i)},aenv-role=node", "--num-cpus=1",
                f"--object-store-memory={OBJECT_STORE}", "--disable-usage-stats", "--block"]  # fmt: skip
        return self.topo.exec_argv(i, argv)

    def start_gateway(self) -> None:
        assert self.redis is not None
        gw = [sys.executable, "-m", "aenv.cli.main", "gateway", "--host", "127.0.0.1", "--port", str(self.port),
              "--redis", self.redis.url, "--probe-interval", "0.5"]  # fmt: skip
        if self.tls:
            gw += ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])]
        self.gateway = self._popen(gw, "gateway", self.env)

    def rejoin_node(self, i: int) -> None:
        """Node ``i``'s Ray node is started again (what a host's supervisor does after its raylet exited or
        was killed): a new Ray node, so the controller places a new agent there."""
        old = self.ray_node_proc(i)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(old.pid, signal.SIGKILL)
        old.wait(timeout=30)
        self._kill_leftovers(str(self.root / ("ray-" + self.topo.name(i))))
        self.ray_procs[1 + i] = self._popen(self._node_argv(i), f"ray-{self.topo.name(i)}")

    def serve_spec(self) -> dict[str, Any]:
        """The controller's template: ``{node}`` and ``{ip}`` are filled per node."""
        assert self.redis is not None
        node_dir = str(self.root / "{node}")
        env = {"AENV_RUNTIME": self.runtime, "AENV_STATE_DIR": node_dir + "/state", "AENV_HOST": "{ip}",
               "AENV_PORT": "8000", "AENV_CLUSTER_REDIS": self.redis.url, "AENV_CLUSTER_NODE_ID": "{node}",
               "AENV_CLUSTER_URL": "http://{ip}:8000",
               # one store for every node: a snapshot or a published pause runs again on any of them
               "AENV_SNAPSHOT_STORE": f"file://{self.root / 'snapshot-store'}", **self.env}  # fmt: skip
        env.update({k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "AENV_CACHE_DIR")})
        spec = ServeSpec(node="{node}", argv=[sys.executable, "-m", "aenv.cli.main", "serve"], url="http://{ip}:8000",
                         pidfile=node_dir + "/serve.pid", log=node_dir + "/serve.log", env=env,
                         redis=self.redis.url)  # fmt: skip
        return spec.to_dict()

    def _run_driver(self, what: str, deadline: float) -> None:
        """A short Ray driver (``python -m aenv.cluster.driver``): creates or stops the controller."""
        argv = [sys.executable, "-m", "aenv.cluster.driver", what, "--ray", self.gcs]
        if what == "start":
            assert self.redis is not None
            argv += ["--redis", self.redis.url, "--spec", json.dumps(self.serve_spec())]
        left = max(10.0, deadline - time.monotonic())
        with (self.root / f"driver-{what}.log").open("ab") as logf:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, timeout=left,
                           check=True)  # fmt: skip

    def _wait_gcs(self, deadline: float) -> None:
        host, port = self.gcs.rsplit(":", 1)
        while time.monotonic() < deadline:
            if self.ray_procs[0].poll() is not None:
                raise RuntimeError(f"the Ray head exited:\n{self._tail('ray-head')}")
            with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
                return
            time.sleep(0.2)
        raise TimeoutError("the Ray head did not start")

    def _wait_nodes_up(self, deadline: float) -> None:
        want = {self.topo.name(i) for i in range(self.nodes)}
        while time.monotonic() < deadline:
            reap_children()
            if self.gateway is not None and self.gateway.poll() is not None:
                raise RuntimeError(f"the gateway exited:\n{self._tail('gateway')}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                got = httpx.get(self.url + "/nodes", headers=self._key(), timeout=2, trust_env=False,
                                verify=self._verify).json()  # fmt: skip
                if {n["nodeID"] for n in got if n["state"] == "up"} >= want:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"not every node came up; see the logs in {self.root}")

    def _key(self) -> dict[str, str]:
        keys = [k for k in self.env.get("AENV_API_KEYS", "").split(",") if k and not k.startswith("sha256:")]
        return {"X-API-KEY": keys[0]} if keys else {}

    def _tail(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    # ---- state --------------------------------------------------------------------------------------
    def serve_pid(self, i: int) -> int | None:
        return read_pid(str(self.root / self.topo.name(i) / "serve.pid"))

    def ray_node_proc(self, i: int) -> subprocess.Popen[bytes]:
        return self.ray_procs[1 + i]

    @contextlib.contextmanager
    def head_down(self, timeout: float = 120.0) -> Iterator[None]:
        """The head dies (its process group SIGKILLed: GCS, its raylet, what ran there) for the block's
        duration, then starts again on the same address with the same Redis: the GCS recovers its tables
        from Redis and the worker nodes reconnect (GCS fault tolerance)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.ray_procs[0].pid, signal.SIGKILL)
        self.ray_procs[0].wait(timeout=30)
        self._kill_leftovers(str(self.root / "ray-head"))
        # On one machine ``ray start --head`` takes the worker raylets' --gcs-address for a head still
        # running, unless the last head's address file is gone (on real machines the workers are elsewhere).
        (self.root / "ray-head" / "ray_current_cluster").unlink(missing_ok=True)
        try:
            yield
        finally:
            self.ray_procs[0] = self._popen(self._head[0], "ray-head", self._head[1])
            self._wait_gcs(time.monotonic() + timeout)

    # ---- stop ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove everything this cluster made; each step tolerates what is already gone."""
        if self.gateway is not None:
            stop_process(self.gateway)
        for i in range(self.nodes):
            self._stop_node_server(i)
        self._stop_ray()
        if self._owns_root:
            self._kill_leftovers()
        if self.redis is not None:
            self.redis.stop()
        self.topo.close()
        for f in self._logs:
            f.close()
        reap_children()
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def node_spec(self, i: int) -> ServeSpec:
        return ServeSpec(**fill(self.serve_spec(), node=self.topo.name(i), ip=self.topo.node_ip(i)))

    def kill_node(self, i: int) -> None:
        """Node ``i``'s machine dies: its Ray processes and its server SIGKILLed (its sandboxes stay,
        unreachable, until ``close`` or a restart of its server kills them)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.ray_node_proc(i).pid, signal.SIGKILL)
        self.ray_node_proc(i).wait(timeout=30)
        pid = self.serve_pid(i)
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        reap_children()

    def kill_machine(self, i: int) -> int:
        """Node ``i``'s machine loses power: its Ray processes, its server and every process of its sandboxes
        SIGKILLed together (``kill_node`` leaves the sandboxes running). Returns how many processes died."""
        from aenv.runtime.ns.cgroups import scope_for

        node_dir = self.root / self.topo.name(i)
        sandboxes = f"/aenv/{scope_for(node_dir / 'state')}/"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.ray_node_proc(i).pid, signal.SIGKILL)
        killed: set[int] = set()
        for _ in range(3):  # what forked while the last round was being killed
            pids = machine_pids(self.serve_pid(i), sandboxes, f"{node_dir}/") - killed
            if not pids:
                break
            kill_all(pids)
            killed |= pids
        self.ray_node_proc(i).wait(timeout=30)
        reap_children()
        return len(killed)

    def restart_gateway(self, hard: bool = True) -> None:
        """The gateway crashes (SIGKILL; ``hard=False``: stopped gracefully) and is started again at once,
        as its supervisor would; it finds the nodes and bindings in Redis."""
        assert self.gateway is not None
        if hard:
            self.gateway.kill()
            self.gateway.wait(timeout=30)
        else:
            stop_process(self.gateway)
        self.start_gateway()

    def restart_redis(self, down: float = 0.0) -> None:
        """Redis stops (SIGTERM: it finishes its append-only file) and ``down`` seconds later starts again
        on the same address with the same data, as a restart of its service does."""
        assert self.redis is not None
        old = self.redis
        old.stop()
        time.sleep(down)
        self.redis = start_redis(old.log_path.parent, host=old.host, port=old.port)

    def _stop_node_server(self, i: int) -> None:
        """Kill the node's sandboxes through its server (started again, outside Ray, if it is gone:
        it adopts them first), then stop it."""
        if self.redis is None or not self._owns_root or not (self.root / self.topo.name(i)).is_dir():
            return
        spec = self.node_spec(i)
        pid = self.serve_pid(i)
        if pid is None or not pid_alive(pid):
            try:
                launch(spec)
                pid = wait_healthy(spec, timeout=120)
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                log.warning("node %s: its server could not be started to kill its sandboxes: %s", spec.node, exc)
                return
        self._kill_sandboxes(i)
        stop(pid)

    def _stop_ray(self) -> None:
        """Each ``ray start --block`` with its process group (raylet, workers, agents): SIGTERM to all,
        up to 5 s, then SIGKILL."""
        for proc in reversed(self.ray_procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in reversed(self.ray_procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            stop_process(proc)

    def _kill_sandboxes(self, i: int) -> None:
        url, key = self.node_url(i), self._key()
        with contextlib.suppress(httpx.HTTPError, ValueError):
            for s in httpx.get(url + "/v2/sandboxes", headers=key, timeout=5, trust_env=False).json():
                httpx.delete(f"{url}/sandboxes/{s['sandboxID']}", headers=key, timeout=30, trust_env=False)

    def _kill_leftovers(self, marker: str = "") -> None:
        """Ray processes that outlived their ``ray start`` (their command lines name this cluster's temp
        dirs, which no other process does): killed by pid."""
        marker = (marker or str(self.root)).rstrip("/") + "/"  # /tmp/aenvc4090/ must not match /tmp/aenvc40901/
        deadline = time.monotonic() + 10
        while (pids := _pids_naming(marker)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
            reap_children()


def _pids_naming(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line contains ``marker``."""
    out = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit() or int(proc_dir.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmd = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if marker in cmd and pid_alive(int(proc_dir.name)):
                out.append(int(proc_dir.name))
    return out
