"""``aenv.rl``: RL rollouts over the unmodified E2B SDK, sync and async (a client library: it talks
HTTP to the server and imports nothing of it).

- ``Episode`` / ``AsyncEpisode``: one rollout in one sandbox, created idempotently by rollout ID, kept
  alive in the background, killed on exit, with an ``outcome`` (ok, command_failed, infra_failed)
  and a ``metrics`` dict;
- ``run_group`` / ``arun_group``: prepare one sandbox, fork it n ways, roll out, score, keep the
  best k, kill the rest;
- ``SearchTree`` / ``beam_search``: tree search by fork — expand a node k ways, score, prune, checkpoint
  and roll back;
- ``Lease``: one heartbeat for every sandbox of the trainer process; if the process dies, they end
  ``ttl`` seconds later (pass ``lease=`` to episodes and groups).
"""

from aenv.rl._episode import AsyncEpisode, Episode, EpisodeNotStarted
from aenv.rl._group import GroupResult, Member, arun_group, run_group
from aenv.rl._lease import LEASE_KEY, Lease
from aenv.rl._outcome import COMMAND_FAILED, ERROR, INFRA_FAILED, OK, Outcome, is_infra
from aenv.rl._tree import Node, SearchTree, beam_search

__all__ = [
    "COMMAND_FAILED", "ERROR", "INFRA_FAILED", "LEASE_KEY", "OK", "AsyncEpisode", "Episode", "EpisodeNotStarted",
    "GroupResult", "Lease", "Member", "Node", "Outcome", "SearchTree", "arun_group", "beam_search", "is_infra",
    "run_group",
]
