"""``simulate``: one federation from Python, the real ClientApp and ServerApp loop.

The same run as ``fedsparse simulate`` (``lab/launch/simulate.py:run_simulation``), on any of
its backends (``lab/launch/backends.py``): ``inprocess`` (the default here: the clients in this
process, ``InProcessGrid``), ``population`` (the same, training vectorised across the clients),
``ray`` (``RayGrid``), ``ray-population`` (``RayGrid``, each worker's share vectorised),
``flower`` (Flower's simulation engine) or ``deploy`` (a loopback deployment). It writes what
the command writes (``rounds.jsonl``, ``summary.json``, ``checkpoint.pt``) and returns the
run's ``RunSummary``::

    from fedsparse.lab.simulation import simulate

    summary = simulate({"num-rounds": 2, "final-rate": 0.7}, clients=3, out="runs/python")

Nothing heavy is imported until ``simulate`` runs: ``import fedsparse.lab.simulation`` stays
light (torch, Flower and Ray load with the run).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from fedsparse.lab.launch.backends import Backend, check_backend

if TYPE_CHECKING:
    from fedsparse.common.config import FederatedConfig
    from fedsparse.common.wire.run_log import RunSummary

__all__ = ["DEFAULT_OUT", "simulate"]

#: Where a run goes when neither ``out`` nor the config's ``out-dir`` names a folder.
DEFAULT_OUT = Path("runs/simulate")


def simulate(
    config: FederatedConfig | Mapping[str, Any],
    *,
    clients: int,
    backend: str = "inprocess",
    out: str | os.PathLike[str] | None = None,
    progress: bool = True,
    timeout: float = 3600.0,
    cpus_per_client: float = 1.0,
    gpus_per_client: float = 0.0,
    resume: bool = False,
    ray_address: str | None = None,
    overwrite: bool = False,
) -> RunSummary:
    """Runs one federation of ``clients`` simulated nodes; returns its ``summary.json``.

    Args:
        config: a ``FederatedConfig``, or a mapping of run-config keys as ``--set`` takes them
            (``{"num-rounds": 3, "final-rate": 0.7}``; ``num_rounds`` alike; values typed or
            as text). Keys left out keep their defaults (``docs/reference/run-config.md``).
        clients: the number of nodes (``--clients``).
        backend: ``inprocess``, ``population``, ``ray``, ``ray-population``, ``flower`` or
            ``deploy`` (``fedsparse simulate --backend``), or a user's ``BackendSpec`` as
            ``package.module:attribute``.
        out: the run's folder; default the config's ``out-dir``, else ``runs/simulate``.
        progress: show the live round table (on stdout); False runs silently.
        timeout: seconds before the run is stopped (``--timeout``; not ``inprocess``).
        cpus_per_client: Ray CPUs per virtual client (``--cpus-per-client``).
        gpus_per_client: Ray GPUs per virtual client, fractional (``--gpus-per-client``).
        resume: continue the run in ``out`` from its checkpoint (``--resume``): with the same
            config, clients, data and plug-ins, else refused by name.
        overwrite: replace the run ``out`` holds, its files removed first (``--overwrite``);
            without ``resume`` or ``overwrite`` an ``out`` that holds a run is refused.
        ray_address: ``ray`` and ``ray-population`` only: the Ray cluster to run on, ``auto`` or
            ``HOST:PORT`` (``--ray-address``); default ``FEDSPARSE_RAY_ADDRESS``, else a
            local cluster of the run's own.

    Raises:
        ValueError: a bad argument or run-config value, in one line naming the field and its
            value (``run config key 'num-round' is unknown; did you mean 'num-rounds'?``);
            a start that fails so removes the ``out`` it created.
        TypeError: ``config`` is neither a ``FederatedConfig`` nor a mapping.
        RuntimeError: the run failed (with the log's tail), or no Ray cluster answers at
            ``ray_address``.
    """
    from rich.console import Console

    from fedsparse.common.config import FederatedConfig
    from fedsparse.lab.launch.simulate import run_simulation

    if isinstance(config, FederatedConfig):
        overrides = _changed(config)
    elif isinstance(config, Mapping):
        overrides = dict(config)
        FederatedConfig.from_run_config(overrides)  # one-line errors before anything starts
    else:
        raise TypeError(
            f"config={type(config).__name__}: expected a FederatedConfig or a mapping of "
            "run-config keys"
        )
    if isinstance(clients, bool) or not isinstance(clients, int):
        raise ValueError(f"clients={clients!r}: expected an integer >= 1")
    name = _backend(backend)
    given = {key.replace("_", "-"): value for key, value in overrides.items()}
    where = Path(out) if out is not None else Path(str(given.pop("out-dir", "") or DEFAULT_OUT))
    overrides = {k: v for k, v in overrides.items() if k.replace("_", "-") != "out-dir"}
    existed = where.exists()
    try:
        return run_simulation(
            out=where,
            overrides=overrides,
            clients=clients,
            cpus_per_client=cpus_per_client,
            gpus_per_client=gpus_per_client,
            timeout=timeout,
            console=None if progress else Console(quiet=True),
            resume=resume,
            backend=name,
            ray_address=ray_address,
            overwrite=overwrite,
        )
    except ValueError:  # a failed start leaves nothing behind (a folder that was there stays)
        if not existed:
            shutil.rmtree(where, ignore_errors=True)
        raise


def _backend(name: str) -> Backend:
    """``name`` as a ``BACKENDS`` name (an older spelling accepted), or a user's
    ``BackendSpec`` reference (``lab/launch/backends.py``), checked."""
    return cast(Backend, check_backend(name))


def _changed(config: FederatedConfig) -> dict[str, Any]:
    """``config``'s run-config keys whose values differ from the defaults."""
    from fedsparse.common.config import FederatedConfig

    defaults = FederatedConfig().to_run_config()
    return {k: v for k, v in config.to_run_config().items() if defaults.get(k) != v}
