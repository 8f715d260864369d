"""Tests for fedsparse.common.training (configs, local, centralized): masks per step,
evaluation, the local DP-SGD + RS loop."""

import itertools
import math

import pytest
import torch
from torch import nn

from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import derive_seed, keep_count, sample_mask
from fedsparse.common.methods.selection import round_mask
from fedsparse.common.training.centralized import train_centralized
from fedsparse.common.training.configs import PrivacyConfig, SparsityConfig, TrainConfig
from fedsparse.common.training.local import EpochStats, evaluate, make_private, train_one_epoch

# --- helpers ----------------------------------------------------------------------------------


def blobs(n: int, *, seed: int, separation: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two Gaussian blobs (std 0.5) at x0 = -separation / +separation: linearly separable."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = 0.5 * torch.randn(n, 2, generator=g)
    x[:, 0] += separation * (2 * y - 1).float()
    return x, y


def mlp(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))


def flat(module: nn.Module) -> torch.Tensor:
    return ParamLayout.from_module(module).flatten_module(module).clone()


def private(
    *,
    model: nn.Module | None = None,
    n: int = 128,
    privacy: PrivacyConfig | None = None,
    epochs_for_target: int = 1,
    **train_kwargs,
):
    x, y = blobs(n, seed=11)
    train = TrainConfig(**{"batch_size": 32, "lr": 0.5, "device": "cpu", **train_kwargs})
    privacy = privacy or PrivacyConfig(noise_multiplier=1.0)
    return make_private(
        model if model is not None else mlp(),
        x,
        y,
        privacy=privacy,
        train=train,
        epochs_for_target=epochs_for_target,
    )


# --- round_mask -------------------------------------------------------------------------------


@pytest.mark.parametrize(("numel", "rate"), [(0, 0.5), (10, 0.0), (10, 0.05), (1000, 0.0009)])
def test_round_mask_is_none_when_nothing_is_dropped(numel: int, rate: float) -> None:
    assert keep_count(numel, rate=rate) == numel  # floor(rate * numel) == 0
    assert round_mask(numel, rate=rate, mask_seed=3, step=1) is None


@pytest.mark.parametrize(
    ("numel", "rate"), [(10, 0.1), (10, 1.0), (1000, 0.7), (38_282, 0.9), (38_282, 0.123)]
)
def test_round_mask_keeps_exactly_keep_count(numel: int, rate: float) -> None:
    mask = round_mask(numel, rate=rate, mask_seed=5, step=2)
    assert mask is not None and mask.dtype == torch.bool and mask.shape == (numel,)
    assert int(mask.sum()) == keep_count(numel, rate=rate) == numel - math.floor(rate * numel)


def test_round_mask_depends_on_seed_and_step_only() -> None:
    numel, rate = 5000, 0.5
    keep = keep_count(numel, rate=rate)

    def mask(seed: int, step: int) -> torch.Tensor:
        m = round_mask(numel, rate=rate, mask_seed=seed, step=step)
        assert m is not None
        return m

    assert torch.equal(mask(7, 3), mask(7, 3))
    # Every party regenerates it from the broadcast (seed, step): the public derivation.
    assert torch.equal(mask(7, 3), sample_mask(numel, keep=keep, seed=derive_seed(7, 3)))
    # Two independent uniform masks of 2500/5000 overlap on 1250 +- 5 SE coordinates
    # (hypergeometric variance keep^2 (d-keep)^2 / (d^2 (d-1)) ~= 312.6).
    se = math.sqrt(keep**2 * (numel - keep) ** 2 / (numel**2 * (numel - 1)))
    for other in (mask(7, 4), mask(8, 3)):
        assert not torch.equal(mask(7, 3), other)
        assert abs(int((mask(7, 3) & other).sum()) - keep**2 / numel) < 5 * se


# --- evaluate ---------------------------------------------------------------------------------


def hand_model() -> nn.Module:
    linear = nn.Linear(2, 3)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
        linear.bias.copy_(torch.tensor([0.0, 0.5, 0.0]))
    # Dropout with p=0.9 would wreck the result unless evaluate() switches to eval mode.
    model = nn.Sequential(linear, nn.Dropout(p=0.9))
    model.train()
    return model


def test_evaluate_matches_a_hand_computation_across_batches() -> None:
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0], [-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]])
    y = torch.tensor([0, 1, 2, 2, 1])
    # Logits W x + b, by hand: argmax 0, 1, 2, 1 (label 2: wrong), 1.
    logits = [[2, 0.5, -2], [0, 1.5, -1], [-1, -0.5, 2], [1, 1.5, -2], [0, 0.5, 0]]
    losses = [
        math.log(sum(math.exp(v) for v in row)) - row[t] for row, t in zip(logits, y, strict=True)
    ]
    expected_loss = sum(losses) / 5  # the mean over examples, not over batches (2, 2, 1)
    for batch_size in (1, 2, 5, 1024):
        loss, accuracy = evaluate(hand_model(), x, y, batch_size=batch_size)
        assert accuracy == 0.8
        assert loss == pytest.approx(expected_loss, rel=1e-6)


def test_evaluate_on_nothing_is_zero_not_nan() -> None:
    assert evaluate(hand_model(), torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)) == (0, 0)


# --- train_one_epoch --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "privacy",
    [
        PrivacyConfig(mechanism="clipped", noise_multiplier=0.0),
        PrivacyConfig(noise_multiplier=1.0),
    ],
    ids=["clipped-no-noise", "dpsgd-sigma-1"],
)
def test_loss_decreases_on_separable_data(privacy: PrivacyConfig) -> None:
    _, module, optimizer, loader = private(privacy=privacy, seed=1)
    x_test, y_test = blobs(256, seed=12)
    test_losses, train_losses = [evaluate(module, x_test, y_test)[0]], []
    for _ in range(4):
        train_losses.append(train_one_epoch(module, optimizer, loader)[0])
        test_losses.append(evaluate(module, x_test, y_test)[0])
    assert all(b < a for a, b in itertools.pairwise(test_losses)), test_losses
    assert train_losses[-1] < 0.5 * train_losses[0]
    assert test_losses[-1] < 0.25 * test_losses[0]
    assert evaluate(module, x_test, y_test)[1] >= 0.98


def test_reported_loss_is_the_per_example_mean_and_examples_are_counted() -> None:
    # Without Poisson sampling every example is seen once, in batches 16, 16, 16, 2; with a
    # learning rate far below float32 resolution the weights do not move, so the epoch's loss
    # must be evaluate()'s mean over the 50 examples (a mean of batch means would differ).
    model = mlp()
    _, module, optimizer, loader = private(
        model=model,
        n=50,
        privacy=PrivacyConfig(mechanism="clipped", noise_multiplier=0.0),
        batch_size=16,
        lr=1e-30,
        poisson_sampling=False,
    )
    before_loss = evaluate(module, *blobs(50, seed=11))[0]  # the data private() trains on
    before = flat(model)
    loss, examples = train_one_epoch(module, optimizer, loader)
    assert examples == 50
    assert torch.equal(flat(model), before)
    assert loss == pytest.approx(before_loss, rel=1e-6)


def test_weights_off_the_mask_do_not_move_at_all() -> None:
    model = mlp()
    engine, module, optimizer, loader = private(model=model, momentum=0.0, seed=4)
    numel = engine.layout.numel
    mask = round_mask(numel, rate=0.6, mask_seed=9, step=0)
    assert mask is not None
    engine.set_mask(mask)
    before = flat(model)
    train_one_epoch(module, optimizer, loader)
    after = flat(model)
    off = ~mask
    assert torch.equal(after[off].view(torch.int32), before[off].view(torch.int32))
    # The kept coordinates all moved (noise alone moves each by ~lr * sigma * C / B per step).
    assert bool((after[mask] != before[mask]).all())
    assert engine.keep_fraction == keep_count(numel, rate=0.6) / numel


def test_momentum_keeps_moving_coordinates_a_later_mask_drops() -> None:
    """dp.py: velocity from an earlier mask still moves coordinates the next mask drops."""
    model = mlp()
    engine, module, optimizer, loader = private(model=model, momentum=0.9, seed=4)
    numel = engine.layout.numel
    first = round_mask(numel, rate=0.5, mask_seed=9, step=0)
    second = round_mask(numel, rate=0.5, mask_seed=9, step=1)
    assert first is not None and second is not None
    engine.set_mask(first)
    train_one_epoch(module, optimizer, loader)
    middle = flat(model)
    engine.set_mask(second)
    train_one_epoch(module, optimizer, loader)
    after = flat(model)
    never = ~(first | second)
    only_first = first & ~second
    assert bool(never.any()) and bool(only_first.any())
    assert torch.equal(after[never], middle[never])
    assert bool((after[only_first] != middle[only_first]).all())


def test_same_seed_same_weights_other_seed_different() -> None:
    mask = round_mask(ParamLayout.from_module(mlp()).numel, rate=0.3, mask_seed=1, step=0)
    assert mask is not None

    def one_epoch(seed: int) -> tuple[torch.Tensor, float, int]:
        model = mlp()
        engine, module, optimizer, loader = private(model=model, seed=seed)
        engine.set_mask(mask)
        loss, examples = train_one_epoch(module, optimizer, loader)
        return flat(model), loss, examples

    a, b, c = one_epoch(21), one_epoch(21), one_epoch(22)
    assert torch.equal(a[0].view(torch.int32), b[0].view(torch.int32))
    assert a[1:] == b[1:]
    # Another seed: other noise (and batches) on every kept coordinate, none off the mask.
    assert torch.equal(a[0] != c[0], mask)


def test_physical_batches_give_the_same_logical_steps() -> None:
    """BatchMemoryManager splits batches but steps (and draws noise) once per logical batch."""

    def one_epoch(max_physical_batch_size: int) -> tuple[torch.Tensor, int, int]:
        model = mlp()
        engine, module, optimizer, loader = private(model=model, seed=3)
        _, examples = train_one_epoch(
            module, optimizer, loader, max_physical_batch_size=max_physical_batch_size
        )
        steps = sum(s for _, _, s in engine.accountant.history)
        return flat(model), examples, steps

    whole, split = one_epoch(0), one_epoch(5)
    assert whole[1:] == split[1:] and whole[2] == 4  # ceil(128 / 32) noisy steps
    torch.testing.assert_close(split[0], whole[0], rtol=1e-5, atol=1e-6)


# --- make_private with a target epsilon -------------------------------------------------------


def test_target_epsilon_is_met_after_the_planned_epochs() -> None:
    # q = 1/75 and 3 epochs: Opacus's make_private_with_epsilon would calibrate for
    # int(3 / q) = 224 steps while 225 run (epsilon 3.0018 > 3 for a target of 3).
    n, batch_size, epochs, target = 75, 1, 3, 3.0
    engine, module, optimizer, loader = private(
        model=nn.Linear(2, 2),
        n=n,
        privacy=PrivacyConfig(target_epsilon=target, delta=1e-5),
        epochs_for_target=epochs,
        batch_size=batch_size,
        lr=0.05,
    )
    assert engine.get_epsilon(1e-5) == 0.0
    spent = []
    for _ in range(epochs):
        train_one_epoch(module, optimizer, loader)
        spent.append(engine.get_epsilon(1e-5))
    assert 0 < spent[0] < spent[1] < spent[2]
    assert sum(s for _, _, s in engine.accountant.history) == epochs * math.ceil(n / batch_size)
    # Calibration bisects until target - epsilon <= 0.01 (epsilon_tolerance), from below.
    assert target - 0.01 <= spent[-1] <= target


# --- train_centralized ------------------------------------------------------------------------


def test_train_centralized_follows_the_schedule_and_reports_each_epoch() -> None:
    seen: list[EpochStats] = []
    x, y = blobs(128, seed=11)
    sparsity = SparsityConfig(schedule="gradual", final_rate=0.6, mask_seed=4)
    history = train_centralized(
        mlp(),
        (x, y),
        blobs(256, seed=12),
        privacy=PrivacyConfig(noise_multiplier=1.0),
        sparsity=sparsity,
        train=TrainConfig(epochs=3, batch_size=32, lr=0.5, seed=2),
        on_epoch=seen.append,
    )
    assert seen == history and [h.epoch for h in history] == [0, 1, 2]
    assert [h.rate for h in history] == pytest.approx([0.0, 0.3, 0.6])
    numel = 2 * 16 + 16 + 16 * 2 + 2
    assert [h.keep_fraction for h in history] == [
        keep_count(numel, rate=r) / numel for r in (0.0, 0.3, 0.6)
    ]
    eps = [h.epsilon for h in history]
    assert 0 < eps[0] < eps[1] < eps[2] < math.inf
    assert history[-1].test_accuracy >= 0.95
    assert all(math.isfinite(h.train_loss) and h.examples > 0 for h in history)
