"""Placement of creates: best of K by load, in-flight creates counted, idempotency keys pinned."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from aenv.gateway import placement
from aenv.gateway.nodes import Node, parse_node


def test_the_least_loaded_of_the_sample_wins() -> None:
    rng = random.Random(1)
    pairs = [("n1", 5.0), ("n2", 1.0), ("n3", 3.0)]
    assert {placement.best_of_k(pairs, rng, k=3) for _ in range(20)} == {"n2"}


def test_k_of_one_is_random_and_reaches_every_node() -> None:
    rng = random.Random(2)
    pairs = [("n1", 5.0), ("n2", 1.0), ("n3", 3.0)]
    assert {placement.best_of_k(pairs, rng, k=1) for _ in range(200)} == {"n1", "n2", "n3"}


def test_equal_nodes_share_creates() -> None:
    rng = random.Random(3)
    got = Counter(placement.best_of_k([("n1", 0.0), ("n2", 0.0)], rng) for _ in range(400))
    assert got["n1"] > 100 and got["n2"] > 100


def test_creates_in_flight_count_as_load() -> None:
    a, b = Node("n1", "http://a:1", "a", 1), Node("n2", "http://b:1", "b", 1)
    a.counts, b.counts = {"running": 2}, {"running": 3}
    a.inflight = 2  # a burst being relayed to n1 right now
    rng = random.Random(4)
    assert placement.best_of_k([(n.id, n.load) for n in (a, b)], rng) == "n2"
    a.inflight = 0
    assert placement.best_of_k([(n.id, n.load) for n in (a, b)], rng) == "n1"


def test_placed_creates_count_until_the_next_report() -> None:
    a = Node("n1", "http://a:1", "a", 1)
    a.placed = 4
    assert a.load == 4
    a.counts = {"running": 1, "paused": 4}
    assert a.load == 4 + 1 + 1  # paused at a quarter


def test_an_idempotency_key_keeps_its_node() -> None:
    pairs = [("n1", 0.0), ("n2", 9.0), ("n3", 4.0)]
    first = placement.by_key(pairs, "rollout-7")
    assert all(placement.by_key(list(reversed(pairs)), "rollout-7") == first for _ in range(5))
    assert len({placement.by_key(pairs, f"k{i}") for i in range(60)}) == 3


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError):
        placement.best_of_k([], random.Random(0))
    with pytest.raises(ValueError):
        placement.by_key([], "k")


def test_node_specs() -> None:
    n = parse_node("http://127.0.0.1:8001/", 1)
    assert (n.id, n.url, n.host, n.port) == ("n2", "http://127.0.0.1:8001", "127.0.0.1", 8001)
    assert parse_node("east=http://10.0.0.5:8000", 0).id == "east"
    for bad in ("127.0.0.1:8000", "https://h:1", "http://h:1/api"):
        with pytest.raises(ValueError):
            parse_node(bad, 0)


def test_a_warm_template_is_worth_its_bonus_among_the_sampled() -> None:
    rng = random.Random(5)
    pairs = [("n1", 1.0), ("n2", 1.5), ("n3", 3.0)]
    assert {placement.best_of_k(pairs, rng, k=3, warm={"n2"}) for _ in range(20)} == {"n2"}  # 0.5 < 1.0
    # more than the bonus less busy still wins
    assert {placement.best_of_k(pairs, rng, k=3, warm={"n3"}) for _ in range(20)} == {"n1"}  # 2.0 > 1.0
    assert placement.WARM_BONUS == 1.0
    # only among the sampled: with k=1 the warm node is not always the choice
    assert {placement.best_of_k(pairs, rng, k=1, warm={"n2"}) for _ in range(200)} == {"n1", "n2", "n3"}


def test_a_node_report_carries_machine_and_warm_templates() -> None:
    n = Node("n1", "http://a:1", "a", 1)
    n.placed = 3
    machine = {"accel": "tcg", "cpu": "max", "qemu": "7.2"}
    n.report({"sandboxes": {"running": 2}, "starting": 1, "runtime": "vm", "machine": machine,
              "warm": {"base": 2, "base-id": 2, "empty": 0, "odd": "x"}})  # fmt: skip
    assert (n.counts, n.starting, n.runtime, n.placed) == ({"running": 2}, 1, "vm", 0)
    assert n.machine == machine and n.warm == {"base": 2, "base-id": 2}
    assert n.warm_for("base") and not n.warm_for("empty") and not n.warm_for(None)
    assert n.describe()["machine"] == machine and n.describe()["warm"] == {"base": 2, "base-id": 2}
    n.report({"sandboxes": {}, "runtime": "ns", "machine": None})  # ns, or a node before these fields
    assert n.machine is None and n.warm == {}
    n.report({"sandboxes": {}, "machine": {"accel": "tcg"}, "warm": ["base"]})  # malformed: ignored
    assert n.machine is None and n.warm == {}


def test_a_node_holding_the_built_template_is_worth_the_cache_bonus() -> None:
    rng = random.Random(1)
    pairs = [("n1", 1.0), ("n2", 1.4), ("n3", 2.0)]
    assert {placement.best_of_k(pairs, rng, k=3, cached={"n2"}) for _ in range(20)} == {"n2"}  # 0.9 < 1.0
    assert {placement.best_of_k(pairs, rng, k=3, cached={"n3"}) for _ in range(20)} == {"n1"}  # 1.5 > 1.0
    assert placement.CACHE_BONUS < placement.WARM_BONUS
    n = Node("n1", "http://h:1", "h", 1)
    n.report({"sandboxes": {}, "held": ["t1", "my-tpl"], "templateStore": "s3://b"})
    assert n.holds("t1") and n.holds("my-tpl:v2") and not n.holds("other") and not n.holds(None)
    assert n.store == "s3://b" and n.describe()["templateStore"] == "s3://b"
