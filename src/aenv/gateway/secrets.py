"""E2B's secrets (``/secrets``) through the gateway.

In a cluster (the gateway's ``--redis``: its nodes are those registered in the cluster directory, each an
``aenv serve --cluster-redis``), every node keeps the secrets in that Redis (``store/secrets_redis.py``):
any live node answers for all of them. So each request goes to ONE live node, the next one if it cannot
be connected to (nothing reached it); a create, update or delete is done once, and a list is that node's
whole answer (merging several nodes' would repeat every secret).

Over a static node list, each node keeps its own secrets: a secret created through the gateway would be
on one node only, and a sandbox placed on another would go out without it. Writing to every node instead
cannot be made to hold (a node down during the create never gets it, and each node would give the secret
another ID), so the gateway refuses the secrets API there with a 501 that names the cluster setting, and
the caller sees the limit at once rather than as a missing header later. A gateway over one node is the
exception: that node's secrets are all there is.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from aenv.api.auth import require_api_key
from aenv.api.errors import error_response
from aenv.gateway.control import ALL, gateway
from aenv.gateway.forward import NodeUnreachable

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.api_route("/secrets", methods=ALL)
@router.api_route("/secrets/{rest:path}", methods=ALL)
async def secrets(request: Request) -> Response:
    gw = gateway(request)
    if not gw.shared_secrets and len(gw.nodes.nodes) > 1:
        return error_response(
            501, "secrets through a gateway need a cluster whose nodes share them: run each node with "
                 "cluster_redis (aenv serve --cluster-redis redis://HOST:PORT) and the gateway with --redis on "
                 "the same Redis; over a static node list, call each node's /secrets itself", None,
            reason="gateway")  # fmt: skip
    body = await request.body()
    for node in sorted(gw.nodes.up(), key=lambda n: n.load):
        try:
            got = await gw.forwarder.send(request, node, body)
        except NodeUnreachable:
            continue
        return got.response()
    return gw.none_up(set())
