"""Every faster DP engine (func, factored) against the Opacus engine, and the engine choice.

Equivalence tolerance. The engines draw the same batches (Opacus's Poisson sampler, same
generator), the same masks and the same noise (the same ``SparseDPOptimizer.add_noise`` and
generator); only the masked norms and the clipped sum of the per-sample gradients are computed
another way (Opacus: the batch-mean loss's backpropagations times B, ``unfold`` + ``einsum``;
func: each example's own loss through ATen's convolution backward; factored: a linear layer's
from its input and output gradient without forming ``b_i a_i^T``, a convolution's from a
grouped convolution backward), so they agree to float32 rounding: measured ~3e-7 relative per
gradient, and the weights after one epoch (16 steps, lr 0.5, digits CNN, |w| <= 0.5) within
1e-7. ``ATOL`` = 2e-6 is 20x that, and 4 orders of magnitude below what any change of the
mechanism moves (one other noise draw moves every kept weight by ~lr * sigma * C / B = 0.016).
Engine-specific properties are in ``test_func_dp.py`` and ``test_factored_dp.py``.
"""

import math
import warnings

import pytest
import torch
from scipy import stats
from torch import nn

from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.dp.engines import AUTO_ENGINES, ENGINE_SPECS, ENGINES, select_engine
from fedsparse.common.dp.engines.factored import FactoredDPEngine
from fedsparse.common.dp.engines.func import FuncDPEngine
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import sample_mask
from fedsparse.common.methods.selection import round_mask
from fedsparse.common.models.classifiers import MODEL_NAMES, build_model
from fedsparse.common.training.configs import DEVICES, PrivacyConfig, TrainConfig, resolve_device
from tests.common.dp.engine_helpers import exact_cudnn, flat, linear_step, one_epoch, private

warnings.filterwarnings("ignore", message="Secure RNG turned off")

ATOL = 2e-6
CPU = torch.device("cpu")
#: The engines other than Opacus's hooks, by config name.
FASTER = {"func": FuncDPEngine, "factored": FactoredDPEngine}


# --- equivalence with the Opacus engine -------------------------------------------------------


@pytest.mark.parametrize("engine", FASTER)
@pytest.mark.parametrize(
    ("mechanism", "sigma", "rate"),
    [("dpsgd", 1.0, 0.0), ("dpsgd", 1.0, 0.9), ("clipped", 0.0, 0.5), ("noisy", 1.0, 0.5)],
    ids=["dpsgd-r0", "dpsgd-r0.9", "clipped-r0.5", "noisy-r0.5"],
)
def test_an_epoch_equals_opacus(engine: str, mechanism: str, sigma: float, rate: float) -> None:
    privacy = PrivacyConfig(mechanism=mechanism, noise_multiplier=sigma)  # type: ignore[arg-type]
    before = flat(build_model("digits-cnn", seed=3))
    opacus = one_epoch("opacus", privacy=privacy, rate=rate)
    faster = one_epoch(engine, privacy=privacy, rate=rate)
    assert type(faster[4]) is FASTER[engine] and type(opacus[4]) is SparseDPEngine
    torch.testing.assert_close(faster[0], opacus[0], rtol=0, atol=ATOL)
    assert float((opacus[0] - before).abs().max()) > 1e3 * ATOL  # the epoch did move them
    assert faster[1] == pytest.approx(opacus[1], rel=1e-6)  # mean loss, summed in another order
    assert faster[2:4] == opacus[2:4]  # the same examples, the same accountant steps
    assert faster[4].get_epsilon(1e-5) == opacus[4].get_epsilon(1e-5)
    # Deterministic: the same seeds give the same weights, bit for bit; others do not.
    again = one_epoch(engine, privacy=privacy, rate=rate)
    assert torch.equal(again[0].view(torch.int32), faster[0].view(torch.int32))
    other = one_epoch(engine, privacy=privacy, rate=rate, seed=6)
    assert float((other[0] - faster[0]).abs().max()) > 1e3 * ATOL


@pytest.mark.parametrize("engine", FASTER)
def test_physical_batches_give_the_same_epoch(engine: str) -> None:
    """Opacus's BatchMemoryManager splits the engine's batches as it splits its own."""
    privacy = PrivacyConfig(noise_multiplier=1.0)
    whole = one_epoch(engine, privacy=privacy, rate=0.5)
    split = one_epoch(engine, privacy=privacy, rate=0.5, max_physical_batch_size=7)
    torch.testing.assert_close(split[0], whole[0], rtol=0, atol=ATOL)
    assert split[2:4] == whole[2:4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("engine", FASTER)
@pytest.mark.parametrize("rate", [0.0, 0.9])
def test_an_epoch_equals_opacus_on_cuda(engine: str, rate: float) -> None:
    privacy = PrivacyConfig(noise_multiplier=1.0)
    # With cuDNN's TF32 on (PyTorch's default), func's per-sample convolution gradients differ
    # from Opacus's unfolded float32 ones by ~1e-4 after an epoch: the math, not the engine.
    with exact_cudnn():
        opacus = one_epoch("opacus", privacy=privacy, rate=rate, device="cuda")
        faster = one_epoch(engine, privacy=privacy, rate=rate, device="cuda")
    assert faster[0].device.type == "cuda"
    torch.testing.assert_close(faster[0], opacus[0], rtol=0, atol=10 * ATOL)
    assert faster[2:4] == opacus[2:4]


# --- the mechanism, on every engine -----------------------------------------------------------


@pytest.mark.parametrize("engine", FASTER)
def test_off_mask_weights_do_not_move_at_all(engine: str) -> None:
    numel = ParamLayout.from_module(build_model("digits-cnn")).numel
    mask = round_mask(numel, rate=0.6, mask_seed=1, step=0)
    assert mask is not None
    before = flat(build_model("digits-cnn", seed=3))
    after, *_ = one_epoch(engine, privacy=PrivacyConfig(noise_multiplier=1.0), rate=0.6)
    assert torch.equal(after[~mask].view(torch.int32), before[~mask].view(torch.int32))
    assert bool((after[mask] != before[mask]).all())  # noise moves every kept coordinate


@pytest.mark.parametrize("engine", FASTER)
def test_secure_mode_draws_from_os_entropy(engine: str) -> None:
    privacy = PrivacyConfig(noise_multiplier=1.0, secure_mode=True)
    first = one_epoch(engine, privacy=privacy, rate=0.5)
    second = one_epoch(engine, privacy=privacy, rate=0.5)  # the same seed=5: ignored
    dp = first[4]
    assert dp.secure_mode and dp.optimizer.generator is dp.secure_rng
    mask = dp.mask
    assert torch.equal(first[0][~mask], second[0][~mask])  # off the mask: the initial weights
    assert bool((first[0][mask] != second[0][mask]).all())  # other batches, other noise


@pytest.mark.parametrize("engine_cls", [SparseDPEngine, *FASTER.values()])
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
    # Without the mask the norms are 13 and 5.02: both clipped to C.
    whole = linear_step(engine_cls, x=x, y=torch.ones(2), mask=None, clip=1.0)
    expected = (x[0] / 13 + x[1] / float(x[1].norm())) / 2
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=0)


def noise_only_grad(engine_cls, *, d: int, keep: int, sigma: float, clip: float, batch: int):
    """The update with zero per-sample gradients: pure noise ``m * N(0, (sigma C)^2) / B``."""
    mask = sample_mask(d, keep=keep, seed=3)
    x = torch.randn(batch, d, generator=torch.Generator().manual_seed(1))
    zero_loss = lambda out, target: 0.0 * out.sum()  # noqa: E731
    grad = linear_step(
        engine_cls, x=x, y=torch.ones(batch), mask=mask, clip=clip, sigma=sigma, criterion=zero_loss
    )
    return grad, mask


@pytest.mark.parametrize("engine", FASTER)
def test_noise_lies_on_the_mask_with_the_analytic_std(engine: str) -> None:
    sigma, clip, batch, d, keep = 1.3, 0.7, 10, 20_000, 8_000
    std = sigma * clip / batch
    kwargs = dict(d=d, keep=keep, sigma=sigma, clip=clip, batch=batch)
    grad, mask = noise_only_grad(FASTER[engine], **kwargs)
    assert torch.count_nonzero(grad[~mask]) == 0
    kept = grad[mask].double()
    assert torch.count_nonzero(kept) == keep
    # Moments within 5 standard errors: mean std/sqrt(k), sample std ~std/sqrt(2k).
    assert abs(float(kept.mean())) < 5 * std / math.sqrt(keep)
    assert abs(float(kept.std()) - std) < 5 * std / math.sqrt(2 * keep)
    assert stats.kstest(kept.numpy(), stats.norm(0, std).cdf).pvalue > 1e-3
    assert stats.kstest(kept.numpy(), stats.norm(0, 1.5 * std).cdf).pvalue < 1e-6
    # The very noise the Opacus engine draws from the same generator state.
    hooks, _ = noise_only_grad(SparseDPEngine, **kwargs)
    assert torch.equal(grad, hooks)


@pytest.mark.parametrize("engine", FASTER)
def test_an_empty_poisson_batch_is_a_noise_only_step(engine: str) -> None:
    x, y = torch.zeros(0, 5), torch.zeros(0)  # the data set: 1 example; the batch: none
    mask = torch.tensor([True, False, True, True, False])
    faster = linear_step(FASTER[engine], x=x, y=y, mask=mask, clip=1.0, sigma=1.0)
    hooks = linear_step(SparseDPEngine, x=x, y=y, mask=mask, clip=1.0, sigma=1.0)
    assert torch.equal(faster, hooks)
    assert torch.equal(faster != 0, mask)


@pytest.mark.parametrize("engine", FASTER)
def test_poisson_sampling_forbids_accumulating_two_batches(engine: str) -> None:
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    _, module, _ = private(
        FASTER[engine], nn.Linear(3, 2), x[:4], y[:4], noise_multiplier=1.0, poisson_sampling=True
    )
    module.backward_per_sample(x[:4], y[:4], criterion=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="Poisson sampling forbids gradient accumulation"):
        module.backward_per_sample(x[4:], y[4:], criterion=nn.CrossEntropyLoss())


# --- which engine, which device ---------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_runs_on_every_engine(name: str) -> None:
    model = build_model(name)
    for engine in ("opacus", *FASTER):
        assert select_engine(engine, module=model, device=CPU) == engine  # type: ignore[arg-type]
    # auto: factored on the CPU, func on CUDA, Opacus where neither can train the model.
    assert AUTO_ENGINES == {"cuda": ("func", "opacus"), None: ("factored", "opacus")}
    assert set(ENGINE_SPECS) == {"opacus", *FASTER}
    assert select_engine("auto", module=model, device=CPU) == "factored"
    assert select_engine("auto", module=model, device=torch.device("cuda")) == "func"
    assert select_engine("opacus", module=model, device=torch.device("cuda")) == "opacus"


def test_engine_and_device_names_are_checked() -> None:
    assert ENGINES == ("auto", "opacus", "func", "factored")
    assert DEVICES == ("auto", "cpu", "cuda")
    unknown = (
        r"^engine='jax': expected one of auto, opacus, func, factored, or "
        r"package\.module:attribute \(an EngineSpec\)$"
    )
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
    assert TrainConfig(engine="factored", device="cpu").engine == "factored"


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
