"""A short Ray driver for the cluster commands: ``start`` creates the controller (if missing) and waits
until it answers, ``status`` prints its view as JSON, ``stop`` kills it and every node agent (the
servers they started keep running: sandboxes outlive their agents, as they outlive their servers).

    python -m aenv.cluster.driver start --ray HOST:PORT --redis redis://HOST:PORT --spec JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="aenv-cluster-driver")
    p.add_argument("what", choices=["start", "status", "stop"])
    p.add_argument("--ray", required=True, help="the Ray head's GCS address, HOST:PORT")
    p.add_argument("--redis", help="the cluster directory (start)")
    p.add_argument("--spec", help="the ServeSpec template, JSON (start)")
    p.add_argument("--period", type=float, default=1.0)
    args = p.parse_args(argv)

    import ray

    from aenv.cluster.controller import CONTROLLER, NAMESPACE, start_controller

    ray.init(address=args.ray, namespace=NAMESPACE, logging_level="warning", log_to_driver=False)
    try:
        if args.what == "start":
            if not args.redis or not args.spec:
                p.error("start needs --redis and --spec")
            handle = start_controller(args.redis, json.loads(args.spec), args.period)
            print(json.dumps(ray.get(handle.status.remote(), timeout=120)))
        elif args.what == "status":
            print(json.dumps(ray.get(ray.get_actor(CONTROLLER).status.remote(), timeout=30), indent=1))
        else:
            stop_all(ray)
    finally:
        ray.shutdown()
    return 0


def stop_all(ray: Any) -> None:
    from aenv.cluster.controller import CONTROLLER, NAMESPACE

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor.get("namespace") == NAMESPACE and (actor["name"] == CONTROLLER or actor["name"].startswith("aenv-agent-")):
            ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE), no_restart=True)


if __name__ == "__main__":
    sys.exit(main())
