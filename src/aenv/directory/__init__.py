"""The cluster directory in Redis: which node owns which sandbox, and which nodes are alive.

``keys`` is its shape (key names, the Lua scripts that fence each write by the node's incarnation),
``node`` the side a node writes (register, bind, unbind, claim at start; ``mark_dead`` for the
controller), ``reader`` the side a gateway reads (lookups, the node records, the event stream).
"""
