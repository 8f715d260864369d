"""Training at a public nominal size ``N``: the data is padded to ``N`` with dummy rows whose
gradients are 0, so the sampling rate, the steps, sigma, the noise's scale and every batch's
size are ``N``'s, whatever the real count ``n <= N``; ``N = n`` trains bit for bit as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.dp.accounting import sample_rate, steps_per_epoch
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.training.configs import PrivacyConfig, TrainConfig
from fedsparse.common.training.local import (
    DUMMY_LABEL,
    make_private,
    padded_cross_entropy,
    train_one_epoch,
)

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
    train_one_epoch(module, optimizer, loader, criterion=padded_cross_entropy)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return weights, dp, optimizer, loader


@pytest.mark.parametrize("engine", ENGINES)
def test_the_real_count_as_nominal_size_pads_nothing_and_trains_as_before(engine: str) -> None:
    privacy = PrivacyConfig(target_epsilon=3.0)
    model = build_model("digits-cnn", seed=0)
    x, y = _digits(100)
    train = TrainConfig(batch_size=16, lr=0.5, engine=engine, device="cpu", seed=3)
    runs = []
    for nominal in (None, 100):
        model = build_model("digits-cnn", seed=0)
        _, module, optimizer, loader = make_private(
            model, x, y, privacy=privacy, train=train, epochs_for_target=1, nominal_size=nominal
        )
        assert len(loader.dataset) == 100  # nothing padded
        train_one_epoch(module, optimizer, loader)
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(*runs)


def test_a_dummy_rows_loss_and_gradient_are_exactly_zero() -> None:
    logits = torch.randn(5, 10, requires_grad=True)
    target = torch.tensor([3, DUMMY_LABEL, 7, DUMMY_LABEL, 0])
    padded_cross_entropy(logits, target).backward()
    assert logits.grad is not None
    assert torch.equal(logits.grad[[1, 3]], torch.zeros(2, 10))
    real = torch.tensor([0, 2, 4])
    reference = logits.detach()[real].clone().requires_grad_(True)
    (nn.functional.cross_entropy(reference, target[real], reduction="sum") / 5).backward()
    assert torch.allclose(logits.grad[real], reference.grad, atol=1e-7)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_batch_has_the_same_size_whatever_the_count(engine: str) -> None:
    """The Poisson draws run over the N slots: with the same seed, nodes of 20 and 250
    examples under N = 300 train on batches of identical sizes (the same rows through the
    model, so the same time), and see exactly their own examples."""
    sizes, seen = {}, {}
    for n in (20, 250):
        model = build_model("digits-cnn", seed=0)
        x, y = _digits(n)
        train = TrainConfig(batch_size=16, lr=0.5, engine=engine, device="cpu", seed=11)
        _, module, optimizer, loader = make_private(
            model,
            x,
            y,
            privacy=PrivacyConfig(noise_multiplier=1.0),
            train=train,
            epochs_for_target=1,
            nominal_size=300,
        )
        batches = [yb for _, yb in loader]  # the first epoch's draws
        sizes[n] = [len(yb) for yb in batches]
        assert all(int((yb != DUMMY_LABEL).sum()) <= n for yb in batches)
        _, seen[n] = train_one_epoch(module, optimizer, loader, criterion=padded_cross_entropy)
    assert sizes[20] == sizes[250] and len(sizes[20]) == 19
    # the real examples an epoch sees: Bin(n, q) a step, n in expectation (sd sqrt(n))
    assert abs(seen[20] - 20) < 5 * 20**0.5 and abs(seen[250] - 250) < 5 * 250**0.5


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
        train_one_epoch(module, optimizer, loader, criterion=padded_cross_entropy)
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
