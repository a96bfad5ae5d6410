"""A private ``redis-server`` (Debian's): the cluster directory and Ray's GCS fault-tolerance store.

Started by hand on one address and port with its data in a directory of its own, never the system
unit; owned by whoever started it (``stop`` kills exactly that process and waits for it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from aenv.cluster.procs import stop_process


class RedisMissing(RuntimeError):
    """No ``redis-server`` on PATH."""


@dataclass
class RedisProc:
    host: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        stop_process(self.proc)


def start_redis(data_dir: Path, host: str = "127.0.0.1", port: int = 0, timeout: float = 20.0) -> RedisProc:
    """A redis-server on ``host:port`` (0: a free one), append-only file in ``data_dir``; returns once it
    answers PING. Raises RedisMissing or RuntimeError (with its log)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisMissing("redis-server not found (Debian: apt-get install redis-server; scripts/setup.sh does)")
    data_dir.mkdir(parents=True, exist_ok=True)
    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    log_path = data_dir / "redis.log"
    argv = [exe, "--bind", host, "--port", str(port), "--dir", str(data_dir), "--appendonly", "yes",
            "--save", "", "--protected-mode", "no", "--daemonize", "no", "--logfile", str(log_path)]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    r = RedisProc(host, port, proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with socket.create_connection((host, port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return r
        except OSError:
            pass
        time.sleep(0.05)
    r.stop()
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
    raise RuntimeError(f"redis-server on {host}:{port} did not start:\n{tail}")
