"""Child processes stopped by PID, descendants included, and loopback ports.

Flower starts some helpers (``flower-superexec``) in new sessions, so a process-group kill
does not reach them; every process started here is stopped by walking its tree in ``/proc``.

Every child starts in its own session, so a signal sent to the command line (SIGINT from a
terminal, SIGTERM from ``timeout``/CI/systemd, SIGHUP from a closed terminal) reaches only the
command line itself: ``request_stop`` (called by its signal handler) makes every wait loop
here raise ``KeyboardInterrupt`` in whichever thread runs it, so each launcher unwinds
through its ``managed_process`` blocks and stops its children, also from worker threads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TypeAlias

from fedsparse.server.launch_markers import STOP_FILE

__all__ = [
    "Process",
    "check_running",
    "clear_stop",
    "descendants",
    "free_port",
    "is_zombie",
    "managed_process",
    "program",
    "raise_if_stopping",
    "request_stop",
    "stop_process",
    "stop_requested",
    "stopping_processes",
    "watch_run_dir",
    "wait_for_port",
]

#: A child process started here (binary output, to a log file).
Process: TypeAlias = subprocess.Popen[bytes]


_STOP = threading.Event()
_RUN_DIRS: set[Path] = set()  # out-dirs of the runs this process launched (watch_run_dir)
_RUN_DIRS_LOCK = threading.RLock()  # re-entrant: request_stop runs in signal handlers
_STOPPING = [0]  # stop_process calls under way in this process (signal handlers must wait)


def stopping_processes() -> bool:
    """Whether a ``stop_process`` is under way: a signal must not interrupt that clean-up."""
    return _STOPPING[0] > 0


def watch_run_dir(out: Path) -> None:
    """Registers a run's out-dir: ``request_stop`` writes its ``STOP_FILE`` (a stale one goes).

    Called for every run this process launches (``launch.prepare_run``), before its ServerApp
    starts.
    """
    out = Path(out)
    (out / STOP_FILE).unlink(missing_ok=True)
    with _RUN_DIRS_LOCK:
        _RUN_DIRS.add(out)


def request_stop() -> None:
    """Asks every wait loop in this process, in every thread, to raise ``KeyboardInterrupt``.

    First it writes ``STOP_FILE`` into the out-dir of every run this process launched: their
    ServerApps then record no further round (``server/run_records.py``). This happens before
    any process is signalled, so a round whose clients die in the clean-up (a Ray actor killed
    under its ClientApp replies with an error) cannot reach the checkpoint as a partial round.
    """
    with _RUN_DIRS_LOCK:
        dirs = sorted(_RUN_DIRS)
    for out in dirs:
        with contextlib.suppress(OSError):  # a deleted run dir has no ServerApp to tell
            (out / STOP_FILE).write_text("the launcher is stopping this run\n")
    _STOP.set()


def stop_requested() -> bool:
    """Whether ``request_stop`` was called (and not ``clear_stop``-ed since)."""
    return _STOP.is_set()


def clear_stop() -> None:
    """Forgets an earlier ``request_stop`` (tests; a command line starts cleared)."""
    _STOP.clear()


def raise_if_stopping() -> None:
    """Raises ``KeyboardInterrupt`` if a stop was requested (called by the wait loops)."""
    if _STOP.is_set():
        raise KeyboardInterrupt("stop requested")


#: Ports ``free_port`` has handed out in this process: never handed out twice.
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and not handed out before.

    The kernel may return a port again once its probe socket is closed (a deployment asks
    for a SuperLink's two ports and one per SuperNode before any of them binds), so this
    process never hands out the same port twice.
    """
    with _HANDED_OUT_LOCK:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


def program(process: Process) -> str:
    """The program ``process`` runs (its first argument), for messages."""
    args = process.args
    return os.fsdecode(args if isinstance(args, str | bytes | os.PathLike) else args[0])


def check_running(processes: Iterable[Process]) -> None:
    """Raises ``RuntimeError`` naming the first of ``processes`` that has exited, if any."""
    for process in processes:
        if process.poll() is not None:
            raise RuntimeError(f"{program(process)} exited with code {process.returncode}")


def wait_for_port(port: int, *, timeout: float, process: Process | None = None) -> None:
    """Waits until 127.0.0.1:port accepts TCP connections.

    Raises:
        RuntimeError: if ``process`` exits first, or on timeout.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raise_if_stopping()
        if process is not None:
            check_running([process])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listened on 127.0.0.1:{port} within {timeout:.0f} s")


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of ``pid`` (Linux ``/proc``; empty elsewhere).

    Flower starts some helpers (``flower-superexec``) in new sessions, so a process-group
    kill does not reach them; stopping by PID walks the tree instead.
    """
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _signal_all(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_process(process: Process, *, grace: float = 10.0) -> None:
    """Stops ``process`` and all its descendants by PID: SIGTERM, then SIGKILL after ``grace``."""
    _STOPPING[0] += 1
    try:
        _stop_tree(process, grace=grace)
    finally:
        _STOPPING[0] -= 1


def _stop_tree(process: Process, *, grace: float) -> None:
    tree = descendants(process.pid)
    if process.poll() is None:
        _signal_all([process.pid], signal.SIGTERM)
    _signal_all(tree, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        alive = [p for p in tree if Path(f"/proc/{p}").exists() and not is_zombie(p)]
        if process.poll() is not None and not alive:
            return
        time.sleep(0.2)
    _signal_all([p for p in [process.pid, *tree] if Path(f"/proc/{p}").exists()], signal.SIGKILL)
    process.wait(timeout=grace)


def is_zombie(pid: int) -> bool:
    """Whether ``pid`` is a zombie (exited, not yet reaped) or gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@contextmanager
def managed_process(
    args: Sequence[str], *, env: Mapping[str, str], log: IO[bytes], cwd: Path | None = None
) -> Iterator[Process]:
    """Starts ``args`` in its own process group; stops the group by PID on exit."""
    process = subprocess.Popen(
        list(args),
        env=dict(env),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        yield process
    finally:
        stop_process(process)
