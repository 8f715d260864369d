"""GIP noisy top-k and random-k inside DP-SGD (``methods/index_selection.py``, the optimizer hook).

The defining properties: the support is chosen from the clipped, noise-free sum of WHOLE
per-sample gradients (clip -> sum -> select -> noise -> mask, GIP Alg. 2), the step is plain
DP-SGD's step masked, GIP's reported epsilon is the Gaussian mechanism's plus the index
selection's ``T * sum_i eps2_i`` (Thm. 2, checked against a hand calculation), and random-k
costs nothing.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.dp.accounting import compute_epsilon_of_history, sample_rate, steps_per_epoch
from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.methods import MethodConfig
from fedsparse.common.methods.gip import gip_privacy
from fedsparse.common.methods.index_selection import (
    IndexBudget,
    StepSelector,
    group_sizes,
    split_budget,
)
from fedsparse.common.methods.mallows import mask_distance_pmf
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.training.centralized import train_centralized
from fedsparse.common.training.configs import PrivacyConfig, SparsityConfig, TrainConfig

warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message=".*non-full backward hook.*")


def test_split_budget_and_its_validation() -> None:
    eps1, eps2 = split_budget(3.0, 0.01)
    assert eps2 == pytest.approx(0.03, abs=1e-15) and eps1 + eps2 == pytest.approx(3.0)
    with pytest.raises(ValueError, match="index-budget-fraction=1.0"):
        split_budget(3.0, 1.0)
    with pytest.raises(ValueError, match="target-epsilon=inf"):
        split_budget(math.inf, 0.01)


def test_index_budget_matches_a_hand_calculation() -> None:
    """d = 1000 in groups of 256: [256, 256, 256, 232]; s1 = 2 min(k, l - k) per group."""
    assert group_sizes(1000) == [256, 256, 256, 232]
    budget = IndexBudget(epsilon=0.05, planned_steps=10)
    # k = 0.5: keeps 128, 128, 128, 116 -> s1 = 256, 256, 256, 232 (sum 1000)
    assert budget.sensitivities(1000, 0.5) == [256, 256, 256, 232]
    assert budget.theta(1000, 0.5) == pytest.approx(0.05 / 10 / 1000, rel=1e-12)
    assert budget.step_cost(1000, 0.5) == pytest.approx(0.005, rel=1e-12)
    # k = 0.1: keeps 256 - floor(230.4) = 26 and 232 - floor(208.8) = 24 -> s1 = 52, 48
    assert budget.sensitivities(1000, 0.1) == [52, 52, 52, 48]
    assert budget.theta(1000, 0.1) == pytest.approx(0.005 / 204, rel=1e-12)
    assert budget.step_cost(1000, 0.1) == pytest.approx(0.005, rel=1e-12)
    # k = 1: nothing to choose, nothing spent
    assert budget.theta(1000, 1.0) == math.inf and budget.step_cost(1000, 1.0) == 0.0


def test_selector_counts_union_and_cost() -> None:
    budget = IndexBudget(epsilon=0.04, planned_steps=4)
    selector = StepSelector("gip", numel=1000, keep_fraction=0.1, budget=budget, seed=1)
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    masks = [selector(g) for _ in range(3)]
    for mask in masks:  # exactly keep_count per group
        counts = [int(m.sum()) for m in torch.split(mask, group_sizes(1000))]
        assert counts == [26, 26, 26, 24]
    assert torch.equal(selector.union, masks[0] | masks[1] | masks[2])
    assert selector.spent == pytest.approx(3 * 0.01, rel=1e-12)
    selector.set_keep_fraction(1.0)
    assert bool(selector(g).all()) and selector.spent == pytest.approx(0.03, rel=1e-12)
    free = StepSelector("random-k", numel=1000, keep_fraction=0.1, seed=1)
    assert int(free(g).sum()) == 102 and free.spent == 0.0
    with pytest.raises(ValueError, match="needs an IndexBudget"):
        StepSelector("gip", numel=10)


def test_gip_swaps_follow_the_mallows_law_at_its_theta() -> None:
    """At a large budget the selection is near top-k; its swap count per group follows
    eq. 11 at the selector's theta (mean within 4 standard errors)."""
    numel, k = 256 * 400, 0.25
    budget = IndexBudget(epsilon=400 * 0.02 * 128, planned_steps=1)  # theta = 0.02
    theta = budget.theta(numel, k)
    assert theta == pytest.approx(0.02, rel=1e-12)
    selector = StepSelector("gip", numel=numel, keep_fraction=k, budget=budget, seed=3)
    g = torch.randn(numel, generator=torch.Generator().manual_seed(4))
    mask = selector(g).reshape(-1, 256)
    top = torch.zeros_like(mask)
    top.scatter_(1, g.abs().reshape(-1, 256).topk(64, dim=1).indices, True)
    swaps = (top & ~mask).sum(dim=1).numpy()
    pmf = mask_distance_pmf(256, 64, theta=theta)
    i = np.arange(len(pmf))
    mean, sd = float((i * pmf).sum()), math.sqrt(float((i**2 * pmf).sum() - (i * pmf).sum() ** 2))
    assert abs(swaps.mean() - mean) < 4 * sd / math.sqrt(len(swaps))


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _step(selector: StepSelector | None, *, sigma: float, clip: float):
    """One DP step on 8 examples, lr 1, no Poisson sampling; returns (model delta, engine)."""
    model = _tiny()
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    g = torch.Generator().manual_seed(5)
    ds = TensorDataset(torch.randn(8, 6, generator=g) * 3, torch.randint(0, 3, (8,), generator=g))
    engine = SparseDPEngine()
    module, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(ds, batch_size=8),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(6),
    )
    if selector is not None:
        engine.set_step_selector(selector)
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(module(xb), yb).backward()
        opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return after - before, ds


class _Recording(StepSelector):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.inputs: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []

    def __call__(self, summed: torch.Tensor) -> torch.Tensor:
        self.inputs.append(summed.clone())
        self.masks.append(super().__call__(summed))
        return self.masks[-1]


def test_selection_sees_the_clipped_noise_free_sum_of_whole_gradients() -> None:
    """Alg. 2 order: clip whole per-sample gradients, sum, select, then noise and mask."""
    clip = 0.05  # every example is clipped: the masked norm would give other factors
    numel = sum(p.numel() for p in _tiny().parameters())
    budget = IndexBudget(epsilon=1.0, planned_steps=1, group_size=16)
    selector = _Recording(
        "gip", numel=numel, keep_fraction=0.25, budget=budget, group_size=16, seed=0
    )
    delta, ds = _step(selector, sigma=0.0, clip=clip)
    model = _tiny()
    x, y = ds.tensors
    expected = torch.zeros(numel)
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        expected += grad * min(1.0, clip / (float(grad.norm()) + 1e-6))
    (summed,), (mask,) = selector.inputs, selector.masks
    torch.testing.assert_close(summed, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(delta, -(expected * mask) / len(x), rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(delta[~mask]) == 0


def test_the_noisy_step_is_plain_dpsgd_masked() -> None:
    """Same seeds: GIP's step equals plain DP-SGD's step times the chosen support, exactly
    (the noise is Opacus's own draw, masked)."""
    numel = sum(p.numel() for p in _tiny().parameters())
    selector = _Recording("random-k", numel=numel, keep_fraction=0.3, group_size=16, seed=2)
    sparse, _ = _step(selector, sigma=1.0, clip=1.0)
    dense, _ = _step(None, sigma=1.0, clip=1.0)
    (mask,) = selector.masks
    assert torch.equal(sparse, dense * mask)


def test_public_mask_and_selector_are_exclusive() -> None:
    model = _tiny()
    engine = SparseDPEngine()
    ds = TensorDataset(torch.randn(4, 6), torch.zeros(4, dtype=torch.long))
    engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(ds, batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    mask = torch.zeros(engine.layout.numel, dtype=torch.bool)
    mask[:5] = True
    engine.set_mask(mask)
    with pytest.raises(ValueError, match="public mask is set"):
        engine.set_step_selector(StepSelector("random-k", numel=engine.layout.numel))
    with pytest.raises(ValueError, match="covers 7 coordinates"):
        engine.set_step_selector(StepSelector("random-k", numel=7))


def _centralized(method: str, epochs: int = 3):
    from fedsparse.common.data.datasets import load_dataset

    train, test = load_dataset("digits", seed=0)
    privacy = PrivacyConfig(target_epsilon=3.0)
    config = TrainConfig(epochs=epochs, batch_size=64, lr=0.5, seed=0, engine="opacus")
    history = train_centralized(
        build_model("digits-cnn", seed=0),
        (train.x, train.y),
        (test.x, test.y),
        privacy=privacy,
        sparsity=SparsityConfig(final_rate=0.9),
        train=config,
        method=MethodConfig(name=method),  # type: ignore[arg-type]
    )
    return history, len(train), privacy, config


@pytest.mark.slow
def test_gip_epsilon_is_the_composition_by_hand() -> None:
    """eps = eps1(accountant, sigma calibrated for 0.99 * 3) + 0.03 * (steps with k < 1) / T.

    Gradual cooling over 3 epochs: k = 1, 0.55, 0.1, so epoch 0 chooses nothing and the
    index selection spends 2/3 of eps2 = 0.03."""
    history, n, privacy, config = _centralized("gip")
    q = sample_rate(n, config.batch_size)
    steps = config.epochs * steps_per_epoch(n, config.batch_size)
    gip, budget = gip_privacy(privacy, MethodConfig(name="gip"), planned_steps=steps)
    assert gip.target_epsilon == pytest.approx(2.97) and budget.epsilon == pytest.approx(0.03)
    from fedsparse.common.dp.accounting import calibrate_noise_multiplier

    sigma = calibrate_noise_multiplier(
        target_epsilon=2.97, delta=1e-5, sample_rate=q, steps=steps, accountant="rdp"
    )
    eps1 = compute_epsilon_of_history([(sigma, q, steps)], delta=1e-5, accountant="rdp")
    last = history[-1]
    assert last.index_epsilon == pytest.approx(0.03 * 2 / 3, rel=1e-9)
    assert last.epsilon == pytest.approx(eps1 + 0.02, rel=1e-9)
    assert last.epsilon <= 3.0
    assert [round(h.keep_fraction, 2) for h in history] == [1.0, 0.55, 0.1]


@pytest.mark.slow
def test_random_k_costs_nothing_beyond_dpsgd() -> None:
    """random-k (Prop. 1): the full budget calibrates sigma and epsilon is the accountant's,
    exactly RS's at the same schedule."""
    random_k, *_ = _centralized("random-k", epochs=2)
    rs, *_ = _centralized("rs", epochs=2)
    assert random_k[-1].index_epsilon == 0.0
    assert random_k[-1].epsilon == rs[-1].epsilon
    assert [round(h.keep_fraction, 2) for h in random_k] == [1.0, 0.1]


def test_gip_needs_a_target_epsilon() -> None:
    with pytest.raises(ValueError, match="needs mechanism='dpsgd' and a target-epsilon"):
        gip_privacy(PrivacyConfig(noise_multiplier=1.0), MethodConfig(name="gip"), planned_steps=1)
