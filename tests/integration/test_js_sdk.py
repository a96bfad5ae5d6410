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
