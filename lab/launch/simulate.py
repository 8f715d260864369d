"""``fedsparse simulate``: the federated app on Flower's simulation engine, with live progress.

Starts a simulation-mode SuperLink on free loopback ports (private ``FLWR_HOME``), submits the
app with ``flwr run ... --stream`` (offline: runtime dependency installation disabled), shows
``<out>/rounds.jsonl`` as a live table while the run goes, and stops every process by PID.
The steps it shares with ``fedsparse deploy`` are in ``lab/launch/base.py``.

``backend="ray"`` runs the same ServerApp loop and ClientApp on ``RayGrid`` instead
(``lab/simulation/raygrid.py``: a local Ray cluster whose workers each hold many virtual clients and
train a batch of them per Ray task), for populations where Flower's engine is too slow; with
full participation and the same seeds it ends with the same model, bit for bit.
``backend="inprocess"`` runs them on ``InProcessGrid`` in this process, and ``"deploy"`` on a
loopback deployment (``lab/launch/deploy.py``): the backends of
``lab/launch/backends.py``, one vocabulary with ``fedsparse sweep``.

Until the first round arrives, a status line under the table says what the run waits for
(``starting the Ray backend...``, ``waiting for round 1...``); where the console is not a
terminal (CI, a file) each status is printed once, as a line, and nothing carries ANSI codes.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from fedsparse.common.training.configs import planned_engine
from fedsparse.common.wire.run_log import RoundLog, RunSummary, read_rounds, record_command
from fedsparse.lab.launch.backends import (
    Backend,
    backend_spec,
    check_backend,
    is_user_backend,
    traits,
)
from fedsparse.lab.launch.base import (
    PreparedRun,
    connect,
    flwr_run,
    log_tail,
    prepare_run,
    read_summary,
    start_process,
    superlink_args,
    wait_for_exit,
)
from fedsparse.lab.launch.flower import (
    SIMULATION_NODE_POLICY,
    flower_logs_in_this_process,
    simulation_policy_env,
)
from fedsparse.lab.launch.run_dir import RunInputs, check_inputs, write_inputs
from fedsparse.server.checkpoint import CHECKPOINT, check_resumable
from fedsparse.server.launch_markers import EXPECTED_NODES_ENV

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


def _row(entry: RoundLog) -> list[str]:
    return [
        str(entry.round),
        str(entry.num_clients),
        f"{entry.rate:.3f}",
        f"{entry.test_accuracy:.4f}",
        f"{entry.epsilon_max:.3f}",
        f"{entry.uplink_payload_bytes:,}",
        f"{entry.uplink_message_bytes:,}",
        f"{entry.dense_uplink_bytes:,}",
        str(entry.num_rejected),
        f"{entry.wall_seconds:.1f}",
    ]


class _LiveRounds:
    """Adds the rounds ``rounds.jsonl`` gained since the last look to ``table``; until the
    first one, shows ``status`` (what the run waits for) under it.

    On a terminal the status is part of the live display; elsewhere (CI, a file: rich then
    draws the table once, at the end) each new status is printed as a line when it is set.
    """

    def __init__(self, table: Table, path: Path, *, since: float, console: Console) -> None:
        self._table, self._path, self._seen, self._since = table, path, 0, since
        self._console, self.status = console, ""

    def refresh(self) -> None:
        try:
            if self._path.stat().st_mtime < self._since:  # an earlier run's, until replaced
                return
        except FileNotFoundError:
            return
        rounds = read_rounds(self._path)
        for entry in rounds[self._seen :]:
            self._table.add_row(*_row(entry))
        self._seen = len(rounds)

    def set_status(self, text: str) -> None:
        """Shows ``text`` until the first round arrives (or the next status)."""
        self.status = text
        if not self._console.is_terminal:
            self._console.print(text, markup=False, highlight=False)

    def render(self) -> RenderableType:
        """The table with the rounds so far, and the status while there are none."""
        with contextlib.suppress(ValueError):  # a line being written: taken in next time
            self.refresh()
        if self._seen or not self.status or not self._console.is_terminal:
            return self._table
        return Group(self._table, Text(self.status, style="dim"))


def _number(value: float) -> int | float:
    """Flower's federation config wants integral CPU counts as integers."""
    return int(value) if float(value).is_integer() else value


def run_simulation(
    *,
    out: Path,
    overrides: Mapping[str, Any],
    clients: int,
    cpus_per_client: float = 1.0,
    gpus_per_client: float = 0.0,
    timeout: float = 3600.0,
    console: Console | None = None,
    resume: bool = False,
    backend: Backend = "flower",
    command: str | None = None,
    ray_address: str | None = None,
    overwrite: bool = False,
) -> RunSummary:
    """Runs one simulated federation; returns its ``summary.json``.

    ``out`` must hold no run (``run_dir.claim``), unless ``resume`` continues it (with the same
    run config, clients, data, plug-ins and family of backends: ``run_dir.check_inputs``, the
    checkpoint) or ``overwrite`` replaces it, its old files removed first.

    ``backend="flower"`` runs it on Flower's simulation engine; ``"ray"`` on ``RayGrid`` in
    a local Ray cluster (or the one this process runs). ``cpus_per_client`` and
    ``gpus_per_client`` are the Ray resources of a client being trained: Flower's
    ``client-resources-num-cpus``/``-num-gpus``, and on ``ray`` those of each worker (a
    worker trains one of its virtual clients at a time). ``"inprocess"`` runs the clients
    in this process (``InProcessGrid``; no timeout), ``"deploy"`` on a loopback deployment
    (``run_deployment``; no ``resume``); neither takes GPUs.

    The simulated nodes keep their state after every round they train in
    ``<out>/node-state`` (``client/state.py``). With ``resume``, the run in ``out`` continues
    from its ``checkpoint.pt`` (``server/checkpoint.py``: round, weights, sampling RNG,
    strategy state) with those node states, and ends with the same model as an uninterrupted
    run with the same overrides; a new run starts from a clean ``node-state``.

    ``command``: the command line that started the run, recorded in ``summary.json`` (None:
    the Python API).

    ``ray_address`` (``ray`` only): the Ray cluster to run on, ``auto`` or ``HOST:PORT``
    (default ``FEDSPARSE_RAY_ADDRESS``, else a local cluster of its own:
    ``rayworkers.ray_cluster``). Flower's engine always starts a local cluster of its own
    (its SuperLink gets ``RAY_ADDRESS=local``): a cluster address that ``ray start`` left
    behind never reaches it.

    Raises:
        ValueError: a bad run-config override (named key and value), ``clients`` below
            ``min-clients``, missing dataset files, an unusable ``out``.
        RuntimeError: the run failed or timed out (with the log's tail).
        KeyboardInterrupt: a stop was requested (a signal); every process is stopped first.
    """
    summary = _simulate(
        out=out,
        overrides=overrides,
        clients=clients,
        cpus_per_client=cpus_per_client,
        gpus_per_client=gpus_per_client,
        timeout=timeout,
        console=console,
        resume=resume,
        backend=backend,
        ray_address=ray_address,
        overwrite=overwrite,
    )
    return record_command(Path(out) / "summary.json", summary, command)


def _simulate(
    *,
    out: Path,
    overrides: Mapping[str, Any],
    clients: int,
    cpus_per_client: float,
    gpus_per_client: float,
    timeout: float,
    console: Console | None,
    resume: bool,
    backend: Backend,
    ray_address: str | None = None,
    overwrite: bool = False,
) -> RunSummary:
    """``run_simulation`` without the command line."""
    console = console or _console()
    check_backend(backend)  # a built-in, or a user's BackendSpec (imported, checked)
    if clients < 1:
        raise ValueError(f"clients={clients}: expected >= 1")
    if not (math.isfinite(gpus_per_client) and gpus_per_client >= 0):
        raise ValueError(f"gpus_per_client={gpus_per_client}: expected a finite value >= 0")
    if gpus_per_client > 0 and not traits(backend).gpus:
        raise ValueError(
            f"gpus_per_client: GPUs need backend flower, ray or ray-population "
            f"(backend={backend!r})"
        )
    if ray_address and not traits(backend).cluster:
        raise ValueError(
            f"ray_address={ray_address}: a cluster address needs backend ray or ray-population"
        )
    if resume and backend == "deploy":
        raise ValueError(
            "resume: a deployment does not resume; use backend flower, ray, inprocess, "
            "population or ray-population"
        )
    if resume and not (Path(out) / "checkpoint.pt").exists():
        raise ValueError(f"resume: no checkpoint.pt in out={out}: nothing to resume")
    if backend == "deploy":
        from fedsparse.lab.launch.deploy import run_deployment

        return run_deployment(
            out=out,
            overrides=overrides,
            num_nodes=clients,
            timeout=timeout,
            idle_seconds=0,
            overwrite=overwrite,
        )
    state_dir = Path(out).resolve() / "node-state"
    if backend == "flower":  # its policy travels in node config syntax: before the claim
        simulation_policy_env(state_dir=state_dir)
    run = prepare_run(
        out,
        {**overrides, **({"resume": "true"} if resume else {})},
        resume=resume,
        overwrite=overwrite,
        clients=("clients", clients),
    )
    try:  # the engine the clients will pick here ("auto" resolves by device and model)
        engine = planned_engine(run.config.engine, run.config.model_name, run.config.device)
    except ValueError:
        engine = run.config.engine
    if gpus_per_client > 0 and run.config.device == "auto":
        engine += " on cuda"  # the Ray workers that train the clients hold a GPU
    inputs = RunInputs.of_run(
        clients=clients,
        backend=backend,
        data=run.data,
        run_config=run.config.to_run_config(),
        engine=engine,
    )
    if resume:  # the same run, or a refusal naming what differs, before anything starts
        check_inputs(run.out, inputs)
        check_resumable(run.out / CHECKPOINT, cfg=run.config)
    else:
        write_inputs(run.out, inputs)
    state_dir = run.out / "node-state"
    if not resume:  # a new run's nodes start afresh (they would drop stale states anyway)
        shutil.rmtree(state_dir, ignore_errors=True)
    table = Table(title=f"fedsparse simulate: {clients} clients, {run.config.num_rounds} rounds")
    for column in COLUMNS:
        table.add_column(column, justify="right")
    live_rounds = _LiveRounds(
        table, run.out / "rounds.jsonl", since=math.floor(run.started), console=console
    )
    if traits(backend).in_process:
        with _live(live_rounds, console):
            live_rounds.set_status(f"waiting for round 1 ({clients} clients in this process)...")
            return _run_in_process(run, clients=clients, state_dir=state_dir, backend=backend)
    if traits(backend).cluster:
        with _live(live_rounds, console):
            return _run_on_ray(
                run,
                clients=clients,
                cpus_per_client=cpus_per_client,
                gpus_per_client=gpus_per_client,
                timeout=timeout,
                state_dir=state_dir,
                status=live_rounds.set_status,
                ray_address=ray_address,
                vectorised=traits(backend).vectorised,
            )
    link = connect(run, name="sim")
    superlink = superlink_args(
        ["--insecure", "--simulation", "--isolation", "subprocess"],
        http_port=link.http_port,
        fleet_port=link.fleet_port,
    )
    federation = [
        "--federation-config",
        f"num-supernodes={clients}",
        "--federation-config",
        f"client-resources-num-cpus={_number(cpus_per_client)}",
    ]
    if gpus_per_client > 0:
        federation += ["--federation-config", f"client-resources-num-gpus={gpus_per_client}"]
    with _live(live_rounds, console):
        live_rounds.set_status("starting Flower's simulation engine (SuperLink, Ray)...")
        with (
            start_process(
                superlink,
                # The simulated ClientApps run in this SuperLink's Ray workers and inherit its
                # environment: that is where the experimenter, as node owner, sets their
                # policy. ... and the ServerApp too: it waits for all the simulated nodes
                # before round 1.
                env={
                    **link.env,
                    **simulation_policy_env(state_dir=state_dir),
                    EXPECTED_NODES_ENV: str(clients),
                    # Its engine's ray.init() takes no address: never the cluster that a
                    # `ray start` left in Ray's temp folder (it may be gone: a silent hang).
                    "RAY_ADDRESS": "local",
                },
                log=run.superlink_log,
                ports=[link.http_port],
            ),
            flwr_run(run, link, *federation) as flwr,
        ):
            live_rounds.set_status(f"waiting for round 1 ({clients} simulated nodes)...")
            returncode = wait_for_exit(flwr, timeout=timeout, timeout_hint=f"; see {run.flwr_log}")
    return read_summary(run, returncode, logs=lambda: log_tail(run.flwr_log, lines=30))


def _console() -> Console:
    """stdout's console; where it is no terminal (logs, CI) 140 columns wide, so that the
    round table is not squeezed into 80 (the command line's console alike)."""
    console = Console()
    return console if console.is_terminal else Console(width=140)


@contextlib.contextmanager
def _live(live_rounds: _LiveRounds, console: Console) -> Iterator[Live]:
    """A live table that takes in the new rounds each time it is drawn (rich's thread).

    Where the console is no terminal, rich draws it once, at the end, without the line
    break a terminal gets: the next line then starts on a line of its own all the same.
    """
    live = Live(
        console=console, refresh_per_second=2, transient=False, get_renderable=live_rounds.render
    )
    try:
        with live:
            yield live
    finally:
        if not console.is_terminal:
            console.line()


def _run_on_ray(
    run: PreparedRun,
    *,
    clients: int,
    cpus_per_client: float,
    gpus_per_client: float,
    timeout: float,
    state_dir: Path,
    status: Callable[[str], None],
    ray_address: str | None = None,
    vectorised: bool = False,
) -> RunSummary:
    """``run`` on ``RayGrid``: the ServerApp loop here, the clients on Ray workers
    (``vectorised``: each worker trains its share of a round at once, ``ray-population``).

    The virtual clients keep their state files in ``state_dir`` as Flower's simulated nodes
    do, so ``resume`` continues a ray run as it continues a Flower one. ``status`` is told
    what the run waits for (the cluster, then round 1). ``ray_address``: the cluster
    (``ray_cluster``; default a local one).

    Raises:
        RuntimeError: the run failed (``FederationFailed``) or timed out.
    """
    from fedsparse.client.app import app as client_app
    from fedsparse.lab.simulation.raygrid import RayGrid
    from fedsparse.lab.simulation.rayworkers import RayWorkers, ray_cluster
    from fedsparse.server.loop import run_federated

    stop_at = time.monotonic() + timeout
    node_config = {**SIMULATION_NODE_POLICY, "state-dir": str(state_dir)}
    status("starting the Ray backend (cluster and workers)...")
    try:
        with (
            flower_logs_in_this_process(),
            ray_cluster(address=ray_address),
            RayWorkers(
                client_app,
                cpus_per_client=cpus_per_client,
                gpus_per_client=gpus_per_client,
                vectorised=vectorised,
            ) as workers,
        ):
            grid = RayGrid(
                workers,
                num_nodes=clients,
                run_config=run.config.to_run_config(),
                node_config=node_config,
                stop_at=stop_at,
            )
            nodes = len({s.node_id for s in workers.stats()})
            status(
                f"waiting for round 1 ({clients} clients on {len(workers.actors)} workers, "
                f"{nodes} Ray node{'s' if nodes != 1 else ''})..."
            )
            return run_federated(grid, run.config)
    except TimeoutError as err:
        raise RuntimeError(f"timeout={timeout:g} s: {err}") from err


def _run_in_process(
    run: PreparedRun, *, clients: int, state_dir: Path, backend: Backend
) -> RunSummary:
    """``run`` on ``InProcessGrid`` (``backend="population"``: ``PopulationGrid``): the
    ServerApp loop and the clients in this process.

    The clients keep their state files in ``state_dir`` as Flower's simulated nodes do, so
    ``resume`` continues an in-process run as it continues a Flower one.

    Raises:
        RuntimeError: the run failed (``FederationFailed``).
    """
    from fedsparse.client.app import app as client_app
    from fedsparse.lab.simulation.inprocess import InProcessGrid
    from fedsparse.lab.simulation.population import PopulationGrid
    from fedsparse.server.loop import run_federated

    node_config = {**SIMULATION_NODE_POLICY, "state-dir": str(state_dir)}
    grid_class: Any = PopulationGrid if traits(backend).vectorised else InProcessGrid
    if is_user_backend(backend):
        grid_class = backend_spec(backend).grid
    with flower_logs_in_this_process():
        grid = grid_class(
            client_app,
            num_nodes=clients,
            run_config=run.config.to_run_config(),
            node_config=node_config,
        )
        return run_federated(grid, run.config)
