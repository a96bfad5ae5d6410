"""Where a create goes: E2B's best of K — sample K live nodes, take the least loaded — with the creates
the gateway is relaying right now counted in each node's load (``Node.inflight``), so a burst does not
pile onto the node that looked emptiest at the last probe.

A node that has a sandbox of the requested template started ahead (its warm pool) is credited
``WARM_BONUS`` of load: a hand-out costs it milliseconds where a start costs a restore, so among the
sampled nodes it wins over one up to a sandbox less busy.

A node that already holds a built template (its layers are there: no fetch from the shared store) is
credited ``CACHE_BONUS``: less than a warm sandbox, more than nothing.

Pure functions over (node id, load) pairs: the gateway filters out down nodes, those that already
refused this create and, for a vm snapshot, those of another machine; these choose among the rest.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Sequence

K = 3  # nodes sampled per create (E2B's choice)
WARM_BONUS = 1.0  # load taken off a sampled node that has a warm sandbox of the requested template
CACHE_BONUS = 0.5  # load taken off a sampled node that holds the requested built template already

Candidate = tuple[str, float]  # (node id, load)


def best_of_k(candidates: Sequence[Candidate], rng: random.Random, k: int = K, warm: Collection[str] = (),
              cached: Collection[str] = ()) -> str:  # fmt: skip
    """The least loaded of ``k`` nodes sampled from ``candidates`` (all of them when there are fewer),
    those in ``warm`` (node ids with a warm sandbox of the template) counted ``WARM_BONUS`` lighter,
    those in ``cached`` (holding the built template) ``CACHE_BONUS`` lighter.
    Ties go to the first sampled, which is random: equal nodes share creates evenly."""
    if not candidates:
        raise ValueError("no candidate nodes")
    sample = rng.sample(list(candidates), min(k, len(candidates)))
    return min(sample, key=lambda c: c[1] - (WARM_BONUS if c[0] in warm else 0.0)
               - (CACHE_BONUS if c[0] in cached else 0.0))[0]  # fmt: skip


def by_key(candidates: Sequence[Candidate], key: str) -> str:
    """The node an idempotency key maps to (rendezvous hashing): a retried create with the same
    ``Idempotency-Key`` reaches the node that may already hold its sandbox, while the same nodes are up."""
    if not candidates:
        raise ValueError("no candidate nodes")
    return max(candidates, key=lambda c: hashlib.sha256(f"{key}\0{c[0]}".encode()).digest())[0]
