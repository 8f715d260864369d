"""Tests for fedsparse.common.masks: exact counts, determinism, uniformity, speed paths."""

import hashlib
import itertools
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy import stats

from fedsparse.common import masks
from fedsparse.common.masks import derive_seed, keep_count, mask_scores, sample_mask


@pytest.mark.parametrize(
    ("numel", "keep"), [(0, 0), (1, 0), (1, 1), (10, 3), (1000, 1), (1000, 999), (300_000, 12_345)]
)
def test_exact_count_dtype_shape(numel: int, keep: int) -> None:
    mask = sample_mask(numel, keep=keep, seed=5)
    assert mask.dtype == torch.bool
    assert mask.shape == (numel,)
    assert int(mask.sum()) == keep


def test_keep_all_is_identity_and_keep_zero_is_empty() -> None:
    assert bool(sample_mask(100, keep=100, seed=1).all())
    assert not bool(sample_mask(100, keep=0, seed=1).any())


def test_same_seed_same_mask_other_seed_differs() -> None:
    a = sample_mask(500_000, keep=50_000, seed=123)
    b = sample_mask(500_000, keep=50_000, seed=123)
    c = sample_mask(500_000, keep=50_000, seed=124)
    assert torch.equal(a, b)
    # Two independent uniform masks overlap on ~keep^2/numel = 5000 coordinates.
    overlap = int((a & c).sum())
    assert abs(overlap - 5000) < 5 * math.sqrt(5000)


def test_mask_is_the_keep_smallest_scores() -> None:
    numel, keep, seed = 5000, 700, 99
    scores = mask_scores(numel, seed=seed)
    expected = np.zeros(numel, dtype=bool)
    expected[np.argsort(scores)[:keep]] = True
    assert np.array_equal(sample_mask(numel, keep=keep, seed=seed).numpy(), expected)
    assert len(np.unique(scores)) == numel  # bijection: no ties


def test_splitmix64_matches_published_reference() -> None:
    # SplitMix64 (Steele, Lea, Flood 2014) from state 0: outputs mix(golden), mix(2*golden).
    golden = 0x9E3779B97F4A7C15
    assert masks._mix64_int(golden) == 0xE220A8397B1DCDAF
    assert masks._mix64_int(2 * golden) == 0x6E789E6AA1B965F4


def test_pinned_mask_values() -> None:
    """Regression pins: a change here breaks wire compatibility between versions."""
    kept = torch.nonzero(sample_mask(40, keep=6, seed=2024)).flatten().tolist()
    assert kept == [3, 5, 8, 15, 26, 30]
    mask = sample_mask(1 << 20, keep=1 << 17, seed=7)  # the chunked window path
    assert hashlib.sha256(mask.numpy().tobytes()).hexdigest()[:16] == "38028d2c87af1ebf"


def test_identical_across_processes() -> None:
    code = (
        "import hashlib; from fedsparse.common.masks import sample_mask;"
        "print(hashlib.sha256(sample_mask(400_000, keep=40_000, seed=31).numpy().tobytes())"
        ".hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = hashlib.sha256(sample_mask(400_000, keep=40_000, seed=31).numpy().tobytes()).hexdigest()
    assert out.stdout.strip() == here


@pytest.mark.parametrize("keep", [1, 17, 150_000, 299_999])
def test_window_path_equals_exact_path(keep: int) -> None:
    fast = masks._window_mask(300_000, keep, 11, 4096)
    assert fast is not None
    assert np.array_equal(fast, masks._exact_mask(300_000, keep, 11))


def test_nested_in_keep() -> None:
    small = sample_mask(10_000, keep=100, seed=3)
    large = sample_mask(10_000, keep=2_000, seed=3)
    assert bool((small & ~large).sum() == 0)


def test_position_uniformity_chi_square() -> None:
    """Each position is kept with probability keep/numel across seeds (chi^2, 49 dof)."""
    numel, keep, trials = 50, 10, 4000
    counts = np.zeros(numel)
    for seed in range(trials):
        counts += sample_mask(numel, keep=keep, seed=seed).numpy()
    p = keep / numel
    # Counts of a without-replacement sample: covariance p(1-p) n/(n-1) (I - 11^T/n).
    var = trials * p * (1 - p) * numel / (numel - 1)
    statistic = float(((counts - trials * p) ** 2).sum() / var)
    assert stats.chi2.sf(statistic, numel - 1) > 1e-3


def test_subset_uniformity_chi_square() -> None:
    """All C(6,2)=15 subsets are equally likely (chi^2 goodness of fit, 14 dof)."""
    subsets = {s: i for i, s in enumerate(itertools.combinations(range(6), 2))}
    counts = np.zeros(len(subsets))
    trials = 6000
    for seed in range(trials):
        kept = tuple(torch.nonzero(sample_mask(6, keep=2, seed=10_000 + seed)).flatten().tolist())
        counts[subsets[kept]] += 1
    assert stats.chisquare(counts).pvalue > 1e-3
    # The test has power: a biased sampler (always including position 0) fails it.
    biased = counts.copy()
    biased[[i for s, i in subsets.items() if 0 in s]] *= 1.3
    assert stats.chisquare(biased, f_exp=np.full(15, biased.sum() / 15)).pvalue < 1e-3


def test_derive_seed_deterministic_distinct_and_bounded() -> None:
    seeds = {derive_seed(7, r) for r in range(1000)}
    assert len(seeds) == 1000
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(7, 3) == derive_seed(7, 3)
    assert derive_seed(7, 3, 1) != derive_seed(7, 3, 2) != derive_seed(7, 3)
    assert derive_seed(7, 1, 2) != derive_seed(7, 2, 1)


def test_keep_count_formula() -> None:
    assert keep_count(100, rate=0.0) == 100
    assert keep_count(100, rate=0.9) == 10
    assert keep_count(550_570, rate=0.7) == 550_570 - math.floor(0.7 * 550_570)
    assert keep_count(7, rate=1.0) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"numel": -1, "keep": 0, "seed": 0}, "numel=-1"),
        ({"numel": 10, "keep": 11, "seed": 0}, "keep=11"),
        ({"numel": 10, "keep": -1, "seed": 0}, "keep=-1"),
        ({"numel": 10, "keep": 2, "seed": -5}, "seed=-5"),
        ({"numel": 10, "keep": 2, "seed": 2**64}, "seed="),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict, match: str) -> None:
    numel = kwargs.pop("numel")
    with pytest.raises(ValueError, match=match):
        sample_mask(numel, **kwargs)


def test_keep_count_rejects_bad_rate() -> None:
    with pytest.raises(ValueError, match="rate=1.5"):
        keep_count(10, rate=1.5)
    with pytest.raises(ValueError, match="rate=nan"):
        keep_count(10, rate=float("nan"))
