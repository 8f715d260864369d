"""Opacus's loop on the func and factored engines: ``criterion(module(x), y).backward()``.

``make_private(..., criterion=..., grad_sample_mode="ghost")`` returns the criterion
(``dp.PerSampleCriterion``) whose loss does the per-sample work in ``backward()``, as Opacus's
fast gradient clipping does; the steps must be the ones ``backward_per_sample`` takes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.dp.engines.factored import FactoredDPEngine
from fedsparse.common.dp.engines.func import FuncDPEngine
from fedsparse.common.dp.per_sample import PerSampleCriterion, PerSampleLoss
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import keep_count, sample_mask
from fedsparse.common.models.classifiers import build_model
from tests.common.dp.engine_helpers import digits, flat

ENGINES = {"func": FuncDPEngine, "factored": FactoredDPEngine}


def make(engine_cls, *, ghost: bool, reduction: str = "mean", rate: float = 0.0, **kwargs):
    model = build_model("digits-cnn", seed=3)
    x, y = digits(96)
    engine = engine_cls()
    result = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=32),
        criterion=nn.CrossEntropyLoss(reduction=reduction),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(11),
        loss_reduction=reduction,
        grad_sample_mode="ghost" if ghost else "hooks",
        **kwargs,
    )
    if rate:
        numel = ParamLayout.from_module(model).numel
        engine.set_mask(sample_mask(numel, keep=keep_count(numel, rate=rate), seed=2))
    return model, engine, result


def train(engine_cls, *, ghost: bool, reduction: str = "mean", rate: float = 0.0):
    """Three steps; returns (weights, reported losses)."""
    model, _, result = make(engine_cls, ghost=ghost, reduction=reduction, rate=rate)
    losses = []
    if ghost:
        module, optimizer, criterion, loader = result
        for x, y in loader:  # Opacus's own loop, unchanged
            optimizer.zero_grad()
            loss = criterion(module(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    else:
        module, optimizer, loader = result
        plain = nn.CrossEntropyLoss(reduction=reduction)
        for x, y in loader:
            optimizer.zero_grad()
            losses.append(float(module.backward_per_sample(x, y, criterion=plain)))
            optimizer.step()
    return flat(model), losses


@pytest.mark.parametrize("rate", [0.0, 0.6])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("engine", ENGINES)
def test_opacus_loop_takes_the_same_steps_as_backward_per_sample(
    engine: str, reduction: str, rate: float
) -> None:
    ours, our_losses = train(ENGINES[engine], ghost=False, reduction=reduction, rate=rate)
    theirs, their_losses = train(ENGINES[engine], ghost=True, reduction=reduction, rate=rate)
    assert torch.equal(theirs.view(torch.int32), ours.view(torch.int32))
    assert not torch.equal(ours, flat(build_model("digits-cnn", seed=3)))
    # The reported loss: the batch loss as the criterion reduces it (func's backward_per_sample
    # reports the per-example mean, so compare the sum through the batch size).
    scale = 32 if engine == "func" and reduction == "sum" else 1
    assert their_losses == pytest.approx([scale * loss for loss in our_losses], rel=1e-5)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_criterion_and_loss_types(engine: str) -> None:
    _, _, result = make(ENGINES[engine], ghost=True)
    assert len(result) == 4 and isinstance(result[2], PerSampleCriterion)
    module, _, criterion, loader = result
    x, y = next(iter(loader))
    loss = criterion(module(x), y)
    assert isinstance(loss, PerSampleLoss)
    with torch.no_grad():
        expected = float(nn.CrossEntropyLoss()(module._module(x), y))
    assert loss.item() == pytest.approx(expected)
    _, _, hooks = make(ENGINES[engine], ghost=False)
    assert len(hooks) == 3  # without "ghost": Opacus's usual (module, optimizer, loader)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_loss_of_another_output_or_a_second_backward_is_refused(engine: str) -> None:
    _, _, (module, optimizer, criterion, loader) = make(ENGINES[engine], ghost=True)
    x, y = next(iter(loader))
    first = criterion(module(x), y)
    second = criterion(module(x), y)  # a newer forward pass: the first loss is stale
    with pytest.raises(ValueError, match="last training forward pass"):
        first.backward()
    second.backward()
    with pytest.raises(ValueError, match="last training forward pass"):
        second.backward()  # once
    optimizer.step()


@pytest.mark.parametrize("engine", ENGINES)
def test_evaluation_forward_passes_are_not_recorded(engine: str) -> None:
    _, _, (module, _, criterion, loader) = make(ENGINES[engine], ghost=True)
    x, y = next(iter(loader))
    module.eval()
    loss = criterion(module(x), y)
    with pytest.raises(ValueError, match="last training forward pass"):
        loss.backward()
    module.train()
    with torch.no_grad():
        loss = criterion(module(x), y)
    with pytest.raises(ValueError, match="last training forward pass"):
        loss.backward()


@pytest.mark.parametrize("engine", ENGINES)
def test_poisson_sampling_still_forbids_two_batches_before_a_step(engine: str) -> None:
    model = build_model("digits-cnn", seed=3)
    x, y = digits(64)
    module, _, criterion, _ = ENGINES[engine]().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=32),
        criterion=nn.CrossEntropyLoss(),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode="ghost",
    )
    criterion(module(x[:8]), y[:8]).backward()
    with pytest.raises(ValueError, match="two batches before one step"):
        criterion(module(x[8:16]), y[8:16]).backward()


def test_a_criterion_that_disagrees_with_loss_reduction_is_refused() -> None:
    with pytest.raises(ValueError, match="criterion.reduction='sum'"):
        model = build_model("digits-cnn", seed=3)
        x, y = digits(32)
        FactoredDPEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=32),
            criterion=nn.CrossEntropyLoss(reduction="sum"),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode="ghost",
        )


def test_the_opacus_hooks_engine_refuses_ghost_mode() -> None:
    # Opacus's ghost clipping computes norms of the whole gradient, not of the masked one.
    with pytest.raises(NotImplementedError, match="ghost"):
        make(SparseDPEngine, ghost=True)
