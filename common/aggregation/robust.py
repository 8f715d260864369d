"""Robust aggregation: coordinate-wise rules a server uses against hostile clients.

Plain functions over tensors (no Flower): ``trimmed_mean`` and ``coordinate_median`` aggregate
``n`` updates coordinate by coordinate (Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust
Distributed Learning: Towards Optimal Statistical Rates", ICML 2018, arXiv:1803.01498). Each
coordinate is aggregated over the updates that *cover* it (``covered``), so the same code serves
one shared mask (every update covers the round's support) and per-client masks (a coordinate may
be covered by few). Guarantee, per coordinate with ``c`` covering updates of which ``b`` are
arbitrary: the trimmed mean lies within the range of the honest values when ``b <= floor(f
c)``, the median when ``b < c / 2``. A coordinate covered by one or two updates gets no
protection (nothing is trimmed), which is why they matter little under ``mask-scope=client``
at small ``n``. Sums run in float64 (float32-max values cannot overflow) and the result is
float32. ``l2_norm`` and ``clip_to_norm`` measure an update and scale it down to a bound
(``common/aggregation/norm_bounds.py`` says which). The values must be finite (the payload
decoder guarantees it); these functions check it.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "clip_to_norm",
    "coordinate_median",
    "l2_norm",
    "trimmed_mean",
    "trim_count",
]


def trim_count(count: int, trim_fraction: float) -> int:
    """Values dropped at EACH end among ``count``: ``floor(trim_fraction * count)``."""
    return int(trim_fraction * count)


def _sorted_columns(
    values: torch.Tensor, covered: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each column sorted ascending in float64 with uncovered entries last, covering counts)."""
    if values.dim() != 2:
        raise ValueError(f"values has shape {tuple(values.shape)}: expected (n, k)")
    if covered is None:
        covered = torch.ones(values.shape, dtype=torch.bool)
    elif covered.shape != values.shape or covered.dtype != torch.bool:
        raise ValueError(
            f"covered has shape {tuple(covered.shape)} and dtype {covered.dtype}: "
            f"expected bool of shape {tuple(values.shape)}"
        )
    x = values.to(torch.float64)
    if not bool(torch.isfinite(x[covered]).all()):
        raise ValueError("values: non-finite entries")
    # +inf sorts after every finite value, so the c covering values of a column come first.
    x = x.masked_fill(~covered, math.inf)
    return torch.sort(x, dim=0).values, covered.sum(dim=0)


def trimmed_mean(
    values: torch.Tensor, *, trim_fraction: float, covered: torch.Tensor | None = None
) -> torch.Tensor:
    """Coordinate-wise trimmed mean of ``n`` updates.

    Per column ``j`` with ``c`` covering rows, drops the ``t = floor(trim_fraction * c)``
    lowest and ``t`` highest covering values and averages the ``c - 2t`` left (``t = 0``: the
    plain mean; ``trim_fraction < 0.5`` always leaves at least one).

    Args:
        values: ``(n, k)`` floating tensor; entries outside ``covered`` are ignored.
        trim_fraction: ``0 <= f < 0.5``.
        covered: ``(n, k)`` bool, which update covers which coordinate (None: all).

    Returns:
        ``(k,)`` float32; 0 where no update covers the coordinate.

    Raises:
        ValueError: on a bad shape, ``trim_fraction`` out of range, or a non-finite covered
            value.
    """
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction={trim_fraction!r}: expected 0 <= f < 0.5")
    ordered, count = _sorted_columns(values, covered)
    # The same float64 product as ``trim_count``, floored: one rule for every column.
    trimmed = torch.floor(trim_fraction * count.to(torch.float64)).to(torch.int64)
    rank = torch.arange(ordered.shape[0]).unsqueeze(1)
    kept = (rank >= trimmed) & (rank < count - trimmed)
    total = torch.where(kept, ordered, 0.0).sum(dim=0)
    left = (count - 2 * trimmed).clamp(min=1)
    return torch.where(count > 0, total / left, 0.0).to(torch.float32)


def coordinate_median(values: torch.Tensor, *, covered: torch.Tensor | None = None) -> torch.Tensor:
    """Coordinate-wise median of ``n`` updates (of an even count: the mean of the middle two).

    Args:
        values: ``(n, k)`` floating tensor; entries outside ``covered`` are ignored.
        covered: ``(n, k)`` bool, which update covers which coordinate (None: all).

    Returns:
        ``(k,)`` float32; 0 where no update covers the coordinate.
    """
    ordered, count = _sorted_columns(values, covered)
    if ordered.shape[0] == 0:
        return torch.zeros(ordered.shape[1], dtype=torch.float32)
    # Rows (c - 1) // 2 and c // 2 of the c covering values (row 0 where c = 0, masked below).
    low = ((count - 1).clamp(min=0) // 2).unsqueeze(0)
    high = (count // 2).unsqueeze(0)
    middle = (ordered.gather(0, low) + ordered.gather(0, high)).squeeze(0) / 2
    return torch.where(count > 0, middle, 0.0).to(torch.float32)


def l2_norm(values: torch.Tensor) -> float:
    """The L2 norm of ``values`` in float64 (float32-max entries do not overflow)."""
    return float(torch.linalg.vector_norm(values.to(torch.float64)))


def clip_to_norm(values: torch.Tensor, *, bound: float) -> torch.Tensor:
    """``values`` scaled down to L2 norm ``bound`` if above it (else unchanged), float32.

    The scale is computed in float64, so the result's norm is ``bound`` to within float32
    rounding of its entries.
    """
    if not (math.isfinite(bound) and bound >= 0):
        raise ValueError(f"bound={bound!r}: expected a finite value >= 0")
    norm = l2_norm(values)
    if norm <= bound:
        return values
    return (values.to(torch.float64) * (bound / norm)).to(torch.float32)
