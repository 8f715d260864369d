"""Rate-limited links: one network namespace per node, joined to the host by a shaped veth pair.

``shaped_links(count, uplink_bps=..., downlink_bps=...)`` gives each node its own Linux network
namespace and a veth pair to the host, with a private /30 (``10.231.0.0/16``): the host end
holds ``host_address`` (a relay for that node listens there) and the namespace end
``node_address``. Both directions are shaped by the kernel's token-bucket filter (``tbf``) on
the sending side of the pair:

* uplink (node to host): egress of the namespace-side veth;
* downlink (host to node): egress of the host-side veth.

``tbf`` parameters, the same for both directions:

* ``rate``: the configured bit rate. It counts Ethernet frames (IP and TCP headers included),
  so a bulk TCP transfer's goodput is about ``1448 / 1514`` (~0.956) of it.
* ``burst``: the larger of two full frames (``2 * 1514`` bytes) and 10 ms of the rate. 10 ms is
  ``rate / HZ`` at ``HZ = 100``, the coarsest kernel tick in use, so the bucket can refill
  between ticks at any rate; two frames so that a full-sized frame always fits.
* ``latency``: ``QUEUE_LATENCY_MS`` (1 s) of queue at the rate (more if the burst takes longer
  to send). The sender sees the queue as its own device's, and Linux TCP recovers from drops
  there unevenly: with 200 ms we measured ~65 drops per 187 kB sent at 1 mbit and, now and
  then, a stall of ~0.45 s (a retransmission timeout); with 1 s, no drop. The cost is up to
  that much queueing delay behind a bulk transfer, as on many real access links.

Names carry the PID of the process that made them and a counter of the links it made
(``<prefix>-<pid>-<i>`` for namespaces, ``<prefix><pid>h<i>``/``<prefix><pid>n<i>`` for the
host and namespace ends; ``i`` counts modulo 1000), so parallel runs never collide and
``cleanup_stale(prefix)`` can delete what crashed runs left behind. Address blocks are chosen
under a file lock, skipping any /30 that overlaps an address or route of the host.

Nothing here touches an interface it did not create: only loopback inside the namespaces and
the veths made here are configured.

Needs Linux, root, and ``ip`` and ``tc`` (iproute2); ``shaping_unavailable()`` says why not.
``netem`` is not used: it is missing from some kernels, and no delay is added.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import ipaddress
import itertools
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fedsparse.lab.launch.processes import Process, check_running, raise_if_stopping

__all__ = [
    "DEFAULT_PREFIX",
    "FRAME_BYTES",
    "InNamespace",
    "NodeLink",
    "QUEUE_LATENCY_MS",
    "burst_bytes",
    "cleanup_stale",
    "format_rate",
    "parse_rate",
    "shaped_links",
    "shaping_unavailable",
    "socket_in",
    "wait_for_port_in",
]

DEFAULT_PREFIX = "fsn"
_PROBE_PREFIX = "fsp"
#: The largest frame on a veth with MTU 1500 (14 bytes of Ethernet header).
FRAME_BYTES = 1514
#: Seconds of rate the token bucket may hold (``rate / HZ`` at ``HZ = 100``).
BURST_SECONDS = 0.01
#: How long a packet may wait in a ``tbf`` queue before it is dropped.
QUEUE_LATENCY_MS = 1000
#: Addresses come from here, one /30 per node.
ADDRESS_POOL = ipaddress.IPv4Network("10.231.0.0/16")
_BLOCKS = ADDRESS_POOL.num_addresses // 4
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = Path("/var/run/netns")
_LOCK_FILE = Path(tempfile.gettempdir()) / "fedsparse-netns.lock"
_PREFIX_RE = re.compile(r"[a-z]{1,4}")
# IFNAMSIZ is 16 with the NUL: prefix (<= 4) + pid (<= 7 digits) + h/n + index (<= 3) = 15.
_MAX_COUNT = 1000

# -- rates ------------------------------------------------------------------------------------

_UNITS = {"": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_RATE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*")


def parse_rate(text: str, *, field: str = "rate") -> float:
    """A bit rate in bit/s from ``text``: ``2000000``, ``500kbit``, ``1mbit``, ``1.5Gbit``.

    Units are tc's bit units, case-insensitive, decimal (``kbit`` = 1000 bit/s): ``bit``,
    ``kbit``, ``mbit``, ``gbit``; a bare number is bit/s. tc's byte units (``bps``, ``kbps``,
    ``mbps``: bytes per second) are refused, because "mbps" usually means megabits to a reader
    and tc would take it as megabytes, an 8x difference.

    Raises:
        ValueError: naming ``field`` and the value, for anything else, zero, or a non-finite
            rate.
    """
    expected = "expected a rate like 1mbit, 500kbit or 2000000 (bit/s)"
    match = _RATE_RE.fullmatch(text.lower())
    if match is None:
        raise ValueError(f"{field}={text!r}: {expected}")
    number, unit = match.groups()
    if unit.endswith("bps"):
        bits = f"{unit[:-3]}bit"
        raise ValueError(
            f"{field}={text!r}: {unit!r} is ambiguous (tc reads it as bytes per second); "
            f"write bits, e.g. {number}{bits}"
        )
    if unit not in _UNITS:
        raise ValueError(f"{field}={text!r}: {expected}")
    rate = float(number) * _UNITS[unit]
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"{field}={text!r}: expected a rate > 0")
    return rate


def format_rate(bps: float) -> str:
    """``bps`` in tc's syntax (integer bit/s, which tc accepts at any size)."""
    return f"{round(bps)}bit"


def burst_bytes(bps: float) -> int:
    """The token-bucket size for ``bps``: two full frames or ``BURST_SECONDS`` of the rate."""
    return max(2 * FRAME_BYTES, math.ceil(bps / 8 * BURST_SECONDS))


# -- commands ---------------------------------------------------------------------------------


def _run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(args), capture_output=True, text=True, check=False, timeout=30)
    if check and result.returncode != 0:
        message = (result.stderr or result.stdout).strip()
        raise RuntimeError(f"{' '.join(args)}: exit {result.returncode}: {message}")
    return result


@functools.cache
def shaping_unavailable() -> str | None:
    """None if this process can make shaped links, else why not (one line).

    Checks the platform, root, ``ip`` and ``tc``, then makes and deletes one shaped link. The
    answer is cached for the life of the process.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"network namespaces and tc need root (euid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool!r} (iproute2) not found on PATH"
    try:
        with shaped_links(1, uplink_bps=1e6, downlink_bps=1e6, prefix=_PROBE_PREFIX):
            pass
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        return f"shaped-link probe failed: {str(err).splitlines()[0]}"
    return None


# -- links ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class NodeLink:
    """One node's namespace and its shaped veth pair (rates in bit/s; None: not shaped)."""

    namespace: str
    host_interface: str
    node_interface: str
    host_address: str  # the host end: listen here for this node
    node_address: str  # the namespace end: the node's source address
    uplink_bps: float | None
    downlink_bps: float | None

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` run inside this namespace (``ip netns exec <namespace> ...``)."""
        return ["ip", "netns", "exec", self.namespace, *args]


_indices = itertools.count()
_indices_lock = threading.Lock()


def _names(prefix: str) -> tuple[str, str, str]:
    """Namespace, host end and namespace end names, new in this process."""
    with _indices_lock:  # an index per link made by this process, so calls never collide
        index = next(_indices) % _MAX_COUNT
    pid = os.getpid()
    return f"{prefix}-{pid}-{index}", f"{prefix}{pid}h{index}", f"{prefix}{pid}n{index}"


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network on this host's addresses and routes (the host namespace)."""
    found = []
    for line in _run(["ip", "-4", "-o", "addr", "show"]).stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            found.append(ipaddress.IPv4Network(fields[fields.index("inet") + 1], strict=False))
    for line in _run(["ip", "-4", "route", "show", "table", "all"]).stdout.splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest[:1].isdigit():
            found.append(ipaddress.IPv4Network(dest, strict=False))
    return found


def _free_blocks(count: int) -> list[ipaddress.IPv4Network]:
    """``count`` /30s of ``ADDRESS_POOL`` overlapping nothing in use, starting at a PID hash."""
    used = [net for net in _used_networks() if net.prefixlen > 0]  # a default route is fine
    start = (os.getpid() * 97) % _BLOCKS
    blocks: list[ipaddress.IPv4Network] = []
    for step in range(_BLOCKS):
        block = ipaddress.IPv4Network(
            (int(ADDRESS_POOL.network_address) + 4 * ((start + step) % _BLOCKS), 30)
        )
        if not any(block.overlaps(net) for net in used):
            blocks.append(block)
            if len(blocks) == count:
                return blocks
    raise RuntimeError(f"no {count} free /30 blocks left in {ADDRESS_POOL}")


def _tbf(bps: float) -> list[str]:
    burst = burst_bytes(bps)
    latency_ms = max(QUEUE_LATENCY_MS, math.ceil(burst / (bps / 8) * 1000))
    return ["tbf", "rate", format_rate(bps), "burst", str(burst), "latency", f"{latency_ms}ms"]


def _create(link: NodeLink) -> None:
    ns, host_if, node_if = link.namespace, link.host_interface, link.node_interface
    _run(["ip", "netns", "add", ns])
    # The peer is created inside the namespace: no moment with both ends on the host.
    _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", node_if, "netns", ns])
    _run(["ip", "addr", "add", f"{link.host_address}/30", "dev", host_if])
    _run(["ip", "-n", ns, "addr", "add", f"{link.node_address}/30", "dev", node_if])
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    _run(["ip", "-n", ns, "link", "set", node_if, "up"])
    _run(["ip", "link", "set", host_if, "up"])
    if link.uplink_bps is not None:
        _run(["tc", "-n", ns, "qdisc", "add", "dev", node_if, "root", *_tbf(link.uplink_bps)])
    if link.downlink_bps is not None:
        _run(["tc", "qdisc", "add", "dev", host_if, "root", *_tbf(link.downlink_bps)])


def _delete(namespace: str, host_interface: str) -> None:
    """Deletes the pair (from the host end) and the namespace; absent ones are fine."""
    _run(["ip", "link", "del", host_interface], check=False)
    _run(["ip", "netns", "del", namespace], check=False)


def _check_rate(name: str, bps: float | None) -> None:
    if bps is not None and not (math.isfinite(bps) and bps > 0):
        raise ValueError(f"{name}={bps}: expected a rate > 0 in bit/s, or None")


@contextlib.contextmanager
def shaped_links(
    count: int,
    *,
    uplink_bps: float | None,
    downlink_bps: float | None,
    prefix: str = DEFAULT_PREFIX,
) -> Iterator[list[NodeLink]]:
    """``count`` namespaces, each joined to the host by a veth pair shaped by ``tbf``.

    Deletes leftovers of dead runs with the same ``prefix`` first, and everything it made on
    exit, whatever the exit (an exception, ``KeyboardInterrupt``). Processes still running in a
    namespace keep it alive but lose their link: stop them before leaving the block.

    Args:
        count: links to make (1 to 1000).
        uplink_bps: node-to-host rate in bit/s (None: unshaped).
        downlink_bps: host-to-node rate in bit/s (None: unshaped).
        prefix: 1 to 4 lowercase letters starting every name made here.

    Raises:
        ValueError: a bad argument. RuntimeError: an ``ip``/``tc`` command failed.
    """
    if not 1 <= count <= _MAX_COUNT:
        raise ValueError(f"count={count}: expected 1 <= count <= {_MAX_COUNT}")
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"prefix={prefix!r}: expected 1 to 4 lowercase letters")
    _check_rate("uplink_bps", uplink_bps)
    _check_rate("downlink_bps", downlink_bps)
    cleanup_stale(prefix)
    made: list[tuple[str, str]] = []
    try:
        links = []
        with _address_lock():
            for block in _free_blocks(count):
                namespace, host_if, node_if = _names(prefix)
                host, node = list(block.hosts())
                link = NodeLink(
                    namespace=namespace,
                    host_interface=host_if,
                    node_interface=node_if,
                    host_address=str(host),
                    node_address=str(node),
                    uplink_bps=uplink_bps,
                    downlink_bps=downlink_bps,
                )
                made.append((namespace, host_if))
                _create(link)
                links.append(link)
        yield links
    finally:
        for namespace, host_if in reversed(made):
            _delete(namespace, host_if)


@contextlib.contextmanager
def _address_lock() -> Iterator[None]:
    """Serializes address choice and assignment between processes on this machine."""
    with open(_LOCK_FILE, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Deletes namespaces and veths named with ``prefix`` whose creator PID is gone.

    A PID reused by an unrelated process keeps its leftovers until that process exits.
    Returns the names deleted.
    """
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"prefix={prefix!r}: expected 1 to 4 lowercase letters")
    ns_re = re.compile(rf"{prefix}-(\d+)-\d+")
    if_re = re.compile(rf"{prefix}(\d+)[hn]\d+")
    deleted = []
    for line in _run(["ip", "-o", "link", "show"]).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        match = if_re.fullmatch(name)
        if match and not _alive(int(match.group(1))):
            _run(["ip", "link", "del", name], check=False)
            deleted.append(name)
    for line in _run(["ip", "netns", "list"]).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = ns_re.fullmatch(name)
        if match and not _alive(int(match.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            deleted.append(name)
    return deleted


# -- sockets inside a namespace -------------------------------------------------------------


def socket_in(
    namespace: str, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM
) -> socket.socket:
    """A new socket in ``namespace``, usable from any thread of this process.

    A socket belongs to the network namespace of the thread that created it, for life; so a
    short-lived thread enters the namespace (``setns``, which moves only the calling thread),
    creates the socket and exits. Nothing else in the process changes namespace.
    """
    result: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(_NETNS_DIR / namespace) as handle:
                if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns({namespace}): {os.strerror(errno)}")
            result.append(socket.socket(family, kind))
        except BaseException as err:  # re-raised in the caller's thread
            result.append(err)

    thread = threading.Thread(target=make, name=f"setns-{namespace}", daemon=True)
    thread.start()
    thread.join()
    [made] = result
    if isinstance(made, BaseException):
        raise made
    return made


class InNamespace(Protocol):
    """Anything naming a network namespace (``NodeLink``, ``hosts.NetnsHost``)."""

    @property
    def namespace(self) -> str: ...


def wait_for_port_in(
    link: InNamespace,
    port: int,
    *,
    timeout: float,
    process: Process | None = None,
    host: str = "127.0.0.1",
) -> None:
    """Waits until ``host:port`` inside ``link``'s namespace accepts TCP connections.

    By default the namespace's own loopback: what a process started with ``link.command(...)``
    listens on when told ``--host 127.0.0.1``.

    Raises:
        RuntimeError: if ``process`` exits first, or on timeout.
        KeyboardInterrupt: if a stop was requested (``processes.request_stop``).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raise_if_stopping()
        if process is not None:
            check_running([process])
        with socket_in(link.namespace) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(
        f"nothing listened on {host}:{port} in {link.namespace} within {timeout:.0f} s"
    )
