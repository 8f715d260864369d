"""The settings of local DP-SGD + RS training, and the device they name.

The federated client and the centralized driver share these pieces. Privacy-relevant settings
(``PrivacyConfig``, ``SparsityConfig``) are kept apart from optimisation/performance knobs
(``TrainConfig``), as jax_privacy keeps ``DPExecutionPlan`` apart from performance flags.

Two performance knobs choose how the same mechanism runs (``TrainConfig``): ``engine`` (Opacus
hooks or ``torch.func``, ``func_dp``; equal to float rounding; ``planned_engine`` says which one
a run gets) and ``device`` (``resolve_device``; the model and each batch go to it, the data stay
on the CPU, where the Poisson sampler draws).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from fedsparse.common.dp.accounting import ACCOUNTANTS, AccountantName
from fedsparse.common.dp.engines import (
    ENGINES,
    EngineName,
    is_user_engine,
    select_engine,
    unknown_engine,
)
from fedsparse.common.dp.mechanisms import is_private
from fedsparse.common.dp.optimizer import MECHANISMS, MechanismName
from fedsparse.common.methods.schedules import RateSchedule, ScheduleName
from fedsparse.common.models.classifiers import ModelName, build_model
from fedsparse.common.names import DEVICES, DeviceName

__all__ = [
    "DEVICES",
    "DeviceName",
    "PrivacyConfig",
    "SparsityConfig",
    "TrainConfig",
    "planned_engine",
    "resolve_device",
]


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
def planned_engine(
    engine: EngineName | str, model_name: ModelName, device: DeviceName = "auto"
) -> str:
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
            if not is_private(self.mechanism):
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
    #: elsewhere; Opacus for a model they cannot train), or a user's ``EngineSpec`` as
    #: ``package.module:attribute``.
    engine: EngineName | str = "auto"
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
        if self.engine not in ENGINES and not is_user_engine(self.engine):
            raise ValueError(unknown_engine(self.engine))
        resolve_device(self.device)
