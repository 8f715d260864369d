"""The coordinate choices the methods share, as plain functions of public inputs.

Layers and their flat ranges (``layer_ranges``, ``frozen_prefix``: DPSGD-LF), the top-``keep``
mask and the federated ranking scores (ranked sparsification, "Differentially Private
Federated Learning with Random Sparsification", arXiv:2112.00845, Algorithm 4), the public
split and the per-layer selection (DP-SSGD, arXiv:2303.04612), and the total density of a run.
The methods that use them are in this package (one module each, ``base.Method``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import derive_seed, keep_count, sample_mask
from fedsparse.common.names import SELECTIONS, SelectionName
from fedsparse.common.seeds import Stream, stream_seed

__all__ = [
    "SELECTIONS",
    "SelectionName",
    "federated_ranking_scores",
    "frozen_prefix",
    "layer_ranges",
    "layerwise_keep",
    "layerwise_mask",
    "public_split",
    "ranked_mask",
    "round_mask",
    "suffix_mask",
    "total_density",
]


def layer_ranges(layout: ParamLayout) -> list[tuple[str, int, int]]:
    """``(layer, start, end)``: each layer's flat coordinates, in order.

    A layer is the module that owns the parameters: consecutive parameters whose names share
    everything before the last dot (``conv1.weight`` and ``conv1.bias``) form one layer.
    """
    layers: list[tuple[str, int, int]] = []
    offset = 0
    for name, n in zip(layout.names, layout.numels, strict=True):
        owner = name.rpartition(".")[0]
        if layers and layers[-1][0] == owner:
            layers[-1] = (owner, layers[-1][1], offset + n)
        else:
            layers.append((owner, offset, offset + n))
        offset += n
    return layers


def frozen_prefix(layout: ParamLayout, freeze_layers: int) -> int:
    """``s``: the number of flat coordinates in the first ``freeze_layers`` layers.

    Raises:
        ValueError: ``freeze_layers`` < 0, or so many that no layer would train.
    """
    layers = layer_ranges(layout)
    if not 0 <= freeze_layers < len(layers):
        raise ValueError(
            f"freeze-layers={freeze_layers}: expected 0 <= m_f < {len(layers)} (the model has "
            f"{len(layers)} layers: {', '.join(owner or '<root>' for owner, _, _ in layers)}; "
            "at least one must train)"
        )
    return layers[freeze_layers - 1][2] if freeze_layers else 0


def ranked_mask(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The mask of the ``keep`` largest ``|scores|`` (ties: the lower index first).

    Raises:
        ValueError: ``keep`` outside ``[0, len(scores)]``.
    """
    numel = scores.numel()
    if not 0 <= keep <= numel:
        raise ValueError(f"keep={keep}: expected 0 <= keep <= {numel}")
    order = torch.argsort(scores.abs().flatten().cpu(), descending=True, stable=True)
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[order[:keep]] = True
    return mask


def federated_ranking_scores(
    delta: torch.Tensor, support: torch.Tensor, *, seed: int
) -> torch.Tensor:
    """Ranking scores of a round from the last round's aggregated update ``delta``.

    ``|delta|`` on ``support`` (the coordinates the last aggregate covered); elsewhere the
    magnitude of ``N(0, s^2)``, ``s`` the population standard deviation of ``delta`` on
    ``support``, from a generator seeded with ``seed`` (public: every party computes the same
    scores). Alg. 4, line 22 in the federation: a coordinate left out once can rank up again.
    """
    if delta.shape != support.shape or support.dtype != torch.bool:
        raise ValueError(
            f"delta {tuple(delta.shape)} and support {tuple(support.shape)} {support.dtype}: "
            "expected equal shapes and a bool support"
        )
    scores = delta.detach().to(torch.float64).abs()
    if bool(support.all()):
        return scores
    kept = delta.detach().to(torch.float64)[support]
    spread = float(kept.std(unbiased=False)) if kept.numel() else 0.0
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(delta.numel(), generator=generator, dtype=torch.float64) * spread
    return torch.where(support, scores, noise.abs())


def public_split(
    num_examples: int, fraction: float, *, run_seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(public, private)``: sorted disjoint indices, ``round(fraction * n)`` public ones.

    A permutation of ``0..n-1`` (numpy's PCG64 from ``stream_seed(run_seed, PUBLIC_SPLIT)``):
    the same split for the server and every client of a run.

    Raises:
        ValueError: ``fraction`` outside ``(0, 1)``, or a split leaving either side empty.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"public-fraction={fraction}: expected 0 < fraction < 1")
    count = round(fraction * num_examples)
    if not 0 < count < num_examples:
        raise ValueError(
            f"public-fraction={fraction}: {count} of {num_examples} examples public: expected "
            "at least one public and one private"
        )
    rng = np.random.default_rng(stream_seed(run_seed, Stream.PUBLIC_SPLIT))
    order = rng.permutation(num_examples)
    return np.sort(order[:count]), np.sort(order[count:])


def layerwise_keep(layout: ParamLayout, rate: float) -> int:
    """Coordinates DP-SSGD keeps: ``keep_count`` of each layer at ``rate``, summed."""
    return sum(keep_count(end - start, rate=rate) for _, start, end in layer_ranges(layout))


def layerwise_mask(
    weights: torch.Tensor,
    layout: ParamLayout,
    *,
    rate: float,
    selection: SelectionName,
    seed: int,
) -> torch.Tensor:
    """DP-SSGD's mask: per layer, the largest ``|weights|`` or a seeded random set.

    Each layer keeps ``keep_count(n_layer, rate)`` coordinates (``magnitude``: ties to the
    lower index; ``random``: ``sample_mask`` with ``derive_seed(seed, layer)``).
    """
    if weights.shape != (layout.numel,):
        raise ValueError(f"weights {tuple(weights.shape)}: expected ({layout.numel},)")
    if selection not in SELECTIONS:
        raise ValueError(f"selection={selection!r}: expected one of {', '.join(SELECTIONS)}")
    mask = torch.zeros(layout.numel, dtype=torch.bool)
    for index, (_, start, end) in enumerate(layer_ranges(layout)):
        keep = keep_count(end - start, rate=rate)
        if selection == "magnitude":
            mask[start:end] = ranked_mask(weights[start:end], keep)
        else:
            mask[start:end] = sample_mask(end - start, keep=keep, seed=derive_seed(seed, index))
    return mask


def suffix_mask(numel: int, start: int) -> torch.Tensor | None:
    """The mask of coordinates ``[start, numel)`` (None when ``start`` is 0: everything)."""
    if not 0 <= start < numel:
        raise ValueError(f"start={start}: expected 0 <= start < numel={numel}")
    if start == 0:
        return None
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[start:] = True
    return mask


def total_density(kept: Sequence[int], weights: Sequence[float], *, numel: int) -> float:
    """Kept coordinates over dense ones: ``sum(w * kept) / (numel * sum(w))`` (nan if no weight).

    ``kept[i]`` coordinates train in step ``i``, which carries weight ``weights[i]`` (its
    number of updates: gradient steps, or answering clients).
    """
    total = float(sum(weights))
    if total <= 0 or numel <= 0:
        return float("nan")
    return float(sum(w * k for k, w in zip(kept, weights, strict=True))) / (numel * total)


def round_mask(numel: int, *, rate: float, mask_seed: int, step: int) -> torch.Tensor | None:
    """The public mask of epoch/round ``step``: ``None`` when nothing is dropped (r = 0)."""
    keep = keep_count(numel, rate=rate)
    if keep == numel:
        return None
    # A per-step refinement of an already derived mask seed, not a stream of the run's seed.
    return sample_mask(numel, keep=keep, seed=derive_seed(mask_seed, step))
