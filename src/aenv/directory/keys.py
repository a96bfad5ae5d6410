"""The cluster directory's shape in Redis: key names, the event channel, and the Lua scripts that change it.

Keys (one Redis, soft state: nodes re-publish what they hold when they start):

- ``aenv:nodes``: set of node ids ever registered;
- ``aenv:node:<id>``: hash ``url``, ``incarnation`` (bumped by every start and by every death),
  ``status`` (``alive`` | ``dead``), ``since``, ``reason``;
- ``aenv:node:<id>:sbx``: set of the sandbox ids bound to the node;
- ``aenv:sbx:<id>``: hash ``node``, ``incarnation`` (the node's when it bound it), ``state`` (``live`` |
  ``lost``), ``reason``, and while the sandbox is paused with its state in the snapshot store,
  ``paused``: JSON (``snapshot``: the published snapshot's id, ``row``: what a node needs to run it
  again under the same id, its envd token included; ``core/handover.py``).

  ``lost``), ``reason``;
- volumes (E2B ``/volumes``: their files are on one node's disk): ``aenv:vol:<id>`` hash ``node``,
  ``incarnation``, ``owner``, ``name``; ``aenv:node:<id>:vol`` the node's volume ids; ``aenv:volname:<owner>:<name>``
  the volume id that holds the name (names are unique per owner across the cluster, as on one node).
  A dead node's volumes stay bound to it (the files are still there, and come back with it): the
  gateway answers for them naming the node, and the name stays taken. The one exception is a volume
  that travelled with a published pause (its data in the snapshot store): the node that adopts the
  sandbox takes the volume over with it (``ADOPT_VOLUME``: only from a node declared dead, once).

Every write a node makes runs as one script that first checks the node's record: the incarnation it
holds must be the current one and the node ``alive``, else the write is refused (``FENCED``). A node
declared dead, or one replaced by a newer start, therefore cannot bind anything; the controller's
``MARK_DEAD`` bumps the incarnation and marks the node's sandboxes lost in the same script. Each script
publishes on ``aenv:events`` what it changed (``bind <sbx> <node>``, ``unbind <sbx>``, ``lost <sbx>
<node>``, ``node <id>``), so gateways drop or fill their caches. ``ADOPT`` moves a lost binding whose
pause is published to the adopting node, once: it checks the binding is still lost with that snapshot.

<node>``, ``node <id>``, ``vbind <vol> <node>``, ``vunbind <vol>``), so gateways drop or fill their caches.
"""

from __future__ import annotations

from typing import Any

EVENTS = "aenv:events"
NODES = "aenv:nodes"
FENCED = "FENCED"
TAKEN = "TAKEN"  # a volume name held by another volume
LOST_TTL = 86400  # seconds a lost binding stays to say where its sandbox was lost


def strs(reply: Any) -> dict[str, str]:
    """A hash reply (decoded) as the str mapping it is; redis-py types it as bytes-or-str."""
    return {str(k): str(v) for k, v in dict(reply).items()}


def node_key(node_id: str) -> str:
    return f"aenv:node:{node_id}"


def node_sandboxes_key(node_id: str) -> str:
    return f"aenv:node:{node_id}:sbx"


def sandbox_key(sandbox_id: str) -> str:
    return f"aenv:sbx:{sandbox_id}"


def node_volumes_key(node_id: str) -> str:
    return f"aenv:node:{node_id}:vol"


def volume_key(volume_id: str) -> str:
    return f"aenv:vol:{volume_id}"


def volume_name_key(owner: str, name: str) -> str:
    return f"aenv:volname:{owner}:{name}"


# KEYS: node hash, nodes set. ARGV: node id, url, now. Returns the new incarnation.
REGISTER = """
local inc = redis.call('HINCRBY', KEYS[1], 'incarnation', 1)
redis.call('HSET', KEYS[1], 'url', ARGV[2], 'status', 'alive', 'since', ARGV[3], 'reason', '')
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('PUBLISH', 'aenv:events', 'node ' .. ARGV[1])
return inc
"""

_FENCE = """
local rec = redis.call('HMGET', KEYS[1], 'incarnation', 'status')
if rec[1] ~= ARGV[2] or rec[2] ~= 'alive' then
  return redis.error_reply('FENCED node ' .. ARGV[1] .. ' incarnation ' .. ARGV[2] .. ' is not current (now '
    .. tostring(rec[1]) .. ', ' .. tostring(rec[2]) .. ')')
end
"""

# KEYS: node hash, node's sandbox set, sandbox hash. ARGV: node id, incarnation, sandbox id. A node's own
# binding bound again (its claim at start) keeps its published pause: the sandbox is still paused here.
BIND = _FENCE + """
local b = redis.call('HMGET', KEYS[3], 'node', 'state', 'paused')
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], 'node', ARGV[1], 'incarnation', ARGV[2], 'state', 'live')
if b[1] == ARGV[1] and b[2] == 'live' and b[3] then redis.call('HSET', KEYS[3], 'paused', b[3]) end
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('PUBLISH', 'aenv:events', 'bind ' .. ARGV[3] .. ' ' .. ARGV[1])
return 1
"""

# Same keys and arguments. Only a live binding to this node is removed (another node may own the id now;
# a lost one stays, so that the gateway can still say where it was lost, until LOST_TTL).
UNBIND = _FENCE + """
redis.call('SREM', KEYS[2], ARGV[3])
local b = redis.call('HMGET', KEYS[3], 'node', 'state')
if b[1] == ARGV[1] and b[2] == 'live' then
  redis.call('DEL', KEYS[3])
  redis.call('PUBLISH', 'aenv:events', 'unbind ' .. ARGV[3])
  return 1
end
return 0
"""

# KEYS: node hash, node's sandbox set. ARGV: node id, reason, now. Idempotent; returns the sandboxes lost.
MARK_DEAD = """
if redis.call('HGET', KEYS[1], 'status') == 'dead' then return 0 end
redis.call('HINCRBY', KEYS[1], 'incarnation', 1)
redis.call('HSET', KEYS[1], 'status', 'dead', 'since', ARGV[3], 'reason', ARGV[2])
local lost = 0
for _, sid in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local k = 'aenv:sbx:' .. sid
  if redis.call('HGET', k, 'node') == ARGV[1] and redis.call('HGET', k, 'state') == 'live' then
    redis.call('HSET', k, 'state', 'lost', 'reason', ARGV[2])
    redis.call('EXPIRE', k, 86400)
    redis.call('PUBLISH', 'aenv:events', 'lost ' .. sid .. ' ' .. ARGV[1])
    lost = lost + 1
  end
end
redis.call('PUBLISH', 'aenv:events', 'node ' .. ARGV[1])
return lost
"""

# Same keys; ARGV: node id, incarnation, sandbox id, the ``paused`` JSON. Only on a live binding to this node.
PUBLISH_PAUSE = _FENCE + """
local b = redis.call('HMGET', KEYS[3], 'node', 'state')
if b[1] ~= ARGV[1] or b[2] ~= 'live' then return 0 end
redis.call('HSET', KEYS[3], 'paused', ARGV[4])
return 1
"""

# Same keys; ARGV: node id, incarnation, sandbox id. The sandbox runs again here: its published pause is stale.
UNPUBLISH_PAUSE = _FENCE + """
if redis.call('HGET', KEYS[3], 'node') ~= ARGV[1] then return 0 end
return redis.call('HDEL', KEYS[3], 'paused')
"""

# KEYS: the adopting node's hash and sandbox set, the sandbox hash. ARGV: node id, incarnation, sandbox id,
# the snapshot id the adopter fetched. Returns the ``paused`` JSON it took over (to give back on failure).
ADOPT = _FENCE + """
local b = redis.call('HMGET', KEYS[3], 'node', 'state', 'paused')
if b[2] ~= 'lost' or not b[3] then
  return redis.error_reply('NOTADOPTABLE sandbox ' .. ARGV[3] .. ' is ' .. tostring(b[2]) .. ' on node '
    .. tostring(b[1]) .. (b[3] and '' or ', without a published pause'))
end
if cjson.decode(b[3])['snapshot'] ~= ARGV[4] then
  return redis.error_reply('NOTADOPTABLE sandbox ' .. ARGV[3] .. ': its published pause changed')
end
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], 'node', ARGV[1], 'incarnation', ARGV[2], 'state', 'live', 'reason',
  'adopted from node ' .. b[1])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('PUBLISH', 'aenv:events', 'bind ' .. ARGV[3] .. ' ' .. ARGV[1])
return b[3]
"""

# KEYS: the sandbox hash. ARGV: sandbox id, the node it was lost on, the reason, the ``paused`` JSON. An
# adoption that failed (its node unbound the id again) puts the lost, published binding back, if none is there.
GIVE_BACK = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'node', ARGV[2], 'state', 'lost', 'reason', ARGV[3], 'paused', ARGV[4])
redis.call('EXPIRE', KEYS[1], 86400)
redis.call('PUBLISH', 'aenv:events', 'lost ' .. ARGV[1] .. ' ' .. ARGV[2])
return 1
"""

# The volume bound to this node (KEYS and ARGV as BIND_VOLUME's, first four and five).
_SET_VOLUME = """
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], 'node', ARGV[1], 'incarnation', ARGV[2], 'owner', ARGV[4], 'name', ARGV[5])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('SET', KEYS[4], ARGV[3])
redis.call('PUBLISH', 'aenv:events', 'vbind ' .. ARGV[3] .. ' ' .. ARGV[1])
return 1
"""

# KEYS: node hash, node's volume set, volume hash, name key. ARGV: node id, incarnation, volume id, owner,
# name. A name another volume holds is refused (TAKEN), whichever node that volume is on.
BIND_VOLUME = _FENCE + """
local held = redis.call('GET', KEYS[4])
if held and held ~= ARGV[3] then
  local where = redis.call('HGET', 'aenv:vol:' .. held, 'node')
  if where then
    return redis.error_reply('TAKEN a volume named ' .. ARGV[5] .. ' already exists (volume ' .. held
      .. ' on node ' .. where .. ')')
  end
end
""" + _SET_VOLUME

# Same keys and arguments: only this node's binding (and the name, if it still names this volume) goes.
UNBIND_VOLUME = _FENCE + """
redis.call('SREM', KEYS[2], ARGV[3])
if redis.call('HGET', KEYS[3], 'node') == ARGV[1] then
  redis.call('DEL', KEYS[3])
  if redis.call('GET', KEYS[4]) == ARGV[3] then redis.call('DEL', KEYS[4]) end
  redis.call('PUBLISH', 'aenv:events', 'vunbind ' .. ARGV[3])
  return 1
end
return 0
"""

# KEYS: the adopting node's hash and volume set, the volume hash, the name key, the dead node's hash and
# volume set. ARGV: node id, incarnation, volume id, owner, name, the dead node's id. A volume whose data
# travelled with an adopted pause moves to the adopter, only from that node and only once it is dead.
ADOPT_VOLUME = _FENCE + """
local cur = redis.call('HGET', KEYS[3], 'node')
if cur == ARGV[1] then return 1 end
if cur and cur ~= ARGV[6] then
  return redis.error_reply('NOTADOPTABLE volume ' .. ARGV[3] .. ' is bound to node ' .. cur)
end
if redis.call('HGET', KEYS[5], 'status') ~= 'dead' then
  return redis.error_reply('NOTADOPTABLE volume ' .. ARGV[3] .. ': node ' .. ARGV[6] .. ' is not declared dead')
end
local held = redis.call('GET', KEYS[4])
if held and held ~= ARGV[3] then
  return redis.error_reply('TAKEN a volume named ' .. ARGV[5] .. ' already exists (volume ' .. held .. ')')
end
redis.call('SREM', KEYS[6], ARGV[3])
""" + _SET_VOLUME
