"""Tests for fedsparse.common.dp.scaling: the C / (1 - mu) rule on hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsparse.common.dp.scaling import (
    clip_momentum_ratio,
    momentum_noise_gain,
    rescale_max_grad_norm,
    rescale_momentum,
)


def test_gain_hand_values() -> None:
    assert momentum_noise_gain(0.0) == 1.0
    assert momentum_noise_gain(0.9) == pytest.approx(10.0)
    assert momentum_noise_gain(0.5) == pytest.approx(2.0)
    assert momentum_noise_gain(0.5, steps=3) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert momentum_noise_gain(0.9, steps=1) == pytest.approx(1.0)
    assert momentum_noise_gain(0.9, steps=2) == pytest.approx(1.9)
    assert momentum_noise_gain(0.0, steps=5) == 1.0
    assert momentum_noise_gain(0.9, steps=2000) == pytest.approx(10.0)  # eq. 117 -> eq. 118


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("steps", [1, 4, 25])
def test_gain_is_pytorch_sgd_velocity(momentum: float, steps: int) -> None:
    # PyTorch's SGD (a = 1, no dampening) fed the same gradient each step: its velocity after
    # `steps` steps is the gradient times eq. 117's partial sum.
    param = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([param], lr=1.0, momentum=momentum)
    for _ in range(steps):
        param.grad = torch.ones(1)
        opt.step()
    velocity = opt.state[param]["momentum_buffer"].item() if momentum else 1.0
    assert velocity == pytest.approx(momentum_noise_gain(momentum, steps=steps))


def test_papers_worked_example() -> None:
    # RF Sec. 4, Tables 5 and 9: (C = 0.1, mu = 0.9) -> (C = 1, mu = 0); C / (1 - mu) = 1.
    assert clip_momentum_ratio(max_grad_norm=0.1, momentum=0.9) == pytest.approx(1.0)
    assert rescale_max_grad_norm(
        max_grad_norm=0.1, momentum=0.9, new_momentum=0.0
    ) == pytest.approx(1.0)
    assert rescale_momentum(
        max_grad_norm=0.1, momentum=0.9, new_max_grad_norm=1.0
    ) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    ("norm", "mu", "new_mu", "expected"),
    [
        (1.0, 0.0, 0.9, 0.1),
        (0.5, 0.5, 0.75, 0.25),
        (0.1, 0.9, 0.5, 0.5),
        (2.0, 0.3, 0.3, 2.0),
    ],
)
def test_rescale_norm_hand_values(norm: float, mu: float, new_mu: float, expected: float) -> None:
    got = rescale_max_grad_norm(max_grad_norm=norm, momentum=mu, new_momentum=new_mu)
    assert got == pytest.approx(expected)
    assert rescale_momentum(
        max_grad_norm=norm, momentum=mu, new_max_grad_norm=got
    ) == pytest.approx(new_mu)


def test_rescale_with_finite_steps() -> None:
    # Two steps since the velocity was zero: gains 1 + mu, so C' = 0.1 * 1.9 / 1 = 0.19.
    got = rescale_max_grad_norm(max_grad_norm=0.1, momentum=0.9, new_momentum=0.0, steps=2)
    assert got == pytest.approx(0.19)


def test_invariant_kept_and_monotone() -> None:
    momenta = np.linspace(0.0, 0.95, 20)
    norms = [
        rescale_max_grad_norm(max_grad_norm=0.1, momentum=0.9, new_momentum=m) for m in momenta
    ]
    for m, c in zip(momenta, norms, strict=True):
        assert clip_momentum_ratio(max_grad_norm=c, momentum=m) == pytest.approx(1.0)
    assert all(a > b for a, b in zip(norms, norms[1:], strict=False))  # more momentum, less C
    back = [rescale_momentum(max_grad_norm=0.1, momentum=0.9, new_max_grad_norm=c) for c in norms]
    np.testing.assert_allclose(back, momenta, atol=1e-12)
    bounds = np.linspace(0.05, 1.0, 20)
    mus = [rescale_momentum(max_grad_norm=0.1, momentum=0.9, new_max_grad_norm=c) for c in bounds]
    assert all(a > b for a, b in zip(mus, mus[1:], strict=False))  # larger C, less momentum
    gains = [momentum_noise_gain(m) for m in momenta]
    assert all(a < b for a, b in zip(gains, gains[1:], strict=False))
    partial = [momentum_noise_gain(0.9, steps=t) for t in range(1, 30)]
    assert all(a < b < 10.0 for a, b in zip(partial, partial[1:], strict=False))


def test_bound_beyond_the_diagonal_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"new_max_grad_norm=1.5: expected <= C / \(1 - mu\) = 1"):
        rescale_momentum(max_grad_norm=0.1, momentum=0.9, new_max_grad_norm=1.5)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: momentum_noise_gain(1.0), "momentum=1.0: expected 0 <= momentum < 1"),
        (lambda: momentum_noise_gain(-0.1), "momentum=-0.1"),
        (lambda: momentum_noise_gain(math.nan), "momentum=nan"),
        (lambda: momentum_noise_gain(0.5, steps=0), "steps=0"),
        (lambda: clip_momentum_ratio(max_grad_norm=0.0, momentum=0.5), "max_grad_norm=0.0"),
        (
            lambda: clip_momentum_ratio(max_grad_norm=math.inf, momentum=0.5),
            "max_grad_norm=inf",
        ),
        (
            lambda: rescale_max_grad_norm(max_grad_norm=1.0, momentum=0.5, new_momentum=1.0),
            "new_momentum=1.0",
        ),
        (
            lambda: rescale_momentum(max_grad_norm=1.0, momentum=0.5, new_max_grad_norm=-1.0),
            "new_max_grad_norm=-1.0",
        ),
    ],
)
def test_validation(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]
