"""What the DP engines' tests share (``test_func_dp.py``, ``test_factored_dp.py``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import keep_count, sample_mask
from fedsparse.common.methods.selection import round_mask
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.training.configs import PrivacyConfig, TrainConfig
from fedsparse.common.training.local import make_private, train_one_epoch


def flat(module: nn.Module) -> torch.Tensor:
    return ParamLayout.from_module(module).flatten_module(module).clone()


@contextlib.contextmanager
def exact_cudnn() -> Iterator[None]:
    """cuDNN without TF32 (PyTorch's default on Ampere and later keeps it on for convolutions)
    and with deterministic kernels: CUDA runs comparable to the CPU's float32 to ~1e-6."""
    tf32, deterministic = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = False, True
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = tf32, deterministic


@functools.cache
def digits(n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    train, _ = load_dataset("digits")
    return train.x[:n], train.y[:n]


def one_epoch(engine: str, *, privacy: PrivacyConfig, rate: float, seed: int = 5, **train):
    """One epoch of ``training`` on 512 digits: (weights, loss, examples, history, engine).

    On the CPU unless ``device=`` says otherwise: ``"auto"`` would pick CUDA on a GPU machine,
    where the tests that compare against CPU tensors or Opacus's float32 sums do not apply."""
    model = build_model("digits-cnn", seed=3)
    defaults = {"batch_size": 32, "lr": 0.5, "seed": seed, "engine": engine, "device": "cpu"}
    config = TrainConfig(**{**defaults, **train})
    dp, module, optimizer, loader = make_private(
        model, *digits(), privacy=privacy, train=config, epochs_for_target=1
    )
    dp.set_mask(round_mask(dp.layout.numel, rate=rate, mask_seed=1, step=0))
    loss, examples = train_one_epoch(
        module, optimizer, loader, max_physical_batch_size=config.max_physical_batch_size
    )
    return flat(model), loss, examples, list(dp.accountant.history), dp


def backward(module: nn.Module, x: torch.Tensor, y: torch.Tensor, criterion) -> None:
    """The engine's backward pass: ``backward_per_sample`` (func, factored) or autograd's."""
    per_sample = getattr(module, "backward_per_sample", None)
    if per_sample is not None:
        per_sample(x, y, criterion=criterion)
    else:
        criterion(module(x), y).backward()


def private(engine_cls, model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kwargs: Any):
    """``engine_cls().make_private`` on ``model`` with one fixed batch of ``(x, y)``; no noise,
    C = 0.5 and no Poisson sampling unless ``kwargs`` say otherwise. (engine, module, opt)."""
    engine = engine_cls()
    options = {"noise_multiplier": 0.0, "max_grad_norm": 0.5, "poisson_sampling": False}
    module, optimizer, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=max(len(x), 1)),
        **{**options, **kwargs},
    )
    return engine, module, optimizer


def set_rate(engine, rate: float, *, seed: int = 3) -> None:
    """The mask keeping ``1 - rate`` of the engine's coordinates (None at rate 0)."""
    numel = engine.layout.numel
    mask = sample_mask(numel, keep=keep_count(numel, rate=rate), seed=seed) if rate else None
    engine.set_mask(mask)


def linear_step(engine_cls, *, x, y, mask, clip: float, sigma: float = 0.0, criterion=None):
    """One step on ``Linear(len(x[0]), 1, bias=False)`` at zero weights; returns its grad."""
    model = nn.Linear(x.shape[1], 1, bias=False)
    nn.init.zeros_(model.weight)
    data = (x, y) if len(x) else (torch.ones(1, x.shape[1]), torch.ones(1))
    engine, module, optimizer = private(
        engine_cls,
        model,
        *data,
        noise_multiplier=sigma,
        max_grad_norm=clip,
        noise_generator=torch.Generator().manual_seed(7),
    )
    engine.set_mask(mask)
    optimizer.zero_grad()
    # Per-example loss y_i * <w, x_i>: its gradient is y_i * x_i (batch mean for the hooks).
    criterion = criterion or (lambda out, target: (out.squeeze(1) * target).mean())
    backward(module, x, y, criterion)
    optimizer.step()
    return model.weight.grad.reshape(-1).clone()
