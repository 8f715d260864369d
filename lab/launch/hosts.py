"""Two "hosts" on one machine: two network namespaces joined by one veth pair, nothing else.

``host_pair()`` makes namespaces A and B, each with its own loopback and one end of a veth
pair holding one address of a private /30 (from ``netns.ADDRESS_POOL``, chosen under the same
lock as the shaped links). The pair is the only route between them, and neither reaches the
machine's own namespace (no link to it, no forwarding): a process in B reaches a process in A
only at ``A.address``, as a SuperNode on another machine reaches its SuperLink.
``tests/integration/test_two_hosts.py`` runs a SuperLink in A and SuperNodes in B this way.

Names follow ``lab/launch/netns.py`` (``<prefix>-<pid>-<i>``), so ``netns.cleanup_stale`` with
the same prefix deletes what a crashed run left behind; deleting a namespace deletes its end of
the pair and with it the pair. Needs what shaped links need (``netns.shaping_unavailable``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from fedsparse.lab.launch.netns import (
    _PREFIX_RE,
    _address_lock,
    _free_blocks,
    _names,
    _run,
    cleanup_stale,
)

__all__ = ["HOSTS_PREFIX", "NetnsHost", "host_pair"]

#: Prefix of the namespaces ``host_pair`` makes (``netns.cleanup_stale(HOSTS_PREFIX)``).
HOSTS_PREFIX = "fsh"


@dataclass(frozen=True, kw_only=True)
class NetnsHost:
    """One "host": a network namespace and its address on the link to the other host."""

    namespace: str
    interface: str  # its end of the veth pair, inside the namespace
    address: str  # on ``interface``: where the other host reaches it

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` run on this host (``ip netns exec <namespace> ...``)."""
        return ["ip", "netns", "exec", self.namespace, *args]


@contextlib.contextmanager
def host_pair(prefix: str = HOSTS_PREFIX) -> Iterator[tuple[NetnsHost, NetnsHost]]:
    """Two namespaces joined by a veth pair: ``(A, B)``; deleted on exit, however it exits.

    Leftovers of dead runs with the same ``prefix`` are deleted first. Processes still running
    in a namespace keep it alive but lose the link: stop them before leaving the block.

    Raises:
        ValueError: a bad ``prefix``. RuntimeError: an ``ip`` command failed.
    """
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"prefix={prefix!r}: expected 1 to 4 lowercase letters")
    cleanup_stale(prefix)
    made: list[str] = []
    try:
        with _address_lock():
            [block] = _free_blocks(1)
            first, second = (str(address) for address in block.hosts())
            (ns_a, if_a, _), (ns_b, if_b, _) = _names(prefix), _names(prefix)
            a = NetnsHost(namespace=ns_a, interface=if_a, address=first)
            b = NetnsHost(namespace=ns_b, interface=if_b, address=second)
            for host in (a, b):
                _run(["ip", "netns", "add", host.namespace])
                made.append(host.namespace)
            # Both ends are created inside their namespaces: never an interface on the machine.
            _run(
                ["ip", "-n", ns_a, "link", "add", if_a, "type", "veth"]
                + ["peer", "name", if_b, "netns", ns_b]
            )
            for host in (a, b):
                ns = host.namespace
                _run(["ip", "-n", ns, "addr", "add", f"{host.address}/30", "dev", host.interface])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["ip", "-n", ns, "link", "set", host.interface, "up"])
        yield a, b
    finally:
        for namespace in reversed(made):
            _run(["ip", "netns", "del", namespace], check=False)
