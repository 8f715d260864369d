"""Sparse-aware federated averaging.

Each client ``c`` sends values ``v_c`` on its support ``S_c`` (the round's public mask, or its
own) and a weight ``n_c`` (its number of training examples). The aggregate moves only
touched coordinates:

    w[i] <- w[i] + sum_{c: i in S_c} n_c v_c[i] / sum_{c: i in S_c} n_c     for i in U_c S_c,
    w[i] unchanged                                                          otherwise.

With one shared mask (``mask-scope=round``) every touched coordinate has every client, and
this is exactly FedAvg of the sparse updates; with ``final-rate=0`` it is dense FedAvg.
Aggregation is post-processing of each client's differentially private output and costs no
privacy. Sums run in float64 so the order in which replies arrive does not matter to within
float32 rounding; weights are accumulated relative to the first one, so the mean is invariant
to scaling every weight and huge finite weights cannot overflow the sums.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SparseAggregator"]


class SparseAggregator:
    """Accumulates weighted sparse updates over a ``dense_size``-dimensional model."""

    def __init__(self, dense_size: int) -> None:
        if dense_size < 0:
            raise ValueError(f"dense_size={dense_size}: expected >= 0")
        self.dense_size = dense_size
        self._sums = torch.zeros(dense_size, dtype=torch.float64)
        self._weights = torch.zeros(dense_size, dtype=torch.float64)
        self.num_updates = 0
        self.total_weight = 0.0
        self._unit = 0.0  # the first weight: sums hold weight / unit, which stays near 1

    def add(self, values: torch.Tensor, *, support: torch.Tensor | None, weight: float) -> None:
        """Adds one client's values on ``support`` (int64 indices; ``None`` = dense).

        Raises:
            ValueError: on a non-positive/non-finite weight, non-finite values, a length
                mismatch between values and support, or a support that is not strictly
                increasing within ``[0, dense_size)`` (a repeated index would count a client
                twice at that coordinate).
        """
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight={weight}: expected a finite value > 0")
        expected = self.dense_size if support is None else support.numel()
        if values.dim() != 1 or values.numel() != expected:
            raise ValueError(f"values has shape {tuple(values.shape)}: expected ({expected},)")
        if support is not None:
            self._check_support(support)
        if not bool(torch.isfinite(values).all()):
            raise ValueError("values: non-finite entries")
        unit = self._unit or weight
        relative = weight / unit
        v = values.to(torch.float64) * relative
        if not (math.isfinite(relative) and bool(torch.isfinite(v).all())):
            raise ValueError(f"weight={weight}: overflows relative to the first weight {unit}")
        self._unit = unit
        weight = relative
        if support is None:
            self._sums += v
            self._weights += weight
        else:
            self._sums.index_add_(0, support, v)
            self._weights.index_add_(0, support, torch.full_like(v, weight))
        self.num_updates += 1
        self.total_weight += weight * self._unit

    def _check_support(self, support: torch.Tensor) -> None:
        if support.dtype != torch.int64 or support.dim() != 1:
            raise ValueError(
                f"support has dtype {support.dtype} and shape {tuple(support.shape)}: "
                "expected 1-D int64"
            )
        if support.numel() == 0:
            return
        low, high = int(support[0]), int(support[-1])
        if low < 0 or high >= self.dense_size or not bool((support[1:] > support[:-1]).all()):
            raise ValueError(
                f"support spans [{low}, {high}]: expected strictly increasing indices in "
                f"[0, {self.dense_size})"
            )

    def touched(self) -> torch.Tensor:
        """Boolean mask of coordinates at least one update covered."""
        return self._weights > 0

    def mean_update(self) -> torch.Tensor:
        """Per-coordinate weighted mean over the covering updates (0 where none), float32."""
        out = torch.zeros(self.dense_size, dtype=torch.float64)
        touched = self.touched()
        out[touched] = self._sums[touched] / self._weights[touched]
        return out.to(torch.float32)

    def apply_(self, weights: torch.Tensor) -> torch.Tensor:
        """Adds the mean update to the flat float32 model ``weights`` in place.

        Returns:
            The boolean mask of coordinates that changed (the touched set).
        """
        if weights.shape != (self.dense_size,):
            raise ValueError(
                f"weights has shape {tuple(weights.shape)}: expected ({self.dense_size},)"
            )
        touched = self.touched()
        weights[touched] += self.mean_update()[touched]
        return touched
