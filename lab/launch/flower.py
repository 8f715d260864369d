"""The Flower environment of a run: console scripts, ``FLWR_HOME``, run config, app bundle."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from fedsparse.client.node_policy import POLICY_ENV, SIMULATION_NODE_POLICY

__all__ = [
    "APP_DIR",
    "app_bundle_dir",
    "fab_size",
    "flower_logs_in_this_process",
    "flwr_env",
    "is_terminal",
    "format_run_config",
    "tool",
    "simulation_policy_env",
    "write_flwr_config",
]

#: The Flower app directory (holds ``pyproject.toml`` with ``[tool.flwr.app]``).
APP_DIR = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """Path of a console script installed next to this Python (the venv's Flower)."""
    candidate = BIN / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


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


def simulation_policy_env(state_dir: Path | None = None) -> dict[str, str]:
    """``FEDSPARSE_NODE_POLICY`` for processes whose simulated ClientApps it configures.

    Args:
        state_dir: where the simulated nodes keep their run state after each round they
            train (``client/state.py``), so that ``resume=true`` continues the run exactly;
            None keeps none (a resumed run then restarts the nodes' accountants).
    """
    policy = dict(SIMULATION_NODE_POLICY)
    if state_dir is not None:
        if any(c.isspace() for c in str(state_dir)):  # entries are separated by spaces
            raise ValueError(f"state_dir={str(state_dir)!r}: expected a path without spaces")
        policy["state-dir"] = str(state_dir)
    entries = " ".join(f"{k}={_toml(v)}" for k, v in policy.items())
    return {POLICY_ENV: entries}


def _toml(value: Any) -> str:
    """``value`` in TOML syntax (Flower's ``--run-config``/``--node-config`` values)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return repr(value)


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
        args += ["--run-config", f"{key}={_toml(value)}"]
    return args


def app_bundle_dir(out: Path, app_dir: Path = APP_DIR) -> Path:
    """A directory holding only the app's ``pyproject.toml``, for ``flwr run`` to bundle.

    ``flwr run`` packs the app directory into the bundle (FAB) that every SuperNode downloads
    when a run starts; from the repository root that is every ``.py``/``.md``/``.toml`` file,
    tests and docs included (~300 KB, twice the digits model). The ServerApp and ClientApp
    import the installed ``fedsparse`` package, so the bundle needs the run config and the
    components from ``pyproject.toml`` only (~3 KB). Flower 1.39's ``fab-exclude`` cannot do
    this: with any user pattern it rejects our ``.gitignore``.
    """
    bundle = Path(out) / ".app"
    bundle.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(app_dir) / "pyproject.toml", bundle / "pyproject.toml")
    return bundle


def fab_size(app_dir: Path = APP_DIR) -> int | None:
    """Bytes of the app bundle (FAB) ``flwr run`` would build now, or None if it cannot.

    Each SuperNode downloads the FAB once, when it pulls the run's first message (round 1).
    """
    try:
        from flwr.cli.build import build_fab_from_disk

        with warnings.catch_warnings():  # pathspec deprecations, once per ignore pattern
            warnings.simplefilter("ignore", DeprecationWarning)
            return len(build_fab_from_disk(Path(app_dir)))
    except Exception:  # informational only: a Flower API change must not fail the run
        return None


@contextlib.contextmanager
def flower_logs_in_this_process() -> Iterator[None]:
    """Flower's logger while the live table runs in this process: warnings and errors only
    (the table replaces the per-round INFO lines), each once, colored only on a terminal.

    Once: Opacus's import calls ``logging.basicConfig``, whose root handler would print every
    line of Flower's logger a second time (it propagates). Colored: Flower's console handler
    colors its level names always; its ``colored`` flag follows whether its stream is a
    terminal. Everything is restored after.
    """
    logger = logging.getLogger("flwr")
    level, propagate = logger.level, logger.propagate
    colored = [(h, h.colored) for h in logger.handlers if hasattr(h, "colored")]
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    for handler, _ in colored:
        handler.colored = is_terminal(getattr(handler, "stream", None))  # type: ignore[attr-defined]
    try:
        yield
    finally:
        logger.setLevel(level)
        logger.propagate = propagate
        for handler, was in colored:
            handler.colored = was  # type: ignore[attr-defined]


def is_terminal(stream: object) -> bool:
    """Whether ``stream`` is a terminal (a closed or odd stream is not)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False
