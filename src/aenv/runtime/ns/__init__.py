"""The ``ns`` runtime: namespace sandboxes on overlayfs with cgroup limits (no VM).

Modules, one job each: ``cgroups`` (v1/v2 limits, freezer, usage), ``launcher`` (stage 2 inside the
new namespaces: mounts, pivot_root, exec the agent), ``process`` (pids we own, reaping), ``network``
(loopback-only or slirp4netns), ``sandbox`` (one sandbox and what it owns), ``pool`` (warm pool),
``reconcile`` (crash clean-up), ``runtime`` (the front door, which passes ``host`` and ``table`` to the
parts ``lifecycle``, ``snapshot``, ``release``, ``procimage`` and ``restored``); envd is spoken to through
``aenv.runtime.envd_client``, shared with the vm runtime.
"""

from aenv.runtime.ns.runtime import NsRuntime

__all__ = ["NsRuntime"]
