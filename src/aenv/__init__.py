"""aenv: self-hosted, E2B-compatible agent environments.

This top-level module stays import-free on purpose: the in-sandbox parts (``aenv.agent``,
``aenv.envd``, ``aenv.mux``) run from the read-only tools mount with their own interpreter and
must not pull in the server's dependencies.
"""

__version__ = "0.1.0"
