"""Team quotas across the nodes behind a gateway (gateway/quotas.py): the nodes' last reports plus the
creates the gateway relayed since."""

from __future__ import annotations

import json

from aenv.gateway.nodes import Node
from aenv.gateway.quotas import check, held_by
from aenv.teams import Quota, TeamDirectory, TeamSpec


def _node(i: int, teams: dict[str, dict[str, int]]) -> Node:
    node = Node(f"n{i}", f"http://h:{i}", "h", i)
    node.report({"sandboxes": {}, "teams": teams})
    return node


def test_the_total_of_every_node_and_the_creates_since() -> None:
    teams = TeamDirectory([], {"rl": TeamSpec(keys=["k"], max_sandboxes=5)}, ["root"], Quota())
    nodes = [_node(1, {"rl": {"sandboxes": 2, "vcpus": 4}}), _node(2, {"rl": {"sandboxes": 2}, "other": {"sandboxes": 9}})]
    assert held_by("rl", nodes).sandboxes == 4 and held_by("rl", nodes).vcpus == 4
    assert check(teams, "rl", nodes) is None
    nodes[0].placed_by_team["rl"] = 1  # relayed since n1's last report
    over = check(teams, "rl", nodes)
    assert over is not None and over.status_code == 429 and over.headers["retry-after"] == "5"
    body = json.loads(bytes(over.body))
    assert body["reason"] == "quota" and body["quota"] == "max_sandboxes" and body["limit"] == 5
    nodes[0].report({"sandboxes": {}, "teams": {"rl": {"sandboxes": 1}}})  # a report resets the count
    assert nodes[0].placed_by_team == {} and check(teams, "rl", nodes) is None
    assert check(teams, "other", nodes) is None  # no limits of its own
