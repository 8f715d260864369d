"""A byte-counting TCP relay, to measure what really crosses the wire between two processes.

``ByteRelay`` listens on 127.0.0.1 and, for every connection it accepts, opens one to a fixed
target and copies bytes both ways, unchanged: it never parses them, so it works for gRPC's
long-lived HTTP/2 streams and for TLS alike (it sees, and counts, the ciphertext). It counts
application-level stream bytes per direction and per connection, client to target as ``"up"``
and target to client as ``"down"``, and keeps a time series of ``(unix_time, connection,
direction, nbytes)`` records so that bytes can be attributed to time windows. TCP/IP headers,
ACKs and retransmissions are below what a socket sees and are not counted.

Each record's time is when the chunk was read (``time.time()``, the system's wall clock), so it
can be matched with timestamps written by other processes on the same machine.

Threads: one acceptor, and two pumps per connection (one per direction). A pump that reads EOF
half-closes the other side (``shutdown(SHUT_WR)``) and the connection's sockets are closed once
both directions are done; an error in either direction aborts both.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal

__all__ = ["DIRECTIONS", "ByteRelay", "ConnectionStats", "Record"]

Direction = Literal["up", "down"]
#: ``up``: client to target (e.g. SuperNode to SuperLink); ``down``: target to client.
DIRECTIONS: tuple[Direction, Direction] = ("up", "down")


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
    """Forwards TCP connections from ``127.0.0.1:<port>`` to ``target``, counting bytes.

    Use as a context manager (``with ByteRelay(("127.0.0.1", 9092)) as relay:``) or call
    ``start()`` and ``stop()``. All accessors are thread-safe and may be called while relaying.

    Args:
        target: ``(host, port)`` every accepted connection is forwarded to.
        port: port to listen on; 0 (default) picks a free one (see ``port`` after ``start``).
        bufsize: largest chunk read at once.
        connect_timeout: seconds allowed to connect to ``target``; if that fails, the accepted
            connection is closed (it still counts in ``connection_count``).
    """

    def __init__(
        self,
        target: tuple[str, int],
        *,
        port: int = 0,
        bufsize: int = 65536,
        connect_timeout: float = 10.0,
    ) -> None:
        if bufsize < 1:
            raise ValueError(f"bufsize={bufsize}: expected >= 1")
        self.target = target
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
        """``127.0.0.1:<port>``, for a client's server-address option."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> ByteRelay:
        """Binds the listener and starts accepting; returns ``self``."""
        if self._listener is not None:
            raise RuntimeError("ByteRelay already started")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self._requested_port))
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
        try:
            while chunk := src.recv(self._bufsize):
                # Counted before it is sent on, so a receiver never gets ahead of the count.
                self._count(conn, direction, len(chunk))
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
