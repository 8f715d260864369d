"""Tests for fedsparse.common.aggregation.norm_bounds: the per-round norm bound and the bound an
honest client's DP parameters imply.

The DP-derived bound (``honest_update_norm_bound``, ``HonestClientBound``) is checked against
a formula written out here, PyTorch's own SGD driven by simulated DP steps, the clients' own
step counts and Opacus's sigma calibration.
"""

import math
import re

import numpy as np
import pytest
import torch

from fedsparse.common.aggregation.norm_bounds import (
    HONEST_FAILURE_PROBABILITY,
    HonestClientBound,
    NormBound,
    honest_update_norm_bound,
    momentum_weights,
)
from fedsparse.common.aggregation.quantized_norms import quantized_norm
from fedsparse.common.aggregation.robust import (
    l2_norm,
)
from fedsparse.common.dp.accounting import calibrate_noise_multiplier, steps_per_epoch
from fedsparse.common.dp.worst_case import worst_case_noise_multiplier
from fedsparse.common.wire.payload.values import quantize_int8

F32_MAX = float(np.finfo(np.float32).max)

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


def _own_bound(caps: HonestClientBound, n: int, keep: int) -> float:
    """The bound of one client of ``n`` examples with its own steps, ``b' = int(n q)`` and ``m
    = n q`` (``privacy.steps_per_epoch``: the loader Opacus builds); ``n < b``: ``b' = n``."""
    batches = -(-n // min(caps.batch_size, n))
    return honest_update_norm_bound(
        lr=caps.lr,
        momentum=caps.momentum,
        max_grad_norm=caps.max_grad_norm,
        noise_multiplier=caps.noise_multiplier,
        expected_batch_size=int(n * (1 / batches)),
        mean_batch_size=n / batches,
        steps=caps.local_epochs * steps_per_epoch(n, caps.batch_size),
        keep=keep,
    )


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
        own = _own_bound(caps, n, keep)
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

    # K = 1: b' = n, every example in every step
    assert _own_bound(caps, first, keep) <= caps.bound(keep) < _own_bound(caps, first - 1, keep)
    # a dataset smaller than the batch size: only K = 1, at the largest client
    tiny = _client_bound(max_examples=20)
    assert (tiny.max_batches, tiny.max_steps) == (1, 1)


@pytest.mark.parametrize("declared", [1, 2, 3])
def test_a_declared_smallest_client_is_covered(declared: int) -> None:
    """``min_examples`` below the covered size: the bound takes K = 1 at that n, so every
    client from it on is covered (the bound is that client's own); undeclared or above the
    covered size, nothing changes."""
    keep = 38_282
    plain = _client_bound()
    assert plain.smallest_covered_examples(keep) == 4 > declared
    caps = _client_bound(min_examples=declared)
    assert caps.bound(keep) == _own_bound(caps, declared, keep) > plain.bound(keep)
    assert caps.smallest_covered_examples(keep) == declared
    for n in range(declared, 40):  # K = 1 up to b = 32, then K = 2
        assert _own_bound(caps, n, keep) <= caps.bound(keep), n
    for same in (0, 4, 32, 1437):  # not declared, or no smaller than what is covered
        assert _client_bound(min_examples=same).bound(keep) == plain.bound(keep)
    for bad in (-1, 1438):
        with pytest.raises(ValueError, match=f"min_examples={bad}: expected 0 .not declared. "):
            _client_bound(min_examples=bad)


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
