"""``aenv gateway``: one E2B endpoint (control plane and sandbox proxy on one port) in front of several
``aenv serve`` nodes.

Stateless: ``nodes`` probes a static node list, ``directory`` says which node owns a sandbox (a cache in
front of a ``Directory``: today it asks the nodes; a Redis directory is the next step), ``placement``
picks a node for a create, ``control`` relays the REST routes (``forward``), ``proxy`` relays sandbox
traffic with the node's own HTTP and WebSocket relays, and ``app`` puts them on one port.
"""

from aenv.gateway.app import GatewaySettings, create_gateway_app
from aenv.gateway.nodes import parse_node

__all__ = ["GatewaySettings", "create_gateway_app", "parse_node"]
