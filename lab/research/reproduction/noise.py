"""Fig. 1c of the RS paper re-measured: the norm of the DP noise a sparsified
``SparseDPEngine`` step adds over the dense one's, against ``sqrt(1 - r)``
(``measure_noise_ratio``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fedsparse.lab.experiments.stats import mean_se
from fedsparse.lab.research.reproduction.plan import PAPER_NOISE_DIM

__all__ = ["measure_noise_ratio"]


# ---------------------------------------------------------------------------------------------
# Fig. 1c: the noise norm ratio


class _ZeroGrad(torch.nn.Module):
    """A model whose loss gradient is zero: a DP step's update is its noise alone."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 0.0


def _noise(d: int, keep: int | None, seed: int) -> torch.Tensor:
    """The noise one ``SparseDPEngine`` step adds (sigma 1, C 1, batch 4), ``keep`` kept."""
    from torch.utils.data import DataLoader, TensorDataset

    from fedsparse.common.dp.engine import SparseDPEngine
    from fedsparse.common.known_warnings import quiet_known_warnings
    from fedsparse.common.masks import sample_mask

    model = _ZeroGrad(d)
    x = torch.zeros(4, d)
    engine = SparseDPEngine()
    with quiet_known_warnings():
        module, optimizer, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(x, torch.zeros(4)), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            noise_generator=torch.Generator().manual_seed(seed),
        )
        engine.set_mask(None if keep is None else sample_mask(d, keep=keep, seed=seed))
        optimizer.zero_grad()
        module(x).sum().backward()
        optimizer.step()
    assert model.fc.weight.grad is not None
    return model.fc.weight.grad.reshape(-1).clone()


def measure_noise_ratio(
    rates: Sequence[float], *, d: int = PAPER_NOISE_DIM, trials: int = 3
) -> list[dict[str, float]]:
    """Per rate: ``||m * xi|| / ||xi||`` (independent draws) over ``trials``, against
    ``sqrt(1 - r)``, with a 3-SE verdict."""
    from fedsparse.common.masks import keep_count

    out = []
    for rate in rates:
        ratios = [
            float(
                _noise(d, keep_count(d, rate=rate), 2 * t + 1).norm()
                / _noise(d, None, 2 * t).norm()
            )
            for t in range(trials)
        ]
        mean, se = mean_se(ratios)
        predicted = math.sqrt(keep_count(d, rate=rate) / d)
        # relative s.e. of a chi norm with k dof ~ 1/sqrt(2k), quadrature sum for the ratio
        keep = keep_count(d, rate=rate)
        theory_se = predicted * math.sqrt(1 / (2 * keep) + 1 / (2 * d)) / math.sqrt(trials)
        out.append(
            {
                "rate": rate,
                "measured": mean,
                "se": se,
                "predicted": predicted,
                "relative_error": mean / predicted - 1,
                "within_3se": float(abs(mean - predicted) <= 3 * max(theory_se, se)),
            }
        )
    return out
