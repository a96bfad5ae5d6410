"""Alternate default / CIDR-policy / domain-policy creates against one server of this checkout."""
import os, statistics, sys, tempfile, time
from pathlib import Path
from aenv.testing.server import API_KEY, start_server, stop_server
N = int(sys.argv[1]) if len(sys.argv) > 1 else 12
tmp = Path(tempfile.mkdtemp(prefix="netcost-"))
srv = start_server(tmp, "ns", {"AENV_POOL_SIZE": "4"})
os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=API_KEY, NO_PROXY="127.0.0.1,localhost")
from e2b import Sandbox
kinds = {"default": None, "cidr": {"deny_out": ["0.0.0.0/0"], "allow_out": ["1.1.1.1"]},
         "domain": {"deny_out": ["0.0.0.0/0"], "allow_out": ["1.1.1.1", "example.com"]}}
res = {k: ([], []) for k in kinds}
try:
    Sandbox.create("base", timeout=600).kill()
    time.sleep(3)
    for i in range(N + 1):
        for k, net in kinds.items():
            t0 = time.perf_counter(); s = Sandbox.create("base", timeout=600, network=net); t1 = time.perf_counter()
            s.commands.run("true"); t2 = time.perf_counter(); s.kill()
            if i: res[k][0].append((t1 - t0) * 1000); res[k][1].append((t2 - t0) * 1000)
            time.sleep(0.3)
finally:
    stop_server(srv)
for k, (c, f) in res.items():
    print(f"{k:8s} create p50 {statistics.median(c):6.1f}  create->first p50 {statistics.median(f):6.1f}  (min {min(f):.1f}) n={len(f)}")
print("log:", srv.log_path)
