"""Baselines measured in the same run as aenv: ``docker run`` (Debian's docker.io engine, started privately by
the bench when installed) and ``runc run`` of the same root filesystem.

The private dockerd runs with ``--iptables=false --bridge=none`` and its own data/exec roots, so it changes
nothing on the host; containers run with ``--network none``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from aenv.testing.leftovers import processes
from aenv.testing.procs import exit_with_parent


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


class RuncBaseline:
    """``runc run`` of /bin/true in the rootfs: create, start, wait, delete — a container's full cycle."""

    name = "runc run"

    def __init__(self, rootfs: Path) -> None:
        self.exe = shutil.which("runc")
        if self.exe is None:
            raise RuntimeError("runc not installed")
        self.dir = Path(tempfile.mkdtemp(prefix="aenv-bench-runc-"))
        subprocess.run([self.exe, "spec"], cwd=self.dir, check=True)
        spec = json.loads((self.dir / "config.json").read_text())
        spec["root"] = {"path": str(rootfs), "readonly": True}
        spec["process"]["terminal"] = False
        spec["process"]["args"] = ["/bin/true"]
        (self.dir / "config.json").write_text(json.dumps(spec))
        self._n = 0

    def once(self) -> float:
        self._n += 1
        cid = f"aenvbench{os.getpid()}x{self._n}"
        return _timed(
            lambda: subprocess.run(
                [self.exe or "runc", "run", "--bundle", str(self.dir), cid],
                check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        )

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class DockerBaseline:
    """``docker run --rm --network none IMAGE /bin/true`` against a private dockerd."""

    name = "docker run"

    def __init__(self, rootfs: Path) -> None:
        if not (shutil.which("dockerd") and shutil.which("docker")):
            raise RuntimeError("docker.io not installed (apt-get install docker.io)")
        self.root = Path(tempfile.mkdtemp(prefix="aenv-bench-docker-"))
        self.sock = self.root / "docker.sock"
        self.proc = subprocess.Popen(
            [
                "dockerd", "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "exec"),
                "--pidfile", str(self.root / "docker.pid"), "-H", f"unix://{self.sock}",
                "--iptables=false", "--ip6tables=false", "--bridge=none", "--ip-forward=false",
            ],
            stdout=subprocess.DEVNULL, stderr=(self.root / "dockerd.log").open("wb"), start_new_session=True,
            preexec_fn=exit_with_parent(),  # a SIGKILLed bench still stops its engine
        )
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.sock}"}
        try:
            self._ready(rootfs)
        except BaseException:  # it failed, or the bench is being stopped (SIGTERM, Ctrl-C) meanwhile
            self.close()
            raise

    def _ready(self, rootfs: Path) -> None:
        """Wait for the engine, then import ``rootfs`` as :attr:`image`."""
        deadline = time.monotonic() + 30
        while subprocess.run(["docker", "info"], env=self.env, capture_output=True).returncode != 0:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("dockerd did not start")
            time.sleep(0.2)
        tar_path = self.root / "rootfs.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(str(rootfs), arcname=".")
        subprocess.run(["docker", "import", str(tar_path), "aenv-bench:base"], env=self.env, check=True, capture_output=True)
        tar_path.unlink()

    image = "aenv-bench:base"

    def once(self) -> float:
        return _timed(
            lambda: subprocess.run(
                ["docker", "run", "--rm", "--network", "none", self.image, "/bin/true"],
                env=self.env, check=True, capture_output=True,
            )
        )

    # ---- the operations the other scenarios pair with aenv's (each returns what it measures) ----------
    def docker(self, *args: str, input: bytes | None = None) -> str:
        """Run one docker CLI command against the private engine; stdout, stripped."""
        res = subprocess.run(["docker", *args], env=self.env, check=True, capture_output=True, input=input)
        return res.stdout.decode().strip()

    def start_idle(self, image: str | None = None) -> str:
        """A detached container that idles (``sleep infinity``); its ID."""
        return self.docker("run", "-d", "--network", "none", image or self.image, "sleep", "infinity")

    def exec_(self, cid: str, cmd: str) -> str:
        return self.docker("exec", cid, "sh", "-c", cmd)

    def commit(self, cid: str, tag: str) -> str:
        return self.docker("commit", cid, tag)

    def remove(self, *cids: str) -> None:
        if cids:
            subprocess.run(["docker", "rm", "-f", *cids], env=self.env, capture_output=True)

    def remove_image(self, *tags: str) -> None:
        if tags:
            subprocess.run(["docker", "rmi", "-f", *tags], env=self.env, capture_output=True)

    def init_pid(self, cid: str) -> int:
        return int(self.docker("inspect", "-f", "{{.State.Pid}}", cid))

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # containerd and its shims run in sessions of their own: a dockerd that did not stop them in
        # time (SIGKILLed above) leaves them, and only their command lines name this engine's dirs
        for p in processes():
            if any(str(self.root) + "/" in a for a in p.argv):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        subprocess.run(["umount", "-R", str(self.root / "exec")], capture_output=True)
        subprocess.run(["sh", "-c", f"grep -o ' {self.root}[^ ]*' /proc/mounts | sort -r | xargs -r -n1 umount -l"],
                       capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def container_baseline(rootfs: Path, prefer: str = "docker") -> Iterator[DockerBaseline | RuncBaseline | None]:
    """The best available baseline: docker if it can be started here, else runc, else None."""
    order: list[type[DockerBaseline] | type[RuncBaseline]] = (
        [DockerBaseline, RuncBaseline] if prefer == "docker" else [RuncBaseline]
    )
    for cls in order:
        try:
            b = cls(rootfs)
        except Exception:
            continue
        try:
            yield b
        finally:
            b.close()
        return
    yield None
