"""ByteRelay: exact byte counts both ways, half-close, windows, a clean stop, fallback shaping."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from fedsparse.lab.launch.relay import ByteRelay, relay_burst_bytes

Handler = Callable[[socket.socket], None]


@contextlib.contextmanager
def tcp_server(handler: Handler) -> Iterator[tuple[str, int]]:
    """A threaded 127.0.0.1 server running ``handler(conn)`` per connection; closes all on exit."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def serve(conn: socket.socket) -> None:
        with conn:
            handler(conn)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(30)
            thread = threading.Thread(target=serve, args=(conn,), daemon=True)
            thread.start()
            threads.append(thread)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield listener.getsockname()
    finally:
        stop.set()
        acceptor.join(5)
        listener.close()
        for thread in threads:
            thread.join(5)


def echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)


def count_then_answer(conn: socket.socket) -> None:
    """Reads to EOF (the client's half-close), then answers with the byte count and closes."""
    total = 0
    while data := conn.recv(65536):
        total += len(data)
    conn.sendall(f"received {total}".encode())


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(65536, n - got))
        assert chunk, f"EOF after {got} of {n} bytes"
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def connect(relay: ByteRelay) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", relay.port), timeout=30)
    return sock


def test_echo_counts_exact_bytes_both_ways() -> None:
    payload = b"hello, relay\n" * 100
    with tcp_server(echo) as target, ByteRelay(target) as relay, connect(relay) as sock:
        sock.sendall(payload)
        assert recv_exactly(sock, len(payload)) == payload
        assert relay.totals() == {"up": len(payload), "down": len(payload)}
        assert relay.connection_count() == 1
        [conn] = relay.connections()
        assert (conn.up, conn.down) == (len(payload), len(payload))


def test_half_close_passes_eof_and_keeps_the_other_direction_open() -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)
    with tcp_server(count_then_answer) as target, ByteRelay(target) as relay:
        with connect(relay) as sock:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)  # the server only answers after this EOF
            answer = recv_all(sock)  # ... and the relay passes the server's close on
        assert answer == f"received {len(payload)}".encode()
        assert relay.totals() == {"up": len(payload), "down": len(answer)}
        wait_until(lambda: relay.open_connections() == 0)
        [conn] = relay.connections()
        assert conn.closed_at is not None and conn.closed_at >= conn.opened_at


def test_large_transfers_on_many_concurrent_connections() -> None:
    sizes = [5 * 1024 * 1024 + i * 4099 for i in range(4)] + [1, 2, 3, 65536, 65537] * 4
    errors: list[BaseException] = []

    def client(size: int) -> None:
        try:
            data = os.urandom(size)
            with connect(relay) as sock:
                sender = threading.Thread(target=sock.sendall, args=(data,))
                sender.start()  # send and receive at once: the echo must not deadlock
                assert recv_exactly(sock, size) == data
                sender.join()
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    with tcp_server(echo) as target, ByteRelay(target) as relay:
        clients = [threading.Thread(target=client, args=(s,)) for s in sizes]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(60)
        assert errors == []
        assert relay.totals() == {"up": sum(sizes), "down": sum(sizes)}
        assert relay.connection_count() == len(sizes)
        per_conn = sorted((c.up, c.down) for c in relay.connections())
        assert per_conn == sorted((s, s) for s in sizes)
        records = relay.records()
        for direction in ("up", "down"):
            assert sum(r.nbytes for r in records if r.direction == direction) == sum(sizes)
        assert all(a.time <= b.time for a, b in zip(records, records[1:], strict=False))


def test_window_attributes_bytes_by_read_time() -> None:
    with tcp_server(echo) as target, ByteRelay(target) as relay, connect(relay) as sock:
        sock.sendall(b"a" * 1000)
        recv_exactly(sock, 1000)
        time.sleep(0.05)
        middle = time.time()
        time.sleep(0.05)
        sock.sendall(b"b" * 300)
        recv_exactly(sock, 300)
        end = time.time() + 1e-3
        assert relay.window(0.0, middle) == {"up": 1000, "down": 1000}
        assert relay.window(middle, end) == {"up": 300, "down": 300}
        assert relay.window(0.0, end) == relay.totals()
        assert relay.window(end, end + 10) == {"up": 0, "down": 0}
        assert relay.window(middle, middle) == {"up": 0, "down": 0}  # [t0, t1) is empty


def test_unreachable_target_closes_the_client() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]  # bound, not listening: connections are refused
        with ByteRelay(("127.0.0.1", dead_port), connect_timeout=2) as relay, connect(relay) as s:
            assert recv_all(s) == b""
            assert relay.totals() == {"up": 0, "down": 0}
            wait_until(lambda: relay.connection_count() == 1 and relay.open_connections() == 0)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc")
def test_stop_closes_every_socket_and_joins_every_thread() -> None:
    with tcp_server(echo) as target:
        before = _open_fds()
        relay = ByteRelay(target).start()
        port = relay.port
        clients = [connect(relay) for _ in range(5)]
        for sock in clients:
            sock.sendall(b"ping")
            assert recv_exactly(sock, 4) == b"ping"
        assert relay.open_connections() == 5
        relay.stop()
        assert [t.name for t in relay.threads() if t.is_alive()] == []
        assert relay.open_connections() == 0
        for sock in clients:  # the relay's ends are gone: EOF or reset
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(10) == b""
            sock.close()
        # nothing the relay opened is still open (the echo server closes its ends on EOF)
        wait_until(lambda: _open_fds() <= before)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        relay.stop()  # idempotent


def test_started_twice_and_not_started() -> None:
    relay = ByteRelay(("127.0.0.1", 9))
    with pytest.raises(RuntimeError, match="not started"):
        _ = relay.port
    with relay, pytest.raises(RuntimeError, match="already started"):
        relay.start()
    with pytest.raises(ValueError, match="bufsize=0"):
        ByteRelay(("127.0.0.1", 9), bufsize=0)


# -- fallback shaping (token bucket) ----------------------------------------------------------
# The bucket meters application bytes, so the ideal goodput is the rate itself. Its burst
# (``relay_burst_bytes``: 4 KiB at these rates) passes at once, under 2% of a 1.5 s transfer,
# and each sleep overshoots by well under 1 ms per 16 ms chunk. A busy 2-core machine can stall
# a pump, hence the wide lower bound; the upper bound is 5% over the rate, far below unshaped
# loopback (Gbit/s) and below the 4x that swapped directions would give.
LOW, HIGH = 0.8, 1.05
SECONDS = 1.5


def send_bytes(nbytes: int) -> Handler:
    payload = os.urandom(nbytes)

    def handler(conn: socket.socket) -> None:
        conn.sendall(payload)

    return handler


def test_relay_burst_covers_a_page_and_ten_milliseconds() -> None:
    assert relay_burst_bytes(1e6) == 4096
    assert relay_burst_bytes(1e9) == 1_250_000


def test_fallback_shaping_limits_each_direction_to_its_rate() -> None:
    up_bps, down_bps = 2e6, 8e6
    up_bytes, down_bytes = int(up_bps / 8 * SECONDS), int(down_bps / 8 * SECONDS)
    with (
        tcp_server(count_then_answer) as target,
        ByteRelay(target, uplink_bps=up_bps, downlink_bps=down_bps) as relay,
    ):
        payload = os.urandom(up_bytes)
        with connect(relay) as sock:
            start = time.perf_counter()
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            answer = recv_all(sock)
            up_seconds = time.perf_counter() - start
        assert answer == f"received {up_bytes}".encode()
        assert relay.totals() == {"up": up_bytes, "down": len(answer)}  # counts unchanged
    with (
        tcp_server(send_bytes(down_bytes)) as target,
        ByteRelay(target, uplink_bps=up_bps, downlink_bps=down_bps) as relay,
    ):
        with connect(relay) as sock:
            start = time.perf_counter()
            got = len(recv_all(sock))
            down_seconds = time.perf_counter() - start
        assert got == down_bytes
        assert relay.totals() == {"up": 0, "down": down_bytes}
        assert sum(r.nbytes for r in relay.records()) == down_bytes
    assert LOW <= up_bytes * 8 / up_seconds / up_bps <= HIGH, f"up: {up_seconds:.2f} s"
    assert LOW <= down_bytes * 8 / down_seconds / down_bps <= HIGH, f"down: {down_seconds:.2f} s"


def test_fallback_rate_is_shared_by_all_connections_of_a_relay() -> None:
    rate, clients = 4e6, 3
    per_client = int(rate / 8 * SECONDS / clients)
    with tcp_server(count_then_answer) as target, ByteRelay(target, uplink_bps=rate) as relay:

        def client() -> None:
            with connect(relay) as sock:
                sock.sendall(os.urandom(per_client))
                sock.shutdown(socket.SHUT_WR)
                assert recv_all(sock) == f"received {per_client}".encode()

        threads = [threading.Thread(target=client) for _ in range(clients)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        seconds = time.perf_counter() - start
        assert relay.totals()["up"] == clients * per_client
    # the burst is shared too: at most one bucket ahead of the rate in all
    assert LOW <= clients * per_client * 8 / seconds / rate <= HIGH, f"{seconds:.2f} s"


def test_stop_is_prompt_while_shaping_a_slow_transfer() -> None:
    with tcp_server(count_then_answer) as target:
        relay = ByteRelay(target, uplink_bps=64e3).start()  # 8 kB/s: 1 MB would take 2 min
        sock = connect(relay)

        def send() -> None:
            with contextlib.suppress(OSError):  # the relay goes away mid-send
                sock.sendall(os.urandom(1 << 20))

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        wait_until(lambda: relay.totals()["up"] > 0)
        start = time.monotonic()
        relay.stop()
        assert time.monotonic() - start < 2.0
        assert [t.name for t in relay.threads() if t.is_alive()] == []
        sock.close()
        sender.join(5)


def test_listen_host_is_where_the_relay_listens() -> None:
    with tcp_server(echo) as target, ByteRelay(target, listen_host="127.0.0.2") as relay:
        assert relay.address == f"127.0.0.2:{relay.port}"
        with socket.create_connection(("127.0.0.2", relay.port), timeout=5) as sock:
            sock.sendall(b"ping")
            assert recv_exactly(sock, 4) == b"ping"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", relay.port), timeout=2).close()


@pytest.mark.parametrize("bps", [0.0, -1.0, float("inf"), float("nan")])
def test_shaping_rates_must_be_positive(bps: float) -> None:
    with pytest.raises(ValueError, match=r"uplink_bps=.*expected a rate > 0"):
        ByteRelay(("127.0.0.1", 9), uplink_bps=bps)
    with pytest.raises(ValueError, match=r"downlink_bps=.*expected a rate > 0"):
        ByteRelay(("127.0.0.1", 9), downlink_bps=bps)
