"""Which DP engine computes the per-sample gradients: the ``engine`` key of every config.

Three engines run the same mechanism (``dp``: sparsify -> clip on the masked norms -> sum ->
masked noise -> scale) with the same Poisson batches, noise draws and accountant, and differ
only in how the per-sample gradients' masked norms and clipped sum are computed:

* ``"opacus"``: Opacus's hooks (``dp.SparseDPEngine``); with no mask, Opacus's own step, bit
  for bit. Every result recorded before the factored engine became the CPU default ran on it.
* ``"func"``: ``torch.func.vmap(grad(...))`` (``func_dp.FuncDPEngine``).
* ``"factored"``: from each layer's input and output gradient, without forming a linear
  layer's per-sample gradients and forming a convolution's a few examples at a time
  (``factored_dp.FactoredDPEngine``).

The last two equal Opacus to float32 rounding (their tests pin it after an epoch).

``"auto"`` takes ``"func"`` on CUDA (``AUTO_ENGINES``; not yet measured on a GPU) and
``"factored"`` elsewhere, each where the model is supported, else ``"opacus"``. What only the
forward pass shows (a layer run twice or not at all, an in-place activation on a layer's
output) is refused at the first batch with an error naming the layer, not fallen back from:
``engine="opacus"`` trains such models. On the CPU the
factored engine was the fastest measured (``benchmarks/engine.py``, README "Benchmarks"): on
the DP-CNN at batch 256 its step ran at 0.75-0.84x of non-private SGD's throughput against
Opacus's 0.28x (glibc's default allocator), and a federated client's call took 0.74-0.86x of
Opacus's time at 10-1000 clients. ``engine="opacus"`` reproduces the runs recorded before it
became the default, bit for bit.

Each engine is one ``EngineSpec`` in ``ENGINE_SPECS``: its name, how it is built (a
``SparseDPEngine`` subclass, or any callable of the same keywords) and which modules it
trains. A user's engine is named in the run config as ``package.module:attribute`` of an
``EngineSpec`` (``common/plugins.py``), with nothing to register here::

    # my_lab/engines.py
    counting = EngineSpec(name="counting", make=CountingDPEngine)

    engine=my_lab.engines:counting

An engine is code that runs on the node with the node's data and noise: it computes the
clipped, noised sum the node's ε is charged for, and nothing here can verify that it does so
honestly (``make_private`` only refuses a ``make`` that builds no ``SparseDPEngine``, which
catches mistakes, not a subclass that drops the noise or seeds it). A deployed node therefore
imports one only if its owner lists it (node policy ``plugin-engines``), as it would trust
installed code; ``engine=auto`` never picks one. The population backend does not run it
(``client/population.py``: such a round runs ``client_round``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import nn

from fedsparse.common import plugins
from fedsparse.common.dp.engines.factored_layers import factored_support_error
from fedsparse.common.dp.engines.func import func_support_error
from fedsparse.common.names import ENGINES, EngineName

if TYPE_CHECKING:
    from fedsparse.common.dp.engine import SparseDPEngine

__all__ = [
    "AUTO_ENGINES",
    "ENGINES",
    "ENGINE_SPECS",
    "EngineName",
    "EngineSpec",
    "engine_spec",
    "is_user_engine",
    "select_engine",
    "unknown_engine",
]


def _any_module(module: nn.Module) -> str | None:
    """Opacus validates the module itself (``make_private``)."""
    return None


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """A DP engine: how the per-sample gradients of the mechanism are computed.

    Attributes:
        name: its name in messages (a built-in's ``engine`` value; the run records name a
            user's engine by its reference).
        make: builds the engine from ``accountant=``, ``secure_mode=`` and ``mechanism=``
            (a ``SparseDPEngine`` subclass is such a callable).
        support_error: why the engine cannot train a module (naming the layer), or None.
    """

    name: str
    make: Callable[..., SparseDPEngine]
    support_error: Callable[[nn.Module], str | None] = _any_module


def _opacus(**kwargs: Any) -> SparseDPEngine:
    from fedsparse.common.dp.engine import SparseDPEngine

    return SparseDPEngine(**kwargs)


def _func(**kwargs: Any) -> SparseDPEngine:
    from fedsparse.common.dp.engines.func import FuncDPEngine

    return FuncDPEngine(**kwargs)


def _factored(**kwargs: Any) -> SparseDPEngine:
    from fedsparse.common.dp.engines.factored import FactoredDPEngine

    return FactoredDPEngine(**kwargs)


#: The built-in engines by name (``"auto"`` is a choice among them: ``AUTO_ENGINES``).
ENGINE_SPECS: Final[dict[str, EngineSpec]] = {
    "opacus": EngineSpec("opacus", _opacus),
    "func": EngineSpec("func", _func, func_support_error),
    "factored": EngineSpec("factored", _factored, factored_support_error),
}
assert set(ENGINE_SPECS) == set(ENGINES) - {"auto"}

#: What ``engine="auto"`` takes on a device type: the first engine that supports the module
#: (the module docstring says why; any other device type takes ``AUTO_ENGINES[None]``).
AUTO_ENGINES: Final[dict[str | None, tuple[str, ...]]] = {
    "cuda": ("func", "opacus"),
    None: ("factored", "opacus"),
}


def is_user_engine(name: str) -> bool:
    """Whether ``name`` names a user's engine (``package.module:attribute``; nothing is
    imported)."""
    return name not in ENGINES and plugins.is_reference(name)


def unknown_engine(name: str) -> str:
    """The error for an ``engine`` value that names no engine."""
    return plugins.unknown_name("engine", name, ENGINES, "an EngineSpec")


def engine_spec(name: str) -> EngineSpec:
    """The engine ``name`` names: a built-in one, or a user's ``EngineSpec`` (imported).

    Raises:
        ValueError: ``auto`` (resolve it with ``select_engine``), an unknown name, or a
            reference to something other than an ``EngineSpec``.
    """
    if name in ENGINE_SPECS:
        return ENGINE_SPECS[name]
    if name == "auto":
        raise ValueError("engine='auto': a choice among the engines (select_engine), not one")
    if not is_user_engine(name):
        raise ValueError(unknown_engine(name))
    return plugins.load_instance(name, field="engine", kind=EngineSpec)


def select_engine(name: EngineName | str, *, module: nn.Module, device: torch.device) -> str:
    """The engine that trains ``module`` on ``device`` for the configured ``name``: a key of
    ``ENGINE_SPECS``, or the user's reference itself (``engine_spec`` gives its spec).

    ``"auto"`` is the first engine of ``AUTO_ENGINES`` for the device type that supports the
    module (func on CUDA, factored elsewhere, else opacus).

    Raises:
        ValueError: an unknown name, or an engine that cannot train the module (the message
            names the layer).
    """
    if name == "auto":
        order = AUTO_ENGINES.get(device.type, AUTO_ENGINES[None])
        for candidate in order:
            if ENGINE_SPECS[candidate].support_error(module) is None:
                return candidate
        return order[-1]
    error = engine_spec(name).support_error(module)
    if error is not None:
        raise ValueError(error)
    return name
