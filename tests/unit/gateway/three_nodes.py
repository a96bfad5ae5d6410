"""A gateway app over three fake nodes (n1..n3, all up) whose answers a test's fake forwarder makes."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI
from starlette.testclient import TestClient

from aenv.gateway.control import Gateway
from aenv.gateway.directory import Locator
from aenv.gateway.forward import Relayed
from aenv.gateway.nodes import Node, NodeSet
from aenv.teams import Quota, TeamDirectory
from tests.unit.gateway.test_directory import FakeDirectory


def answer(node: Node, status: int, payload: Any) -> Relayed:
    """A node's JSON answer, as the forwarder relays it."""
    return Relayed(status, [("content-type", "application/json")], json.dumps(payload).encode(), node)


def client(forwarder: object, router: APIRouter) -> TestClient:
    """``router`` of a gateway whose forwarder is ``forwarder`` (its ``send`` plays the nodes)."""
    nodes = NodeSet([Node(f"n{i}", f"http://h:{i}", "h", i) for i in (1, 2, 3)], httpx.AsyncClient(), None)
    for n in nodes.nodes.values():
        n.up = True
    app = FastAPI()
    app.state.gateway = Gateway(nodes, Locator(nodes, FakeDirectory({})), forwarder, random.Random(0))  # type: ignore[arg-type]
    app.state.teams = TeamDirectory([], {}, [], Quota())  # no keys: open
    app.include_router(router)
    return TestClient(app)
