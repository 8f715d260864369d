"""What a curious or hostile server can try against a client: noise reconstruction, and a
crafted model that singles out one example (``single_out``).

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

``single_out`` crafts a finite global model of the digits CNN whose loss is NaN for exactly
one chosen example: before the mechanism zeroed non-finite per-sample gradients, a node
holding that example failed whenever it was in a Poisson batch, and its error reply told
member from non-member (``tests/client/test_membership.py``,
``tests/integration/test_node_pinning.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import DigitsCNN
from fedsparse.common.seeds import Stream, client_train_seed, stream_seed

__all__ = ["rebuild_seeded_noise", "single_out"]

#: The largest float32: ``FLOAT_MAX * 2`` overflows to ``inf``.
FLOAT_MAX = torch.finfo(torch.float32).max


def single_out(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Crafts ``model`` (a ``DigitsCNN``, in place) so that its loss is NaN on exactly one
    example of ``(x, y)``; returns that example's index.

    Hidden unit ``a`` of the first linear layer reads a random direction ``u`` of the conv
    features, scaled so that the top-scoring example saturates ``tanh`` at +1 and every other
    one at -1; unit ``b`` is ``tanh(20) = 1`` for all. Class 0's logit is ``FLOAT_MAX * (h_a +
    h_b)``: 0 for everyone but the target, ``+inf`` for it, so its log-softmax is ``inf -
    inf``. The huge weights meet only saturated units, whose derivative is 0, so every other
    example's per-sample gradient stays finite. Every weight stays finite.

    Raises:
        ValueError: not a ``DigitsCNN``, or no example can be singled out (a tie).
    """
    if not isinstance(model, DigitsCNN):
        raise ValueError(f"model={type(model).__name__}: expected a DigitsCNN")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        features = model.classifier[0](model.features(x))  # N x 512
        u = torch.randn(features.shape[1], generator=generator)
        top2 = torch.topk(features @ u, 2)
        gap = float(top2.values[0] - top2.values[1])
        if not gap > 0:
            raise ValueError("no example scores above all others: nothing to single out")
        scale = 40.0 / gap  # the target at +20, the runner-up at -20: both saturate
        fc1, fc2 = model.classifier[1], model.classifier[3]
        assert isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)
        a, b = 0, 1
        fc1.weight[a] = scale * u
        fc1.bias[a] = -scale * float(top2.values[0] + top2.values[1]) / 2
        fc1.weight[b] = 0.0
        fc1.bias[b] = 20.0
        fc2.weight[0] = 0.0
        fc2.weight[0, a] = FLOAT_MAX
        fc2.weight[0, b] = FLOAT_MAX
        fc2.bias[0] = 0.0
        loss = nn.functional.cross_entropy(model(x), y, reduction="none")
    target = int(top2.indices[0])
    if (~torch.isfinite(loss)).nonzero().flatten().tolist() != [target]:
        raise ValueError("the crafted model does not single out one example")
    return target


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
