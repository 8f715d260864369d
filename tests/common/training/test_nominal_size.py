"""Training at a public nominal size ``N``: the sampling rate, the steps, sigma and the noise's
scale are ``N``'s, whatever the real count ``n <= N``; ``N = n`` trains bit for bit as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.dp.accounting import sample_rate, steps_per_epoch
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.training.configs import PrivacyConfig, TrainConfig
from fedsparse.common.training.local import make_private, train_one_epoch

ENGINES = ("opacus", "func", "factored")


def _digits(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    train, _ = load_dataset("digits", seed=0)
    return train.x[:n], train.y[:n]


def _epoch(
    n: int, *, nominal: int | None, engine: str, privacy: PrivacyConfig, seed: int = 3
) -> tuple[torch.Tensor, object, object, object]:
    """(the weights after one epoch, the engine, its optimizer, its loader)."""
    model = build_model("digits-cnn", seed=0)
    x, y = _digits(n)
    train = TrainConfig(batch_size=16, lr=0.5, engine=engine, device="cpu", seed=seed)
    dp, module, optimizer, loader = make_private(
        model, x, y, privacy=privacy, train=train, epochs_for_target=1, nominal_size=nominal
    )
    train_one_epoch(module, optimizer, loader)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return weights, dp, optimizer, loader


@pytest.mark.parametrize("engine", ENGINES)
def test_the_real_count_as_nominal_size_trains_bit_for_bit_as_before(engine: str) -> None:
    privacy = PrivacyConfig(target_epsilon=3.0)
    before = _epoch(100, nominal=None, engine=engine, privacy=privacy)[0]
    after = _epoch(100, nominal=100, engine=engine, privacy=privacy)[0]
    assert torch.equal(before, after)


@pytest.mark.parametrize("engine", ENGINES)
def test_rate_steps_sigma_and_scale_come_from_the_nominal_size(engine: str) -> None:
    privacy = PrivacyConfig(target_epsilon=3.0)
    nominal, b = 300, 16
    q = sample_rate(nominal, b)
    seen = set()
    for n in (150, 151, 299, 300):
        _, dp, optimizer, loader = _epoch(n, nominal=nominal, engine=engine, privacy=privacy)
        assert len(loader) == steps_per_epoch(nominal, b) == 19
        assert optimizer.expected_batch_size == int(nominal * q) == 15
        ((sigma, rate, steps),) = dp.accountant.history
        assert (rate, steps) == (q, 19)
        seen.add((sigma, dp.get_epsilon(1e-5)))
    assert len(seen) == 1  # the same sigma and epsilon whatever n


def test_the_noise_is_scaled_by_the_nominal_batch_whatever_the_count() -> None:
    """Zero gradients (a zero learning signal: all-zero inputs of a bias-free linear map):
    the update is pure noise, std lr sigma C sqrt(steps) / int(N q), for n = 20 and n = 200."""
    nominal, b, lr, sigma = 400, 20, 0.5, 2.0
    q = sample_rate(nominal, b)
    expected = lr * sigma * 1.0 * steps_per_epoch(nominal, b) ** 0.5 / int(nominal * q)
    for n in (20, 200):
        model = nn.Linear(16, 500, bias=False)
        nn.init.zeros_(model.weight)
        x, y = torch.zeros(n, 16), torch.zeros(n, dtype=torch.long)
        train = TrainConfig(batch_size=b, lr=lr, engine="opacus", device="cpu", seed=n)
        _, module, optimizer, loader = make_private(
            model,
            x,
            y,
            privacy=PrivacyConfig(noise_multiplier=sigma),
            train=train,
            epochs_for_target=1,
            nominal_size=nominal,
        )
        train_one_epoch(module, optimizer, loader)
        update = model.weight.detach().flatten()
        std = float(update.std())
        # 8000 draws: the sample std's relative standard error is 1/sqrt(2 * 8000) = 0.8%
        assert abs(std / expected - 1) < 5 * (2 * update.numel()) ** -0.5, (n, std, expected)


def test_a_nominal_size_below_the_data_is_refused() -> None:
    model = build_model("digits-cnn", seed=0)
    x, y = _digits(50)
    train = TrainConfig(batch_size=16, device="cpu")
    with pytest.raises(ValueError, match="nominal_size=49: below the data set's 50 examples"):
        make_private(
            model,
            x,
            y,
            privacy=PrivacyConfig(noise_multiplier=1.0),
            train=train,
            epochs_for_target=1,
            nominal_size=49,
        )
