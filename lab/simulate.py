"""``fedsparse simulate``: the federated app on Flower's simulation engine, with live progress.

Starts a simulation-mode SuperLink on free loopback ports (private ``FLWR_HOME``), submits the
app with ``flwr run ... --stream`` (offline: runtime dependency installation disabled), shows
``<out>/rounds.jsonl`` as a live table while the run goes, and stops every process by PID.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from fedsparse.common.config import FederatedConfig
from fedsparse.lab.flower import (
    app_bundle_dir,
    flwr_env,
    format_run_config,
    tool,
    write_flwr_config,
)
from fedsparse.lab.processes import free_port, managed_process, wait_for_port

__all__ = ["run_simulation"]

COLUMNS = (
    "round",
    "clients",
    "rate",
    "test acc",
    "eps max",
    "up payload B",
    "up msg B",
    "dense up B",
    "rejected",
    "s",
)


def _row(entry: dict) -> list[str]:
    return [
        str(entry["round"]),
        str(entry["num_clients"]),
        f"{entry['rate']:.3f}",
        f"{entry['test_accuracy']:.4f}",
        f"{entry['epsilon_max']:.3f}",
        f"{entry['uplink_payload_bytes']:,}",
        f"{entry['uplink_message_bytes']:,}",
        f"{entry['dense_uplink_bytes']:,}",
        str(entry["num_rejected"]),
        f"{entry['wall_seconds']:.1f}",
    ]


def _number(value: float) -> int | float:
    """Flower's federation config wants integral CPU counts as integers."""
    return int(value) if float(value).is_integer() else value


def run_simulation(
    *,
    out: Path,
    overrides: dict[str, str],
    clients: int,
    cpus_per_client: float = 1.0,
    timeout: float = 3600.0,
    console: Console | None = None,
) -> dict:
    """Runs one simulated federation; returns ``summary.json``'s content.

    Raises:
        ValueError: a bad run-config override (named key and value).
        RuntimeError: the run failed or timed out (with the log's tail).
    """
    console = console or Console()
    out = out.resolve()
    run_config = {**overrides, "out-dir": str(out)}
    config = FederatedConfig.from_run_config(run_config)  # validate before starting anything
    typed = {k: v for k, v in config.to_run_config().items() if k in run_config}
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("rounds.jsonl", "summary.json"):
        (out / stale).unlink(missing_ok=True)
    flwr_home = out / ".flwr"
    shutil.rmtree(flwr_home, ignore_errors=True)
    http, fleet = free_port(), free_port()  # the Control API shares the Runtime HTTP port
    write_flwr_config(flwr_home, name="sim", control_port=http)
    env = flwr_env(flwr_home)
    superlink_args = [
        tool("flower-superlink"),
        "--insecure",
        "--simulation",
        "--isolation",
        "subprocess",
        "--host",
        "127.0.0.1",
        "--port",
        str(http),
        "--fleet-api-address",
        f"127.0.0.1:{fleet}",
        "--disable-runtime-dependency-installation",
    ]
    run_args = [
        tool("flwr"),
        "run",
        str(app_bundle_dir(out)),
        "sim",
        *format_run_config(typed),
        "--federation-config",
        f"num-supernodes={clients}",
        "--federation-config",
        f"client-resources-num-cpus={_number(cpus_per_client)}",
        "--stream",
    ]
    table = Table(title=f"fedsparse simulate: {clients} clients, {config.num_rounds} rounds")
    for column in COLUMNS:
        table.add_column(column, justify="right")
    rounds_path, seen = out / "rounds.jsonl", 0
    with (
        (out / "superlink.log").open("wb") as link_log,
        managed_process(superlink_args, env=env, log=link_log) as superlink,
    ):
        wait_for_port(http, timeout=60, process=superlink)
        with (
            (out / "flwr.log").open("wb") as run_log,
            managed_process(run_args, env=env, log=run_log, cwd=out / ".app") as run,
            Live(table, console=console, refresh_per_second=2, transient=False),
        ):
            deadline = time.monotonic() + timeout
            while True:
                done = run.poll() is not None
                if rounds_path.exists():
                    lines = rounds_path.read_text().splitlines()
                    for line in lines[seen:]:
                        table.add_row(*_row(json.loads(line)))
                    seen = len(lines)
                if done:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timeout={timeout:.0f} s reached; see {out / 'flwr.log'}")
                time.sleep(0.5)
    summary_path = out / "summary.json"
    if run.returncode != 0 or not summary_path.exists():
        tail = (out / "flwr.log").read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(
            f"flwr run exited with code {run.returncode} and "
            f"{'no' if not summary_path.exists() else 'a'} summary.json:\n" + "\n".join(tail)
        )
    return json.loads(summary_path.read_text())
