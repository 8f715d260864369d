"""Tests for fedsparse.common.masks: exact counts, determinism, uniformity, speed paths, the
process's shared masks."""

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
from fedsparse.common.masks import (
    SHARED_MASKS,
    derive_seed,
    keep_count,
    mask_scores,
    sample_mask,
    seeded_mask,
    seeded_support,
)


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


# --- the process's shared masks ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("numel", "keep", "seed"),
    [(0, 0, 1), (10, 0, 2), (10, 10, 3), (1000, 1, 4), (1000, 700, 5), (300_000, 12_345, 6)],
)
def test_shared_masks_are_sample_mask_and_its_nonzero(numel: int, keep: int, seed: int) -> None:
    want = sample_mask(numel, keep=keep, seed=seed)
    mask, support = seeded_mask(numel, keep, seed), seeded_support(numel, keep, seed)
    assert mask.dtype == torch.bool and torch.equal(mask, want)
    assert support.dtype == torch.int64 and support.shape == (keep,)
    assert torch.equal(support, torch.nonzero(want).flatten())
    assert bool((support[1:] > support[:-1]).all())


def test_a_second_call_returns_the_same_tensor_from_one_cache() -> None:
    masks._shared.cache_clear()
    mask, support = seeded_mask(5000, 1234, 77), seeded_support(5000, 1234, 77)
    assert seeded_mask(5000, 1234, 77) is mask and seeded_support(5000, 1234, 77) is support
    info = masks._shared.cache_info()
    assert (info.misses, info.hits, info.maxsize) == (1, 3, SHARED_MASKS)  # one entry for both
    for seed in range(SHARED_MASKS):  # the oldest goes once SHARED_MASKS others came after it
        seeded_mask(5000, 1234, 1000 + seed)
    assert seeded_mask(5000, 1234, 77) is not mask
    assert torch.equal(seeded_mask(5000, 1234, 77), mask)


def test_a_private_copy_written_into_does_not_reach_other_callers() -> None:
    """The client trains on a clone (``client/local_round.py``); writing it leaks nowhere."""
    want = sample_mask(2000, keep=500, seed=8)
    private = seeded_mask(2000, 500, 8).clone()
    private[:] = True
    assert torch.equal(seeded_mask(2000, 500, 8), want)
    assert torch.equal(seeded_support(2000, 500, 8), torch.nonzero(want).flatten())


def test_shared_masks_check_their_arguments_and_cache_no_failure() -> None:
    with pytest.raises(ValueError, match="keep"):
        seeded_mask(10, 11, 1)
    with pytest.raises(ValueError, match="keep"):
        seeded_support(10, -1, 1)
    assert seeded_support(10, 10, 1).tolist() == list(range(10))


def test_a_warm_cache_checks_its_arguments_as_a_cold_one() -> None:
    """``lru_cache`` alone would answer ``keep=100.0`` or ``seed=True`` from a warm entry."""
    masks.seeded_mask(1000, 100, 1)  # warm
    for numel, keep, seed in ((1000, 100.0, 1), (1000.0, 100, 1), (1000, 100, 1.0), (2, 1, True)):
        with pytest.raises(ValueError, match="expected an int"):
            masks.seeded_mask(numel, keep, seed)  # type: ignore[arg-type]
    assert torch.equal(
        masks.seeded_mask(1000, np.int64(100), np.uint64(1)), masks.seeded_mask(1000, 100, 1)
    )


def test_a_decoded_support_is_the_callers_own_unless_shared() -> None:
    """``SparseUpdate.support()`` is a copy: writing into it cannot reach another decode."""
    from fedsparse.common.wire.payload.update import SparseUpdate

    def update() -> SparseUpdate:
        return SparseUpdate(
            values=torch.ones(10),
            dense_size=100,
            encoding="seeded",
            mask_seed=5,
            round=1,
        )

    first = update().support()
    assert first is not None
    expected = first.clone()
    first[0], first[1] = first[1].item(), first[0].item()  # a caller's in-place edit
    again = update().support(shared=True)
    assert again is not None and torch.equal(again, expected)
    assert torch.equal(update().to_dense().nonzero().flatten(), expected)
