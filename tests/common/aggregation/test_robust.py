"""Tests for fedsparse.common.aggregation.robust: coordinate-wise trimmed mean and median, norm
bounds.

Oracles: ``scipy.stats.trim_mean`` and ``numpy.median`` on float64 copies (so a float32-max
pair averages without overflow, as the code under test does), column by column over the
covering rows. The code sums in float64 in another order and rounds once to float32, so the
comparisons allow one float32 rounding plus a float64 summation bound ``n eps64 max|v|``.

The DP-derived bound (``honest_update_norm_bound``, ``HonestClientBound``) is checked against
a formula written out here, PyTorch's own SGD driven by simulated DP steps, the clients' own
step counts and Opacus's sigma calibration.
"""

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from fedsparse.common.aggregation.robust import (
    HONEST_FAILURE_PROBABILITY,
    HonestClientBound,
    NormBound,
    clip_to_norm,
    coordinate_median,
    honest_update_norm_bound,
    l2_norm,
    momentum_weights,
    quantized_norm,
    trim_count,
    trimmed_mean,
    worst_case_noise_multiplier,
)
from fedsparse.common.dp.accounting import calibrate_noise_multiplier, steps_per_epoch
from fedsparse.common.wire.payload.values import quantize_int8

F32_MAX = float(np.finfo(np.float32).max)
_EPS64 = 2.0**-52


# --- strategies and oracles -------------------------------------------------------------------

_any_value = st.floats(width=32, allow_nan=False, allow_infinity=False)
_fractions = st.sampled_from([0.0, 0.1, 0.2, 0.25, 1 / 3, 0.4, 0.49])


@st.composite
def matrices(draw: st.DrawFn, *, covered: bool) -> tuple[np.ndarray, np.ndarray]:
    """(n x k float32 values, n x k bool coverage: all True unless ``covered``)."""
    n = draw(st.integers(1, 9))
    k = draw(st.integers(1, 6))
    values = np.array(
        draw(st.lists(_any_value, min_size=n * k, max_size=n * k)), dtype=np.float32
    ).reshape(n, k)
    mask = np.ones((n, k), dtype=bool)
    if covered:
        mask = np.array(
            draw(st.lists(st.booleans(), min_size=n * k, max_size=n * k)), dtype=bool
        ).reshape(n, k)
    return values, mask


def column_oracle(values: np.ndarray, mask: np.ndarray, rule) -> np.ndarray:
    out = np.zeros(values.shape[1], dtype=np.float32)
    for j in range(values.shape[1]):
        column = values[mask[:, j], j].astype(np.float64)
        if column.size:
            out[j] = np.float32(rule(column))
    return out


def assert_close(got: torch.Tensor, want: np.ndarray, values: np.ndarray) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    scale = np.abs(values.astype(np.float64)).max(axis=0)
    atol = values.shape[0] * _EPS64 * scale + float(np.finfo(np.float32).smallest_subnormal)
    err = np.abs(got.numpy().astype(np.float64) - want.astype(np.float64))
    assert (err <= 2.0**-23 * np.abs(want.astype(np.float64)) + atol).all(), (got, want)


# --- oracles ----------------------------------------------------------------------------------


@settings(derandomize=True, max_examples=200, deadline=None)
@given(matrices(covered=False), _fractions)
def test_trimmed_mean_is_scipys_trim_mean_per_coordinate(case, fraction: float) -> None:
    values, mask = case
    got = trimmed_mean(torch.from_numpy(values), trim_fraction=fraction)
    assert_close(got, column_oracle(values, mask, lambda c: stats.trim_mean(c, fraction)), values)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(matrices(covered=True), _fractions)
def test_trimmed_mean_uses_only_the_updates_covering_each_coordinate(case, fraction) -> None:
    values, mask = case
    got = trimmed_mean(
        torch.from_numpy(values), trim_fraction=fraction, covered=torch.from_numpy(mask)
    )
    assert_close(got, column_oracle(values, mask, lambda c: stats.trim_mean(c, fraction)), values)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(matrices(covered=True))
def test_median_is_numpys_median_of_the_covering_updates(case) -> None:
    values, mask = case
    got = coordinate_median(torch.from_numpy(values), covered=torch.from_numpy(mask))
    # The mean of two float32 values in float64 is exact: one rounding to float32, equal.
    np.testing.assert_array_equal(got.numpy(), column_oracle(values, mask, np.median))


@settings(derandomize=True, max_examples=100, deadline=None)
@given(matrices(covered=False), st.integers(0, 2**32 - 1))
def test_the_order_of_the_updates_does_not_matter(case, seed: int) -> None:
    values, _ = case
    perm = np.random.default_rng(seed).permutation(values.shape[0])
    x, y = torch.from_numpy(values), torch.from_numpy(values[perm])
    assert torch.equal(coordinate_median(x), coordinate_median(y))
    assert_close(
        trimmed_mean(y, trim_fraction=0.2),
        trimmed_mean(x, trim_fraction=0.2).numpy(),
        values,
    )


# --- robustness -------------------------------------------------------------------------------


@pytest.mark.parametrize("attack", [1e30, -1e30, F32_MAX, -F32_MAX])
def test_one_arbitrary_update_of_five_stays_within_the_honest_range(attack: float) -> None:
    honest = torch.tensor(
        [[0.1, -0.2, 0.3], [0.2, -0.1, 0.1], [0.15, -0.3, 0.2], [0.05, -0.25, 0.4]]
    )
    values = torch.cat([honest, torch.full((1, 3), attack)])
    low, high = honest.min(dim=0).values, honest.max(dim=0).values
    for robust in (trimmed_mean(values, trim_fraction=0.2), coordinate_median(values)):
        assert torch.isfinite(robust).all()
        assert (low <= robust).all() and (robust <= high).all()
    # Exactly: 5 values, t = 1 dropped at each end, so the attacker and one extreme honest
    # value go; the median is the 3rd of 5.
    side = 0 if attack > 0 else -1  # which honest extreme survives
    sorted_honest = honest.double().sort(dim=0).values
    kept = sorted_honest[1:] if attack > 0 else sorted_honest[:-1]
    torch.testing.assert_close(
        trimmed_mean(values, trim_fraction=0.2), kept.mean(dim=0).float(), rtol=0, atol=1e-7
    )
    assert torch.equal(coordinate_median(values), sorted_honest[2 + side].float())
    # The plain mean is wrecked (what the default aggregator relies on the norm bound for).
    assert trimmed_mean(values, trim_fraction=0.0).abs().min() > 1e29


def test_float32_max_values_average_without_overflow() -> None:
    values = torch.full((3, 2), F32_MAX)
    values[:, 1] = -F32_MAX
    assert torch.equal(trimmed_mean(values, trim_fraction=0.0), torch.tensor([F32_MAX, -F32_MAX]))
    assert torch.equal(coordinate_median(values[:2]), torch.tensor([F32_MAX, -F32_MAX]))


# --- trim-fraction edge cases -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "fraction", "trimmed"),
    [
        (1, 0.49, 0),
        (2, 0.49, 0),
        (3, 0.49, 1),
        (4, 0.2, 0),  # 0.8 rounds down: nothing trimmed, the plain mean
        (5, 0.2, 1),
        (9, 0.2, 1),
        (10, 0.2, 2),
        (10, 0.1, 1),  # 0.1 * 10 is exactly 1.0 in float64
        (7, 0.0, 0),
    ],
)
def test_trim_count_is_floor_of_fraction_times_count(count, fraction, trimmed) -> None:
    assert trim_count(count, fraction) == trimmed
    values = torch.arange(count, dtype=torch.float32).unsqueeze(1) ** 2  # skewed
    expected = float(np.mean(np.arange(count, dtype=np.float64)[trimmed : count - trimmed] ** 2))
    assert float(trimmed_mean(values, trim_fraction=fraction)[0]) == pytest.approx(expected)


def test_near_half_trimming_of_an_odd_count_is_the_median() -> None:
    values = torch.tensor([[5.0], [-1.0], [1e30]])
    assert float(trimmed_mean(values, trim_fraction=0.49)[0]) == 5.0
    assert float(coordinate_median(values)[0]) == 5.0


def test_even_count_median_is_the_mean_of_the_middle_two() -> None:
    values = torch.tensor([[1.0, 0.0], [2.0, 0.0], [10.0, 0.0], [-4.0, 1.0]])
    assert coordinate_median(values).tolist() == [1.5, 0.0]


def test_uncovered_coordinates_are_zero_and_ignore_their_values() -> None:
    values = torch.tensor([[1.0, 7.0, 1e30], [3.0, 9.0, 2.0]])
    covered = torch.tensor([[True, False, False], [True, False, True]])
    assert trimmed_mean(values, trim_fraction=0.2, covered=covered).tolist() == [2.0, 0.0, 2.0]
    assert coordinate_median(values, covered=covered).tolist() == [2.0, 0.0, 2.0]
    assert coordinate_median(torch.zeros(0, 3)).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("fraction", [0.5, -0.1, math.nan, 1.0])
def test_a_trim_fraction_outside_0_to_half_is_an_error(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"trim_fraction=.*expected 0 <= f < 0.5"):
        trimmed_mean(torch.zeros(3, 2), trim_fraction=fraction)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"values has shape \(3,\): expected \(n, k\)"):
        coordinate_median(torch.zeros(3))
    with pytest.raises(ValueError, match="covered has shape"):
        coordinate_median(torch.zeros(3, 2), covered=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="values: non-finite"):
        trimmed_mean(torch.tensor([[1.0], [math.inf]]), trim_fraction=0.2)
    # a non-finite value where nobody covers the coordinate is ignored
    nan_uncovered = coordinate_median(
        torch.tensor([[1.0], [math.nan]]), covered=torch.tensor([[True], [False]])
    )
    assert nan_uncovered.tolist() == [1.0]


# --- norm bounds ------------------------------------------------------------------------------


def test_relative_bound_is_ratio_times_the_median_from_three_updates_on() -> None:
    bound = NormBound(max_norm_ratio=3.0)
    assert bound.bound([1.0, 2.0, 1e30]) == (6.0, "max-norm-ratio=3 x median 2")
    assert bound.bound([1.0, 2.0, 3.0, 1e30]) == (7.5, "max-norm-ratio=3 x median 2.5")
    assert bound.bound([1.0, 1e30]) == (math.inf, "no bound")  # 2 < min_updates
    assert bound.bound([0.0, 0.0, 5.0]) == (math.inf, "no bound")  # median 0: no scale
    assert NormBound().bound([1.0, 2.0, 1e30])[0] == math.inf  # both off by default


def test_absolute_and_relative_bounds_take_the_smaller() -> None:
    both = NormBound(max_norm_ratio=3.0, max_update_norm=5.0)
    assert both.bound([1.0, 2.0, 3.0]) == (5.0, "max-update-norm=5")
    assert both.bound([1.0, 1.0, 1.0]) == (3.0, "max-norm-ratio=3 x median 1")
    assert both.bound([1.0]) == (5.0, "max-update-norm=5")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_norm_ratio": 0.9}, r"max_norm_ratio=0.9: expected >= 1 \(0: off\)"),
        ({"max_norm_ratio": math.inf}, "max_norm_ratio=inf: expected a finite value >= 0"),
        ({"max_update_norm": -1.0}, "max_update_norm=-1.0: expected a finite value >= 0"),
    ],
)
def test_bad_bounds_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NormBound(**kwargs)


@pytest.mark.parametrize("scale", [2.5, 1e30, F32_MAX])
def test_clip_scales_down_to_exactly_the_bound_and_keeps_the_direction(scale: float) -> None:
    direction = torch.tensor([3.0, -4.0, 0.0, 12.0]) / 13.0
    values = (direction.double() * scale).float()
    clipped = clip_to_norm(values, bound=2.0)
    assert math.isclose(l2_norm(clipped), 2.0, rel_tol=1e-6)
    torch.testing.assert_close(clipped / 2.0, direction, rtol=1e-6, atol=0)


def test_clip_leaves_updates_at_or_under_the_bound_untouched() -> None:
    values = torch.tensor([3.0, 4.0])
    assert clip_to_norm(values, bound=5.0) is values  # exactly at the bound
    assert clip_to_norm(values, bound=6.0) is values
    assert clip_to_norm(values, bound=0.0).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="bound=nan"):
        clip_to_norm(values, bound=math.nan)


def test_norm_of_float32_max_values_does_not_overflow() -> None:
    values = torch.full((38_282,), F32_MAX)
    assert l2_norm(values) == pytest.approx(F32_MAX * math.sqrt(38_282), rel=1e-12)


# --- the bound an honest client's DP parameters imply ------------------------------------------


def _velocity_weights(momentum: float, steps: int) -> list[float]:
    """Each step's gradient's weight in ``sum_t v_t`` times ``1 - momentum``, by running the
    heavy-ball recursion on unit impulses (PyTorch's: ``v_1 = g_1``, ``v_t = mu v_{t-1} + g_t``)."""
    weights = []
    for hit in range(steps):
        velocity, total = 0.0, 0.0
        for t in range(steps):
            velocity = momentum * velocity + (1.0 if t == hit else 0.0)
            total += velocity
        weights.append(total * (1 - momentum))
    return weights


def _bound_by_hand(
    *, lr, momentum, clip, sigma, divisor, mean, steps, keep, p=1e-9, adaptive=False
) -> float:
    a = _velocity_weights(momentum, steps)
    log_fail = math.log((2 if sigma > 0 else 1) / p)
    mean_x = mean * sum(a)
    batches = mean_x + log_fail / 3 + math.sqrt(log_fail**2 / 9 + 2 * mean_x * log_fail)
    if adaptive:
        noise = sigma * sum(a) * (math.sqrt(keep) + math.sqrt(2 * math.log(2 * steps / p)))
    else:
        root = math.sqrt(sum(x * x for x in a))
        noise = sigma * root * (math.sqrt(keep) + math.sqrt(2 * log_fail))
    return lr / (1 - momentum) * clip * (batches + noise) / divisor


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("steps", [1, 2, 45, 300])
def test_momentum_weights_are_the_heavy_ball_recursions(momentum: float, steps: int) -> None:
    a = _velocity_weights(momentum, steps)
    total, root = momentum_weights(momentum, steps)
    assert total == pytest.approx(sum(a), rel=1e-12)
    assert root == pytest.approx(math.sqrt(sum(x * x for x in a)), rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "pinned"),
    [
        (dict(momentum=0.0, clip=1.0, sigma=1.0, mean=16.5), 2.357533641960106),
        (dict(momentum=0.9, clip=2.0, sigma=1.5, mean=16.0), 26.058654515201056),
        (dict(momentum=0.0, clip=1.0, sigma=0.0, mean=16.0), 1.5539618528167833),
        (dict(momentum=0.0, clip=1.0, sigma=1.0, mean=16.0, adaptive=True), 3.970833883658375),
    ],
)
def test_honest_bound_is_the_documented_formula(kwargs: dict, pinned: float) -> None:
    common = dict(lr=0.1, divisor=16, steps=10, keep=1000)
    value = honest_update_norm_bound(
        lr=0.1,
        momentum=kwargs["momentum"],
        max_grad_norm=kwargs["clip"],
        noise_multiplier=kwargs["sigma"],
        expected_batch_size=16,
        mean_batch_size=kwargs["mean"],
        steps=10,
        keep=1000,
        adaptive_support=kwargs.get("adaptive", False),
    )
    assert value == pytest.approx(_bound_by_hand(**common, **kwargs), rel=1e-12)
    assert value == pytest.approx(pinned, rel=1e-12)


def _bound(**overrides: float) -> float:
    kwargs = dict(
        lr=0.25,
        momentum=0.0,
        max_grad_norm=1.0,
        noise_multiplier=2.0,
        expected_batch_size=16.0,
        steps=20,
        keep=5000,
    )
    return honest_update_norm_bound(**{**kwargs, **overrides})  # type: ignore[arg-type]


def test_honest_bound_grows_with_steps_sigma_keep_lr_clip_and_momentum() -> None:
    for name, values in [
        ("steps", [1, 2, 10, 45, 200]),
        ("noise_multiplier", [0.0, 0.5, 1.0, 4.9, 20.0]),
        ("keep", [0, 1, 100, 11_485, 38_282]),
        ("lr", [0.01, 0.25, 1.0]),
        ("max_grad_norm", [0.1, 1.0, 3.0]),
        ("momentum", [0.0, 0.5, 0.9, 0.99]),
    ]:
        bounds = [_bound(**{name: v}) for v in values]
        assert all(x < y for x, y in zip(bounds, bounds[1:], strict=False)), (name, bounds)
    # larger expected batches (the noise is divided by them) and likelier events: smaller
    bounds = [_bound(expected_batch_size=b) for b in (1, 8, 16, 32)]
    assert all(x > y for x, y in zip(bounds, bounds[1:], strict=False))
    bounds = [_bound(failure_probability=p) for p in (1e-3, 1e-9, 1e-15)]
    assert all(x < y for x, y in zip(bounds, bounds[1:], strict=False))


def _simulated_max(
    *, lr: float, momentum: float, sigma: float, n: int, batches: int, steps: int, keep: int
) -> float:
    """The largest of 400 simulated honest rounds at the worst case for the clipped sum: every
    clipped per-sample gradient at norm 1 in one direction, Poisson batches of ``n`` examples
    at ``p = 1 / batches``, fresh noise each step, PyTorch's SGD; Opacus's divisor."""
    gen = torch.Generator().manual_seed(0)
    divisor = int(n * (1 / batches))
    direction = torch.zeros(keep)
    direction[0] = 1.0
    largest = 0.0
    for _ in range(400):
        w = torch.zeros(keep, requires_grad=True)
        opt = torch.optim.SGD([w], lr=lr, momentum=momentum)
        for _ in range(steps):
            size = torch.binomial(torch.tensor(float(n)), torch.tensor(1 / batches), generator=gen)
            noise = torch.randn(keep, generator=gen) * sigma
            w.grad = (size * direction + noise) / divisor
            opt.step()
        largest = max(largest, float(w.detach().norm()))
    return largest


@pytest.mark.parametrize(
    ("momentum", "sigma", "n", "batches", "steps", "keep"),
    [
        (0.0, 1.0, 33, 2, 10, 1000),  # n = b + 1 at b = 32: the smallest b' = 16
        (0.9, 1.0, 33, 2, 10, 1000),
        (0.0, 0.0, 33, 2, 10, 1000),  # mechanism "clipped"
        (0.9, 3.0, 289, 10, 30, 200),  # n = 9 b + 1
        (0.5, 0.5, 65, 3, 20, 5000),
    ],
)
def test_simulated_honest_rounds_stay_under_the_bound_which_is_within_2_5x_of_them(
    momentum: float, sigma: float, n: int, batches: int, steps: int, keep: int
) -> None:
    simulated = _simulated_max(
        lr=0.1, momentum=momentum, sigma=sigma, n=n, batches=batches, steps=steps, keep=keep
    )
    bound = honest_update_norm_bound(
        lr=0.1,
        momentum=momentum,
        max_grad_norm=1.0,
        noise_multiplier=sigma,
        expected_batch_size=int(n * (1 / batches)),
        mean_batch_size=n / batches,
        steps=steps,
        keep=keep,
    )
    assert simulated < bound < 2.5 * simulated


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0.0}, "lr=0.0: expected a finite value > 0"),
        ({"max_grad_norm": math.inf}, "max_grad_norm=inf: expected a finite value > 0"),
        ({"noise_multiplier": -1.0}, "noise_multiplier=-1.0: expected a finite value >= 0"),
        ({"expected_batch_size": 0.0}, "expected_batch_size=0.0: expected a value > 0"),
        ({"steps": 0}, "steps=0: expected >= 1"),
        ({"keep": -1}, "keep=-1: expected >= 0"),
        ({"momentum": 1.0}, "momentum=1.0: expected 0 <= momentum < 1"),
        ({"failure_probability": 0.0}, "failure_probability=0.0: expected 0 < p < 1"),
    ],
)
def test_bad_bound_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        _bound(**kwargs)


def _client_bound(**overrides: object) -> HonestClientBound:
    kwargs: dict = dict(
        lr=0.25,
        momentum=0.0,
        max_grad_norm=1.0,
        noise_multiplier=4.9,
        batch_size=32,
        local_epochs=1,
        max_examples=1437,
    )
    return HonestClientBound(**{**kwargs, **overrides})


@pytest.mark.parametrize(
    "overrides",
    [{}, {"momentum": 0.9, "local_epochs": 3}, {"noise_multiplier": 0.0}, {"batch_size": 64}],
)
def test_the_worst_case_covers_every_data_size_from_the_batch_size_on(overrides: dict) -> None:
    """Each ``n`` in ``[b, N]`` with the client's own steps, ``b' = int(n q)`` and ``m = n q``
    (``privacy.steps_per_epoch``: the loader Opacus builds) is under ``bound``; the bound is
    one of them (the maximum is attained)."""
    caps = _client_bound(max_examples=700, **overrides)
    b, keep = caps.batch_size, 11_485
    bound = caps.bound(keep)
    largest = 0.0
    for n in range(1, caps.max_examples + 1):
        batches = -(-n // min(b, n))
        own = honest_update_norm_bound(
            lr=caps.lr,
            momentum=caps.momentum,
            max_grad_norm=caps.max_grad_norm,
            noise_multiplier=caps.noise_multiplier,
            expected_batch_size=int(n * (1 / batches)),
            mean_batch_size=n / batches,
            steps=caps.local_epochs * steps_per_epoch(n, b),
            keep=keep,
        )
        if n >= caps.smallest_covered_examples(keep):
            assert own <= bound * (1 + 1e-12), n
        largest = max(largest, own) if n >= b else largest
    assert caps.max_steps == caps.local_epochs * -(-700 // b)
    assert largest <= bound <= 1.02 * largest  # the K-worst n's m = b' + 1 is 2% looser at most
    assert 1 <= caps.smallest_covered_examples(keep) <= b


def test_small_clients_are_covered_only_from_smallest_covered_examples_on() -> None:
    """Below the batch size a client takes one step an epoch on all its data: its noise
    term grows as 1/n. On digits' defaults the maximum over K covers from 4 examples on."""
    caps = _client_bound()
    keep = 38_282
    first = caps.smallest_covered_examples(keep)
    assert first == 4

    def alone(n: int) -> float:  # K = 1: b' = n, every example in every step
        return honest_update_norm_bound(
            lr=0.25,
            momentum=0.0,
            max_grad_norm=1.0,
            noise_multiplier=4.9,
            expected_batch_size=n,
            steps=1,
            keep=keep,
        )

    assert alone(first) <= caps.bound(keep) < alone(first - 1)
    # a dataset smaller than the batch size: only K = 1, at the largest client
    tiny = _client_bound(max_examples=20)
    assert (tiny.max_batches, tiny.max_steps) == (1, 1)


def test_client_bound_quantizes_and_checks_its_caps() -> None:
    caps = _client_bound()  # digits' defaults, sigma rounded to 4.9
    assert caps.bound(38_282) == pytest.approx(67.2744549054493, rel=1e-12)
    int8 = _client_bound(value_dtype="int8")
    assert int8.bound(38_282) == pytest.approx(caps.bound(38_282) * (1 + math.sqrt(38_282) / 254))
    assert _client_bound(value_dtype="bf16").bound(100) == pytest.approx(
        caps.bound(100) * (1 + 2**-8)
    )
    gip = _client_bound(adaptive_support=True)
    assert gip.bound(3888) > caps.bound(3888)
    assert caps.failure_probability == HONEST_FAILURE_PROBABILITY == 1e-9
    for kwargs, match in [
        ({"batch_size": 0}, "batch_size=0: expected >= 1"),
        ({"max_examples": 0}, "max_examples=0: expected >= 1"),
        ({"noise_multiplier": math.nan}, "noise_multiplier=nan"),
        ({"value_dtype": "fp8"}, "value_dtype='fp8': expected one of"),
    ]:
        with pytest.raises(ValueError, match=re.escape(match)):
            _client_bound(**kwargs)


@pytest.mark.parametrize("value_dtype", ["fp16", "bf16", "int8"])
def test_quantized_norm_bounds_the_decoded_norm(value_dtype: str) -> None:
    gen = torch.Generator().manual_seed(1)
    cases = [
        torch.randn(5000, generator=gen),
        torch.randn(5000, generator=gen) * 1e-6,  # fp16 subnormals
        torch.cat([torch.tensor([127.0]), torch.full((999,), 0.5)]),  # int8: every tie rounds up
    ]
    for values in cases:
        if value_dtype == "int8":
            raw, scale = quantize_int8(values.numpy())
            decoded = torch.from_numpy(np.frombuffer(raw, dtype=np.int8).astype(np.float32)) * scale
        else:
            dtype = torch.float16 if value_dtype == "fp16" else torch.bfloat16
            decoded = values.to(dtype).to(torch.float32)
        bound = quantized_norm(l2_norm(values), value_dtype=value_dtype, keep=values.numel())
        assert l2_norm(decoded) <= bound


def test_the_smallest_of_the_bounds_applies_with_its_description() -> None:
    bound = NormBound(max_norm_ratio=3.0, max_update_norm=50.0)
    honest = (40.0, "dp-norm-bound=40")
    assert bound.bound([1.0, 1e30], honest=honest) == honest  # two updates: no relative bound
    assert bound.bound([1.0], honest=(60.0, "x")) == (50.0, "max-update-norm=50")
    assert bound.bound([5.0, 5.0, 5.0], honest=honest) == (15.0, "max-norm-ratio=3 x median 5")
    assert NormBound().bound([1e30], honest=honest) == honest
    with pytest.raises(ValueError, match="honest="):
        NormBound().bound([1.0], honest=(math.nan, "x"))


# --- the worst-case sigma ---------------------------------------------------------------------


def _calibrated(target: float, epochs: int, batches: int, accountant: str = "rdp") -> float:
    return calibrate_noise_multiplier(
        target_epsilon=target,
        delta=1e-5,
        sample_rate=1 / batches,
        steps=epochs * batches,
        accountant=accountant,  # type: ignore[arg-type]
    )


@pytest.mark.filterwarnings("ignore:Optimal order is the:UserWarning")
@pytest.mark.parametrize(
    ("target", "epochs", "looseness"),
    [(3.0, 10, 1.05), (1.0, 10, 1.05), (8.0, 10, 1.1), (10.0, 1, 1.3)],
)
def test_worst_case_sigma_is_at_least_every_clients_and_close_to_the_largest(
    target: float, epochs: int, looseness: float
) -> None:
    """Every data size's calibration (``K = ceil(n / b)`` batches an epoch) is under it. For
    epsilon 10 over one epoch the largest is not at ``q = 1`` (``K = 1``) but at ``K = 3``:
    no ``K`` is assumed."""
    worst = worst_case_noise_multiplier(
        target_epsilon=target, delta=1e-5, epochs=epochs, accountant="rdp"
    )
    sigmas = {k: _calibrated(target, epochs, k) for k in (1, 2, 3, 4, 6, 10, 45)}
    assert max(sigmas.values()) <= worst <= looseness * max(sigmas.values())
    if target == 10.0:
        assert max(sigmas, key=sigmas.__getitem__) == 3 and sigmas[3] > 1.2 * sigmas[1]


@pytest.mark.slow
@pytest.mark.parametrize("accountant", ["prv", "gdp"])
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")
def test_worst_case_sigma_covers_the_prv_and_gdp_calibrations(accountant: str) -> None:
    worst = worst_case_noise_multiplier(
        target_epsilon=3.0,
        delta=1e-5,
        epochs=10,
        accountant=accountant,  # type: ignore[arg-type]
    )
    assert worst >= worst_case_noise_multiplier(
        target_epsilon=3.0, delta=1e-5, epochs=10, accountant="rdp"
    )
    for batches in (1, 2, 5, 20):
        assert _calibrated(3.0, 10, batches, accountant) <= worst


def test_worst_case_sigma_arguments_are_named() -> None:
    for kwargs, match in [
        ({"target_epsilon": 0.0}, "target_epsilon=0.0: expected a finite value > 0"),
        ({"target_epsilon": 0.005}, "target_epsilon=0.005: too small for a worst-case sigma"),
        ({"epochs": 0}, "epochs=0: expected >= 1"),
        ({"delta": 1.0}, "delta=1.0: expected 0 < delta < 1"),
        ({"accountant": "moments"}, "accountant='moments': expected one of"),
    ]:
        args = dict(target_epsilon=3.0, delta=1e-5, epochs=10, accountant="rdp") | kwargs
        with pytest.raises(ValueError, match=re.escape(match)):
            worst_case_noise_multiplier(**args)  # type: ignore[arg-type]
