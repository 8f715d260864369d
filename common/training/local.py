"""Local DP-SGD + RS training: configs, one-epoch loop, evaluation, centralized driver.

The federated client and the centralized demo share these pieces. Privacy-relevant settings
(``PrivacyConfig``, ``SparsityConfig``) are kept apart from optimisation/performance knobs
(``TrainConfig``), as jax_privacy keeps ``DPExecutionPlan`` apart from performance flags.

Randomness comes from separate, seeded streams (``seeds.Stream``): Poisson sampling (the data
loader's generator) and DP noise (the optimizer's generator) from ``TrainConfig.seed``, masks
from ``SparsityConfig.mask_seed``; in ``secure_mode`` Opacus draws noise and batches from OS
entropy and seeds are refused.

Two performance knobs choose how the same mechanism runs (``TrainConfig``): ``engine`` (Opacus
hooks or ``torch.func``, ``func_dp``; equal to float rounding) and ``device`` (the model and
each batch go to it; the data stay on the CPU, where the Poisson sampler draws). On a CUDA
device the noise comes from a CUDA generator seeded from the same stream, so results differ
from the CPU's: other generator, other kernels.

A ``target_epsilon`` is met on the exact number of steps that run
(``privacy.calibrate_noise_multiplier`` with ``privacy.steps_per_epoch``), not on the
``int(epochs / q)`` of Opacus's ``make_private_with_epsilon``, which can be one step short (see
``privacy``). Where the two counts agree, σ is Opacus's, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal, get_args

import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.dp.accounting import (
    ACCOUNTANTS,
    AccountantName,
    calibrate_noise_multiplier,
    sample_rate,
    steps_per_epoch,
)
from fedsparse.common.dp.engines import ENGINES, EngineName, select_engine
from fedsparse.common.dp.engines.factored import FactoredDPEngine, FactoredGradSampleModule
from fedsparse.common.dp.engines.func import FuncDPEngine, FuncGradSampleModule
from fedsparse.common.dp.optimizer import MECHANISMS, MechanismName, SparseDPEngine
from fedsparse.common.known_warnings import quiet_known_warnings
from fedsparse.common.methods import EpochContext, MethodConfig, public_split
from fedsparse.common.methods.gip import gip_privacy
from fedsparse.common.methods.schedules import RateSchedule, ScheduleName
from fedsparse.common.methods.selection import round_mask
from fedsparse.common.models.classifiers import ModelName, build_model
from fedsparse.common.seeds import Stream, stream_seed

__all__ = [
    "ACCOUNTANTS",
    "DEVICES",
    "DeviceName",
    "EpochStats",
    "PrivacyConfig",
    "SparsityConfig",
    "TrainConfig",
    "evaluate",
    "gip_privacy",
    "make_private",
    "planned_engine",
    "resolve_device",
    "round_mask",
    "pretrain_public",
    "train_centralized",
    "train_one_epoch",
]


DeviceName = Literal["auto", "cpu", "cuda"]
"""Where local training runs; ``"auto"`` is CUDA when torch finds a device, else the CPU."""

DEVICES: Final[tuple[DeviceName, ...]] = get_args(DeviceName)


def resolve_device(name: DeviceName) -> torch.device:
    """The torch device for a ``device`` setting (``"auto"``: CUDA if available, else CPU).

    Raises:
        ValueError: an unknown name, or ``"cuda"`` on a machine where torch finds no CUDA
            device (the message names the setting: ``device='cuda': ...``).
    """
    if name not in DEVICES:
        raise ValueError(f"device={name!r}: expected one of {', '.join(DEVICES)}")
    cuda = torch.cuda.is_available()
    if name == "cuda" and not cuda:
        raise ValueError(
            "device='cuda': expected 'auto' or 'cpu' on this machine: torch finds no CUDA "
            "device (torch.cuda.is_available() is False)"
        )
    if name == "auto":
        return torch.device("cuda" if cuda else "cpu")
    return torch.device(name)


@functools.lru_cache(maxsize=64)
def planned_engine(engine: EngineName, model_name: ModelName, device: DeviceName = "auto") -> str:
    """The engine ``make_private`` picks for a fresh ``model_name`` on ``device`` here.

    What a run's record names, so that a finished result is reused only by a run that would
    train it the same way: ``"auto"`` resolves by device and model (``select_engine``), and
    the engines agree only to float rounding.

    Raises:
        ValueError: as ``resolve_device`` and ``select_engine`` (the setting named).
    """
    module = build_model(model_name, seed=0)
    return select_engine(engine, module=module, device=resolve_device(device))


@dataclass(frozen=True, kw_only=True)
class PrivacyConfig:
    """Privacy-relevant settings of local training.

    Exactly one of ``noise_multiplier`` and ``target_epsilon`` is set for ``mechanism="dpsgd"``.
    """

    mechanism: MechanismName = "dpsgd"
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    accountant: AccountantName = "rdp"
    secure_mode: bool = False

    def __post_init__(self) -> None:
        if self.mechanism not in MECHANISMS:
            raise ValueError(
                f"mechanism={self.mechanism!r}: expected one of {', '.join(MECHANISMS)}"
            )
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(
                f"accountant={self.accountant!r}: expected one of {', '.join(ACCOUNTANTS)}"
            )
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(
                f"noise_multiplier={self.noise_multiplier}, target_epsilon={self.target_epsilon}: "
                "set exactly one"
            )
        if self.noise_multiplier is not None and not (
            math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0
        ):
            raise ValueError(f"noise_multiplier={self.noise_multiplier}: expected finite >= 0")
        if self.target_epsilon is not None:
            if self.mechanism != "dpsgd":
                raise ValueError(f"target_epsilon={self.target_epsilon}: needs mechanism='dpsgd'")
            if not (math.isfinite(self.target_epsilon) and self.target_epsilon > 0):
                raise ValueError(f"target_epsilon={self.target_epsilon}: expected finite > 0")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta={self.delta}: expected 0 < delta < 1")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm={self.max_grad_norm}: expected finite > 0")


@dataclass(frozen=True, kw_only=True)
class SparsityConfig:
    """Random-sparsification settings: the rate schedule and the mask seed."""

    schedule: ScheduleName = "gradual"
    final_rate: float = 0.0
    cooling_steps: int = 1
    initial_keep: float = 1.0
    final_keep: float = 1.0
    steps: tuple[float, ...] = ()
    mask_seed: int = 0

    def __post_init__(self) -> None:
        self.rate_schedule(1)  # validates the schedule fields
        if not 0 <= self.mask_seed < 2**64:
            raise ValueError(f"mask_seed={self.mask_seed}: expected 0 <= mask_seed < 2**64")

    def rate_schedule(self, total_steps: int) -> RateSchedule:
        """The schedule over ``total_steps`` epochs (centralized) or rounds (federated)."""
        return RateSchedule(
            kind=self.schedule,
            final_rate=self.final_rate,
            total_steps=total_steps,
            cooling_steps=self.cooling_steps,
            initial_keep=self.initial_keep,
            final_keep=self.final_keep,
            steps=self.steps,
        )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation and performance knobs of local training."""

    epochs: int = 1
    batch_size: int = 64
    lr: float = 0.1
    momentum: float = 0.0
    max_physical_batch_size: int = 0
    poisson_sampling: bool = True
    #: Base seed of the private streams (Poisson sampling, DP noise): reproducible runs for
    #: simulation, where anyone who knows it can rebuild the noise. None: fresh OS entropy
    #: on every ``make_private`` call, never stored or sent (a deployed client).
    seed: int | None = 0
    #: DP engine computing per-sample gradients (``engines.select_engine``): "opacus" hooks,
    #: "func" (torch.func), "factored" (``factored_dp``), or "auto" (func on CUDA, factored
    #: elsewhere; Opacus for a model they cannot train).
    engine: EngineName = "auto"
    #: Where the model and batches go (``resolve_device``); checked here, so "cuda" on a
    #: machine without one fails when the config is built.
    device: DeviceName = "auto"

    def __post_init__(self) -> None:
        for field in ("epochs", "batch_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}={getattr(self, field)}: expected >= 1")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr}: expected finite > 0")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum={self.momentum}: expected 0 <= momentum < 1")
        if self.max_physical_batch_size < 0:
            raise ValueError(
                f"max_physical_batch_size={self.max_physical_batch_size}: expected >= 0"
            )
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r}: expected one of {', '.join(ENGINES)}")
        resolve_device(self.device)


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


def make_private(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    privacy: PrivacyConfig,
    train: TrainConfig,
    epochs_for_target: int,
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
    if privacy.target_epsilon is not None:
        steps = epochs_for_target * steps_per_epoch(
            len(x), train.batch_size, poisson_sampling=train.poisson_sampling
        )
        noise_multiplier = calibrate_noise_multiplier(
            target_epsilon=privacy.target_epsilon,
            delta=privacy.delta,
            sample_rate=sample_rate(
                len(x), train.batch_size, poisson_sampling=train.poisson_sampling
            ),
            steps=steps,
            accountant=privacy.accountant,
        )
    assert noise_multiplier is not None  # PrivacyConfig sets exactly one of the two
    loader = DataLoader(
        TensorDataset(x, y),
        batch_size=min(train.batch_size, len(x)),
        generator=data_gen,
        shuffle=not train.poisson_sampling and data_gen is not None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=train.lr, momentum=train.momentum)
    engines = {"func": FuncDPEngine, "factored": FactoredDPEngine}
    engine_cls = engines.get(engine_name, SparseDPEngine)
    engine = engine_cls(
        accountant=privacy.accountant, secure_mode=privacy.secure_mode, mechanism=privacy.mechanism
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


def train_one_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    *,
    max_physical_batch_size: int = 0,
) -> tuple[float, int]:
    """One pass over ``loader``; returns (mean training loss, examples seen).

    Batches go to the model's device. ``model`` is what ``make_private`` returned: Opacus's
    ``GradSampleModule`` (per-sample gradients from hooks in ``backward``), the func
    engine's ``FuncGradSampleModule`` or the factored engine's ``FactoredGradSampleModule``
    (``backward_per_sample``).
    """
    model.train()
    criterion = nn.CrossEntropyLoss()
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
                total_loss += float(loss) * len(xb)
                examples += len(xb)

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
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, criterion: nn.Module
) -> torch.Tensor:
    """Computes the batch's per-sample gradients for the DP optimizer; returns the mean loss."""
    if isinstance(model, (FuncGradSampleModule, FactoredGradSampleModule)):
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
        )
        history.append(stats)
        if on_epoch is not None:
            on_epoch(stats)
    return history
