"""Child processes stopped by PID, descendants included, and loopback ports.

Flower starts some helpers (``flower-superexec``) in new sessions, so a process-group kill
does not reach them; every process started here is stopped by walking its tree in ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TypeAlias

__all__ = [
    "Process",
    "check_running",
    "descendants",
    "free_port",
    "is_zombie",
    "managed_process",
    "program",
    "stop_process",
    "wait_for_port",
]

#: A child process started here (binary output, to a log file).
Process: TypeAlias = subprocess.Popen[bytes]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
