"""Centralized DP-SGD + RS: a whole training run on one data set, one public mask per epoch.

``train_centralized`` drives ``local``'s pieces (``make_private``, ``train_one_epoch``,
``evaluate``) epoch by epoch, with the mask, step selector and layer freezing of the chosen
method (``common/methods/``) and the rate schedule of ``SparsityConfig``; ``pretrain_public`` is
DP-SSGD's non-private pretraining on public examples, which the server runs too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from fedsparse.common.dp.accounting import steps_per_epoch
from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.methods import EpochContext, MethodConfig, public_split
from fedsparse.common.seeds import Stream, stream_seed
from fedsparse.common.training.configs import PrivacyConfig, SparsityConfig, TrainConfig
from fedsparse.common.training.local import (
    EpochStats,
    _device_of,
    evaluate,
    make_private,
    train_one_epoch,
)

__all__ = [
    "pretrain_public",
    "train_centralized",
]


def pretrain_public(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> None:
    """Non-private SGD on public examples (DP-SSGD's pretraining), in place, deterministic.

    Shuffled batches from a generator seeded with ``stream_seed(seed, PUBLIC_PRETRAIN)``, the
    same threads and order everywhere: the server and a test get the same weights. No privacy
    is spent: the examples are public.
    """
    if epochs < 0 or batch_size < 1 or not lr > 0:
        raise ValueError(
            f"epochs={epochs}, batch_size={batch_size}, lr={lr}: expected >= 0, >= 1, > 0"
        )
    generator = torch.Generator().manual_seed(stream_seed(seed, Stream.PUBLIC_PRETRAIN))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    criterion = nn.CrossEntropyLoss()
    device = _device_of(model)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), batch_size):
            batch = order[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            criterion(model(x[batch].to(device)), y[batch].to(device)).backward()
            optimizer.step()


def _clear_momentum(
    optimizer: torch.optim.Optimizer, engine: SparseDPEngine, mask: torch.Tensor
) -> None:
    """Zeroes the momentum of the coordinates off ``mask``: frozen layers move by exactly 0.

    (RS keeps the velocity, as its paper does; layer freezing does not update a frozen
    layer at all.)
    """
    views = engine.layout.split(mask, field="mask")
    for name, param in engine.named_trainable_parameters().items():
        buffer = optimizer.state.get(param, {}).get("momentum_buffer")
        if buffer is not None:
            buffer.masked_fill_(~views[name].to(buffer.device), 0.0)


def train_centralized(
    model: nn.Module,
    train_xy: tuple[torch.Tensor, torch.Tensor],
    test_xy: tuple[torch.Tensor, torch.Tensor],
    *,
    privacy: PrivacyConfig,
    sparsity: SparsityConfig,
    train: TrainConfig,
    on_epoch: Callable[[EpochStats], None] | None = None,
    method: MethodConfig | None = None,
    on_mask: Callable[[int, torch.Tensor | None], None] | None = None,
) -> list[EpochStats]:
    """Centralized DP-SGD with one public mask per epoch, chosen by ``method``.

    ``rs`` (default): RS paper, Algorithm 1; ``random-freeze``: the same with the cooling
    schedule; ``lf``: DP-SGD, then the first ``freeze_layers`` layers frozen from epoch
    ``freeze_after`` on, their momentum cleared so that they move by exactly 0; ``ranked``:
    RS paper, Algorithm 4, the mask of epoch ``e`` from the last epoch's perturbed gradients;
    ``dpssgd``: pretraining on the public slice of ``train_xy``, then DP-SGD on the rest with
    the per-layer selection, once or each epoch (``common/methods/``). ``on_mask(epoch,
    mask)`` sees each epoch's mask (None: all).

    Returns one ``EpochStats`` per epoch (rate, kept fraction, losses, accuracy, epsilon).

    Raises:
        ValueError: ``random-freeze`` with a schedule other than ``cooling``, or ``lf`` with
            more layers to freeze than the model has.
    """
    method = method or MethodConfig()
    impl = method.method()
    sparsity = dataclasses.replace(sparsity, schedule=impl.resolve_schedule(sparsity.schedule))
    if impl.pretrains_on_public:  # dpssgd: pretrain on the public slice; DP-SGD on the rest
        x, y = train_xy
        public, private = public_split(len(x), impl.public_fraction, run_seed=train.seed or 0)
        pretrain_public(
            model,
            x[torch.from_numpy(public)],
            y[torch.from_numpy(public)],
            epochs=method.public_epochs,
            batch_size=train.batch_size,
            lr=train.lr,
            seed=train.seed or 0,
        )
        train_xy = (x[torch.from_numpy(private)], y[torch.from_numpy(private)])
    # gip: the budget split up front (sigma for eps1, theta from eps2); else unchanged
    privacy, index_budget = impl.split_privacy(
        privacy,
        planned_steps=train.epochs
        * steps_per_epoch(
            len(train_xy[0]), train.batch_size, poisson_sampling=train.poisson_sampling
        ),
    )
    engine, module, optimizer, loader = make_private(
        model, *train_xy, privacy=privacy, train=train, epochs_for_target=train.epochs
    )
    impl.check_layout(engine.layout)
    # gip, random-k: every step chooses its support (common/methods/index_selection.py)
    selector = impl.step_selector(
        numel=engine.layout.numel,
        keep_fraction=1.0,
        budget=index_budget,
        # Private like the noise: OS entropy without a seed or in secure mode.
        seed=None
        if train.seed is None or privacy.secure_mode
        else stream_seed(train.seed, Stream.INDEX_SELECTION),
    )
    if selector is not None:
        engine.set_step_selector(selector)
    impl.attach(engine, optimizer, seed=train.seed or 0)  # ranked: its gradient sums
    schedule = sparsity.rate_schedule(train.epochs)
    numel = engine.layout.numel
    kept_before = steps_before = 0  # gip, random-k: the selector's counts before the epoch
    history = []
    for epoch in range(train.epochs):
        rate, mask, freezes = impl.epoch_mask(
            EpochContext(
                epoch=epoch,
                schedule=schedule,
                layout=engine.layout,
                mask_seed=sparsity.mask_seed,
                weights=engine.layout.flatten_module(model).cpu(),
            )
        )
        if selector is not None:
            selector.set_keep_fraction(1.0 - rate)
            kept_before, steps_before = selector.kept, selector.steps
        if freezes and mask is not None:  # lf: the frozen layers move by exactly 0
            _clear_momentum(optimizer, engine, mask)
        engine.set_mask(mask)
        if on_mask is not None:
            on_mask(epoch, mask)
        train_loss, examples = train_one_epoch(
            module, optimizer, loader, max_physical_batch_size=train.max_physical_batch_size
        )
        test_loss, test_acc = evaluate(module, *test_xy)
        keep_fraction = engine.keep_fraction
        if selector is not None and selector.steps > steps_before:
            steps = selector.steps - steps_before
            keep_fraction = (selector.kept - kept_before) / (steps * numel)
        stats = EpochStats(
            epoch=epoch,
            rate=rate,
            keep_fraction=keep_fraction,
            train_loss=train_loss,
            examples=examples,
            epsilon=engine.get_epsilon(privacy.delta),
            test_loss=test_loss,
            test_accuracy=test_acc,
            index_epsilon=engine.index_epsilon,
            noise_multiplier=float(optimizer.noise_multiplier),  # type: ignore[attr-defined]
        )
        history.append(stats)
        if on_epoch is not None:
            on_epoch(stats)
    return history
