"""Tests for the DP-SGD + RS step (fedsparse.common.dp.optimizer): order, norms, noise,
equivalences."""

import math
import warnings

import pytest
import torch
from opacus import PrivacyEngine
from opacus.accountants import PRVAccountant, RDPAccountant
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.masks import sample_mask

warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message=".*non-full backward hook.*")


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 16),
        nn.Tanh(),
        nn.Linear(16, 3),
    )


def data(n: int = 48, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    )


def run_steps(
    engine_cls,
    *,
    mask_fn=None,
    momentum=0.0,
    steps=3,
    sigma=1.0,
    clip=1.0,
    poisson=True,
    mechanism=None,
    lr=0.1,
    batch_size=16,
):
    torch.manual_seed(0)
    model = small_cnn()
    initial = [p.detach().clone() for p in model.parameters()]
    loader = DataLoader(data(), batch_size=batch_size, generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    engine = engine_cls() if mechanism is None else engine_cls(mechanism=mechanism)
    module, dp_opt, dp_loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=clip,
        poisson_sampling=poisson,
        noise_generator=torch.Generator().manual_seed(2),
    )
    if mask_fn is not None:
        engine.set_mask(mask_fn(engine))
    done = 0
    while done < steps:
        for xb, yb in dp_loader:
            dp_opt.zero_grad()
            nn.functional.cross_entropy(module(xb), yb).backward()
            dp_opt.step()
            done += 1
            if done == steps:
                break
    delta = torch.cat(
        [(p.detach() - q).reshape(-1) for p, q in zip(model.parameters(), initial, strict=True)]
    )
    return model, engine, delta


def test_r0_reproduces_plain_opacus_bit_for_bit() -> None:
    for momentum in (0.0, 0.9):
        plain, _, _ = run_steps(PrivacyEngine, momentum=momentum)
        sparse, _, _ = run_steps(SparseDPEngine, momentum=momentum)
        full, _, _ = run_steps(
            SparseDPEngine,
            momentum=momentum,
            mask_fn=lambda e: torch.ones(e.layout.numel, dtype=torch.bool),
        )
        for a, b, c in zip(plain.parameters(), sparse.parameters(), full.parameters(), strict=True):
            assert torch.equal(a, b)
            assert torch.equal(a, c)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_masked_coordinates_get_exactly_zero_update(momentum: float) -> None:
    mask_fn = lambda e: sample_mask(e.layout.numel, keep=e.layout.numel // 4, seed=3)  # noqa: E731
    _, engine, delta = run_steps(SparseDPEngine, mask_fn=mask_fn, momentum=momentum, steps=6)
    mask = engine.mask
    assert torch.count_nonzero(delta[~mask]) == 0
    assert torch.count_nonzero(delta[mask]) == int(mask.sum())  # noise moves every kept coord
    assert engine.keep_fraction == pytest.approx(int(mask.sum()) / mask.numel())


def brute_force_update(model: nn.Module, x, y, mask_flat, clip: float) -> torch.Tensor:
    """Per-example autograd: sparsify, clip by the MASKED norm, sum (no noise)."""
    total = None
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]) * mask_flat
        g = g * min(1.0, clip / (float(g.norm()) + 1e-6))
        total = g if total is None else total + g
    return total


@pytest.mark.parametrize("clip", [0.05, 1e3])
def test_clip_norms_are_masked_gradient_norms(clip: float) -> None:
    torch.manual_seed(0)
    model = small_cnn()
    reference_model = small_cnn()
    reference_model.load_state_dict(model.state_dict())
    ds = data(n=16)
    x, y = ds.tensors
    engine = SparseDPEngine()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    module, dp_opt, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(ds, batch_size=16),
        noise_multiplier=0.0,
        max_grad_norm=clip,
        poisson_sampling=False,
    )
    mask = sample_mask(engine.layout.numel, keep=engine.layout.numel // 3, seed=9)
    engine.set_mask(mask)
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    dp_opt.zero_grad()
    nn.functional.cross_entropy(module(x), y).backward()
    dp_opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = brute_force_update(reference_model, x, y, mask.float(), clip) / 16
    torch.testing.assert_close(before - after, expected, rtol=1e-4, atol=1e-6)
    if clip < 1:  # the masked norms, not the full ones, are what got clipped
        unmasked = brute_force_update(reference_model, x, y, torch.ones_like(mask.float()), clip)
        assert not torch.allclose((unmasked * mask.float()) / 16, expected, rtol=1e-2)


class ZeroGrad(nn.Module):
    """A model whose loss gradient is identically zero: updates are pure DP noise."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 0.0


def noise_only_grad(
    *,
    keep: int | None,
    d: int = 20_000,
    sigma: float = 1.3,
    clip: float = 0.7,
    batch: int = 10,
    seed: int = 4,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    model = ZeroGrad(d)
    x = torch.randn(batch, d)
    engine = SparseDPEngine()
    module, dp_opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(x, torch.zeros(batch)), batch_size=batch),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(seed),
    )
    mask = None if keep is None else sample_mask(d, keep=keep, seed=seed)
    engine.set_mask(mask)
    dp_opt.zero_grad()
    module(x).sum().backward()
    dp_opt.step()
    return model.fc.weight.grad.reshape(-1).clone(), mask


def test_zero_gradients_give_masked_noise_with_analytic_std() -> None:
    sigma, clip, batch = 1.3, 0.7, 10
    std = sigma * clip / batch
    grad, mask = noise_only_grad(keep=8_000, sigma=sigma, clip=clip, batch=batch)
    assert torch.count_nonzero(grad[~mask]) == 0
    kept = grad[mask].double().numpy()
    assert stats.kstest(kept, stats.norm(0, std).cdf).pvalue > 1e-3
    assert stats.kstest(kept, stats.norm(0, 1.5 * std).cdf).pvalue < 1e-6
    assert stats.kstest(kept, stats.norm(0, std / 1.5).cdf).pvalue < 1e-6


def test_noise_norm_ratio_is_sqrt_keep_fraction() -> None:
    d = 20_000
    for rate in (0.5, 0.9):
        keep = d - math.floor(rate * d)
        ratios = []
        for seed in range(5):
            dense, _ = noise_only_grad(keep=None, d=d, seed=seed)
            sparse, _ = noise_only_grad(keep=keep, d=d, seed=seed + 100)
            ratios.append(float(sparse.norm() / dense.norm()))
        # Relative s.e. of a chi norm with k dof is ~1/sqrt(2k); the ratio's is the quadrature
        # sum; the mean of 5 ratios divides it by sqrt(5).
        se = math.sqrt(1 / (2 * keep) + 1 / (2 * d)) / math.sqrt(5) * math.sqrt(1 - rate)
        assert abs(sum(ratios) / 5 - math.sqrt(1 - rate)) < 5 * se


def test_sparse_noise_equals_masked_plain_noise() -> None:
    """Kept coordinates receive exactly the noise Opacus would draw from the same state."""
    dense, _ = noise_only_grad(keep=None, d=5000, seed=8)
    sparse, mask = noise_only_grad(keep=1000, d=5000, seed=8)
    assert torch.equal(sparse[mask], dense[mask])


@pytest.mark.parametrize("accountant_cls", [RDPAccountant, PRVAccountant])
def test_epsilon_equals_opacus_accountant(accountant_cls) -> None:
    name = "rdp" if accountant_cls is RDPAccountant else "prv"
    torch.manual_seed(0)
    model = small_cnn()
    loader = DataLoader(data(n=48), batch_size=12)
    engine = SparseDPEngine(accountant=name)
    module, dp_opt, dp_loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.1,
        max_grad_norm=1.0,
    )
    engine.set_mask(sample_mask(engine.layout.numel, keep=100, seed=0))
    for _ in range(3):
        for xb, yb in dp_loader:
            dp_opt.zero_grad()
            nn.functional.cross_entropy(module(xb), yb).backward()
            dp_opt.step()
    reference = accountant_cls()
    reference.history = [(1.1, 12 / 48, 12)]
    assert engine.get_epsilon(1e-5) == pytest.approx(reference.get_epsilon(delta=1e-5), rel=1e-9)
    assert engine.get_epsilon(1e-5) > 0


def test_clipped_ablation_is_noise_free_and_not_private() -> None:
    mask_fn = lambda e: sample_mask(e.layout.numel, keep=200, seed=1)  # noqa: E731
    _, engine_a, delta_a = run_steps(
        SparseDPEngine, mask_fn=mask_fn, sigma=0.0, mechanism="clipped", poisson=False
    )
    _, engine_b, delta_b = run_steps(SparseDPEngine, mask_fn=mask_fn, sigma=0.0, poisson=False)
    assert torch.equal(delta_a, delta_b)  # Alg. 3 == Alg. 1 with sigma = 0
    assert engine_a.get_epsilon(1e-5) == math.inf
    with pytest.raises(ValueError, match="noise_multiplier=1.0"):
        run_steps(SparseDPEngine, sigma=1.0, mechanism="clipped")


def test_noisy_ablation_skips_clipping() -> None:
    """Alg. 2: with sigma = 0 the update is the masked, UNclipped mean gradient."""
    torch.manual_seed(0)
    model = small_cnn()
    ref = small_cnn()
    ref.load_state_dict(model.state_dict())
    x, y = data(n=8).tensors
    engine = SparseDPEngine(mechanism="noisy")
    module, dp_opt, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=0.0,
        max_grad_norm=1e-4,
        poisson_sampling=False,
    )
    mask = sample_mask(engine.layout.numel, keep=300, seed=2)
    engine.set_mask(mask)
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    dp_opt.zero_grad()
    nn.functional.cross_entropy(module(x), y).backward()
    dp_opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = brute_force_update(ref, x, y, mask.float(), clip=math.inf) / 8
    torch.testing.assert_close(before - after, expected, rtol=1e-4, atol=1e-7)
    assert engine.get_epsilon(1e-5) == math.inf


def test_masks_are_keyed_by_name_with_frozen_parameters() -> None:
    torch.manual_seed(0)
    model = small_cnn()
    model[0].weight.requires_grad_(False)  # frozen: not part of the mask
    engine = SparseDPEngine()
    module, dp_opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=DataLoader(data(), batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    assert engine.layout.names == ("0.bias", "4.weight", "4.bias", "6.weight", "6.bias")
    trainable = [p for p in model.parameters() if p.requires_grad]
    initial = [p.detach().clone() for p in trainable]
    frozen = model[0].weight.detach().clone()
    mask = sample_mask(engine.layout.numel, keep=50, seed=0)
    engine.set_mask(mask)
    for xb, yb in loader:
        dp_opt.zero_grad()
        nn.functional.cross_entropy(module(xb), yb).backward()
        dp_opt.step()
    delta = torch.cat(
        [(p.detach() - q).reshape(-1) for p, q in zip(trainable, initial, strict=True)]
    )
    assert torch.count_nonzero(delta[~mask]) == 0
    assert torch.equal(model[0].weight, frozen)


def test_batch_memory_manager_split_equals_one_batch() -> None:
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    def one(physical: int | None) -> torch.Tensor:
        torch.manual_seed(0)
        model = small_cnn()
        engine = SparseDPEngine()
        module, dp_opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(data(n=32), batch_size=32),
            noise_multiplier=0.8,
            max_grad_norm=0.5,
            poisson_sampling=False,
            noise_generator=torch.Generator().manual_seed(5),
        )
        engine.set_mask(sample_mask(engine.layout.numel, keep=150, seed=5))
        batches = (
            loader
            if physical is None
            else BatchMemoryManager(
                data_loader=loader, max_physical_batch_size=physical, optimizer=dp_opt
            ).__enter__()
        )
        for xb, yb in batches:
            dp_opt.zero_grad()
            nn.functional.cross_entropy(module(xb), yb).backward()
            dp_opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    torch.testing.assert_close(one(8), one(None), rtol=1e-5, atol=1e-6)


def test_empty_poisson_batch_with_mask() -> None:
    _, engine, delta = run_steps(
        SparseDPEngine,
        batch_size=1,
        steps=60,
        mask_fn=lambda e: sample_mask(e.layout.numel, keep=30, seed=0),
    )
    assert torch.count_nonzero(delta[~engine.mask]) == 0
    assert torch.isfinite(delta).all()


def test_set_mask_validation() -> None:
    _, engine, _ = run_steps(SparseDPEngine, steps=1)
    d = engine.layout.numel
    with pytest.raises(ValueError, match=rf"mask has shape \({d + 1},\)"):
        engine.set_mask(torch.ones(d + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="float32"):
        engine.set_mask(torch.ones(d))
    with pytest.raises(RuntimeError, match="make_private"):
        SparseDPEngine().set_mask(None)


def test_unsupported_modes_and_bad_config_raise() -> None:
    model = small_cnn()
    kwargs = dict(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data(), batch_size=16),
        max_grad_norm=1.0,
    )
    with pytest.raises(NotImplementedError, match="ghost"):
        SparseDPEngine().make_private(noise_multiplier=1.0, grad_sample_mode="ghost", **kwargs)
    with pytest.raises(ValueError, match="noise_multiplier=nan"):
        SparseDPEngine().make_private(noise_multiplier=float("nan"), **kwargs)
    with pytest.raises(ValueError, match="max_grad_norm=inf"):
        SparseDPEngine().make_private(noise_multiplier=1.0, **{**kwargs, "max_grad_norm": math.inf})
    with pytest.raises(ValueError, match="mechanism='topk'"):
        SparseDPEngine(mechanism="topk")


def test_make_private_with_epsilon_hits_target() -> None:
    torch.manual_seed(0)
    model = small_cnn()
    engine = SparseDPEngine()
    module, dp_opt, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data(n=48), batch_size=12),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=1.0,
    )
    engine.set_mask(sample_mask(engine.layout.numel, keep=500, seed=0))
    for _ in range(2):
        for xb, yb in loader:
            dp_opt.zero_grad()
            nn.functional.cross_entropy(module(xb), yb).backward()
            dp_opt.step()
    eps = engine.get_epsilon(1e-5)
    assert 2.8 < eps <= 3.0 + 1e-6
    with pytest.raises(ValueError, match="not private"):
        SparseDPEngine(mechanism="noisy").make_private_with_epsilon(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_size=12),
            target_epsilon=3.0,
            target_delta=1e-5,
            epochs=2,
            max_grad_norm=1.0,
        )
