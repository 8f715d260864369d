"""Starting and stopping Flower processes on loopback, for ``fedsparse simulate`` and tests.

``fedsparse simulate`` runs the real Flower path: a simulation-mode ``flower-superlink``
(Ray backend, clients in subprocess isolation) that this module starts on free 127.0.0.1
ports with a private ``FLWR_HOME``, then ``flwr run <app> <connection> --stream`` against
it. Every process started here is stopped by PID (its whole process group) on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = [
    "APP_DIR",
    "flwr_env",
    "format_run_config",
    "free_port",
    "managed_process",
    "descendants",
    "stop_process",
    "tool",
    "wait_for_port",
    "write_flwr_config",
]

#: The Flower app directory (holds ``pyproject.toml`` with ``[tool.flwr.app]``).
APP_DIR = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """Path of a console script installed next to this Python (the venv's Flower)."""
    candidate = BIN / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, *, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Waits until 127.0.0.1:port accepts TCP connections.

    Raises:
        RuntimeError: if ``process`` exits first, or on timeout.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with code {process.returncode}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listened on 127.0.0.1:{port} within {timeout:.0f} s")


def write_flwr_config(
    flwr_home: Path, *, name: str, control_port: int, root_certificates: Path | None = None
) -> None:
    """Writes ``$FLWR_HOME/config.toml`` with one SuperLink connection ``name``."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    lines = [
        "[superlink]",
        f'default = "{name}"',
        "",
        f"[superlink.{name}]",
        f'address = "127.0.0.1:{control_port}"',
    ]
    if root_certificates is None:
        lines.append("insecure = true")
    else:
        lines.append(f'root-certificates = "{root_certificates}"')
    (flwr_home / "config.toml").write_text("\n".join(lines) + "\n")


def flwr_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower processes: private FLWR_HOME, no update checks, no telemetry."""
    env = dict(os.environ)
    # Flower's processes spawn their helpers (flower-superexec, flwr-serverapp, ...) from PATH.
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        FLWR_HOME=str(flwr_home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def format_run_config(values: Mapping[str, Any]) -> list[str]:
    """``--run-config`` arguments, one ``key=value`` each, values in TOML syntax."""
    args = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = json.dumps(value)
        else:
            text = repr(value)
        args += ["--run-config", f"{key}={text}"]
    return args


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


def stop_process(process: subprocess.Popen, *, grace: float = 10.0) -> None:
    """Stops ``process`` and all its descendants by PID: SIGTERM, then SIGKILL after ``grace``."""
    tree = descendants(process.pid)
    if process.poll() is None:
        _signal_all([process.pid], signal.SIGTERM)
    _signal_all(tree, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        alive = [p for p in tree if Path(f"/proc/{p}").exists() and not _is_zombie(p)]
        if process.poll() is not None and not alive:
            return
        time.sleep(0.2)
    _signal_all([p for p in [process.pid, *tree] if Path(f"/proc/{p}").exists()], signal.SIGKILL)
    process.wait(timeout=grace)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@contextmanager
def managed_process(
    args: Sequence[str], *, env: Mapping[str, str], log: IO[bytes], cwd: Path | None = None
) -> Iterator[subprocess.Popen]:
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
