"""Every method, engine and mechanism on a CUDA device (skipped where torch finds none).

CI has no GPU; ``scripts/device-check.sh`` runs this file (and the engine benchmark) on a
lent one. What runs here: the whole centralized loop of each method of the five papers on each
engine, on the device; the same run without noise on the CPU and on CUDA (the Poisson batches
are drawn on the CPU in both, so only float rounding separates them); noise drawn on the device
from the run's seed, and in secure mode from OS entropy.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.dp.optimizer import MECHANISMS
from fedsparse.common.layout import ParamLayout
from fedsparse.common.methods import METHODS, MethodConfig
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.training.centralized import train_centralized
from fedsparse.common.training.configs import PrivacyConfig, SparsityConfig, TrainConfig
from tests.common.dp.engine_helpers import exact_cudnn, flat, one_epoch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ENGINES = ("opacus", "func", "factored")


def digits_split(n_train: int = 768, n_test: int = 512):
    train, test = load_dataset("digits")
    return (train.x[:n_train], train.y[:n_train]), (test.x[:n_test], test.y[:n_test])


def run(method: str, engine: str, *, device: str, privacy: PrivacyConfig, epochs: int = 2):
    model = build_model("digits-cnn", seed=3)
    train_xy, test_xy = digits_split()
    masks: list[torch.Tensor | None] = []
    history = train_centralized(
        model,
        train_xy,
        test_xy,
        privacy=privacy,
        sparsity=SparsityConfig(schedule="gradual", final_rate=0.8, mask_seed=4),
        train=TrainConfig(
            epochs=epochs, batch_size=64, lr=0.5, seed=2, engine=engine, device=device
        ),
        method=MethodConfig(name=method, public_fraction=0.2, public_epochs=1),
        on_mask=lambda _epoch, mask: masks.append(mask),
    )
    return model, history, masks


def method_privacy(method: str) -> PrivacyConfig:
    if method == "gip":  # GIP splits a target epsilon between the values and the indices
        return PrivacyConfig(target_epsilon=8.0)
    return PrivacyConfig(noise_multiplier=1.0)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_on_cuda(method: str, engine: str) -> None:
    model, history, _ = run(method, engine, device="cuda", privacy=method_privacy(method))
    assert all(p.device.type == "cuda" for p in model.parameters())
    layout = ParamLayout.from_module(model)
    assert bool(torch.isfinite(layout.flatten_module(model)).all())
    assert len(history) == 2
    assert all(math.isfinite(h.train_loss) and h.examples > 0 for h in history)
    assert 0 < history[0].epsilon <= history[1].epsilon < math.inf
    # 10 classes, 768 examples, 2 noisy epochs: learning, not chance (0.1).
    assert history[-1].test_accuracy >= 0.3


@pytest.mark.parametrize("engine", ENGINES)
def test_off_mask_weights_do_not_move_on_cuda(engine: str) -> None:
    before = flat(build_model("digits-cnn", seed=3))
    after, *_, dp = one_epoch(
        engine, privacy=PrivacyConfig(noise_multiplier=1.0), rate=0.6, device="cuda"
    )
    mask = dp.mask.cpu()
    after = after.cpu()
    assert torch.equal(after[~mask].view(torch.int32), before[~mask].view(torch.int32))
    assert bool((after[mask] != before[mask]).all())  # noise moves every kept coordinate


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("engine", ENGINES)
def test_without_noise_cuda_matches_the_cpu(engine: str, mechanism: str) -> None:
    # mechanism "noisy" clips nothing and adds noise: sigma 0 leaves plain SGD on the mask.
    privacy = PrivacyConfig(mechanism=mechanism, noise_multiplier=0.0)
    cpu, cpu_history, _ = run("rs", engine, device="cpu", privacy=privacy)
    with exact_cudnn():  # TF32 convolutions differ from float32 ones by ~1e-3 after 2 epochs
        gpu, gpu_history, _ = run("rs", engine, device="cuda", privacy=privacy)
    layout = ParamLayout.from_module(cpu)
    # 24 steps at lr 0.5 amplify the kernels' rounding: on an H200 (torch 2.11) func matched
    # to 1e-4 everywhere; opacus and factored with clipping differed by 1.35e-4 on 2 of the
    # 38,282 weights, every other within 1e-4.
    gpu_weights, cpu_weights = layout.flatten_module(gpu).cpu(), layout.flatten_module(cpu)
    torch.testing.assert_close(gpu_weights, cpu_weights, rtol=0, atol=1e-3)
    assert int(((gpu_weights - cpu_weights).abs() > 1e-4).sum()) <= 10
    assert [h.examples for h in gpu_history] == [h.examples for h in cpu_history]


@pytest.mark.parametrize("engine", ENGINES)
def test_noise_is_drawn_on_cuda_from_the_seed_and_in_secure_mode_from_os_entropy(
    engine: str,
) -> None:
    privacy = PrivacyConfig(noise_multiplier=1.0)
    first = one_epoch(engine, privacy=privacy, rate=0.5, device="cuda")
    again = one_epoch(engine, privacy=privacy, rate=0.5, device="cuda")
    assert first[0].device.type == "cuda"
    assert first[4].optimizer.generator.device.type == "cuda"
    # The same seed, the same noise: only cuDNN's non-deterministic sums differ (~1e-6), far
    # below one step's noise (lr * sigma * C / B = 0.5 / 32 per coordinate).
    torch.testing.assert_close(first[0], again[0], rtol=0, atol=1e-4)
    secure = PrivacyConfig(noise_multiplier=1.0, secure_mode=True)
    one = one_epoch(engine, privacy=secure, rate=0.5, device="cuda")
    two = one_epoch(engine, privacy=secure, rate=0.5, device="cuda")
    assert one[4].optimizer.generator.device.type == "cuda"
    mask = one[4].mask.to(one[0].device)
    assert torch.equal(one[0][~mask], two[0][~mask])  # off the mask: the initial weights
    # Other noise: the kept coordinates differ by about the noise, not by rounding.
    assert float((one[0][mask] - two[0][mask]).abs().median()) > 1e-2
