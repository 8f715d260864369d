"""Sparse-aware federated averaging.

Each client ``c`` sends values ``v_c`` on its support ``S_c`` (the round's public mask, or its
own) and a weight ``n_c`` (its number of training examples). The aggregate moves only
touched coordinates:

    w[i] <- w[i] + sum_{c: i in S_c} n_c v_c[i] / sum_{c: i in S_c} n_c     for i in U_c S_c,
    w[i] unchanged                                                          otherwise.

With one shared mask (``mask-scope=round``) every touched coordinate has every client, and
this is exactly FedAvg of the sparse updates; with ``final-rate=0`` it is dense FedAvg.
Aggregation is post-processing of each client's differentially private output and costs no
privacy. The sums are exact (``common/aggregation/exact_sum.py``: the float64 nearest the
exact sum of ``n_c v_c``, and of ``n_c``), so the mean is the same number, bit for bit, in
whatever order the updates arrive: a server adds each update as it comes and holds none.
Weights enter scaled by the first one's power of two (``ldexp(n_c, -scale)``, exact), so huge
finite weights cannot overflow the sums and the products round as ``v_c x n_c`` does; a
weight more than ``2**500`` from the first is refused. Consecutive updates on the same
support (the round's mask: one tensor for every reply of a round) are summed on that support
and added into the model-sized sums once, not once per update (exactly, so the grouping
changes nothing).

The weight ``n_c`` is whatever the server passes: with ``weighting="uniform"`` (the default)
it is 1 for every accepted update, so a client cannot buy influence by claiming examples;
``weighting="examples"`` trusts the clients' ``num-examples`` (simulation, trusted silos).

``RobustAggregator`` (``aggregator="trimmed-mean"`` or ``"median"``) keeps every update and
applies ``common/aggregation/robust.py``'s coordinate-wise rule on the round's support instead of
the
mean: per coordinate over the updates covering it, unweighted. It holds ``n x keep`` values
(``n x |union of supports|`` under per-client masks).
"""

from __future__ import annotations

import math

import torch

from fedsparse.common.aggregation.exact_sum import ExactSum, exact_partials
from fedsparse.common.aggregation.robust import coordinate_median, trimmed_mean
from fedsparse.common.finite import all_finite
from fedsparse.common.names import AGGREGATORS, WEIGHTINGS, AggregatorName, Weighting

__all__ = [
    "AGGREGATORS",
    "WEIGHTINGS",
    "AggregatorName",
    "RobustAggregator",
    "SparseAggregator",
    "Weighting",
    "make_aggregator",
]


#: The range of a weight relative to the first one's power of two, ``ldexp(w, -scale)``:
#: within it a product ``values x relative`` rounds as ``values x weight`` does, in any order
#: (outside, subnormal products or an overflowing sum would not: within it, none can).
_RELATIVE = (2.0**-500, 2.0**500)


class SparseAggregator:
    """Accumulates weighted sparse updates over a ``dense_size``-dimensional model."""

    def __init__(self, dense_size: int) -> None:
        if dense_size < 0:
            raise ValueError(f"dense_size={dense_size}: expected >= 0")
        self.dense_size = dense_size
        self._sums = ExactSum(dense_size)
        self._weights = ExactSum(dense_size)
        self.num_updates = 0
        self._added: list[float] = []  # every weight, for total_weight (math.fsum)
        self._scale: int | None = None  # weights enter as ldexp(weight, -scale): exact
        # Updates on one support not yet scattered: (support, their values' sums, weights).
        self._pending: tuple[torch.Tensor, ExactSum, list[float]] | None = None
        self._checked: torch.Tensor | None = None  # the last support that passed its checks
        # Dense updates' weights not yet in ``_weights``, kept as numbers only while every
        # update so far was dense (every coordinate then has their sum): no model-sized
        # addition per update.
        self._dense_weights: list[float] | None = []
        self._scratch: torch.Tensor | None = None  # an addend in float64 (_scratch_for)

    @property
    def total_weight(self) -> float:
        """The accepted updates' summed weight (exactly rounded)."""
        return math.fsum(self._added)

    def add(self, values: torch.Tensor, *, support: torch.Tensor | None, weight: float) -> None:
        """Adds one client's values on ``support`` (int64 indices; ``None`` = dense).

        Raises:
            ValueError: on a non-positive/non-finite weight, non-finite values, a length
                mismatch between values and support, or a support that is not strictly
                increasing within ``[0, dense_size)`` (a repeated index would count a client
                twice at that coordinate).
        """
        _check_weight(weight)
        _check_update(
            values, support, self.dense_size, checked=support is self._checked, finite=False
        )
        # 1 <= the first weight's relative < 2 (a weight of 1 is 1): a power of two, exact
        scale = self._scale if self._scale is not None else math.frexp(weight)[1] - 1
        try:
            relative = math.ldexp(weight, -scale)
        except OverflowError:  # far above the first weight: out of range, as below
            relative = math.inf
        if not _RELATIVE[0] <= relative <= _RELATIVE[1]:
            if not all_finite(values):  # (the values' error first, as always)
                raise ValueError("values: non-finite entries")
            raise ValueError(f"weight={weight}: out of range beside the first weight")
        v = self._scratch_for(values.numel())  # the sums only read it (ExactSum.add_)
        v.copy_(values)
        if relative == 1.0:  # (x 1.0 is exact, and finite values stay finite)
            if not all_finite(values):
                raise ValueError("values: non-finite entries")
        else:
            v.mul_(relative)  # = fl(values x weight) x 2**-scale: the same in any order
            if not all_finite(v):  # a non-finite value stays one; else the product overflowed
                if not all_finite(values):
                    raise ValueError("values: non-finite entries")
                raise ValueError(f"weight={weight}: out of range beside the first weight")
        self._scale = scale
        if support is None:
            self._flush()
            self._sums.add_(v)
            if self._dense_weights is not None:
                self._dense_weights.append(relative)
            else:
                self._weights.add_(torch.full_like(v, relative))
        else:
            self._materialize()
            self._checked = support
            pending = self._pending
            if pending is None or pending[0] is not support:
                self._flush()
                pending = self._pending = (support, ExactSum(support.numel()), [])
            pending[1].add_(v)
            pending[2].append(relative)
        self.num_updates += 1
        self._added.append(weight)

    def _scratch_for(self, size: int) -> torch.Tensor:
        """A float64 buffer of ``size`` for one addend (kept: a fresh one a round's update
        costs its page faults)."""
        if self._scratch is None or self._scratch.numel() != size:
            self._scratch = torch.empty(size, dtype=torch.float64)
        return self._scratch

    def _flush(self) -> None:
        """Adds the pending updates' sums into the model-sized sums (exactly)."""
        if self._pending is not None:
            support, sums, weights = self._pending
            self._pending = None
            sums.merge_into(self._sums, support)
            for part in exact_partials(weights):  # the weights' exact sum (one part, mostly)
                self._weights.add_(
                    torch.full((support.numel(),), part, dtype=torch.float64), support
                )

    def _materialize(self) -> None:
        """Writes the dense updates' summed weight into ``_weights`` (still all zero)."""
        if self._dense_weights is not None:
            for part in exact_partials(self._dense_weights):
                self._weights.add_(torch.full((self.dense_size,), part, dtype=torch.float64))
            self._dense_weights = None

    def touched(self) -> torch.Tensor:
        """Boolean mask of coordinates at least one update covered."""
        self._materialize()
        self._flush()
        return self._weights.value() > 0

    def mean_update(self) -> torch.Tensor:
        """Per-coordinate weighted mean over the covering updates (0 where none), float32."""
        out = torch.zeros(self.dense_size, dtype=torch.float64)
        touched = self.touched()  # flushes
        out[touched] = self._sums.value()[touched] / self._weights.value()[touched]
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


def _check_weight(weight: float) -> None:
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"weight={weight}: expected a finite value > 0")


def _check_update(
    values: torch.Tensor,
    support: torch.Tensor | None,
    dense_size: int,
    *,
    checked: bool = False,
    finite: bool = True,
) -> None:
    """Shape, support and (``finite``) finiteness checks shared by both aggregators
    (``checked``: this very support tensor passed ``_check_support`` already)."""
    expected = dense_size if support is None else support.numel()
    if values.dim() != 1 or values.numel() != expected:
        raise ValueError(f"values has shape {tuple(values.shape)}: expected ({expected},)")
    if support is not None and not checked:
        _check_support(support, dense_size)
    if finite and not all_finite(values):
        raise ValueError("values: non-finite entries")


def _check_support(support: torch.Tensor, dense_size: int) -> None:
    if support.dtype != torch.int64 or support.dim() != 1:
        raise ValueError(
            f"support has dtype {support.dtype} and shape {tuple(support.shape)}: "
            "expected 1-D int64"
        )
    if support.numel() == 0:
        return
    low, high = int(support[0]), int(support[-1])
    if low < 0 or high >= dense_size or not bool((support[1:] > support[:-1]).all()):
        raise ValueError(
            f"support spans [{low}, {high}]: expected strictly increasing indices in "
            f"[0, {dense_size})"
        )


class RobustAggregator:
    """Keeps every update; applies a coordinate-wise robust rule over the covering updates.

    Args:
        dense_size: ``d``.
        rule: ``"trimmed-mean"`` or ``"median"`` (``common/aggregation/robust.py``).
        trim_fraction: for ``"trimmed-mean"``, ``0 <= f < 0.5`` per end.

    Weights are checked (finite, > 0) but not used: both rules are unweighted.
    """

    def __init__(self, dense_size: int, *, rule: AggregatorName, trim_fraction: float = 0.2):
        if dense_size < 0:
            raise ValueError(f"dense_size={dense_size}: expected >= 0")
        if rule not in ("trimmed-mean", "median"):
            raise ValueError(f"rule={rule!r}: expected 'trimmed-mean' or 'median'")
        if not 0.0 <= trim_fraction < 0.5:
            raise ValueError(f"trim_fraction={trim_fraction!r}: expected 0 <= f < 0.5")
        self.dense_size = dense_size
        self.rule = rule
        self.trim_fraction = trim_fraction
        self._updates: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.num_updates = 0

    def add(self, values: torch.Tensor, *, support: torch.Tensor | None, weight: float) -> None:
        """Keeps one client's values on ``support`` (int64 indices; ``None`` = dense).

        Raises:
            ValueError: as ``SparseAggregator.add``.
        """
        _check_weight(weight)
        _check_update(values, support, self.dense_size)
        self._updates.append((values.detach().to(torch.float32), support))
        self.num_updates += 1

    def _union(self) -> torch.Tensor:
        """The sorted union of the supports (every coordinate if one update is dense)."""
        supports = [s for _, s in self._updates]
        if any(s is None for s in supports):
            return torch.arange(self.dense_size)
        first = supports[0]
        assert first is not None
        if all(s is not None and torch.equal(s, first) for s in supports):
            return first
        return torch.unique(torch.cat([s for s in supports if s is not None]))

    def _stacked(self, union: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(``n x |union|`` values, which update covers which entry; None: all)."""
        if all(s is None or s.numel() == union.numel() for _, s in self._updates):
            return torch.stack([v for v, _ in self._updates]), None  # one shared support
        values = torch.zeros(len(self._updates), union.numel(), dtype=torch.float32)
        covered = torch.zeros(values.shape, dtype=torch.bool)
        for row, (v, support) in enumerate(self._updates):
            cols = (
                torch.arange(union.numel())
                if support is None
                else torch.searchsorted(union, support)
            )
            values[row, cols] = v
            covered[row, cols] = True
        return values, covered

    def update(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the touched coordinates as sorted int64 indices, the rule's value at each)."""
        if not self._updates:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32)
        union = self._union()
        values, covered = self._stacked(union)
        if self.rule == "median":
            return union, coordinate_median(values, covered=covered)
        return union, trimmed_mean(values, trim_fraction=self.trim_fraction, covered=covered)

    def apply_(self, weights: torch.Tensor) -> torch.Tensor:
        """Adds the robust update to the flat float32 model ``weights`` in place.

        Returns:
            The boolean mask of coordinates that changed (the union of the supports).
        """
        if weights.shape != (self.dense_size,):
            raise ValueError(
                f"weights has shape {tuple(weights.shape)}: expected ({self.dense_size},)"
            )
        union, delta = self.update()
        weights[union] += delta
        touched = torch.zeros(self.dense_size, dtype=torch.bool)
        touched[union] = True
        return touched


def make_aggregator(
    name: AggregatorName, dense_size: int, *, trim_fraction: float = 0.2
) -> SparseAggregator | RobustAggregator:
    """The run's aggregator for one round."""
    if name == "mean":
        return SparseAggregator(dense_size)
    return RobustAggregator(dense_size, rule=name, trim_fraction=trim_fraction)
