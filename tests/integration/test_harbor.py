"""Harbor runs a local task end to end on aenv with its ``e2b`` environment and the ``oracle`` agent:
the task's Dockerfile (``FROM`` an image of the local registry, ``ENV PATH=...:$PATH``, RUN, USER,
WORKDIR, COPY) becomes an E2B template build (``AsyncTemplate.build_in_background``, build status,
tags), each trial a sandbox
created from ``name:<build ID>``, the solution and tests are uploaded and run, and the logs come back.
Two concurrent trials share one build. Slow (a template build, Harbor's own start-up); run it per
runtime: ``AENV_TEST_RUNTIME=ns|vm pytest -m slow tests/integration/test_harbor.py``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from aenv.testing.server import Server
from tests.fixtures.harbor import harbor_env, harbor_python, seconds, write_task
from tests.fixtures.plugin import PushedImages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

TASK = {
    "task.toml": """\
schema_version = "1.4"

[task]
name = "aenv/greeting"
version = "1.0.0"
description = "Write a greeting built from the image."

[verifier]
timeout_sec = 300.0
environment_mode = "shared"

[agent]
timeout_sec = 300.0

[environment]
network_mode = "no-network"
build_timeout_sec = 900.0
""",
    "instruction.md": "Write $GREETING, /app/seed.txt and /app/built.txt to /app/greeting.txt; then who you are,\n"
    "who built the image, what `mytool` prints and where you are to /app/facts.txt.\n",
    "environment/Dockerfile": """\
FROM debian:bookworm
ENV GREETING="hello from aenv" PATH="/opt/tools/bin:$PATH"
RUN useradd -m -s /bin/bash agent && mkdir -p /opt/tools/bin /app && chown agent /app \\
 && printf '#!/bin/sh\\necho tool-ok\\n' > /opt/tools/bin/mytool && chmod +x /opt/tools/bin/mytool
USER agent
WORKDIR /app
COPY seed.txt /app/seed.txt
RUN echo built-in-image > /app/built.txt && whoami > /app/builder
""",
    "environment/seed.txt": "seed from the build context\n",
    "solution/solve.sh": """\
#!/bin/bash
set -e
{ echo "$GREETING"; cat /app/seed.txt /app/built.txt; } > /app/greeting.txt
{ whoami; cat /app/builder; mytool; pwd; } > /app/facts.txt
""",
    "tests/test.sh": """\
#!/bin/bash
mkdir -p /logs/verifier
want=$(printf 'hello from aenv\\nseed from the build context\\nbuilt-in-image')
facts=$(printf 'agent\\nagent\\ntool-ok\\n/app')
if [ "$(cat /app/greeting.txt)" = "$want" ] && [ "$(cat /app/facts.txt)" = "$facts" ]; then echo 1; else echo 0; fi \\
  > /logs/verifier/reward.txt
cat /app/greeting.txt /app/facts.txt
""",
}
VERIFIER_OUT = "hello from aenv\nseed from the build context\nbuilt-in-image\nagent\nagent\ntool-ok\n/app\n"


@pytest.fixture(scope="session")
def harbor() -> Path:
    """Session-scoped, so a missing Harbor skips before a registry and a server are started."""
    return harbor_python()


def test_harbor_oracle_scores_one(
    harbor: Path, mirror_server: Server, pushed_images: PushedImages, runtime_name: str, tmp_path: Path,
    record_property: pytest.RecordProperty,
) -> None:  # fmt: skip
    pushed_images.require("debian:bookworm")
    task = write_task(tmp_path / "greeting", TASK)
    jobs = tmp_path / "jobs"
    cmd = [str(harbor.parent / "harbor"), "run", "-p", str(task), "-e", "e2b", "-a", "oracle",
           "-o", str(jobs), "--job-name", "aenv", "-k", "2", "-n", "2", "-y", "-q"]  # fmt: skip
    res = subprocess.run(cmd, cwd=tmp_path, env=harbor_env(mirror_server.url), capture_output=True, text=True,
                         timeout=1200, check=False)  # fmt: skip
    output = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, output
    job = json.loads((jobs / "aenv" / "result.json").read_text())
    assert job["n_total_trials"] == 2 and job["stats"]["n_errored_trials"] == 0, (job, output)
    trials = sorted(p.parent for p in (jobs / "aenv").glob("*/result.json"))
    assert len(trials) == 2, trials
    walls = []
    for trial in trials:
        result = json.loads((trial / "result.json").read_text())
        assert result.get("exception_info") is None, result["exception_info"]
        assert result["verifier_result"]["rewards"] == {"reward": 1.0}, result["verifier_result"]
        assert (trial / "verifier" / "test-stdout.txt").read_text() == VERIFIER_OUT
        walls.append(seconds(result))
        print(f"{runtime_name}: trial {trial.name}: {walls[-1]:.1f} s "
              f"(environment setup {seconds(result['environment_setup']):.1f} s)")  # fmt: skip
    record_property("harbor_trial_seconds", walls)
