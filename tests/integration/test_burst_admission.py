"""200 SDK creates at the same instant against a real server (issue 20): each is served or a readable
429/503 (the SDK's RateLimitException / ServiceBusyException), never a connection error; then the run
is reaped by its metadata tag, exactly the sandboxes it made."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.conftest import API_KEY, Server

BURST = 200


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_burst_of_sdk_creates_is_served_or_readably_refused(server: Server, e2b_env: dict[str, str]) -> None:
    from e2b import RateLimitException, Sandbox, ServiceBusyException

    run = f"burst-{time.monotonic_ns()}"
    tally: Counter[str] = Counter()
    errors: list[str] = []
    ids: list[str] = []
    lock = threading.Lock()
    go = threading.Event()

    def one(i: int) -> None:
        go.wait()
        try:
            sbx = Sandbox.create("base", timeout=300, metadata={"run": run, "i": str(i)})
        except (RateLimitException, ServiceBusyException) as exc:
            with lock:
                tally["refused"] += 1
                if "retry" not in str(exc).lower():
                    errors.append(f"unreadable refusal: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - what the test counts
            with lock:
                tally["error"] += 1
                errors.append(f"{type(exc).__name__}: {exc}")
            return
        with lock:
            tally["served"] += 1
            ids.append(sbx.sandbox_id)

    started = time.monotonic()
    with ThreadPoolExecutor(BURST) as pool:
        futures = [pool.submit(one, i) for i in range(BURST)]
        go.set()
        for f in futures:
            f.result()
    wall = time.monotonic() - started
    print(f"\n{BURST} concurrent creates in {wall:.1f} s: {dict(tally)}")
    try:
        assert tally["error"] == 0 and not errors, errors[:5]
        assert tally["served"] + tally["refused"] == BURST
        assert tally["served"] >= 32
        sbx = Sandbox.connect(ids[0])  # a served one works (not `with`: its exit would kill it)
        assert sbx.commands.run("echo ok").stdout == "ok\n"
    finally:
        with httpx.Client(base_url=server.url, headers={"X-API-KEY": API_KEY}, trust_env=False, timeout=600) as c:
            t0 = time.monotonic()
            report = c.post("/aenv/sandboxes/kill", json={"metadata": {"run": run}}).json()
            print(f"reaped {len(report['killed'])} in {time.monotonic() - t0:.1f} s, failed {report['failed'][:3]}")
            assert sorted(report["killed"]) == sorted(ids)
            assert c.get("/v2/sandboxes", params={"metadata": f"run={run}"}).json() == []
