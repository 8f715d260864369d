"""Flower's own way in: ``flwr run . --stream`` from the checkout, with the venv active, trains
the app on Flower's local simulation offline (no dependency installation: the venv's
``activate`` sets ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION``, the Makefile writes it),
and its simulated nodes hold the run's partitions (inside Flower's ``ClientAppActor`` a
ClientApp takes the simulation policy: ``client/guard.py: in_flower_simulation``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedsparse.common.wire.run_log import read_rounds

ROOT = Path(__file__).resolve().parents[2]
#: What the venv's ``activate`` sets (the Makefile writes it).
OFFLINE = "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"


def _stop_local_superlink(home: Path) -> None:
    """Stops the SuperLink ``flwr run`` started for ``home`` (detached, in its own session),
    and its children, by PID."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "flower-superlink" in cmdline and str(home) in cmdline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(proc.name), signal.SIGKILL)


@pytest.mark.slow
def test_flwr_run_trains_offline_on_flowers_local_simulation(tmp_path: Path) -> None:
    activate = Path(sys.executable).parent / "activate"
    assert f"{OFFLINE}=1" in activate.read_text(), (
        f"{activate}: not made by `make` (the Makefile adds the line that keeps flwr run offline)"
    )
    home, out = tmp_path / "flwr-home", tmp_path / "run"
    command = (
        f'source "{activate}" && cd "{ROOT}" && exec flwr run . --stream '
        f"--run-config \"num-rounds=1 final-rate=0.5 out-dir='{out}'\""
    )
    env = {
        k: v for k, v in os.environ.items() if k != "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"
    }
    env |= {"FLWR_HOME": str(home), "RAY_ADDRESS": "local"}
    try:
        run = subprocess.run(
            ["bash", "-c", command], env=env, capture_output=True, text=True, timeout=420
        )
    finally:
        _stop_local_superlink(home)
    log = run.stdout + run.stderr
    assert "Installing application dependencies" not in log
    rounds = read_rounds(out / "rounds.jsonl")
    assert [r.round for r in rounds] == [1], log[-3000:]
    assert all(not r.failed and r.num_accepted == r.num_clients >= 2 for r in rounds), log[-3000:]
    assert rounds[-1].epsilon_max > 0 and (out / "summary.json").exists()
