"""A/B: the gateway before and after the probe fix, 1,000 simulated nodes, one gateway."""
import os, tempfile, time, sys
from pathlib import Path
from bench.cluster_sim import SimCluster, cpu_meter, creates, routed
n = int(sys.argv[1])
for label, src in (("before", "/tmp/simt/old/src"), ("after", "/work/wt-sim/src")):
    os.environ["PYTHONPATH"] = src + ":/work/wt-sim"
    with tempfile.TemporaryDirectory() as tmp:
        c = SimCluster(Path(tmp), n)
        try:
            c.start(); t0 = time.time(); gws = c.gateways(int(sys.argv[2])); start = time.time() - t0
            idle = {}
            with cpu_meter(c.gateway_pids(), idle):
                time.sleep(4)
            busy = {}
            with cpu_meter(c.gateway_pids(), busy):
                l = creates(gws, 32, 6, 1)
            g = routed(gws, 32, 4, l.ids, 2) if l.ids else None
            log = open(Path(tmp)/"gw0.log").read()
            print(label, sys.argv[2], "gw", f"start {start:.1f}s idleCPU {idle['cpu']*100:.0f}% creates/s {l.rate:.1f} failed {l.failed} busyCPU {busy['cpu']*100:.0f}% "
                  f"GET/s {g.rate if g else 0:.0f} flaps {log.count(' down: ')} load {os.getloadavg()[0]:.0f}", flush=True)
        finally:
            c.close()
