"""GIP's noisy top-k pruning: index selection perturbed by a Mallows model.

GIP (Gradient Index Pruning: "Improving Differentially-Private Deep Learning with Gradients
Index Pruning", an OpenReview submission) keeps, in each
group of ``l = group_size`` consecutive coordinates of the clipped batch gradient, the ``k``
largest by magnitude, and makes that data-dependent choice differentially private by drawing
the kept set from a Mallows model centred on it (Alg. 1)::

    P(I | I0) = exp(-theta * d(I, I0)) / psi(theta)                       (Def. 2, eq. 3)

over ``S_k``, the binary index sequences of the group with exactly ``k`` ones (Def. 4), where
``I0`` is the top-k sequence and ``d`` the L1 distance ("Without specification, we use
L1-norm distance", Sec. 3). Two sequences of ``S_k`` that differ in ``i`` swapped pairs are
at distance ``2i``, and there are ``C(k, i) C(l - k, i)`` of them, so App. A.2 samples by
(1) drawing ``i`` with ``P(i) ~ C(k, i) C(l - k, i) exp(-2 theta i)`` (eq. 11), then
(2) turning ``i`` uniformly chosen ones of ``I0`` off and ``i`` uniformly chosen zeros on.
That is :func:`noisy_top_k_mask` (``distance="hamming"``).

Privacy (Thm. 1, App. A.1). ``psi`` does not depend on ``I0``, so by the triangle inequality
the output density changes by at most ``exp(theta * s1)`` between neighbouring datasets,
where ``s1 = sup ||I(g) - I(g')||_1`` is the index sensitivity (Def. 3); within ``S_k`` it is
at most ``min(2k, 2(l - k))`` per group (Sec. 4.1): :func:`index_sensitivity`. Hence each
group is ``eps2_i``-DP when ``theta_i <= eps2_i / s1`` (the paper states "if and only if";
A.1 proves this direction). Groups and steps compose by basic composition: the index
selection costs ``T * sum_i eps2_i`` on top of the Gaussian mechanism's ``eps1`` (Thm. 2):
:func:`max_dispersion`.

Order in DP-SGD (Alg. 2): clip each per-sample gradient -> sum -> choose ``I`` from the
clipped, noise-free sum with this module -> add noise -> multiply by ``I`` -> scale. Unlike
RS masks, ``I`` depends on private data: no other party can rebuild it from a seed, so it
must travel with the update, and it costs the extra ``eps2``. The random-k baseline
(:func:`random_k_mask`, Prop. 1) is data-independent and costs nothing.

Also here, for rankings: :func:`sample_mallows_ranking`, the Mallows model over permutations
with the Kendall-tau distance (repeated insertion, Doignon et al. 2004), and the
``distance="kendall"`` variant of the top-k (perturb the ranking by ``|g|``, keep its first
``k``). That variant is not the paper's: its sensitivity is the Kendall distance between the
rankings of neighbouring gradients, up to ``l (l - 1) / 2`` (one example can reverse a
group's order), so the same budget buys a ``theta`` smaller by ``l (l - 1) / (2 s1)``:
over 100 times for ``l = 256``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final, Literal, get_args

import numpy as np
import torch

from fedsparse.common.masks import keep_count

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "DISTANCES",
    "IndexDistance",
    "index_sensitivity",
    "kendall_distance",
    "kendall_distance_pmf",
    "mask_distance_pmf",
    "max_dispersion",
    "noisy_top_k_mask",
    "random_k_mask",
    "sample_mallows_ranking",
]

DEFAULT_GROUP_SIZE: Final = 256
"""GIP's group length ``l`` (Alg. 1 splits the gradient into groups for tractability)."""

IndexDistance = Literal["hamming", "kendall"]
DISTANCES: Final[tuple[IndexDistance, ...]] = get_args(IndexDistance)


def _check_theta(theta: float) -> float:
    if math.isnan(theta) or theta < 0:
        raise ValueError(f"theta={theta}: expected 0 <= theta <= inf")
    return float(theta)


def _mallows_pmf(log_counts: np.ndarray, distance: np.ndarray, theta: float) -> np.ndarray:
    """``counts * exp(-theta * distance)``, normalized; ``theta = inf`` puts all mass on 0."""
    penalty = theta * distance if theta < math.inf else np.where(distance > 0, np.inf, 0.0)
    log_weights = log_counts - penalty
    weights = np.exp(log_weights - log_weights.max())
    return weights / weights.sum()


def kendall_distance(a: np.ndarray, b: np.ndarray) -> int:
    """The Kendall-tau distance: how many item pairs rankings ``a`` and ``b`` order differently.

    ``a`` and ``b`` are permutations of ``0..n-1``; O(n^2) time and memory.
    """
    position_in_a = np.argsort(a)
    p = position_in_a[np.asarray(b)]
    return int(np.triu(p[:, None] > p[None, :], k=1).sum())


def kendall_distance_pmf(n: int, *, theta: float) -> np.ndarray:
    """The law of a Mallows ranking's Kendall distance ``d`` to its reference, ``n`` items.

    ``P(d) = N(n, d) exp(-theta d) / psi`` for ``d = 0..n(n-1)/2``, where the Mahonian number
    ``N(n, d)`` counts the permutations of ``n`` items with ``d`` inversions.
    """
    theta = _check_theta(theta)
    if n < 1:
        raise ValueError(f"n={n}: expected >= 1")
    counts = [1]  # coefficients of prod_{i<n} (1 + q + ... + q^i), exact integers
    for i in range(1, n):
        counts = [sum(counts[max(0, d - i) : d + 1]) for d in range(len(counts) + i)]
    log_counts = np.array([math.log(c) for c in counts])
    return _mallows_pmf(log_counts, np.arange(len(counts)), theta)


def mask_distance_pmf(size: int, keep: int, *, theta: float) -> np.ndarray:
    """The law of the number ``i`` of swapped pairs between a Mallows kept set and its mode.

    Over ``S_k`` (``keep`` of ``size`` kept) with the L1 distance ``2i``:
    ``P(i) = C(keep, i) C(size - keep, i) exp(-2 theta i) / psi`` for
    ``i = 0..min(keep, size - keep)`` (GIP eq. 11).
    """
    theta = _check_theta(theta)
    if not 0 <= keep <= size:
        raise ValueError(f"keep={keep}: expected 0 <= keep <= size={size}")
    i = np.arange(min(keep, size - keep) + 1)
    log_counts = np.array([math.log(math.comb(keep, j) * math.comb(size - keep, j)) for j in i])
    return _mallows_pmf(log_counts, 2 * i, theta)


def _insertion_offsets(groups: int, n: int, theta: float, rng: np.random.Generator) -> np.ndarray:
    """``V[:, i]`` in 0..i with ``P(v) ~ exp(-theta v)``, by inverting its CDF."""
    i = np.arange(n)
    u = rng.random((groups, n))
    if theta == 0:
        v = np.floor(u * (i + 1))
    else:
        # P(V <= v) = (1 - q^(v+1)) / (1 - q^(i+1)), q = exp(-theta); expm1/log1p keep it
        # exact for small theta, and theta = inf gives V = 0 (no inversions).
        v = np.floor(-np.log1p(-u * -np.expm1(-theta * (i + 1))) / theta)
    return np.clip(v, 0, i).astype(np.int64)


def sample_mallows_ranking(
    reference: np.ndarray, *, theta: float, generator: np.random.Generator
) -> np.ndarray:
    """Draw rankings from the Mallows model with Kendall-tau distance around ``reference``.

    Repeated insertion: the reference's items are inserted one by one into a growing list,
    item ``i`` (0-based) ``v`` places above the bottom with ``P(v) ~ exp(-theta v)``,
    ``v <= i``. It then sits below exactly ``v`` of the items ranked above it in the
    reference, so the Kendall distance is ``sum v`` and ``P(ranking) ~ exp(-theta d)``; each
    ranking has exactly one insertion sequence, so the law is exact.

    Args:
        reference: The mode, ``n`` items best first; or ``m x n``, one ranking per row.
        theta: Dispersion, ``>= 0``: 0 is uniform over all ``n!`` rankings, ``inf`` returns
            ``reference``.
        generator: The random stream.

    Returns:
        Rankings of the same shape and items as ``reference``.
    """
    theta = _check_theta(theta)
    ref = np.asarray(reference)
    rows = ref.reshape(-1, ref.shape[-1]) if ref.ndim else ref.reshape(1, 1)
    groups, n = rows.shape
    offsets = _insertion_offsets(groups, n, theta, generator)
    position = np.zeros((groups, n), dtype=np.int64)  # of each inserted item, in the list
    for i in range(n):
        slot = (i - offsets[:, i])[:, None]
        position[:, :i] += position[:, :i] >= slot  # items at or below the slot move down
        position[:, i : i + 1] = slot
    out = np.empty_like(rows)
    np.put_along_axis(out, position, rows, axis=1)
    return out.reshape(ref.shape)


def _perturb_top_k(
    magnitudes: np.ndarray,
    keep: int,
    theta: float,
    distance: IndexDistance,
    rng: np.random.Generator,
) -> np.ndarray:
    """The kept-set mask (``m x l``, ``keep`` per row) for rows of equal length ``l``."""
    groups, size = magnitudes.shape
    ranking = np.argsort(-magnitudes, axis=1, kind="stable")  # ties: lower index first
    if distance == "kendall":
        ranking = sample_mallows_ranking(ranking, theta=theta, generator=rng)
        out = np.zeros((groups, size), dtype=bool)
        np.put_along_axis(out, ranking[:, :keep], True, axis=1)
        return out
    reference = np.zeros((groups, size), dtype=bool)
    np.put_along_axis(reference, ranking[:, :keep], True, axis=1)
    pmf = mask_distance_pmf(size, keep, theta=theta)
    swaps = np.asarray(rng.choice(len(pmf), size=groups, p=pmf)).reshape(groups, 1)
    # Rank each one (and each zero) by a random key; the `swaps` first of each flip.
    keys = rng.random((groups, size))
    rank_ones = np.argsort(np.argsort(np.where(reference, keys, np.inf), axis=1), axis=1)
    rank_zeros = np.argsort(np.argsort(np.where(reference, np.inf, keys), axis=1), axis=1)
    return np.where(reference, rank_ones >= swaps, rank_zeros < swaps)


def _group_masks(
    scores: np.ndarray,
    keep_fraction: float,
    group_size: int,
    select: Callable[[np.ndarray, int], np.ndarray],
) -> np.ndarray:
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction={keep_fraction}: expected 0 < keep_fraction <= 1")
    if group_size < 1:
        raise ValueError(f"group_size={group_size}: expected >= 1")
    full = len(scores) - len(scores) % group_size
    parts = []
    if full:  # all full groups at once, then the shorter last group
        parts.append(select(scores[:full].reshape(-1, group_size), group_size).reshape(-1))
    if full < len(scores):
        parts.append(select(scores[full:][None, :], len(scores) - full).reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


def noisy_top_k_mask(
    grad: torch.Tensor,
    *,
    keep_fraction: float,
    theta: float,
    generator: np.random.Generator,
    group_size: int = DEFAULT_GROUP_SIZE,
    distance: IndexDistance = "hamming",
) -> torch.Tensor:
    """GIP's noisy top-k pruning (Alg. 1 with the App. A.2 sampler): the perturbed index set.

    The flattened ``grad`` is cut into consecutive groups of ``group_size`` (the last one may
    be shorter); in a group of length ``l``, ``k = keep_count(l, rate=1 - keep_fraction)``
    coordinates are kept, drawn from the Mallows model around that group's top-k by ``|g|``
    (ties broken towards the lower index, so exactly ``k``, unlike Alg. 1's percentile
    threshold).

    Guarantee: with ``theta <= eps2 / index_sensitivity(l, k, distance)`` each group's kept
    set is ``eps2``-DP (Thm. 1); see the module docstring for composition.

    Args:
        grad: The clipped, summed, noise-free batch gradient (Alg. 2, line 9), any shape.
        keep_fraction: GIP's ``k`` in (0, 1]; 1 keeps everything (then ``theta`` is moot).
        theta: Mallows dispersion ``>= 0``: 0 gives :func:`random_k_mask`'s law, ``inf``
            the exact top-k.
        generator: The mechanism's private random stream.
        group_size: ``l``, default 256 (the paper's).
        distance: ``"hamming"`` (the paper's L1 over index sequences) or ``"kendall"``.

    Returns:
        A bool tensor of ``grad``'s shape and device.

    Raises:
        ValueError: A NaN in ``grad``, or a parameter out of range.
    """
    if distance not in DISTANCES:
        raise ValueError(f"distance={distance!r}: expected one of {', '.join(DISTANCES)}")
    theta = _check_theta(theta)
    magnitudes = grad.detach().abs().flatten().to("cpu", torch.float64).numpy()
    if np.isnan(magnitudes).any():
        raise ValueError("grad: contains NaN; the top-k of a NaN gradient is undefined")

    def select(rows: np.ndarray, size: int) -> np.ndarray:
        keep = keep_count(size, rate=1.0 - keep_fraction)
        return _perturb_top_k(rows, keep, theta, distance, generator)

    mask = _group_masks(magnitudes, keep_fraction, group_size, select)
    return torch.from_numpy(mask).reshape(grad.shape).to(grad.device)


def random_k_mask(
    numel: int,
    *,
    keep_fraction: float,
    generator: np.random.Generator,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> torch.Tensor:
    """GIP's privacy-free random-k baseline, per group: ``k`` uniform coordinates of each.

    Same groups and ``k`` as :func:`noisy_top_k_mask`, so the two differ only in how the
    kept set is chosen (it is that function's ``theta = 0`` law). The paper's random-k
    (Prop. 1) draws ``k d`` coordinates over the whole gradient instead: that is
    ``masks.sample_mask``, which every party can rebuild from a seed.
    """
    if numel < 0:
        raise ValueError(f"numel={numel}: expected >= 0")

    def select(rows: np.ndarray, size: int) -> np.ndarray:
        keep = keep_count(size, rate=1.0 - keep_fraction)
        ranks = np.argsort(np.argsort(generator.random(rows.shape), axis=1), axis=1)
        return ranks < keep

    return torch.from_numpy(_group_masks(np.zeros(numel), keep_fraction, group_size, select))


def index_sensitivity(size: int, keep: int, *, distance: IndexDistance = "hamming") -> int:
    """``s1``: the largest distance between the reference index sets (or rankings) of one
    group under neighbouring datasets. Hamming: ``2 min(k, l - k)`` (GIP Sec. 4.1, after
    Def. 3). Kendall: ``l (l - 1) / 2``, the diameter of the rankings (not in the paper)."""
    if not 0 <= keep <= size:
        raise ValueError(f"keep={keep}: expected 0 <= keep <= size={size}")
    if distance == "hamming":
        return 2 * min(keep, size - keep)
    if distance == "kendall":
        return size * (size - 1) // 2
    raise ValueError(f"distance={distance!r}: expected one of {', '.join(DISTANCES)}")


def max_dispersion(
    *, epsilon: float, sensitivity: int, num_groups: int = 1, steps: int = 1
) -> float:
    """The largest ``theta`` for which ``steps`` rounds of index selection over
    ``num_groups`` groups cost at most ``epsilon`` in total, the budget split evenly:
    ``theta = epsilon / (steps * num_groups * s1)`` (Thm. 1 per group, basic composition over
    groups and steps as in Thm. 2). ``sensitivity = 0`` (nothing to choose) gives ``inf``."""
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon={epsilon}: expected a finite value >= 0")
    if sensitivity < 0 or num_groups < 1 or steps < 1:
        raise ValueError(
            f"sensitivity={sensitivity}, num_groups={num_groups}, steps={steps}: "
            "expected sensitivity >= 0 and num_groups, steps >= 1"
        )
    if sensitivity == 0:
        return math.inf
    return epsilon / (steps * num_groups * sensitivity)
