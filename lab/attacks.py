"""What a curious server can do with a client's update: the noise-reconstruction attack.

A client whose DP noise comes from a seeded stream (``noise=seeded``, simulation) draws it
from ``Stream.DP_NOISE`` under ``client_train_seed(run seed, round, partition)``: all of it
known to the server, which wrote the run config. The server can then regenerate every step's
noise draw and subtract it from the update, leaving the noise-free update (the sum of clipped
gradients): DP is gone. A deployed client (``noise=fresh``) draws from OS entropy; the same
subtraction then leaves the update plus a second, independent noise term, and the residual is
*larger* than the update.

The rebuild mirrors ``SparseDPOptimizer``: per noisy step, one ``N(0, (σC)²)`` draw per
parameter in the layout's order from the noise generator, masked, divided by Opacus's
expected batch size, times ``-lr`` (plain SGD, momentum 0), summed over the steps.
"""

from __future__ import annotations

import torch

from fedsparse.common.layout import ParamLayout
from fedsparse.common.seeds import Stream, client_train_seed, stream_seed

__all__ = ["rebuild_seeded_noise"]


def rebuild_seeded_noise(
    layout: ParamLayout,
    *,
    run_seed: int,
    server_round: int,
    partition_id: int,
    steps: int,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: int,
    lr: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """The noise part of a seeded client's model delta (flat, zeros off the mask).

    Args:
        steps: noisy optimizer steps the client took this round (``privacy.steps_per_epoch``
            times local epochs).
        expected_batch_size: Opacus's ``int(n * q)`` for the client's ``n`` examples.
        mask: the round's public mask (None: dense).
    """
    seed = stream_seed(client_train_seed(run_seed, server_round, partition_id), Stream.DP_NOISE)
    generator = torch.Generator().manual_seed(seed)
    std = noise_multiplier * max_grad_norm
    total = torch.zeros(layout.numel, dtype=torch.float32)
    for _ in range(steps):
        draws = [
            torch.normal(mean=0, std=std, size=tuple(shape), generator=generator)
            for shape in layout.shapes
        ]
        total += torch.cat([d.reshape(-1) for d in draws])
    if mask is not None:
        total = total * mask
    return -lr * total / expected_batch_size
