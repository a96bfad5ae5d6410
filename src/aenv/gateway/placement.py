"""Where a create goes: E2B's best of K — sample K live nodes, take the least loaded — with the creates
the gateway is relaying right now counted in each node's load (``Node.inflight``), so a burst does not
pile onto the node that looked emptiest at the last probe.

Pure functions over (node id, load) pairs: the gateway filters out down nodes and those that already
refused this create, and these choose among the rest.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

K = 3  # nodes sampled per create (E2B's choice)

Candidate = tuple[str, float]  # (node id, load)


def best_of_k(candidates: Sequence[Candidate], rng: random.Random, k: int = K) -> str:
    """The least loaded of ``k`` nodes sampled from ``candidates`` (all of them when there are fewer).
    Ties go to the first sampled, which is random: equal nodes share creates evenly."""
    if not candidates:
        raise ValueError("no candidate nodes")
    sample = rng.sample(list(candidates), min(k, len(candidates)))
    return min(sample, key=lambda c: c[1])[0]


def by_key(candidates: Sequence[Candidate], key: str) -> str:
    """The node an idempotency key maps to (rendezvous hashing): a retried create with the same
    ``Idempotency-Key`` reaches the node that may already hold its sandbox, while the same nodes are up."""
    if not candidates:
        raise ValueError("no candidate nodes")
    return max(candidates, key=lambda c: hashlib.sha256(f"{key}\0{c[0]}".encode()).digest())[0]
