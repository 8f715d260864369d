"""Which coordinates train in each epoch (centralized) or round (federated): the ``method``.

Every method here chooses its coordinates from public information only (the config, the
model's layout, the step and a public seed), never from data, so the privacy accounting of
DP-SGD is unchanged (the mask is applied before per-sample clipping and the noise is added on
the kept coordinates only: ``common/dp.py``).

- ``rs``: random sparsification (RS paper, Algorithm 1): a uniformly random mask of ``keep``
  coordinates per step, ``r(e)`` from the run's ``schedule`` (gradual cooling by default).
- ``random-freeze``: random freeze (``random-freeze-dpsgd.txt``, Algorithm 1): the same random
  mask, with the freeze rate ramped linearly to ``r*`` at the cooling time ``e*`` and constant
  after, ``r(e) = r* min(e / e*, 1)`` (schedule ``cooling``, ``e*`` = ``cooling-rounds`` or
  ``--cooling-steps``). Its *total density* (non-zero gradient coordinates over the dense
  count, over the whole run) is reported for every method (``total_density``).
- ``lf``: DP-SGD with layer freezing (``dpsgd-lf-layer-freezing.txt``, Algorithm 1): plain
  DP-SGD until step ``t_f`` (``freeze-after``), then the first ``m_f`` layers
  (``freeze-layers``, closest to the input) are frozen: their gradients are zeroed before
  clipping and get no noise, so they move by exactly 0. The sparsification rate does not apply
  (RS is off). A layer is a module that owns parameters (a convolution's weight and bias are
  one layer), in ``named_parameters()`` order. The frozen layers are a prefix of the flat
  coordinates, ``[0, s)``: in the federation a client sends the values of ``[s, d)`` only, as
  a dense vector of ``d - s`` values, so the frozen layers cost no uplink byte.

- ``ranked``: ranked sparsification (RS paper, Algorithm 4, App. I): epoch 0 trains every
  coordinate; epoch ``e`` keeps the ``keep`` coordinates of largest ``|z^{e-1}|``, where ``z``
  sums the last epoch's perturbed (noisy) gradients plus fresh noise on the masked coordinates
  (line 22: else a coordinate masked once would never be ranked up again). The ranking is
  post-processing of DP outputs: no privacy cost. ``clean_ranking`` ranks the clipped
  gradients before noise instead: NOT private (the reported ε does not cover it), only the
  paper's Figure 12 reference. In the federation (``federated_ranking_scores``) ``z`` is the
  last round's aggregated update ``w_{r-1} - w_{r-2}``, public to every participant, with
  fresh noise off its support drawn from a public seed at the update's own spread (its
  standard deviation on the support). The server always holds both models, a client only if
  it trained the round before, so the server ranks and sends the support explicitly (a
  bitmap, ``d / 8`` bytes, counted on the downlink); the client replies with the ``keep``
  values in support order, values only.

- ``dpssgd``: DP-SSGD (``dpssgd-pruning-public-data.txt``): a slice of the training set,
  ``public-fraction`` of it, is declared public (``public_split``; the clients' partitions
  are drawn from the rest). The model is pretrained on it without noise for
  ``public-epochs`` (by the server, in the federation), then DP-SGD updates only the selected
  coordinates: in every layer the ``keep_count(n_layer, final-rate)`` of largest ``|w|``
  (``selection=magnitude``, the weights are public: pretrained on public data or released
  under DP) or a uniformly random set (``random``), chosen once after pretraining
  (``selection-mode=freeze``: parameter freezing) or again each round (``reselect``). No
  privacy cost: nothing private chooses the mask. In the federation the server selects and
  sends the support as for ``ranked``.

- ``gip`` and ``random-k``: the exception to the first paragraph. GIP's noisy top-k
  (``gip-gradient-index-pruning.txt``) chooses a new support at every DP step from the
  clipped gradient sum, perturbed by a Mallows model, and pays for it from its own share of
  the budget; random-k chooses uniformly per group of ``group-size`` and pays nothing. Both
  live in ``common/gip.py``; the keep ratio follows the rate schedule (``k = 1 - r``).

Steps are 0-based: epoch ``e`` in ``0..E-1``, or round ``r - 1``. ``lf`` freezes from step
``t_f`` on (``t > t_f`` in the paper's 1-based count).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, get_args

import numpy as np
import torch

from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import derive_seed, keep_count, sample_mask
from fedsparse.common.schedules import ScheduleName
from fedsparse.common.seeds import Stream, stream_seed

__all__ = [
    "FEDERATED_METHODS",
    "METHODS",
    "SELECTIONS",
    "SELECTION_MODES",
    "MethodConfig",
    "FederatedMethodName",
    "MethodName",
    "SelectionMode",
    "SelectionName",
    "federated_ranking_scores",
    "frozen_prefix",
    "layerwise_keep",
    "layerwise_mask",
    "public_split",
    "layer_ranges",
    "method_schedule",
    "ranked_mask",
    "suffix_mask",
    "total_density",
]

MethodName = Literal["rs", "random-freeze", "lf", "ranked", "dpssgd", "gip", "random-k"]
"""The methods above (run-config ``method``, ``fedsparse train --method``)."""

METHODS: Final[tuple[MethodName, ...]] = get_args(MethodName)

FederatedMethodName = Literal["rs", "random-freeze", "lf", "ranked", "dpssgd", "gip", "random-k"]
"""The methods a federation runs (run-config ``method``): all of them."""

FEDERATED_METHODS: Final[tuple[FederatedMethodName, ...]] = get_args(FederatedMethodName)

SelectionName = Literal["magnitude", "random"]
"""DP-SSGD's pruning criterion: largest ``|w|`` per layer, or uniformly random per layer."""

SELECTIONS: Final[tuple[SelectionName, ...]] = get_args(SelectionName)

SelectionMode = Literal["freeze", "reselect"]
"""DP-SSGD's mode: one selection after pretraining (parameter freezing), or a new one each
round (centralized: each epoch), the federated form of per-step parameter selection."""

SELECTION_MODES: Final[tuple[SelectionMode, ...]] = get_args(SelectionMode)


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


def method_schedule(
    method: MethodName, schedule: ScheduleName, field: str = "schedule"
) -> ScheduleName:
    """The rate schedule ``method`` runs: ``cooling`` for ``random-freeze``, ``constant`` for
    ``dpssgd`` (its pruning ratio is ``final-rate`` throughout), else ``schedule``.

    Raises:
        ValueError: ``random-freeze`` with a schedule other than the default ``gradual`` or
            ``cooling`` (random freeze *is* the cooling schedule); ``dpssgd`` with one other
            than ``gradual`` or ``constant``.
    """
    if method == "dpssgd":
        if schedule not in ("gradual", "constant"):
            raise ValueError(
                f"{field}={schedule!r}: method='dpssgd' prunes at final-rate throughout "
                "(schedule 'constant'); leave the schedule unset or set 'constant'"
            )
        return "constant"
    if method != "random-freeze":
        return schedule
    if schedule not in ("gradual", "cooling"):
        raise ValueError(
            f"{field}={schedule!r}: method='random-freeze' ramps the rate to r* at the cooling "
            "time e* (schedule 'cooling'); leave the schedule unset or set 'cooling'"
        )
    return "cooling"


@dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """The method and its own parameters (``freeze_*`` apply to ``lf`` only).

    Attributes:
        name: one of ``METHODS``.
        freeze_layers: ``m_f``, layers frozen from ``freeze_after`` on (``lf``: >= 1).
        freeze_after: ``t_f``, the first 0-based step (epoch, or round - 1) that freezes.
    """

    name: MethodName = "rs"
    freeze_layers: int = 1
    freeze_after: int = 0
    #: ``ranked`` only: rank without the noise (NOT private; Figure 12's reference).
    clean_ranking: bool = False
    #: ``dpssgd`` only (see the module).
    public_fraction: float = 0.1
    public_epochs: int = 5
    selection: SelectionName = "magnitude"
    selection_mode: SelectionMode = "freeze"
    #: ``gip`` only: the share of ``target-epsilon`` spent on the indices (``eps2``).
    index_budget_fraction: float = 0.01
    #: ``gip`` and ``random-k``: GIP's group length ``l``.
    group_size: int = 256

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise ValueError(f"method={self.name!r}: expected one of {', '.join(METHODS)}")
        if self.freeze_layers < 1:
            raise ValueError(f"freeze-layers={self.freeze_layers}: expected >= 1")
        if self.freeze_after < 0:
            raise ValueError(f"freeze-after={self.freeze_after}: expected >= 0")
        if not 0.0 < self.public_fraction < 1.0:
            raise ValueError(f"public-fraction={self.public_fraction}: expected 0 < f < 1")
        if self.public_epochs < 0:
            raise ValueError(f"public-epochs={self.public_epochs}: expected >= 0")
        if self.selection not in SELECTIONS:
            raise ValueError(
                f"selection={self.selection!r}: expected one of {', '.join(SELECTIONS)}"
            )
        if self.selection_mode not in SELECTION_MODES:
            raise ValueError(
                f"selection-mode={self.selection_mode!r}: expected one of "
                f"{', '.join(SELECTION_MODES)}"
            )
        if not 0.0 < self.index_budget_fraction < 1.0:
            raise ValueError(
                f"index-budget-fraction={self.index_budget_fraction}: expected 0 < f < 1"
            )
        if self.group_size < 2:
            raise ValueError(f"group-size={self.group_size}: expected >= 2")
        if self.clean_ranking and self.name != "ranked":
            raise ValueError(f"clean_ranking=True: only with method='ranked' (got {self.name!r})")

    @property
    def uses_rate(self) -> bool:
        """Whether the rate schedule chooses a public random mask (``rs``, ``random-freeze``)."""
        return self.name in ("rs", "random-freeze")

    @property
    def selects_per_step(self) -> bool:
        """Whether each DP step chooses its own support (``gip``, ``random-k``)."""
        return self.name in ("gip", "random-k")

    def frozen(self, layout: ParamLayout, step: int) -> int:
        """``s``: the frozen coordinate prefix at 0-based ``step`` (0: nothing frozen).

        Raises:
            ValueError: ``freeze_layers`` leaves no layer to train (``frozen_prefix``).
        """
        if self.name != "lf":
            return 0
        s = frozen_prefix(layout, self.freeze_layers)
        return s if step >= self.freeze_after else 0

    def check(self, layout: ParamLayout) -> None:
        """Checks the method's parameters against the model (``lf``: enough layers)."""
        if self.name == "lf":
            frozen_prefix(layout, self.freeze_layers)


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
