"""The backend vocabulary: where the clients of a run live, one set of names for every command.

``fedsparse simulate`` and ``fedsparse sweep`` both take ``--backend`` from ``BACKENDS``:
``flower`` (Flower's simulation engine), ``inprocess`` (``InProcessGrid``: the clients in the
server's process), ``deploy`` (a loopback deployment of a SuperLink and SuperNodes), ``ray``
(``RayGrid``: many virtual clients per Ray worker), ``population`` (``PopulationGrid``: the
clients in the server's process, each round's training vectorised across them,
``client/population.py``) and ``ray-population`` (``RayGrid`` whose workers each train their
share of a round vectorised, as ``population`` does: ``RayWorkers(vectorised=True)``). Older
spellings stay accepted through ``BACKEND_ALIASES`` (``simulation``: the sweep's old name of
Flower's engine). Nothing to import here but the names, so the command line's help reads them
at no cost.

``auto`` (``AUTO``, the default of ``fedsparse sweep``, ``frontier`` and ``reproduce``) is a
choice, not a backend: a run folder that holds a finished run keeps the backend that ran it
(its numbers, and so its reuse, belong to that backend), and a new run goes to
``auto_backend``: ``population``, or ``ray-population`` where the settings ask for a Ray
cluster or GPUs.

A user's backend is named as ``package.module:attribute`` of a ``BackendSpec``
(``common/plugins.py``), with nothing to register here: a grid the server's round loop drives
in this process (``in_process`` traits; ``fedsparse simulate`` and the Python API run it),
for instance ``InProcessGrid`` with its own scheduling. Its results are its own family (a run
resumes only on it) and a run's recorded inputs carry its code's version::

    # my_lab/backends.py
    mine = BackendSpec(name="mine", grid=MyGrid)  # MyGrid(client_app, num_nodes=..., ...)

    fedsparse simulate --backend my_lab.backends:mine
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final, Literal

from fedsparse.common import plugins

__all__ = [
    "AUTO",
    "BACKENDS",
    "BACKEND_ALIASES",
    "BACKEND_CHOICES",
    "BACKEND_CHOICE_HELP",
    "BACKEND_HELP",
    "BACKEND_TRAITS",
    "DEFAULT_BACKEND",
    "Backend",
    "BackendSpec",
    "BackendTraits",
    "auto_backend",
    "backend_args",
    "backend_name",
    "backend_spec",
    "check_backend",
    "is_auto",
    "is_user_backend",
    "traits",
]

#: Where the clients of a run live (see this module's docstring).
Backend = Literal["flower", "inprocess", "deploy", "ray", "population", "ray-population"]
BACKENDS: tuple[Backend, ...] = (
    "flower",
    "inprocess",
    "deploy",
    "ray",
    "population",
    "ray-population",
)
#: Older names of backends, accepted wherever a backend is named.
BACKEND_ALIASES: dict[str, Backend] = {"simulation": "flower"}
#: The choice of backend by run folder and settings (this module's docstring).
AUTO: Final = "auto"
#: What the commands that run many federations (sweep, frontier, reproduce) take as
#: ``--backend``: a backend, or ``AUTO``.
BACKEND_CHOICES: tuple[str, ...] = (*BACKENDS, AUTO)
#: The backends as the commands' ``--backend`` help names them.
BACKEND_HELP = (
    "flower (alias simulation): Flower's engine | inprocess | deploy | ray | population "
    "(in process, training vectorised across clients) | ray-population (vectorised on each "
    "Ray worker)"
)
#: ``BACKEND_HELP`` for the commands that also take ``AUTO``.
BACKEND_CHOICE_HELP = (
    f"{BACKEND_HELP} | auto: a folder's finished run keeps the backend that ran it, a new run "
    "trains on population (ray-population with --ray-address or GPUs)"
)


def backend_name(name: str) -> str:
    """``name`` with an older spelling replaced by its ``BACKENDS`` name (others unchanged)."""
    return BACKEND_ALIASES.get(name, name)


@dataclasses.dataclass(frozen=True)
class BackendTraits:
    """What a backend runs, asked instead of comparing its name outside this package.

    Attributes:
        deployed: real SuperLink and SuperNode processes (``fedsparse deploy``).
        shaped_links: its links can be shaped (``--uplink-rate``/``--downlink-rate``).
        cluster: Ray workers that may join a cluster (``--ray-address``); one run uses every
            worker, so a sweep runs one job at a time.
        gpus: its clients can be given GPUs (``--gpus-per-client``).
        in_process: the clients live in the caller's process (a sweep gives each job its own
            process: Flower and torch keep process globals).
        vectorised: a round's train messages are answered together, the clients' DP-SGD
            steps vectorised across them (``PopulationGrid``, or each Ray worker's share:
            ``RayWorkers(vectorised=True)``).
    """

    deployed: bool = False
    shaped_links: bool = False
    cluster: bool = False
    gpus: bool = False
    in_process: bool = False
    vectorised: bool = False


#: Each backend's traits (``BACKENDS``' order).
BACKEND_TRAITS: dict[Backend, BackendTraits] = {
    "flower": BackendTraits(gpus=True),
    "inprocess": BackendTraits(in_process=True),
    "deploy": BackendTraits(deployed=True, shaped_links=True),
    "ray": BackendTraits(cluster=True, gpus=True),
    "population": BackendTraits(in_process=True, vectorised=True),
    "ray-population": BackendTraits(cluster=True, gpus=True, vectorised=True),
}
#: The backend ``fedsparse simulate`` runs without ``--backend``.
DEFAULT_BACKEND: Backend = "flower"


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """A user's backend: a grid the ServerApp's loop drives in this process.

    Attributes:
        name: its name in messages (the run records name it by its reference).
        grid: builds the grid, called as ``InProcessGrid`` is: ``grid(client_app, num_nodes=,
            run_config=, node_config=)``; the result is a Flower ``Grid`` whose train messages
            reach ``client_app`` (fedsparse's ClientApp, as every runner's do).
        traits: what it runs; ``in_process`` only (the clients live in this process).
    """

    name: str
    grid: Callable[..., Any]
    traits: BackendTraits = BackendTraits(in_process=True)


def is_user_backend(name: str) -> bool:
    """Whether ``name`` names a user's backend (``package.module:attribute``; nothing is
    imported)."""
    return backend_name(name) not in BACKENDS and plugins.is_reference(name)


def _unknown(name: str) -> str:
    return plugins.unknown_name("backend", name, BACKENDS, "a BackendSpec")


def backend_spec(name: str) -> BackendSpec:
    """The user's backend ``name`` names, imported and checked.

    Raises:
        ValueError: not a reference, not a ``BackendSpec``, or traits other than in process.
    """
    if not is_user_backend(name):
        raise ValueError(_unknown(name))
    spec = plugins.load_instance(name, field="backend", kind=BackendSpec)
    if spec.traits != BackendTraits(in_process=True):
        raise ValueError(
            f"backend={name!r}: traits {spec.traits}: a user's backend runs in process only "
            "(BackendTraits(in_process=True))"
        )
    return spec


def check_backend(name: str) -> str:
    """``name`` as a backend: its ``BACKENDS`` name (an older spelling replaced) or a user's
    reference (imported and checked: ``backend_spec``).

    Raises:
        ValueError: neither, naming it and the known ones.
    """
    if backend_name(name) in BACKENDS:
        return backend_name(name)
    backend_spec(name)
    return name


def traits(name: str) -> BackendTraits:
    """The traits of the backend ``name`` (an older spelling accepted; a user's imported).

    Raises:
        ValueError: an unknown backend, naming it and the known ones.
    """
    if is_user_backend(name):
        return backend_spec(name).traits
    try:
        return BACKEND_TRAITS[backend_name(name)]  # type: ignore[index]
    except KeyError:
        raise ValueError(_unknown(name)) from None


def backend_args(name: str) -> list[str]:
    """The ``fedsparse simulate`` arguments that select ``name`` (none for the default)."""
    name = backend_name(name)
    return [] if name == DEFAULT_BACKEND else ["--backend", name]


def auto_backend(*, cluster: bool = False, gpus: bool = False) -> Backend:
    """The backend ``AUTO`` gives a new run: ``population``, or ``ray-population`` where the
    run needs a Ray cluster (``cluster``: an address) or GPUs (``gpus``)."""
    return "ray-population" if cluster or gpus else "population"


def is_auto(name: str) -> bool:
    """Whether ``name`` is the ``AUTO`` choice rather than a backend."""
    return name == AUTO
