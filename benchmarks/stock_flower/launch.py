"""Runs the stock app on Flower's simulation engine the way ``fedsparse simulate`` runs fedsparse.

Same recipe, same helpers (``fedsparse.lab.launch.base``/``flower``/``processes``): a simulation
SuperLink on free loopback ports with a private ``FLWR_HOME`` and runtime dependency
installation disabled (offline), ``flwr run <this directory> sim --run-config ...
--federation-config num-supernodes=N --federation-config client-resources-num-cpus=C
--stream``, every process stopped by PID however the run ends (SIGINT, SIGTERM and SIGHUP
included). The run is done when the ServerApp has written ``<out>/summary.json``.

Usage: python benchmarks/stock_flower/launch.py --out DIR [--clients 10]
           [--cpus-per-client 1] [--timeout 3600] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedsparse.lab.launch.base import log_tail, start_process, superlink_args, wait_for_exit
from fedsparse.lab.launch.flower import flwr_env, format_run_config, tool, write_flwr_config
from fedsparse.lab.launch.processes import free_port, request_stop, stopping_processes

APP_DIR = Path(__file__).resolve().parent
if str(APP_DIR) not in sys.path:  # run as a script from elsewhere, or imported by a test
    sys.path.insert(0, str(APP_DIR))

from stock_opacus.task import StockConfig  # noqa: E402 - needs APP_DIR on the path

__all__ = ["APP_DIR", "run_stock_simulation"]

#: The connection name in the run's ``FLWR_HOME`` (``flwr run``'s second argument).
CONNECTION = "sim"


def run_stock_simulation(
    *,
    out: Path,
    overrides: Mapping[str, Any],
    clients: int,
    cpus_per_client: float = 1.0,
    timeout: float = 3600.0,
) -> dict[str, Any]:
    """Runs the stock app on ``clients`` simulated nodes; returns its ``summary.json``.

    Raises:
        ValueError: a bad override (named key and value) or ``clients`` below ``min-nodes``.
        RuntimeError: the run failed or timed out (with the log's tail).
        KeyboardInterrupt: a stop was requested; every process is stopped first.
    """
    out = Path(out).resolve()
    cfg = StockConfig.from_run_config({**overrides, "out-dir": str(out)})  # validate first
    if cfg.min_nodes > clients:
        raise ValueError(f"clients={clients}: below min-nodes={cfg.min_nodes}")
    typed = {k: v for k, v in cfg.to_run_config().items() if k in {*overrides, "out-dir"}}
    flwr_home = out / ".flwr"
    shutil.rmtree(flwr_home, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    http, fleet = free_port(), free_port()
    write_flwr_config(flwr_home, name=CONNECTION, control_port=http)
    env = flwr_env(flwr_home)
    superlink = superlink_args(
        ["--insecure", "--simulation", "--isolation", "subprocess"],
        http_port=http,
        fleet_port=fleet,
    )
    cpus = int(cpus_per_client) if float(cpus_per_client).is_integer() else cpus_per_client
    run = [
        tool("flwr"),
        "run",
        str(APP_DIR),
        CONNECTION,
        *format_run_config(typed),
        "--federation-config",
        f"num-supernodes={clients}",
        "--federation-config",
        f"client-resources-num-cpus={cpus}",
        "--stream",
    ]
    flwr_log = out / "flwr.log"
    with (
        start_process(superlink, env=env, log=out / "superlink.log", ports=[http]),
        start_process(run, env=env, log=flwr_log, cwd=APP_DIR) as flwr,
    ):
        returncode = wait_for_exit(flwr, timeout=timeout, timeout_hint=f"; see {flwr_log}")
    summary = out / "summary.json"
    fresh = summary.exists() and summary.stat().st_mtime >= math.floor(started)
    if returncode != 0 or not fresh:
        raise RuntimeError(
            f"flwr run exited with code {returncode} and {'a' if fresh else 'no'} "
            f"summary.json of this run:\n{log_tail(flwr_log, lines=30)}"
        )
    return dict(json.loads(summary.read_text()))


def _parse_sets(items: list[str]) -> dict[str, str]:
    sets = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected key=value")
        sets[key.strip()] = value.strip()
    return sets


_SIGNAL: list[int] = []


def _on_signal(signum: int, frame: object) -> None:
    """Stops the run and every process it started (as ``fedsparse``'s command line does)."""
    if _SIGNAL:
        return
    _SIGNAL.append(signum)
    request_stop()
    if not stopping_processes():
        raise KeyboardInterrupt(signal.Signals(signum).name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--cpus-per-client", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    code = 0
    try:
        summary = run_stock_simulation(
            out=args.out,
            overrides=_parse_sets(args.sets),
            clients=args.clients,
            cpus_per_client=args.cpus_per_client,
            timeout=args.timeout,
        )
        print(f"stock run done: {json.dumps(summary)}")
    except KeyboardInterrupt:
        code = 130
    except (ValueError, RuntimeError) as err:
        print(f"stock run failed: {err}", file=sys.stderr)
        code = 1
    if _SIGNAL:
        code = 128 + _SIGNAL[0]
    raise SystemExit(code)


if __name__ == "__main__":
    main()
