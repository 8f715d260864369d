"""A byte-counting TCP relay, to measure what really crosses the wire between two processes.

``ByteRelay`` listens on 127.0.0.1 (or ``listen_host``) and, for every connection it accepts,
opens one to a fixed target and copies bytes both ways, unchanged: it never parses them, so it
works for gRPC's long-lived HTTP/2 streams and for TLS alike (it sees, and counts, the
ciphertext). It counts application-level stream bytes per direction and per connection, client
to target as ``"up"`` and target to client as ``"down"``, and keeps a time series of
``(unix_time, connection, direction, nbytes)`` records so that bytes can be attributed to time
windows. TCP/IP headers, ACKs and retransmissions are below what a socket sees and are not
counted.

Each record's time is when the chunk was read (``time.time()``, the system's wall clock), so it
can be matched with timestamps written by other processes on the same machine.

Threads: one acceptor, and two pumps per connection (one per direction). A pump that reads EOF
half-closes the other side (``shutdown(SHUT_WR)``) and the connection's sockets are closed once
both directions are done; an error in either direction aborts both.

Fallback shaping: with ``uplink_bps``/``downlink_bps`` the relay also rate-limits a direction
with a token bucket shared by all its connections (one relay per node: the node's link). This
is for machines where kernel shaping (``lab/launch/netns.py``) is unavailable, and differs from it:
the rate counts application bytes (no headers, so the goodput equals the rate, where a ``tbf``
link's is ~0.956 of it), and the bucket delays a chunk after it was read and counted, so a
record's time can be ahead of the chunk's delivery by up to one bucket (``relay_burst_bytes``,
4 KiB or 10 ms of the rate, if larger) per connection sending in that direction at once. The
byte counts are the same either way.
"""

from __future__ import annotations

import contextlib
import math
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal

__all__ = ["DIRECTIONS", "ByteRelay", "ConnectionStats", "Record", "relay_burst_bytes"]

Direction = Literal["up", "down"]
#: ``up``: client to target (e.g. SuperNode to SuperLink); ``down``: target to client.
DIRECTIONS: tuple[Direction, Direction] = ("up", "down")


def relay_burst_bytes(bps: float) -> int:
    """The fallback token bucket's size for ``bps``: 4 KiB or 10 ms of the rate, if larger."""
    return max(4096, math.ceil(bps / 8 * 0.01))


class _TokenBucket:
    """Bytes may pass at ``bps / 8`` per second, ``burst`` at once; thread-safe.

    ``take(n)`` spends ``n`` tokens at once, going into debt if need be, and returns how long
    the caller must wait before sending (until the debt is paid): callers after it wait for
    that debt too, so the rate holds across threads, first come first served.
    """

    def __init__(self, bps: float) -> None:
        self.rate = bps / 8
        self.burst = relay_burst_bytes(bps)
        self._tokens = float(self.burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> float:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            return max(0.0, -self._tokens / self.rate)


@dataclass(frozen=True)
class Record:
    """``nbytes`` read from one side of connection ``connection`` at unix time ``time``."""

    time: float
    connection: int
    direction: Direction
    nbytes: int


@dataclass
class ConnectionStats:
    """Bytes relayed over one accepted connection (a snapshot when returned by the relay)."""

    id: int
    opened_at: float
    closed_at: float | None = None
    up: int = 0
    down: int = 0


@dataclass
class _Connection:
    stats: ConnectionStats
    client: socket.socket
    upstream: socket.socket | None = None
    pumps_left: int = 2
    threads: list[threading.Thread] = field(default_factory=list)


class ByteRelay:
    """Forwards TCP connections from ``<listen_host>:<port>`` to ``target``, counting bytes.

    Use as a context manager (``with ByteRelay(("127.0.0.1", 9092)) as relay:``) or call
    ``start()`` and ``stop()``. All accessors are thread-safe and may be called while relaying.

    Args:
        target: ``(host, port)`` every accepted connection is forwarded to.
        port: port to listen on; 0 (default) picks a free one (see ``port`` after ``start``).
        listen_host: IPv4 address to listen on (e.g. a ``NodeLink.host_address``).
        bufsize: largest chunk read at once.
        connect_timeout: seconds allowed to connect to ``target``; if that fails, the accepted
            connection is closed (it still counts in ``connection_count``).
        uplink_bps: fallback shaping of client-to-target bytes, in bit/s (None: none).
        downlink_bps: fallback shaping of target-to-client bytes, in bit/s (None: none).
    """

    def __init__(
        self,
        target: tuple[str, int],
        *,
        port: int = 0,
        bufsize: int = 65536,
        connect_timeout: float = 10.0,
        listen_host: str = "127.0.0.1",
        uplink_bps: float | None = None,
        downlink_bps: float | None = None,
    ) -> None:
        if bufsize < 1:
            raise ValueError(f"bufsize={bufsize}: expected >= 1")
        for name, bps in (("uplink_bps", uplink_bps), ("downlink_bps", downlink_bps)):
            if bps is not None and not (math.isfinite(bps) and bps > 0):
                raise ValueError(f"{name}={bps}: expected a rate > 0 in bit/s, or None")
        self.target = target
        self.listen_host = listen_host
        self.uplink_bps = uplink_bps
        self.downlink_bps = downlink_bps
        self._buckets: dict[Direction, _TokenBucket | None] = {
            "up": None if uplink_bps is None else _TokenBucket(uplink_bps),
            "down": None if downlink_bps is None else _TokenBucket(downlink_bps),
        }
        self._requested_port = port
        self._bufsize = bufsize
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._port: int | None = None
        self._acceptor: threading.Thread | None = None
        self._connections: list[_Connection] = []
        self._records: list[Record] = []
        self._totals = {"up": 0, "down": 0}
        self.started_at: float | None = None
        self.stopped_at: float | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port the relay listens (or listened) on, once started."""
        if self._port is None:
            raise RuntimeError("ByteRelay not started")
        return self._port

    @property
    def address(self) -> str:
        """``<listen_host>:<port>``, for a client's server-address option."""
        return f"{self.listen_host}:{self.port}"

    def start(self) -> ByteRelay:
        """Binds the listener and starts accepting; returns ``self``."""
        if self._listener is not None:
            raise RuntimeError("ByteRelay already started")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.listen_host, self._requested_port))
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._port = int(listener.getsockname()[1])
        self.started_at = time.time()
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"relay-accept-{self.port}", daemon=True
        )
        self._acceptor.start()
        return self

    def stop(self, *, timeout: float = 5.0) -> None:
        """Stops accepting, aborts every open connection, closes all sockets, joins threads."""
        if self._listener is None or self._stopping.is_set():
            return
        self._stopping.set()
        if self._acceptor is not None:
            self._acceptor.join(timeout)
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            self._abort(conn)
        deadline = time.monotonic() + timeout
        for conn in connections:
            for thread in conn.threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        for conn in connections:
            self._close(conn)
        self.stopped_at = time.time()

    def __enter__(self) -> ByteRelay:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- accessors ---------------------------------------------------------------------------

    def totals(self) -> dict[str, int]:
        """Bytes relayed so far: ``{"up": ..., "down": ...}``."""
        with self._lock:
            return dict(self._totals)

    def window(self, t0: float, t1: float) -> dict[str, int]:
        """Bytes read in the unix-time window ``[t0, t1)``: ``{"up": ..., "down": ...}``."""
        sums = {"up": 0, "down": 0}
        for record in self.records():
            if t0 <= record.time < t1:
                sums[record.direction] += record.nbytes
        return sums

    def records(self) -> list[Record]:
        """A copy of the time series, in the order the chunks were read."""
        with self._lock:
            return list(self._records)

    def connection_count(self) -> int:
        """Connections accepted so far (open or closed)."""
        with self._lock:
            return len(self._connections)

    def open_connections(self) -> int:
        """Connections accepted and not yet closed."""
        with self._lock:
            return sum(1 for c in self._connections if c.stats.closed_at is None)

    def connections(self) -> list[ConnectionStats]:
        """Per-connection byte counts (copies)."""
        with self._lock:
            return [ConnectionStats(**vars(c.stats)) for c in self._connections]

    def threads(self) -> list[threading.Thread]:
        """Every thread this relay started (for tests: none alive after ``stop``)."""
        with self._lock:
            pumps = [t for c in self._connections for t in c.threads]
        return [t for t in (self._acceptor, *pumps) if t is not None]

    # -- internals ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            while not self._stopping.is_set():
                if not selector.select(timeout=0.1):
                    continue
                try:
                    client, _ = self._listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    return
                self._open(client)

    def _open(self, client: socket.socket) -> None:
        client.setblocking(True)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            stats = ConnectionStats(id=len(self._connections), opened_at=time.time())
            conn = _Connection(stats=stats, client=client)
            self._connections.append(conn)
        try:
            upstream = socket.create_connection(self.target, timeout=self._connect_timeout)
        except OSError:
            self._close(conn)
            return
        upstream.settimeout(None)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            conn.upstream = upstream
            stopping = self._stopping.is_set()
            if not stopping:
                conn.threads = [
                    threading.Thread(
                        target=self._pump,
                        args=(conn, src, dst, direction),
                        name=f"relay-{self.port}-{stats.id}-{direction}",
                        daemon=True,
                    )
                    for src, dst, direction in (
                        (client, upstream, "up"),
                        (upstream, client, "down"),
                    )
                ]
        if stopping:
            self._close(conn)
            return
        for thread in conn.threads:
            thread.start()

    def _pump(
        self, conn: _Connection, src: socket.socket, dst: socket.socket, direction: Direction
    ) -> None:
        bucket = self._buckets[direction]
        size = self._bufsize if bucket is None else min(self._bufsize, bucket.burst)
        try:
            while chunk := src.recv(size):
                # Counted before it is sent on, so a receiver never gets ahead of the count.
                self._count(conn, direction, len(chunk))
                if bucket is not None and (delay := bucket.take(len(chunk))) > 0:
                    self._stopping.wait(delay)
                dst.sendall(chunk)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)  # pass the EOF on (half-close)
        except OSError:
            self._abort(conn)
        finally:
            with self._lock:
                conn.pumps_left -= 1
                done = conn.pumps_left == 0
            if done:
                self._close(conn)

    def _count(self, conn: _Connection, direction: Direction, nbytes: int) -> None:
        with self._lock:
            self._records.append(Record(time.time(), conn.stats.id, direction, nbytes))
            self._totals[direction] += nbytes
            if direction == "up":
                conn.stats.up += nbytes
            else:
                conn.stats.down += nbytes

    @staticmethod
    def _abort(conn: _Connection) -> None:
        """Wakes both pumps of ``conn`` (their reads return or fail); closes nothing."""
        for sock in (conn.client, conn.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _close(self, conn: _Connection) -> None:
        for sock in (conn.client, conn.upstream):
            if sock is not None:
                sock.close()
        with self._lock:
            if conn.stats.closed_at is None:
                conn.stats.closed_at = time.time()
