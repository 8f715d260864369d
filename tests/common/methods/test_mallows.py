"""Tests for fedsparse.common.methods.mallows: samplers against the Mallows model's closed forms."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedsparse.common.methods.mallows import (
    index_sensitivity,
    kendall_distance,
    kendall_distance_pmf,
    mask_distance_pmf,
    max_dispersion,
    noisy_top_k_mask,
    random_k_mask,
    sample_mallows_ranking,
)

# Fixed seeds make every statistical test deterministic; the thresholds leave room for the
# true law (p > 1e-3) and none for a 1.5x wrong theta (p < 1e-6).
ACCEPT_P = 1e-3
REJECT_P = 1e-6


def _chi2_pvalue(counts: np.ndarray, pmf: np.ndarray) -> float:
    """Pearson chi-square p-value of ``counts`` against ``pmf``, merging bins expecting < 5."""
    expected = pmf * counts.sum()
    order = np.argsort(expected)
    obs, exp = [], []
    acc_o = acc_e = 0.0
    for k in order:  # pool the rarest bins until each pooled bin expects >= 5
        acc_o, acc_e = acc_o + counts[k], acc_e + expected[k]
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        obs[-1] += acc_o
        exp[-1] += acc_e
    if len(obs) < 2:
        return 1.0 if np.isclose(obs[0], exp[0]) else 0.0
    return float(stats.chisquare(obs, exp).pvalue)


def _kendall_distances(rankings: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Vectorized Kendall distance of each row of ``rankings`` to ``reference``."""
    p = np.argsort(reference)[rankings]
    i, j = np.triu_indices(rankings.shape[1], k=1)
    return (p[:, i] > p[:, j]).sum(axis=1)


# ------------------------------------------------------------------ Kendall / rankings


def test_kendall_distance_basics() -> None:
    ident = np.arange(6)
    assert kendall_distance(ident, ident) == 0
    assert kendall_distance(ident, ident[::-1]) == 15
    assert kendall_distance(ident, np.array([1, 0, 2, 3, 4, 5])) == 1
    a, b = np.array([2, 0, 3, 1, 5, 4]), np.array([4, 1, 0, 5, 3, 2])
    assert kendall_distance(a, b) == kendall_distance(b, a)
    assert kendall_distance(a, b) == _kendall_distances(b[None], a)[0]


def test_kendall_pmf_is_mahonian() -> None:
    mahonian_4 = np.array([1, 3, 5, 6, 5, 3, 1])  # OEIS A008302, row n = 4
    np.testing.assert_allclose(kendall_distance_pmf(4, theta=0.0), mahonian_4 / 24)
    weights = mahonian_4 * np.exp(-0.7 * np.arange(7))
    np.testing.assert_allclose(kendall_distance_pmf(4, theta=0.7), weights / weights.sum())
    assert kendall_distance_pmf(1, theta=2.0).tolist() == [1.0]
    assert kendall_distance_pmf(5, theta=math.inf).tolist() == [1.0] + [0.0] * 10


@pytest.mark.parametrize("n", [5, 6])
@pytest.mark.parametrize("theta", [0.0, 0.4, 1.2])
def test_ranking_distances_match_closed_form(n: int, theta: float) -> None:
    rng = np.random.default_rng(1234 + n)
    reference = rng.permutation(n)  # not the identity: the law is relative to the mode
    samples = sample_mallows_ranking(np.tile(reference, (20_000, 1)), theta=theta, generator=rng)
    assert (np.sort(samples, axis=1) == np.arange(n)).all()
    counts = np.bincount(_kendall_distances(samples, reference), minlength=n * (n - 1) // 2 + 1)
    assert _chi2_pvalue(counts, kendall_distance_pmf(n, theta=theta)) > ACCEPT_P
    wrong = 1.5 * theta if theta else 0.2
    assert _chi2_pvalue(counts, kendall_distance_pmf(n, theta=wrong)) < REJECT_P


@pytest.mark.parametrize("theta", [0.0, 0.7])
def test_ranking_law_is_exact_over_all_permutations(theta: float) -> None:
    # Not only the distance: each permutation has probability exp(-theta d) / psi.
    n, rng = 4, np.random.default_rng(7)
    reference = np.array([2, 0, 3, 1])
    samples = sample_mallows_ranking(np.tile(reference, (24_000, 1)), theta=theta, generator=rng)
    perms = list(itertools.permutations(range(n)))
    index = {p: k for k, p in enumerate(perms)}
    counts = np.bincount([index[tuple(s)] for s in samples.tolist()], minlength=len(perms))
    d = np.array([kendall_distance(reference, np.array(p)) for p in perms])
    law = np.exp(-theta * d) / np.exp(-theta * d).sum()
    assert _chi2_pvalue(counts, law) > ACCEPT_P


@pytest.mark.parametrize("theta", [60.0, math.inf])
def test_large_theta_returns_the_reference(theta: float) -> None:
    rng = np.random.default_rng(3)
    reference = np.stack([rng.permutation(40) for _ in range(50)])
    np.testing.assert_array_equal(
        sample_mallows_ranking(reference, theta=theta, generator=rng), reference
    )


def test_ranking_seeding() -> None:
    ref = np.arange(30)
    a = sample_mallows_ranking(ref, theta=0.1, generator=np.random.default_rng(5))
    b = sample_mallows_ranking(ref, theta=0.1, generator=np.random.default_rng(5))
    c = sample_mallows_ranking(ref, theta=0.1, generator=np.random.default_rng(6))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert sample_mallows_ranking(np.array([9]), theta=0.0, generator=np.random.default_rng()) == 9


@pytest.mark.parametrize("theta", [-0.1, math.nan])
def test_theta_validated(theta: float) -> None:
    with pytest.raises(ValueError, match=f"theta={theta}"):
        sample_mallows_ranking(np.arange(3), theta=theta, generator=np.random.default_rng())
    with pytest.raises(ValueError, match=f"theta={theta}"):
        noisy_top_k_mask(
            torch.ones(8), keep_fraction=0.5, theta=theta, generator=np.random.default_rng()
        )


# ------------------------------------------------------------ GIP noisy top-k (Alg. 1)


def _group_sums(mask: torch.Tensor, group_size: int) -> list[int]:
    flat = mask.flatten()
    return [int(flat[i : i + group_size].sum()) for i in range(0, len(flat), group_size)]


@pytest.mark.parametrize("distance", ["hamming", "kendall"])
@pytest.mark.parametrize(("keep_fraction", "per_group"), [(0.1, [26, 26, 26, 24]), (1.0, None)])
def test_noisy_top_k_keeps_exactly_k_per_group(
    distance: str, keep_fraction: float, per_group: list[int] | None
) -> None:
    grad = torch.randn(10, 100)  # 1000 coordinates: three groups of 256 and one of 232
    mask = noisy_top_k_mask(
        grad,
        keep_fraction=keep_fraction,
        theta=0.05,
        generator=np.random.default_rng(0),
        distance=distance,  # type: ignore[arg-type]
    )
    assert mask.shape == grad.shape and mask.dtype == torch.bool
    assert _group_sums(mask, 256) == (per_group or [256, 256, 256, 232])


@pytest.mark.parametrize("distance", ["hamming", "kendall"])
def test_infinite_theta_is_the_exact_top_k(distance: str) -> None:
    grad = torch.randn(1000, dtype=torch.float64)
    mask = noisy_top_k_mask(
        grad,
        keep_fraction=0.25,
        theta=math.inf,
        generator=np.random.default_rng(0),
        group_size=100,
        distance=distance,  # type: ignore[arg-type]
    )
    expected = torch.zeros(10, 100, dtype=torch.bool)
    expected.scatter_(1, grad.view(10, 100).abs().topk(25, dim=1).indices, True)
    assert torch.equal(mask, expected.flatten())


def _repeated_groups(magnitudes: np.ndarray, groups: int) -> torch.Tensor:
    """The same group of magnitudes ``groups`` times: one reference set, many samples."""
    return torch.from_numpy(np.tile(magnitudes, groups))


@pytest.mark.parametrize("theta", [0.0, 0.3, 1.0])
def test_hamming_swaps_match_eq_11(theta: float) -> None:
    size, keep, groups = 20, 5, 20_000
    magnitudes = np.random.default_rng(0).permutation(size).astype(np.float64)
    reference = magnitudes >= size - keep  # the 5 largest
    mask = noisy_top_k_mask(
        _repeated_groups(magnitudes, groups),
        keep_fraction=0.25,
        theta=theta,
        generator=np.random.default_rng(11),
        group_size=size,
    ).view(groups, size)
    assert (mask.sum(dim=1) == keep).all()
    swaps = (torch.from_numpy(reference) & ~mask).sum(dim=1).numpy()
    counts = np.bincount(swaps, minlength=keep + 1)
    assert _chi2_pvalue(counts, mask_distance_pmf(size, keep, theta=theta)) > ACCEPT_P
    wrong = 1.5 * theta if theta else 0.2
    assert _chi2_pvalue(counts, mask_distance_pmf(size, keep, theta=wrong)) < REJECT_P
    # Which coordinates swap is uniform: each reference one is dropped with probability
    # E[i] / k and each zero picked with probability E[i] / (l - k); tolerance 5 SE.
    mean_swaps = float(np.arange(keep + 1) @ mask_distance_pmf(size, keep, theta=theta))
    freq = mask.double().mean(dim=0).numpy()
    p_on = np.where(reference, 1 - mean_swaps / keep, mean_swaps / (size - keep))
    se = np.sqrt(p_on * (1 - p_on) / groups)
    assert (np.abs(freq - p_on) <= 5 * se + 1e-12).all()


@pytest.mark.parametrize("theta", [0.0, 0.5])
def test_hamming_law_is_exact_over_s_k(theta: float) -> None:
    # Every kept set I of a group of 6 with k = 3 has probability exp(-theta d(I, I0)) / psi.
    size, keep, groups = 6, 3, 40_000
    magnitudes = np.array([0.1, 5.0, 0.3, 4.0, 3.0, 0.2])
    reference = magnitudes >= 3.0
    mask = noisy_top_k_mask(
        _repeated_groups(magnitudes, groups),
        keep_fraction=0.5,
        theta=theta,
        generator=np.random.default_rng(2),
        group_size=size,
    ).view(groups, size)
    subsets = [np.isin(np.arange(size), c) for c in itertools.combinations(range(size), keep)]
    codes = mask.numpy() @ (1 << np.arange(size))
    index = {int(s @ (1 << np.arange(size))): k for k, s in enumerate(subsets)}
    counts = np.bincount([index[int(c)] for c in codes], minlength=len(subsets))
    d = np.array([np.sum(s != reference) for s in subsets])  # L1 distance, 2 per swap
    law = np.exp(-theta * d) / np.exp(-theta * d).sum()
    assert _chi2_pvalue(counts, law) > ACCEPT_P


def test_theta_bound_gives_the_privacy_ratio() -> None:
    # Thm. 1 from the exact law: for any two references in S_k and any output I,
    # |log P(I | I0) - log P(I | I0')| <= theta * d(I0, I0') <= theta * s1, with equality
    # reached; so theta = eps / s1 is eps-DP and no larger theta is.
    size, keep, theta = 6, 2, 0.4
    subsets = [np.isin(np.arange(size), c) for c in itertools.combinations(range(size), keep)]
    dist = np.array([[np.sum(a != b) for b in subsets] for a in subsets])
    log_p = -theta * dist - np.log(np.exp(-theta * dist[0]).sum())  # psi: same for every I0
    worst = max(np.abs(log_p[a] - log_p[b]).max() for a in range(len(subsets)) for b in range(a))
    s1 = index_sensitivity(size, keep)
    assert s1 == dist.max() == 4
    assert worst == pytest.approx(theta * s1)
    eps = 1.3
    assert max_dispersion(epsilon=eps, sensitivity=s1) * s1 == pytest.approx(eps)


def test_theta_zero_is_uniform_over_s_k() -> None:
    # Eq. 11 at theta = 0 is the hypergeometric law of |I & I0| (Vandermonde's identity).
    size, keep = 256, 26
    hyper = stats.hypergeom(size, keep, keep).pmf(keep - np.arange(keep + 1))
    np.testing.assert_allclose(mask_distance_pmf(size, keep, theta=0.0), hyper, rtol=1e-9)


def test_noisy_top_k_seeding_and_nan() -> None:
    grad = torch.randn(600)
    kwargs = {"keep_fraction": 0.2, "theta": 0.01}
    a = noisy_top_k_mask(grad, generator=np.random.default_rng(1), **kwargs)
    b = noisy_top_k_mask(grad, generator=np.random.default_rng(1), **kwargs)
    c = noisy_top_k_mask(grad, generator=np.random.default_rng(2), **kwargs)
    assert torch.equal(a, b) and not torch.equal(a, c)
    grad[17] = math.nan
    with pytest.raises(ValueError, match="grad: contains NaN"):
        noisy_top_k_mask(grad, generator=np.random.default_rng(1), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_fraction": 0.0}, "keep_fraction=0.0"),
        ({"keep_fraction": 1.5}, "keep_fraction=1.5"),
        ({"group_size": 0}, "group_size=0"),
        ({"distance": "l2"}, "distance='l2'"),
    ],
)
def test_noisy_top_k_validation(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"keep_fraction": 0.5, "theta": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        noisy_top_k_mask(torch.ones(8), generator=np.random.default_rng(), **args)  # type: ignore[arg-type]


def test_empty_gradient() -> None:
    mask = noisy_top_k_mask(
        torch.ones(0), keep_fraction=0.5, theta=1.0, generator=np.random.default_rng()
    )
    assert mask.shape == (0,)
    assert random_k_mask(0, keep_fraction=0.5, generator=np.random.default_rng()).shape == (0,)


# --------------------------------------------------------------------- random-k baseline


def test_random_k_exactly_k_per_group_and_uniform() -> None:
    rng = np.random.default_rng(0)
    masks = torch.stack([random_k_mask(1000, keep_fraction=0.1, generator=rng) for _ in range(400)])
    for mask in masks:
        assert _group_sums(mask, 256) == [26, 26, 26, 24]
    # Uniform within each group: per-position counts against k / l. (Each draw picks k
    # distinct positions, so the counts vary a little less than multinomial ones: the
    # chi-square test is slightly conservative here.)
    counts = masks.sum(dim=0).double().numpy()
    for start, size, keep in [(0, 256, 26), (768, 232, 24)]:
        group = counts[start : start + size]
        assert group.sum() == keep * len(masks)
        assert _chi2_pvalue(group, np.full(size, 1 / size)) > ACCEPT_P
    # Independent across draws: a fixed seed gives the same masks, another seed others.
    again = random_k_mask(1000, keep_fraction=0.1, generator=np.random.default_rng(0))
    other = random_k_mask(1000, keep_fraction=0.1, generator=np.random.default_rng(1))
    assert torch.equal(again, masks[0]) and not torch.equal(other, masks[0])


def test_random_k_matches_theta_zero_law() -> None:
    size, keep, groups = 20, 5, 20_000
    rng = np.random.default_rng(4)
    mask = random_k_mask(size * groups, keep_fraction=0.25, generator=rng, group_size=size)
    reference = np.zeros(size, dtype=bool)
    reference[[1, 4, 9, 12, 19]] = True  # any fixed set: the law is relative to it
    swaps = (torch.from_numpy(reference) & ~mask.view(groups, size)).sum(dim=1).numpy()
    counts = np.bincount(swaps, minlength=keep + 1)
    assert _chi2_pvalue(counts, mask_distance_pmf(size, keep, theta=0.0)) > ACCEPT_P


# ----------------------------------------------------------------------------- privacy


def test_index_sensitivity() -> None:
    assert index_sensitivity(256, 26) == 52  # 2 k l with k l = 26
    assert index_sensitivity(256, 230) == 52  # 2 l - 2 k l
    assert index_sensitivity(256, 128) == 256
    assert index_sensitivity(256, 256) == 0 and index_sensitivity(256, 0) == 0
    assert index_sensitivity(256, 26, distance="kendall") == 256 * 255 // 2
    with pytest.raises(ValueError, match="keep=300"):
        index_sensitivity(256, 300)


def test_max_dispersion() -> None:
    assert max_dispersion(epsilon=1.0, sensitivity=52) == pytest.approx(1 / 52)
    # Split evenly over 100 groups and 1,000 steps: T * sum_i eps2_i = epsilon (Thm. 2).
    theta = max_dispersion(epsilon=2.0, sensitivity=52, num_groups=100, steps=1000)
    assert theta == pytest.approx(2.0 / 5_200_000)
    assert 1000 * 100 * theta * 52 == pytest.approx(2.0)
    assert max_dispersion(epsilon=1.0, sensitivity=0) == math.inf
    assert max_dispersion(epsilon=0.0, sensitivity=4) == 0.0
    with pytest.raises(ValueError, match="epsilon=-1"):
        max_dispersion(epsilon=-1.0, sensitivity=4)
    with pytest.raises(ValueError, match="num_groups=0"):
        max_dispersion(epsilon=1.0, sensitivity=4, num_groups=0)
