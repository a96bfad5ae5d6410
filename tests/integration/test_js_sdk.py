"""Smoke test with the JS SDK (npm `e2b`) under node: create, run, files, kill."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.fixtures.js import js_sdk_dir

SCRIPT = r"""
import { Sandbox } from 'e2b'
const s = await Sandbox.create('base')
const r = await s.commands.run('echo js-$((1+1))')
await s.files.write('/home/user/js.txt', 'from-js')
const back = await s.files.read('/home/user/js.txt')
console.log(JSON.stringify({ out: r.stdout.trim(), back, running: await s.isRunning() }))
await s.kill()
"""


def test_js_sdk_smoke(e2b_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = js_sdk_dir()
    node = shutil.which("node") or "node"
    script = cache / "smoke.mjs"
    script.write_text(SCRIPT)
    res = subprocess.run([node, str(script)], cwd=cache, capture_output=True, text=True, timeout=120, env={**os.environ, **e2b_env})
    assert res.returncode == 0, res.stderr
    import json

    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"out": "js-2", "back": "from-js", "running": True}


BUILD_SCRIPT = r"""
import { Sandbox, Template } from 'e2b'
const name = process.argv[2]
const logs = []
const t = Template().fromTemplate('base').runCmd('echo js-built > /opt/j').setWorkdir('/opt')
const info = await Template.build(t, name, { onBuildLogs: (e) => logs.push(String(e.message ?? e)) })
const s = await Sandbox.create(name)
const r = await s.commands.run('cat j; pwd')
await s.kill()
let failed = null
try { await Template.build(Template().fromTemplate('base').runCmd('exit 5'), name + '-bad') }
catch (e) { failed = e.constructor.name + ': ' + e.message }
console.log(JSON.stringify({ out: r.stdout.trim().split('\n'), id: !!info.templateId, steps: logs.some(m => m.includes('step 1/')),
                             exists: await Template.exists(name), failed, badExists: await Template.exists(name + '-bad') }))
"""


def test_js_sdk_template_build(e2b_env: dict[str, str]) -> None:
    """The same template build through the npm ``e2b`` package (JS SDK parity)."""
    import json
    import secrets

    cache = js_sdk_dir()
    script = cache / f"build_{secrets.token_hex(4)}.mjs"
    script.write_text(BUILD_SCRIPT)
    try:
        res = subprocess.run([shutil.which("node") or "node", str(script), f"js-{secrets.token_hex(3)}"], cwd=cache,
                             capture_output=True, text=True, timeout=300, env={**os.environ, **e2b_env})
    finally:
        script.unlink()
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["out"] == ["js-built", "/opt"] and out["id"] and out["steps"] and out["exists"], out
    assert out["failed"] and "BuildError" in out["failed"] and "exit code 5" in out["failed"], out
    assert out["badExists"] is False


ENDED_SCRIPT = r"""
import { Sandbox } from 'e2b'
const s = await Sandbox.create('base')
const cmd = await s.commands.run('sleep 60', { background: true })
const host = s.getHost(3000)
await s.kill()
const err = await cmd.wait().catch((e) => e)
const res = await fetch(`${process.env.E2B_SANDBOX_URL}`, { headers: { 'E2b-Sandbox-Id': s.sandboxId, 'E2b-Sandbox-Port': '3000' } })
console.log(JSON.stringify({ error: err?.constructor?.name, message: String(err?.message), status: res.status,
                             body: await res.json(), host }))
"""


def test_js_sdk_hears_that_a_killed_sandbox_ended(e2b_env: dict[str, str]) -> None:
    """Over plain HTTP (the quick start, docs/quickstart.md): a command whose sandbox is killed mid-stream ends with
    the SDK's "killed or reached its end of life" error (the proxy cuts the stream, the SDK probes
    /health), and a request to the ended sandbox's port answers E2B's words exactly (the JS SDK's own
    ``host.test.ts`` and ``sandboxKilledDuringRun.test.ts`` compare them)."""
    import json

    cache = js_sdk_dir()
    script = cache / "ended.mjs"
    script.write_text(ENDED_SCRIPT)
    node = shutil.which("node") or "node"
    res = subprocess.run([node, str(script)], cwd=cache, capture_output=True, text=True, timeout=120,
                         env={**os.environ, **e2b_env})  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["error"] == "TimeoutError" and "sandbox was killed or reached its end of life" in out["message"], out
    assert out["status"] == 502 and out["body"]["message"] == "The sandbox was not found", out
    assert out["body"]["code"] == 502 and out["body"]["reason"] == "killed", out
