"""The network of a cluster on one machine: a bridge with the control address, and one network
namespace per node joined to it by a veth pair, on a private /24 (default 10.213.0.0/24).

The bridge has no uplink and the namespaces no default route: traffic can only reach the /24, whose
addresses are all inside namespaces this module made (the bridge's .1 is the control host: Redis, the
Ray head). ``Topology.close`` removes what it made, in reverse order, and tolerates what is gone.
"""

from __future__ import annotations

import contextlib
import ipaddress
import shutil
import subprocess
from dataclasses import dataclass, field


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def check_available() -> None:
    import os

    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2 (ip) is not installed")


@dataclass
class Topology:
    """Names and addresses; ``tag`` keeps two clusters on one machine apart (interface names <= 15)."""

    tag: str
    nodes: int
    subnet: str = "10.213.0.0/24"
    made: list[tuple[str, str]] = field(default_factory=list)  # ("ns"|"link", name), in creation order

    def __post_init__(self) -> None:
        net = ipaddress.ip_network(self.subnet)
        if net.prefixlen != 24 or not net.is_private or self.nodes > 200:
            raise ValueError(f"subnet {self.subnet}: give a private /24 (at most 200 nodes)")
        self._base = net.network_address

    @property
    def bridge(self) -> str:
        return f"aenvbr{self.tag}"[:15]

    @property
    def control_ip(self) -> str:
        return str(self._base + 1)

    def ns(self, i: int) -> str:
        return f"aenv-{self.tag}-n{i + 1}"

    def veth(self, i: int) -> str:
        return f"av{self.tag}n{i + 1}"[:15]

    def node_ip(self, i: int) -> str:
        return str(self._base + 11 + i)

    def name(self, i: int) -> str:
        return f"n{i + 1}"

    def create(self) -> None:
        """The bridge and every namespace; on failure what was made is removed again."""
        check_available()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self.made.append(("link", self.bridge))
            _ip("addr", "add", f"{self.control_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.nodes):
                self._node(i)
        except BaseException:
            self.close()
            raise

    def _node(self, i: int) -> None:
        ns, veth = self.ns(i), self.veth(i)
        _ip("netns", "add", ns)
        self.made.append(("ns", ns))
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self.made.append(("link", veth))
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{self.node_ip(i)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def exec_argv(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``i``'s network namespace, and only that: ``nsenter --net``, not ``ip
        netns exec``, which also remounts /sys in a mount namespace of its own and so hides
        /sys/fs/cgroup from the node's server."""
        return ["nsenter", f"--net=/run/netns/{self.ns(i)}", "--", *argv]

    def cut(self, i: int) -> None:
        """Partition node ``i`` (its veth down); ``heal`` undoes it."""
        _ip("link", "set", self.veth(i), "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "up")

    def close(self) -> None:
        while self.made:
            kind, name = self.made.pop()
            with contextlib.suppress(subprocess.CalledProcessError):
                if kind == "ns":
                    _ip("netns", "delete", name)
                else:
                    _ip("link", "delete", name, check=False)
