"""How each run of a sweep executes: ``RunSettings``, and one federation on each backend.

``run_backend`` runs one federation on ``RunSettings.backend`` (the vocabulary of
``lab/launch/backends.py``):

- ``flower``: Flower's simulation engine (``run_simulation``: SuperLink + ``flwr run``);
- ``inprocess``: ``run_federated`` on ``InProcessGrid`` with the real ClientApp (fast);
- ``population``: the same on ``PopulationGrid`` (each round's training vectorised across the
  clients, ``client/population.py``);
- ``ray``: ``run_federated`` on ``RayGrid`` (``lab/simulation/raygrid.py``): one local Ray
  cluster and one set of workers, each holding many virtual clients, serve every run inside a
  ``ray_session`` (a sweep's), one run at a time (each run uses every worker);
- ``ray-population``: the same with each worker training its share of a round vectorised
  (``RayWorkers(vectorised=True)``);
- ``deploy``: a loopback deployment (``run_deployment``: TLS, authenticated SuperNodes),
  optionally on shaped links (``uplink_bps``/``downlink_bps``).

``RunSettings.backend`` may also be ``auto`` (the default of sweep, frontier and reproduce):
``for_folder`` then gives each run its backend, the one that ran the finished run its folder
holds, else ``fresh``'s (``population``; ``ray-population`` with a cluster address or GPUs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import shlex
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedsparse.common.wire.run_log import RunSummary
    from fedsparse.lab.simulation.rayworkers import RayWorkers

from fedsparse.lab.launch.backends import (
    AUTO,
    BACKENDS,
    Backend,
    BackendTraits,
    auto_backend,
    backend_args,
    backend_name,
    is_auto,
    traits,
)
from fedsparse.lab.launch.flower import flower_logs_in_this_process

__all__ = ["RunSettings", "ray_session", "run_backend", "share_cpus", "standalone_command"]


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """How each run executes (not part of the run config; ``clients`` is part of a run's id).

    ``backend`` is a ``BACKENDS`` name or ``auto``: each run's own is then ``for_folder``'s.
    """

    backend: Backend | str = "flower"
    clients: int = 10
    cpus_per_client: float = 1.0
    gpus_per_client: float = 0.0  # flower and ray only: Ray GPUs per client trained
    timeout: float = 3600.0
    uplink_bps: float | None = None  # deploy only: each node's shaped uplink (bit/s)
    downlink_bps: float | None = None  # deploy only: each node's shaped downlink (bit/s)
    ray_address: str | None = None  # ray only: a Ray cluster (auto, HOST:PORT); None: local

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", backend_name(self.backend))  # an older spelling
        if self.backend not in BACKENDS and not is_auto(self.backend):
            raise ValueError(
                f"backend={self.backend!r}: expected one of {', '.join(BACKENDS)} or {AUTO}"
            )
        for name in ("uplink_bps", "downlink_bps"):
            value = getattr(self, name)
            if value is not None and not self.backend_traits.shaped_links:
                raise ValueError(
                    f"{name.replace('_bps', '-rate')}: shaped links need --backend deploy "
                    f"(backend={self.backend!r})"
                )
        if self.ray_address and not self.backend_traits.cluster:
            raise ValueError(
                f"ray-address {self.ray_address}: a cluster address needs --backend ray or "
                f"ray-population "
                f"(backend={self.backend!r})"
            )
        if self.clients < 1:
            raise ValueError(f"clients={self.clients}: expected >= 1")
        if not self.cpus_per_client > 0:
            raise ValueError(f"cpus_per_client={self.cpus_per_client}: expected > 0")
        if not (math.isfinite(self.gpus_per_client) and self.gpus_per_client >= 0):
            raise ValueError(f"gpus_per_client={self.gpus_per_client}: expected >= 0")
        if self.gpus_per_client > 0 and not self.backend_traits.gpus:
            raise ValueError(
                f"gpus-per-client: GPUs need --backend flower, ray or ray-population "
                f"(backend={self.backend!r})"
            )
        if not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout}: expected > 0")

    @property
    def fresh_backend(self) -> Backend:
        """The backend a new run trains on: ``backend``, or ``auto_backend``'s for ``auto``."""
        if is_auto(self.backend):
            return auto_backend(cluster=bool(self.ray_address), gpus=self.gpus_per_client > 0)
        return self.backend  # type: ignore[return-value]

    @property
    def backend_traits(self) -> BackendTraits:
        """The traits of ``fresh_backend`` (what a new run's backend runs)."""
        return traits(self.fresh_backend)

    @property
    def label(self) -> str:
        """The backend as a report names it (``auto`` with the backend of its new runs)."""
        if is_auto(self.backend):
            return (
                f"{AUTO} (new runs: {self.fresh_backend}; a reused run: the backend its "
                "sweep-run.json names)"
            )
        return str(self.backend)

    def fresh(self) -> RunSettings:
        """These settings as a run that trains takes them: ``auto`` replaced by
        ``fresh_backend``; any other backend as it is."""
        if not is_auto(self.backend):
            return self
        return dataclasses.replace(self, backend=self.fresh_backend)

    def for_folder(self, run_dir: Path) -> RunSettings:
        """These settings as the run ``run_dir`` holds is compared with them (reused, or
        refused by the input that differs): under ``auto``, with the backend that ran the
        finished run there (its ``sweep-run.json``), else ``fresh``'s; any other backend as it
        is. Only compared with, never run (``execute_run`` trains on ``fresh``), so the
        recorded backend is taken as it is, without checking the other settings against it
        (a population run is reused under ``--ray-address``)."""
        if not is_auto(self.backend):
            return self
        recorded = None
        try:
            record = json.loads((Path(run_dir) / "sweep-run.json").read_text())
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict) and record.get("status") == "ok":
            name = record.get("backend")
            recorded = backend_name(name) if isinstance(name, str) else None
        settings = self.fresh()
        if recorded in BACKENDS and recorded != settings.backend:
            object.__setattr__(settings, "backend", recorded)  # compared with, not run
        return settings


#: torch's threads for a vectorised run in this process: a sweep's job process gets its share
#: of the CPUs (``share_cpus``); None: every CPU the process may use.
_JOB_THREADS: int | None = None


def share_cpus(jobs: int) -> None:
    """Gives this process (one of ``jobs`` running at once) its share of the CPUs for a
    vectorised run: a process pool's initializer."""
    global _JOB_THREADS
    getaffinity = getattr(os, "sched_getaffinity", None)  # Linux; else every CPU
    cpus = len(getaffinity(0)) if getaffinity else (os.cpu_count() or 1)
    _JOB_THREADS = max(1, cpus // max(1, jobs))


def _run_inprocess(overrides: Mapping[str, str], out: Path, settings: RunSettings) -> RunSummary:
    from fedsparse.client.app import app as client_app
    from fedsparse.common.config import FederatedConfig
    from fedsparse.lab.simulation.inprocess import InProcessGrid
    from fedsparse.lab.simulation.population import PopulationGrid
    from fedsparse.server.app import run_federated

    cfg = FederatedConfig.from_run_config({**overrides, "out-dir": str(out)})
    common: dict[str, Any] = {
        "num_nodes": settings.clients,
        "run_config": cfg.to_run_config(),
        "stop_at": time.monotonic() + settings.timeout,  # checked between rounds
    }
    if settings.backend_traits.vectorised:
        grid: InProcessGrid = PopulationGrid(client_app, threads=_JOB_THREADS, **common)
    else:
        grid = InProcessGrid(client_app, **common)
    try:
        with flower_logs_in_this_process():
            return run_federated(grid, cfg)
    except TimeoutError as err:
        raise RuntimeError(f"timeout={settings.timeout:g} s: {err}") from err


@dataclass
class _RaySession:
    """The Ray cluster and workers of the runs inside ``ray_session``, started on first use."""

    settings: RunSettings
    stack: contextlib.ExitStack
    workers: RayWorkers | None = None
    unreachable: str = ""  # the cluster did not answer: every later run fails at once with it

    def get_workers(self) -> RayWorkers:
        if self.unreachable:
            raise RuntimeError(self.unreachable)
        if self.workers is None:
            from fedsparse.client.app import app as client_app
            from fedsparse.lab.simulation.rayworkers import RayWorkers, ray_cluster

            try:
                self.stack.enter_context(ray_cluster(address=self.settings.ray_address))
            except RuntimeError as err:  # no cluster at the address (one line naming it)
                self.unreachable = f"{err} (the sweep's first ray run found none)"
                raise
            self.workers = self.stack.enter_context(
                RayWorkers(
                    client_app,
                    cpus_per_client=self.settings.cpus_per_client,
                    gpus_per_client=self.settings.gpus_per_client,
                    vectorised=self.settings.backend_traits.vectorised,
                )
            )
        return self.workers


#: The session of the sweep under way (``ray_session``); a run outside one starts its own.
_RAY_SESSION: ContextVar[_RaySession | None] = ContextVar("ray_session", default=None)


@contextlib.contextmanager
def ray_session(settings: RunSettings) -> Iterator[None]:
    """One Ray cluster and one set of workers for every ``ray`` run inside (nothing else).

    Started by the first run that needs them (a sweep of reused runs starts nothing); the
    cluster is this process's running one, else a new one that ends with the session, and
    the workers end with it.
    """
    with contextlib.ExitStack() as stack:
        token = _RAY_SESSION.set(_RaySession(settings, stack))
        try:
            yield
        finally:
            _RAY_SESSION.reset(token)


def _run_ray(overrides: Mapping[str, str], out: Path, settings: RunSettings) -> RunSummary:
    from fedsparse.common.config import FederatedConfig
    from fedsparse.lab.simulation.raygrid import RayGrid
    from fedsparse.server.app import run_federated

    session = _RAY_SESSION.get()
    if session is None:  # a run outside a sweep's session: a cluster of its own
        with ray_session(settings):
            return _run_ray(overrides, out, settings)
    cfg = FederatedConfig.from_run_config({**overrides, "out-dir": str(out)})
    grid = RayGrid(
        session.get_workers(),
        num_nodes=settings.clients,
        run_config=cfg.to_run_config(),
        stop_at=time.monotonic() + settings.timeout,
    )
    with flower_logs_in_this_process():
        return run_federated(grid, cfg)


def _run_flower(overrides: Mapping[str, str], out: Path, settings: RunSettings) -> RunSummary:
    from rich.console import Console

    from fedsparse.lab.launch.simulate import run_simulation

    return run_simulation(
        out=out,
        overrides=dict(overrides),
        clients=settings.clients,
        cpus_per_client=settings.cpus_per_client,
        gpus_per_client=settings.gpus_per_client,
        timeout=settings.timeout,
        console=Console(file=io.StringIO(), width=140),  # no live table under the progress bar
    )


def _run_deployment(overrides: Mapping[str, str], out: Path, settings: RunSettings) -> RunSummary:
    from fedsparse.lab.launch.deploy import run_deployment

    return run_deployment(
        out=out,
        overrides=dict(overrides),
        num_nodes=settings.clients,
        timeout=settings.timeout,
        idle_seconds=0,
        uplink_bps=settings.uplink_bps,
        downlink_bps=settings.downlink_bps,
    )


def run_backend(overrides: Mapping[str, str], out: Path, settings: RunSettings) -> RunSummary:
    """Runs one federation on ``settings.fresh_backend`` (``settings.backend``, or ``auto``'s
    choice for a new run); returns its summary (``summary.json``)."""
    runners = {
        "inprocess": _run_inprocess,
        "flower": _run_flower,
        "deploy": _run_deployment,
        "ray": _run_ray,
        "ray-population": _run_ray,
        "population": _run_inprocess,
    }
    return runners[settings.fresh_backend](overrides, out, settings)


def _bits_per_second(rate: float) -> str:
    """A rate in bit/s as ``parse_rate`` reads it back exactly (a bare number)."""
    return str(int(rate)) if float(rate).is_integer() else repr(float(rate))


def standalone_command(overrides: Mapping[str, str], out: Path, settings: RunSettings) -> str:
    """The ``fedsparse simulate`` (``deploy``: ``fedsparse deploy``) line that runs this one
    federation on its own, into ``out``, as ``run_backend`` runs it; options at their
    defaults left out. A sweep records it in each run's ``summary.json`` (``command``)."""
    sets = [a for key, value in overrides.items() for a in ("--set", f"{key}={value}")]
    if settings.backend_traits.deployed:
        args = ["fedsparse", "deploy", "--out", str(out), "--nodes", str(settings.clients)]
        args += [*sets, "--idle-seconds", "0"]
        for flag, rate in (
            ("--uplink-rate", settings.uplink_bps),
            ("--downlink-rate", settings.downlink_bps),
        ):
            args += [flag, _bits_per_second(rate)] if rate is not None else []
    else:
        args = ["fedsparse", "simulate", "--out", str(out), "--clients", str(settings.clients)]
        args += [*sets]
        args += backend_args(settings.fresh_backend)
        if settings.cpus_per_client != 1.0:
            args += ["--cpus-per-client", f"{settings.cpus_per_client:g}"]
        if settings.gpus_per_client:
            args += ["--gpus-per-client", f"{settings.gpus_per_client:g}"]
        args += ["--ray-address", settings.ray_address] if settings.ray_address else []
    args += ["--timeout", f"{settings.timeout:g}"] if settings.timeout != 3600.0 else []
    return shlex.join(args)
