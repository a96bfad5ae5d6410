"""The in-sandbox agent: PID 1 of every sandbox (ns and vm).

Jobs, each in its own module:

* ``supervisor`` - reap every zombie (we are PID 1) and keep envd running (restart when it dies);
  optionally run the template's start command once.
* ``channel``    - the host↔sandbox mux channel: a listening unix socket (ns) or a virtio-serial
  character device (vm). Every stream the host opens is bridged to ``127.0.0.1:<port>`` here.
* ``hooks``      - post-restore/fork hooks (reseed the RNG from host-supplied bytes).
* ``fallback_envd`` - a health/init-only stand-in used only when the real envd is not in the bundle.

Stdlib + ``aenv.mux`` only: this package runs from the read-only tools mount (``/.aenv``).
"""
