"""Local DP-SGD + RS training: wrapping a model for it, the one-epoch loop, evaluation.

The federated client and the centralized driver (``centralized``) share these pieces; their
settings are ``configs``'s.

Randomness comes from separate, seeded streams (``seeds.Stream``): Poisson sampling (the data
loader's generator) and DP noise (the optimizer's generator) from ``TrainConfig.seed``, masks
from ``SparsityConfig.mask_seed``; in ``secure_mode`` Opacus draws noise and batches from OS
entropy and seeds are refused. On a CUDA device the noise comes from a CUDA generator seeded
from the same stream, so results differ from the CPU's: other generator, other kernels.

A ``target_epsilon`` is met on the exact number of steps that run
(``privacy.calibrate_noise_multiplier`` with ``privacy.steps_per_epoch``), not on the
``int(epochs / q)`` of Opacus's ``make_private_with_epsilon``, which can be one step short (see
``privacy``). Where the two counts agree, σ is Opacus's, bit for bit.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.dp.accounting import (
    calibrate_noise_multiplier,
    sample_rate,
    steps_per_epoch,
)
from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.dp.engines import engine_spec, select_engine
from fedsparse.common.dp.per_sample import PerSampleModule
from fedsparse.common.known_warnings import quiet_known_warnings
from fedsparse.common.seeds import Stream, stream_seed
from fedsparse.common.training.configs import PrivacyConfig, TrainConfig, resolve_device

__all__ = [
    "DUMMY_LABEL",
    "EpochStats",
    "evaluate",
    "make_private",
    "pad_to_nominal",
    "padded_cross_entropy",
    "train_one_epoch",
]


@dataclass(frozen=True, kw_only=True)
class EpochStats:
    """What one epoch (or one federated round's local training) produced."""

    epoch: int
    rate: float
    keep_fraction: float
    train_loss: float
    examples: int
    epsilon: float
    test_loss: float = math.nan
    test_accuracy: float = math.nan
    #: GIP: the index selection's share of ``epsilon`` so far (pure DP,
    #: ``common/methods/index_selection.py``).
    index_epsilon: float = 0.0
    #: the sigma DP-SGD ran with: as given, or as calibrated for a target epsilon (None: not
    #: recorded)
    noise_multiplier: float | None = None


def make_private(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    privacy: PrivacyConfig,
    train: TrainConfig,
    epochs_for_target: int,
    nominal_size: int | None = None,
) -> tuple[SparseDPEngine, nn.Module, torch.optim.Optimizer, DataLoader]:
    """Wraps ``model`` for DP-SGD + RS on the in-memory data ``(x, y)``.

    Moves ``model`` to ``train.device`` (in place) and picks the engine for ``train.engine``
    (``engines.select_engine``); the engine is a ``SparseDPEngine`` either way.

    Args:
        epochs_for_target: epochs that ``target_epsilon`` must cover (ignored with a fixed
            ``noise_multiplier``). σ is calibrated for exactly the steps they take,
            ``epochs_for_target * privacy.steps_per_epoch(len(x), train.batch_size)``, at the
            rate the accountant charges, ``privacy.sample_rate(len(x), train.batch_size)``
            (Opacus's ``make_private_with_epsilon`` used ``int(epochs / q)`` steps at the
            loader's ``q``; where those agree, σ is unchanged).
        nominal_size: a public bound ``N >= len(x)`` (a deployed node's declared
            ``nominal-size``; None: ``len(x)``). The data is padded to ``N`` examples with
            ``DUMMY_LABEL`` rows (zero inputs), so that Poisson sampling runs over ``N`` slots:
            the rate ``q = 1 / ceil(N / b)``, the steps, the calibrated σ, the noise's scale
            ``int(N q)`` and every batch's size are functions of ``N`` and the sampler's draws,
            never of the real count ``n`` (nor is a step's time: the same rows go through the
            model whatever ``n`` is). Train with ``criterion=padded_cross_entropy``: a dummy
            row's loss, and so its per-sample gradient, is exactly 0, so the clipped sum is that
            of the sampled real examples, as if sampled from those alone at rate ``q``: the
            same DP guarantee. ``N = len(x)`` pads nothing and trains exactly as None does.
    """
    device = resolve_device(train.device)
    model.to(device)
    engine_name = select_engine(train.engine, module=model, device=device)
    data_gen, noise_gen = None, None
    if not privacy.secure_mode:  # secure mode: the engine's own OS-entropy generator
        seed = train.seed if train.seed is not None else secrets.randbits(63)
        data_gen = torch.Generator().manual_seed(stream_seed(seed, Stream.POISSON_SAMPLING))
        # Noise is drawn where the gradients are: a CUDA generator on a CUDA device.
        noise_gen = torch.Generator(device).manual_seed(stream_seed(seed, Stream.DP_NOISE))
    noise_multiplier = privacy.noise_multiplier
    if nominal_size is not None:
        x, y = pad_to_nominal(x, y, nominal_size)
    size = len(x)
    if privacy.target_epsilon is not None:
        steps = epochs_for_target * steps_per_epoch(
            size, train.batch_size, poisson_sampling=train.poisson_sampling
        )
        noise_multiplier = calibrate_noise_multiplier(
            target_epsilon=privacy.target_epsilon,
            delta=privacy.delta,
            sample_rate=sample_rate(
                size, train.batch_size, poisson_sampling=train.poisson_sampling
            ),
            steps=steps,
            accountant=privacy.accountant,
        )
    assert noise_multiplier is not None  # PrivacyConfig sets exactly one of the two
    loader = DataLoader(
        TensorDataset(x, y),
        batch_size=max(1, min(train.batch_size, size)),
        generator=data_gen,
        shuffle=not train.poisson_sampling and data_gen is not None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=train.lr, momentum=train.momentum)
    engine = engine_spec(engine_name).make(
        accountant=privacy.accountant, secure_mode=privacy.secure_mode, mechanism=privacy.mechanism
    )
    if not isinstance(engine, SparseDPEngine):  # a user's mistake (its honesty is trusted)
        raise ValueError(
            f"engine={engine_name!r}: built a {type(engine).__name__}, expected a "
            "fedsparse.common.dp.engine.SparseDPEngine (sparsify -> clip -> sum -> noise)"
        )
    with quiet_known_warnings():
        private = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=privacy.max_grad_norm,
            poisson_sampling=train.poisson_sampling,
            noise_generator=noise_gen,
        )
    module, dp_optimizer, dp_loader = private
    if privacy.secure_mode and device.type != "cpu":
        # The engine's OS-entropy generator is a CPU one (it also drives the Poisson sampler,
        # which runs on the CPU); the noise needs one on the device, seeded the same way.
        dp_optimizer.generator = torch.Generator(device).manual_seed(secrets.randbits(63))
    return engine, module, dp_optimizer, dp_loader


#: The label of the rows ``make_private`` pads a data set to its nominal size with.
DUMMY_LABEL = -1


def pad_to_nominal(
    x: torch.Tensor, y: torch.Tensor, nominal_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` followed by ``nominal_size - len(x)`` dummy rows: zero inputs, label
    ``DUMMY_LABEL`` (``make_private``).

    Raises:
        ValueError: ``nominal_size`` below ``len(x)``.
    """
    missing = nominal_size - len(x)
    if missing < 0:
        raise ValueError(f"nominal_size={nominal_size}: below the data set's {len(x)} examples")
    if missing == 0:
        return x, y
    dummy_x = torch.zeros((missing, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dummy_y = torch.full((missing,), DUMMY_LABEL, dtype=y.dtype, device=y.device)
    return torch.cat([x, dummy_x]), torch.cat([y, dummy_y])


def padded_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The cross-entropy averaged over every row of the batch, a ``DUMMY_LABEL`` row's being
    exactly 0 (so is its gradient): the criterion of data padded to its nominal size. The
    same arithmetic runs whatever rows are dummies."""
    losses = nn.functional.cross_entropy(output, target, reduction="none", ignore_index=DUMMY_LABEL)
    return losses.mean()


def train_one_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    *,
    max_physical_batch_size: int = 0,
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[float, int]:
    """One pass over ``loader``; returns (mean training loss, examples seen).

    Batches go to the model's device. ``model`` is what ``make_private`` returned: Opacus's
    ``GradSampleModule`` (per-sample gradients from hooks in ``backward``) or a
    ``PerSampleModule`` (the func and factored engines' modules: ``backward_per_sample``).
    ``criterion``: the batch loss (default cross-entropy; data padded to a nominal size:
    ``padded_cross_entropy``, and the examples seen are the real ones).
    """
    model.train()
    criterion = criterion or nn.CrossEntropyLoss()
    device = _device_of(model)
    total_loss, examples = 0.0, 0

    def run(batches: DataLoader) -> None:
        nonlocal total_loss, examples
        for xb, yb in batches:
            xb, yb = xb.to(device), yb.to(device)
            # An empty Poisson batch still takes a step: Opacus adds noise to a zero sum.
            optimizer.zero_grad(set_to_none=True)
            loss = _backward(model, xb, yb, criterion)
            optimizer.step()
            if len(xb):
                real = int((yb != DUMMY_LABEL).sum())
                total_loss += float(loss) * len(xb)  # the dummies' losses are 0
                examples += real

    if max_physical_batch_size > 0:
        with BatchMemoryManager(
            data_loader=loader,
            max_physical_batch_size=max_physical_batch_size,
            optimizer=optimizer,  # type: ignore[arg-type]
        ) as memory_safe_loader:
            run(memory_safe_loader)
    else:
        run(loader)
    return (total_loss / examples if examples else math.nan), examples


def _backward(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Computes the batch's per-sample gradients for the DP optimizer; returns the mean loss."""
    if isinstance(model, PerSampleModule):  # the module computes its own (func, factored)
        return model.backward_per_sample(x, y, criterion=criterion)
    loss = criterion(model(x), y)
    loss.backward()
    return loss.detach()


def _device_of(model: nn.Module) -> torch.device:
    """The device of ``model``'s parameters (the CPU for a model without any)."""
    first = next(model.parameters(), None)
    return torch.device("cpu") if first is None else first.device


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 1024
) -> tuple[float, float]:
    """Returns (mean cross-entropy loss, accuracy) of ``model`` on ``(x, y)``.

    Batches of ``(x, y)`` go to the model's device.
    """
    model.eval()
    device = _device_of(model)
    loss, correct = 0.0, 0
    for start in range(0, len(x), batch_size):
        logits = model(x[start : start + batch_size].to(device))
        target = y[start : start + batch_size].to(device)
        loss += float(nn.functional.cross_entropy(logits, target, reduction="sum"))
        correct += int((logits.argmax(dim=1) == target).sum())
    n = max(len(x), 1)
    return loss / n, correct / n
