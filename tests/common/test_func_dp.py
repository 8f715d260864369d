"""Tests for the torch.func DP engine (fedsparse.common.func_dp) against the Opacus engine.

Equivalence tolerance. Both engines draw the same batches (Opacus's Poisson sampler, same
generator), the same masks and the same noise (the same ``SparseDPOptimizer`` and generator);
only the per-sample gradients are computed differently (hooks: the batch-mean loss's
backpropagations times B, ``unfold`` + ``einsum``; func: each example's own loss through
ATen's convolution backward), so they agree to float32 rounding: measured ~3e-7 relative per
gradient, and the weights after one epoch (16 steps, lr 0.5, digits CNN, |w| <= 0.5) within
1e-7. ``ATOL`` = 2e-6 is 20x that, and 4 orders of magnitude below what any change of the
mechanism moves (one other noise draw moves every kept weight by ~lr * sigma * C / B = 0.016).
"""

import functools
import math
import warnings

import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.config import FederatedConfig
from fedsparse.common.data import load_dataset
from fedsparse.common.dp import SparseDPEngine
from fedsparse.common.engines import AUTO_FUNC_DEVICES, ENGINES, select_engine
from fedsparse.common.func_dp import FuncDPEngine, FuncGradSampleModule, func_support_error
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import sample_mask
from fedsparse.common.models import MODEL_INPUT_SHAPES, MODEL_NAMES, build_model
from fedsparse.common.training import (
    DEVICES,
    PrivacyConfig,
    TrainConfig,
    make_private,
    resolve_device,
    round_mask,
    train_one_epoch,
)

warnings.filterwarnings("ignore", message="Secure RNG turned off")

ATOL = 2e-6
CPU = torch.device("cpu")


def flat(module: nn.Module) -> torch.Tensor:
    return ParamLayout.from_module(module).flatten_module(module).clone()


@functools.cache
def digits(n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    train, _ = load_dataset("digits")
    return train.x[:n], train.y[:n]


def one_epoch(engine: str, *, privacy: PrivacyConfig, rate: float, seed: int = 5, **train):
    """One epoch of ``training`` on 512 digits: (weights, loss, examples, history, engine)."""
    model = build_model("digits-cnn", seed=3)
    config = TrainConfig(**{"batch_size": 32, "lr": 0.5, "seed": seed, "engine": engine, **train})
    dp, module, optimizer, loader = make_private(
        model, *digits(), privacy=privacy, train=config, epochs_for_target=1
    )
    dp.set_mask(round_mask(dp.layout.numel, rate=rate, mask_seed=1, step=0))
    loss, examples = train_one_epoch(
        module, optimizer, loader, max_physical_batch_size=config.max_physical_batch_size
    )
    return flat(model), loss, examples, list(dp.accountant.history), dp


# --- equivalence with the Opacus engine -------------------------------------------------------


@pytest.mark.parametrize(
    ("mechanism", "sigma", "rate"),
    [("dpsgd", 1.0, 0.0), ("dpsgd", 1.0, 0.9), ("clipped", 0.0, 0.5), ("noisy", 1.0, 0.5)],
    ids=["dpsgd-r0", "dpsgd-r0.9", "clipped-r0.5", "noisy-r0.5"],
)
def test_func_equals_opacus_after_an_epoch(mechanism: str, sigma: float, rate: float) -> None:
    privacy = PrivacyConfig(mechanism=mechanism, noise_multiplier=sigma)  # type: ignore[arg-type]
    before = flat(build_model("digits-cnn", seed=3))
    opacus = one_epoch("opacus", privacy=privacy, rate=rate)
    func = one_epoch("func", privacy=privacy, rate=rate)
    assert isinstance(func[4], FuncDPEngine) and not isinstance(opacus[4], FuncDPEngine)
    torch.testing.assert_close(func[0], opacus[0], rtol=0, atol=ATOL)
    assert float((opacus[0] - before).abs().max()) > 1e3 * ATOL  # the epoch did move them
    assert func[1] == pytest.approx(opacus[1], rel=1e-6)  # mean loss, summed in another order
    assert func[2:4] == opacus[2:4]  # the same examples, the same accountant steps
    assert func[4].get_epsilon(1e-5) == opacus[4].get_epsilon(1e-5)
    # Deterministic: the same seeds give the same weights, bit for bit; others do not.
    again = one_epoch("func", privacy=privacy, rate=rate)
    assert torch.equal(again[0].view(torch.int32), func[0].view(torch.int32))
    other = one_epoch("func", privacy=privacy, rate=rate, seed=6)
    assert float((other[0] - func[0]).abs().max()) > 1e3 * ATOL


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_per_sample_gradients_equal_opacus_hooks_for_every_model(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, *MODEL_INPUT_SHAPES[name], generator=g)
    y = torch.randint(0, 10, (4,), generator=g)
    grads = {}
    for engine_cls in (SparseDPEngine, FuncDPEngine):
        model = build_model(name)
        module, optimizer, _ = engine_cls().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )
        backward(module, x, y, nn.CrossEntropyLoss())
        grads[engine_cls] = [p.grad_sample for p in model.parameters()]
    for hooks, func in zip(grads[SparseDPEngine], grads[FuncDPEngine], strict=True):
        assert func.shape == hooks.shape == (4, *hooks.shape[1:])
        torch.testing.assert_close(func, hooks, rtol=1e-5, atol=1e-6 * float(hooks.abs().max()))


def test_physical_batches_give_the_same_epoch() -> None:
    """Opacus's BatchMemoryManager splits the func engine's batches as it splits its own."""
    privacy = PrivacyConfig(noise_multiplier=1.0)
    whole = one_epoch("func", privacy=privacy, rate=0.5)
    split = one_epoch("func", privacy=privacy, rate=0.5, max_physical_batch_size=7)
    torch.testing.assert_close(split[0], whole[0], rtol=0, atol=ATOL)
    assert split[2:4] == whole[2:4]


# --- the mechanism, on the func engine --------------------------------------------------------


def backward(module: nn.Module, x: torch.Tensor, y: torch.Tensor, criterion) -> None:
    if isinstance(module, FuncGradSampleModule):
        module.backward_per_sample(x, y, criterion=criterion)
    else:
        criterion(module(x), y).backward()


def test_off_mask_weights_do_not_move_at_all() -> None:
    numel = ParamLayout.from_module(build_model("digits-cnn")).numel
    mask = round_mask(numel, rate=0.6, mask_seed=1, step=0)
    assert mask is not None
    before = flat(build_model("digits-cnn", seed=3))
    after, *_ = one_epoch("func", privacy=PrivacyConfig(noise_multiplier=1.0), rate=0.6)
    assert torch.equal(after[~mask].view(torch.int32), before[~mask].view(torch.int32))
    assert bool((after[mask] != before[mask]).all())  # noise moves every kept coordinate


def test_secure_mode_draws_from_os_entropy_on_the_func_engine() -> None:
    privacy = PrivacyConfig(noise_multiplier=1.0, secure_mode=True)
    first = one_epoch("func", privacy=privacy, rate=0.5)
    second = one_epoch("func", privacy=privacy, rate=0.5)  # the same seed=5: ignored
    engine = first[4]
    assert engine.secure_mode and engine.optimizer.generator is engine.secure_rng
    mask = engine.mask
    assert torch.equal(first[0][~mask], second[0][~mask])  # off the mask: the initial weights
    assert bool((first[0][mask] != second[0][mask]).all())  # other batches, other noise


def linear_step(engine_cls, *, x, y, mask, clip: float, sigma: float = 0.0, criterion=None):
    """One step on ``Linear(len(x[0]), 1, bias=False)`` at zero weights; returns its grad."""
    model = nn.Linear(x.shape[1], 1, bias=False)
    nn.init.zeros_(model.weight)
    engine = engine_cls()
    dataset = (
        TensorDataset(x, y) if len(x) else TensorDataset(torch.ones(1, x.shape[1]), torch.ones(1))
    )
    module, optimizer, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(dataset, batch_size=len(dataset)),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(7),
    )
    engine.set_mask(mask)
    optimizer.zero_grad()
    # Per-example loss y_i * <w, x_i>: its gradient is y_i * x_i (batch mean for the hooks).
    criterion = criterion or (lambda out, target: (out.squeeze(1) * target).mean())
    backward(module, x, y, criterion)
    optimizer.step()
    return model.weight.grad.reshape(-1).clone()


@pytest.mark.parametrize("engine_cls", [FuncDPEngine, SparseDPEngine])
def test_clipping_uses_the_masked_norms_by_hand(engine_cls) -> None:
    # g_1 = (3, 4, 12): norm 13, masked (3, 4, 0) norm 5 -> clipped to C = 1: (0.6, 0.8, 0).
    # g_2 = (0.3, 0.4, 5): norm 5.02 (would be clipped), masked norm 0.5 <= C: kept as is.
    # Sum (0.9, 1.2, 0), divided by the batch size 2.
    x = torch.tensor([[3.0, 4.0, 12.0], [0.3, 0.4, 5.0]])
    mask = torch.tensor([True, True, False])
    grad = linear_step(engine_cls, x=x, y=torch.ones(2), mask=mask, clip=1.0)
    # C / (norm + 1e-6) is Opacus's clip factor: 1e-6 relative off the exact 0.6, 0.8.
    torch.testing.assert_close(grad, torch.tensor([0.45, 0.6, 0.0]), rtol=1e-6, atol=0)
    assert grad[2] == 0.0


def noise_only_grad(engine_cls, *, d: int, keep: int, sigma: float, clip: float, batch: int):
    """The update with zero per-sample gradients: pure noise ``m * N(0, (sigma C)^2) / B``."""
    mask = sample_mask(d, keep=keep, seed=3)
    x = torch.randn(batch, d, generator=torch.Generator().manual_seed(1))
    zero_loss = lambda out, target: 0.0 * out.sum()  # noqa: E731
    grad = linear_step(
        engine_cls, x=x, y=torch.ones(batch), mask=mask, clip=clip, sigma=sigma, criterion=zero_loss
    )
    return grad, mask


def test_noise_lies_on_the_mask_with_the_analytic_std() -> None:
    sigma, clip, batch, d, keep = 1.3, 0.7, 10, 20_000, 8_000
    std = sigma * clip / batch
    grad, mask = noise_only_grad(FuncDPEngine, d=d, keep=keep, sigma=sigma, clip=clip, batch=batch)
    assert torch.count_nonzero(grad[~mask]) == 0
    kept = grad[mask].double()
    assert torch.count_nonzero(kept) == keep
    # Moments within 5 standard errors: mean std/sqrt(k), sample std ~std/sqrt(2k).
    assert abs(float(kept.mean())) < 5 * std / math.sqrt(keep)
    assert abs(float(kept.std()) - std) < 5 * std / math.sqrt(2 * keep)
    assert stats.kstest(kept.numpy(), "norm", args=(0, std)).pvalue > 1e-3
    assert stats.kstest(kept.numpy(), "norm", args=(0, 1.5 * std)).pvalue < 1e-6
    # The very noise the Opacus engine draws from the same generator state.
    hooks, _ = noise_only_grad(SparseDPEngine, d=d, keep=keep, sigma=sigma, clip=clip, batch=batch)
    assert torch.equal(grad, hooks)


def test_an_empty_poisson_batch_is_a_noise_only_step() -> None:
    x, y = torch.zeros(0, 5), torch.zeros(0)  # the data set: 1 example; the batch: none
    mask = torch.tensor([True, False, True, True, False])
    func = linear_step(FuncDPEngine, x=x, y=y, mask=mask, clip=1.0, sigma=1.0)
    hooks = linear_step(SparseDPEngine, x=x, y=y, mask=mask, clip=1.0, sigma=1.0)
    assert torch.equal(func, hooks)
    assert torch.equal(func != 0, mask)


def test_poisson_sampling_forbids_accumulating_two_batches() -> None:
    model = nn.Linear(3, 2)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    module, _, _ = FuncDPEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    module.backward_per_sample(x[:4], y[:4], criterion=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="Poisson sampling forbids gradient accumulation"):
        module.backward_per_sample(x[4:], y[4:], criterion=nn.CrossEntropyLoss())


def test_frozen_parameters_get_no_per_sample_gradient() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    module = FuncGradSampleModule(model)
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    loss = module.backward_per_sample(x, y, criterion=nn.CrossEntropyLoss())
    assert getattr(model[0].weight, "grad_sample", None) is None
    assert [tuple(p.grad_sample.shape) for p in model.parameters() if p.requires_grad] == [
        (5, 4),
        (5, 2, 4),
        (5, 2),
    ]
    # Example 0's own gradient, by plain autograd.
    model.zero_grad()
    nn.functional.cross_entropy(model(x[:1]), y[:1]).backward()
    torch.testing.assert_close(model[2].weight.grad_sample[0], model[2].weight.grad)
    with torch.no_grad():
        assert float(loss) == pytest.approx(float(nn.functional.cross_entropy(model(x), y)))


# --- which engine, which device ---------------------------------------------------------------


def test_unsupported_layers_are_named() -> None:
    batchnorm = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    dropout = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.5)))
    stats_norm = nn.Sequential(nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2, track_running_stats=True))
    assert "layer '1' (BatchNorm2d) mixes the examples" in str(func_support_error(batchnorm))
    assert "layer '1.0' (Dropout) draws randomness" in str(func_support_error(dropout))
    assert "layer '1' (InstanceNorm2d) updates running statistics" in str(
        func_support_error(stats_norm)
    )
    for module in (batchnorm, dropout):
        with pytest.raises(ValueError, match=r"^engine='func': layer '1"):
            select_engine("func", module=module, device=CPU)
        with pytest.raises(ValueError, match=r"^engine='func': layer '1"):
            FuncGradSampleModule(module)
        # auto falls back to Opacus (which trains Dropout and refuses BatchNorm itself).
        assert select_engine("auto", module=module, device=torch.device("cuda")) == "opacus"
    model = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.1), nn.Linear(8, 2))
    x, y = torch.randn(16, 2), torch.randint(0, 2, (16,))
    with pytest.raises(ValueError, match=r"^engine='func': layer '1' \(Dropout\)"):
        make_private(
            model,
            x,
            y,
            privacy=PrivacyConfig(noise_multiplier=1.0),
            train=TrainConfig(engine="func", device="cpu"),
            epochs_for_target=1,
        )


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_runs_on_the_func_engine(name: str) -> None:
    model = build_model(name)
    assert func_support_error(model) is None
    assert select_engine("func", module=model, device=CPU) == "func"
    on_cuda = select_engine("auto", module=model, device=torch.device("cuda"))
    assert on_cuda == ("func" if "cuda" in AUTO_FUNC_DEVICES else "opacus")
    # On the CPU, auto takes the factored engine (test_factored_dp.py), not func.
    assert "cpu" not in AUTO_FUNC_DEVICES
    assert select_engine("auto", module=model, device=CPU) == "factored"
    assert select_engine("opacus", module=model, device=torch.device("cuda")) == "opacus"


def test_engine_and_device_names_are_checked() -> None:
    assert ENGINES == ("auto", "opacus", "func", "factored")
    assert DEVICES == ("auto", "cpu", "cuda")
    unknown = r"^engine='jax': expected one of auto, opacus, func, factored$"
    with pytest.raises(ValueError, match=unknown):
        TrainConfig(engine="jax")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^device='tpu': expected one of auto, cpu, cuda$"):
        TrainConfig(device="tpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=unknown):
        select_engine("jax", module=nn.Linear(1, 1), device=CPU)  # type: ignore[arg-type]
    for key, value in (("engine", "jax"), ("device", "gpu")):
        with pytest.raises(ValueError, match=rf"^{key}='{value}': expected one of "):
            FederatedConfig.from_run_config({key: value})
    assert (FederatedConfig().engine, FederatedConfig().device) == ("auto", "auto")
    assert TrainConfig(engine="func", device="cpu").device == "cpu"


def test_cuda_without_a_gpu_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = r"^device='cuda': expected 'auto' or 'cpu' on this machine: torch finds no CUDA"
    with pytest.raises(ValueError, match=message):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=message):
        TrainConfig(device="cuda")
    assert resolve_device("auto") == CPU
    # The run config itself accepts it: the server parses it too, and needs no GPU.
    assert FederatedConfig.from_run_config({"device": "cuda"}).device == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda") == resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rate", [0.0, 0.9])
def test_func_equals_opacus_on_cuda(rate: float) -> None:
    privacy = PrivacyConfig(noise_multiplier=1.0)
    opacus = one_epoch("opacus", privacy=privacy, rate=rate, device="cuda")
    func = one_epoch("func", privacy=privacy, rate=rate, device="cuda")
    assert func[0].device.type == "cuda"
    # cuDNN's kernels may differ more than the CPU's; still far below one noise draw.
    torch.testing.assert_close(func[0], opacus[0], rtol=0, atol=10 * ATOL)
    assert func[2:4] == opacus[2:4]
