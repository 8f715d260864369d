"""The model a client process reuses across its train calls, one architecture at a time.

``process_model`` builds a model per ``(name, seed)`` once per process (a worker serving many
virtual clients builds it once instead of once per call); ``client_round``
(``client/local_round.py``) loads the round's global weights into it under its lock and hands
it to ``release`` afterwards, which takes Opacus's hooks and every gradient off it again, so
each call sees it as a fresh build would be but for its weights.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

from opacus import GradSampleModule
from torch import nn

from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import build_model

__all__ = ["ProcessModel", "process_model", "release"]


@dataclasses.dataclass(frozen=True)
class ProcessModel:
    """A process's model of one architecture, reused by its ``train`` calls (one at a time,
    under ``lock``): every call loads the round's global weights into it first and leaves no
    hooks or gradients behind (``client/local_round.py: client_round``), so a worker serving
    many virtual clients builds it once instead of once per call."""

    model: nn.Module
    layout: ParamLayout
    lock: threading.Lock


@functools.lru_cache(maxsize=2)
def process_model(name: str, seed: int) -> ProcessModel:
    model = build_model(name, seed=seed)  # type: ignore[arg-type]
    return ProcessModel(model, ParamLayout.from_module(model), threading.Lock())


def release(model: nn.Module, module: nn.Module | None) -> None:
    """Leaves ``model`` as a fresh build would be but for its weights: Opacus's hooks removed
    (its ``GradSampleModule`` hooks the wrapped layers themselves) and no gradients kept."""
    if isinstance(module, GradSampleModule):
        module.cleanup()  # its hooks, and the attributes it patched onto the parameters
    # hooks of a wrapping that failed before returning the module
    for handle in model.__dict__.pop("autograd_grad_sample_hooks", []):
        handle.remove()
    for p in model.parameters():
        p.grad = None
        for name in _PARAM_STATE:
            if hasattr(p, name):
                delattr(p, name)
    for layer in model.modules():
        for name in _LAYER_STATE:
            layer.__dict__.pop(name, None)


#: What the DP optimizers (and the func engine) attach to parameters, and Opacus's hooks to
#: layers, while training.
_PARAM_STATE = ("grad_sample", "summed_grad", "_current_grad_sample", "_forward_counter")
_LAYER_STATE = ("activations", "max_batch_len")
