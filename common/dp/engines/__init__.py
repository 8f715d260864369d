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

``"auto"`` takes ``"func"`` on CUDA (``AUTO_FUNC_DEVICES``; not yet measured on a GPU) and
``"factored"`` elsewhere, each where the model is supported, else ``"opacus"``. What only the
forward pass shows (a layer run twice or not at all, an in-place activation on a layer's
output) is refused at the first batch with an error naming the layer, not fallen back from:
``engine="opacus"`` trains such models. On the CPU the
factored engine was the fastest measured (``benchmarks/engine.py``, README "Benchmarks"): on
the DP-CNN at batch 256 its step ran at 0.75-0.84x of non-private SGD's throughput against
Opacus's 0.28x (glibc's default allocator), and a federated client's call took 0.74-0.86x of
Opacus's time at 10-1000 clients. ``engine="opacus"`` reproduces the runs recorded before it
became the default, bit for bit.
"""

from __future__ import annotations

from typing import Final, Literal

import torch
from torch import nn

from fedsparse.common.dp.engines.factored_layers import factored_support_error
from fedsparse.common.dp.engines.func import func_support_error
from fedsparse.common.names import ENGINES, EngineName

__all__ = ["AUTO_FUNC_DEVICES", "ENGINES", "EngineName", "select_engine"]


#: Device types on which ``engine="auto"`` takes the func engine (module docstring).
AUTO_FUNC_DEVICES: Final[frozenset[str]] = frozenset({"cuda"})


def select_engine(
    name: EngineName, *, module: nn.Module, device: torch.device
) -> Literal["opacus", "func", "factored"]:
    """The engine that trains ``module`` on ``device`` for the configured ``name``.

    ``"auto"`` is ``"func"`` on the device types of ``AUTO_FUNC_DEVICES`` (CUDA) and
    ``"factored"`` elsewhere, when that engine supports the module, else ``"opacus"``.

    Raises:
        ValueError: an unknown name, or ``"func"``/``"factored"`` for a module that engine
            cannot train (the message names the layer).
    """
    if name not in ENGINES:
        raise ValueError(f"engine={name!r}: expected one of {', '.join(ENGINES)}")
    if name == "opacus":
        return "opacus"
    if name == "func":
        error = func_support_error(module)
        if error is not None:
            raise ValueError(error)
        return "func"
    if name == "factored":
        error = factored_support_error(module)
        if error is not None:
            raise ValueError(error)
        return "factored"
    if device.type in AUTO_FUNC_DEVICES:
        return "func" if func_support_error(module) is None else "opacus"
    return "factored" if factored_support_error(module) is None else "opacus"
