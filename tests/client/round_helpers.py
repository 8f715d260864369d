"""The client tests' run config and round-1 instruction, without Flower: the tests of the
Flower-free client round (``client_round``, the population runner) import these alone, so
they run where flwr is not installed (a GPU machine: ``scripts/device-check.sh``)."""

from __future__ import annotations

import torch

from fedsparse.common.config import FederatedConfig
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import keep_count
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.wire.payload import encode_update
from fedsparse.common.wire.protocol import TrainInstruction, round_seed

__all__ = ["RATE", "cfg", "first_task", "weights"]

RATE = 0.5


def cfg(**kwargs) -> FederatedConfig:
    """The tests' run config: 3 rounds at final rate ``RATE``, then ``kwargs``."""
    return FederatedConfig(**{"num_rounds": 3, "final_rate": RATE, **kwargs})


def weights(cfg: FederatedConfig, shift: float = 0.0) -> torch.Tensor:
    """The run's initial model, flat, plus ``shift``."""
    model = build_model(cfg.model_name, seed=cfg.seed)
    return ParamLayout.from_module(model).flatten_module(model) + shift


def first_task(run: FederatedConfig, flat: torch.Tensor) -> TrainInstruction:
    """Round 1's instruction, as the server sends it (constant schedule: keep at final-rate)."""
    d = flat.numel()
    return TrainInstruction(
        server_round=1,
        num_rounds=run.num_rounds,
        mask_seed=round_seed(run.seed, 1),
        keep=keep_count(d, rate=run.final_rate),
        mask_scope=run.mask_scope,
        local_epochs=run.local_epochs,
        batch_size=run.batch_size,
        lr=run.lr,
        momentum=run.momentum,
        base_version=-1,
        model_version=0,
        model=encode_update(flat, dense_size=d, round=1),
    )
