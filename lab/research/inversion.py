"""Gradient inversion against RS-sparsified (DP-)SGD updates: RS paper Sec. 5, Thm 5.1, Fig. 5.

Two attacks on one client's update, and the experiment that puts them side by side with the
paper's claim that random sparsification (RS) raises the reconstruction error.

* ``invert_gradients``: Inverting Gradients (IG, Geiping et al. 2020). The attacker holds the
  model at the round's weights, the victim's observed gradient (``-update / lr``), the round's
  public mask and the victim's label (known, as IG's reference code ``inversefed`` takes it;
  ``infer_label`` is the iDLG alternative, reported as a diagnostic). It optimizes a dummy
  image with Adam (signed gradients, step decay at 3/8, 5/8, 7/8 of the iterations, pixels
  boxed to ``[0, 1]``) on ``1 - cos(grad(dummy)[S], observed[S]) + tv_weight * TV(dummy)``,
  where ``S`` is the mask's support: off-mask coordinates of an RS update carry neither data
  nor noise, so the attack reads only ``observed[S]``. With restarts it keeps the one with
  the lowest final objective.
* ``linear_attack``: the closed-form attack of Thm 5.1 (Zhu & Blaschko 2021, Eq. 15): least
  squares on ``m * K x = m * (g + xi)``. Given the mask, its error is
  ``sigma^2 tr((K_m^T K_m)^-1)`` in expectation (``linear_attack_expected_error``; for a scalar
  ``x``, ``sigma^2 / ||m * k||^2``, the paper's Eq. 110), bounded below over masks by Eq. 17,
  ``sigma^2 / ((1 - r) ||k||^2)`` (``theorem51_lower_bound``). The paper's ``1 - r`` is the
  expected kept fraction; our masks keep exactly ``keep = d - floor(r d)`` coordinates, so the
  bound uses ``keep / d``, which equals ``1 - r`` when ``r d`` is an integer.

The victim's update comes from the repository's mechanism itself (``victim_update``): one
step of ``SparseDPOptimizer`` (per-sample gradient -> mask -> clip at C -> sum -> noise
``m * N(0, (sigma C)^2)`` -> scale) on a batch of one, then the SGD update, as a client sends.

A reference cell, the null (``NULL_LABEL``), runs the same attack on ``m * xi`` alone (the
DP mechanism's limit sigma -> infinity: the victim's own noise draw, no data): a cell leaks
only where its MSE is below the null's at the same r. The design is paired: per image, one
mask seed for every r and one noise draw for every setting (``AttackStream``).

Reconstruction error is measured in the data's pixel scale, ``[0, 1]`` (digits' 0..16 ink
levels divided by 16), as ``MSE = mean((x_hat - x)^2)`` over the 64 pixels and
``PSNR = 10 log10(1 / MSE)`` dB.

Entry point: ``python -m fedsparse.lab.research.inversion --out docs/reconstruction`` runs the grid
r x {non-private, the paper's fixed noise N(0, 1e-3), DP at each epsilon} on digits test
images and writes ``results.csv``, ``mse_vs_rate.png``, ``examples.png`` and ``report.md``.

References:
    J. Geiping, H. Bauermeister, H. Droege, M. Moeller. "Inverting Gradients - How easy is it
    to break privacy in federated learning?". NeurIPS 2020. arXiv:2003.14053.
    B. Zhao, K. R. Mopuri, H. Bilen. "iDLG: Improved Deep Leakage from Gradients". 2020.
    arXiv:2001.02610.
    J. Zhu, M. Blaschko. "R-GAP: Recursive Gradient Attack on Privacy". ICLR 2021.
    J. Zhu, M. Blaschko. "Improving Differentially Private SGD via Randomly Sparsified
    Gradients". TMLR 2023. arXiv:2112.00845 (Sec. 5, Thm 5.1, App. D, Fig. 5).
"""

from __future__ import annotations

import argparse
import copy
import csv
import enum
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.dp.accounting import (
    calibrate_noise_multiplier,
    compute_epsilon,
    sample_rate,
    steps_per_epoch,
)
from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.dp.optimizer import MechanismName
from fedsparse.common.known_warnings import quiet_known_warnings
from fedsparse.common.masks import derive_seed, keep_count, sample_mask
from fedsparse.common.models.classifiers import build_model
from fedsparse.lab.experiments.stats import mean_se

__all__ = [
    "AttackRow",
    "AttackStream",
    "CellSummary",
    "ExperimentConfig",
    "InversionConfig",
    "LinearCheck",
    "NULL_LABEL",
    "PixelScale",
    "PrivacySetting",
    "Reconstruction",
    "Results",
    "attack_one",
    "flat_gradient",
    "infer_label",
    "invert_gradients",
    "linear_attack",
    "linear_attack_expected_error",
    "main",
    "plot_examples",
    "plot_mse",
    "privacy_settings",
    "reconstruction_error",
    "run",
    "single_step_epsilon",
    "summarize",
    "theorem51_check",
    "theorem51_lower_bound",
    "total_variation",
    "tune_tv_weight",
    "verdict",
    "victim_update",
    "write_csv",
    "write_outputs",
    "write_report",
]


class AttackStream(enum.IntEnum):
    """Seed streams of this experiment, ``derive_seed(seed, stream, *path)``.

    Paired design: an image's mask seed, noise draw and dummy start are the same in every
    cell, so differences between cells are not seed noise. Masks with one seed are nested in
    ``keep`` (``masks.sample_mask``), so the r = 0.99 mask is inside the r = 0.9 one, and the
    noise on a kept coordinate is the same draw at every rate and in every setting, scaled by
    sigma C (the engine draws full-size noise, then masks it).
    """

    #: Which test (and tuning: training) images are attacked.
    IMAGES = 0
    #: Public: the round's mask (path: image).
    MASK = 1
    #: Private to the victim: its noise (path: image). The same draw in every noisy setting
    #: and in the null, scaled by sigma C: settings differ by the signal and the scale only.
    VICTIM_NOISE = 2
    #: The attacker's dummy initialisation (path: image).
    DUMMY = 3
    #: Thm 5.1 simulation: the constraint vector, then each trial's mask and noise.
    LINEAR = 4


# --- the attacks ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class InversionConfig:
    """Inverting Gradients' optimisation settings (Geiping et al. 2020, Sec. 4).

    Attributes:
        iterations: Adam steps per restart, >= 1 (IG used 24,000 on ImageNet-size models; an
            8x8 digit converges in a few hundred, see the report).
        lr: Adam's step size in normalized-pixel units, > 0 (IG: 0.1).
        tv_weight: weight of total variation, >= 0.
        restarts: independent dummy initialisations, >= 1; the lowest final objective wins.
        signed: step on the sign of the gradient (IG's default), else on the gradient.
    """

    iterations: int = 300
    lr: float = 0.1
    tv_weight: float = 1e-2
    restarts: int = 1
    signed: bool = True

    def __post_init__(self) -> None:
        for name in ("iterations", "restarts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an integer >= 1")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr}: expected a finite value > 0")
        if not (math.isfinite(self.tv_weight) and self.tv_weight >= 0):
            raise ValueError(f"tv_weight={self.tv_weight}: expected a finite value >= 0")


@dataclass(frozen=True, kw_only=True)
class PixelScale:
    """The affine map between the model's normalized inputs and pixels in ``[0, 1]``."""

    mean: float
    std: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.std) and self.std > 0):
            raise ValueError(f"std={self.std}: expected a finite value > 0")

    @classmethod
    def of_standardized(cls, x: torch.Tensor) -> PixelScale:
        """Recovers ``(mean, std)`` from standardized images whose pixels span ``[0, 1]``.

        ``load_dataset("digits")`` standardizes with its training split's own mean and std
        and does not return them; every digit split contains both blank (0) and full-ink (1)
        pixels, so ``min = -mean / std`` and ``max = (1 - mean) / std``.
        """
        low, high = float(x.min()), float(x.max())
        if not high > low:
            raise ValueError(f"x: min={low}, max={high}: expected max > min")
        std = 1.0 / (high - low)
        return cls(mean=-low * std, std=std)

    def to_pixels(self, x: torch.Tensor) -> torch.Tensor:
        """Normalized images to pixels in ``[0, 1]``."""
        return x * self.std + self.mean

    @property
    def bounds(self) -> tuple[float, float]:
        """Normalized values of the pixels 0 and 1 (IG's box constraint)."""
        return -self.mean / self.std, (1.0 - self.mean) / self.std


@dataclass(frozen=True, kw_only=True)
class Reconstruction:
    """An attack's output: the image (normalized, ``1 x C x H x W``) and its final objective."""

    image: torch.Tensor
    objective: float


def reconstruction_error(
    estimate: torch.Tensor, truth: torch.Tensor, *, scale: PixelScale
) -> tuple[float, float]:
    """``(MSE, PSNR)`` in pixel scale ``[0, 1]``: PSNR = 10 log10(1 / MSE) dB (inf if exact)."""
    mse = float((scale.to_pixels(estimate) - scale.to_pixels(truth)).pow(2).mean())
    return mse, (math.inf if mse == 0 else 10.0 * math.log10(1.0 / mse))


def flat_gradient(
    model: nn.Module, image: torch.Tensor, label: torch.Tensor, *, create_graph: bool = False
) -> torch.Tensor:
    """Cross-entropy gradient over the trainable parameters, flat, ``named_parameters`` order."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss = nn.functional.cross_entropy(model(image), label)
    grads = torch.autograd.grad(loss, params, create_graph=create_graph)
    return torch.cat([g.reshape(-1) for g in grads])


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic TV, mean absolute neighbour difference along H plus along W (IG's)."""
    dh = (x[..., 1:, :] - x[..., :-1, :]).abs().mean()
    dw = (x[..., :, 1:] - x[..., :, :-1]).abs().mean()
    return dh + dw


def invert_gradients(
    model: nn.Module,
    observed: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    label: int,
    image_shape: tuple[int, ...],
    bounds: tuple[float, float],
    config: InversionConfig,
    generator: torch.Generator,
) -> Reconstruction:
    """Inverting Gradients on the observed coordinates (module docstring).

    Args:
        model: the victim's model at the weights its gradient was taken at (not modified).
        observed: the flat observed gradient; only ``observed[mask]`` is read.
        mask: the round's public mask (flat bool); ``None`` observes every coordinate.
        label: the victim's label (known to the attacker).
        image_shape: ``C x H x W``.
        bounds: normalized values of pixel 0 and 1; the dummy is kept inside.
        generator: draws the dummy initialisations (standard normal, then boxed).

    Raises:
        ValueError: the mask keeps nothing, or ``observed`` is zero on its support (no
            direction to match).
    """
    support = None if mask is None else torch.nonzero(mask.reshape(-1)).squeeze(1)
    target = observed.detach().reshape(-1)
    target = target if support is None else target[support]
    if target.numel() == 0 or not bool(target.ne(0).any()):
        raise ValueError("observed: zero (or empty) on the mask's support, nothing to invert")
    labels = torch.tensor([label])
    best: Reconstruction | None = None
    for _ in range(config.restarts):
        dummy = torch.randn((1, *image_shape), generator=generator).clamp_(*bounds)
        image = _descend(model, dummy, target, support, labels, bounds, config)
        objective = float(_objective(model, image, target, support, labels, config.tv_weight))
        if best is None or objective < best.objective:
            best = Reconstruction(image=image.detach(), objective=objective)
    assert best is not None  # restarts >= 1
    return best


def _objective(
    model: nn.Module,
    image: torch.Tensor,
    target: torch.Tensor,
    support: torch.Tensor | None,
    labels: torch.Tensor,
    tv_weight: float,
) -> torch.Tensor:
    grad = flat_gradient(model, image, labels, create_graph=image.requires_grad)
    grad = grad if support is None else grad[support]
    cosine = nn.functional.cosine_similarity(grad, target, dim=0)
    return 1.0 - cosine + tv_weight * total_variation(image)


def _descend(
    model: nn.Module,
    dummy: torch.Tensor,
    target: torch.Tensor,
    support: torch.Tensor | None,
    labels: torch.Tensor,
    bounds: tuple[float, float],
    config: InversionConfig,
) -> torch.Tensor:
    dummy.requires_grad_(True)
    optimizer = torch.optim.Adam([dummy], lr=config.lr)
    n = config.iterations
    milestones = [n * 3 // 8, n * 5 // 8, n * 7 // 8]
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
    for _ in range(n):
        objective = _objective(model, dummy, target, support, labels, config.tv_weight)
        # Only the dummy's gradient: backward() would also fill the model's parameters' .grad.
        (grad,) = torch.autograd.grad(objective, [dummy])
        dummy.grad = grad.sign() if config.signed else grad
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            dummy.clamp_(*bounds)
    return dummy.detach()


def infer_label(observed: torch.Tensor, mask: torch.Tensor | None, *, num_classes: int) -> int:
    """iDLG's label: the most negative observed gradient of the output layer's bias.

    With softmax cross-entropy on one example that bias's gradient is ``p - onehot(y)``,
    negative only at ``y``. Assumes the last ``num_classes`` coordinates are that bias (every
    model in ``common.models`` ends in ``nn.Linear(..., num_classes)``). Returns -1 when the
    mask keeps none of them. Noise or a mask that drops ``y``'s coordinate makes it wrong.
    """
    values = observed.reshape(-1)[-num_classes:]
    seen = torch.ones(num_classes, dtype=torch.bool)
    if mask is not None:
        seen = mask.reshape(-1)[-num_classes:]
    if not bool(seen.any()):
        return -1
    return int(torch.where(seen, values, torch.full_like(values, math.inf)).argmin())


def linear_attack(
    constraints: torch.Tensor, observed: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Least-squares input from a linear gradient relation, on the mask (Thm 5.1, Eq. 100).

    Solves ``min_x ||m * (K x - y)||^2`` for ``K`` (``d`` or ``d x n``) and the observed
    ``y = m * (K x + xi)``: the rows off the mask are dropped, never read.

    Returns:
        ``x_hat``, shape ``(n,)`` (``(1,)`` for a vector ``K``), in ``K``'s dtype.

    Raises:
        ValueError: the kept rows do not determine ``x`` (``m * k = 0`` in the scalar case: the
            paper's "arbitrary reconstruction error").
    """
    matrix = constraints.reshape(len(constraints), -1)
    rows = matrix if mask is None else matrix[mask]
    values = observed if mask is None else observed[mask]
    if len(rows) == 0 or int(torch.linalg.matrix_rank(rows)) < matrix.shape[1]:
        raise ValueError(
            f"mask: keeps {len(rows)} rows of rank < {matrix.shape[1]}, x is not determined"
        )
    return torch.linalg.lstsq(rows, values.reshape(-1, 1)).solution.reshape(-1)


def linear_attack_expected_error(
    constraints: torch.Tensor, mask: torch.Tensor | None, *, std: float
) -> float:
    """``E[||x - x_hat||^2 | m] = std^2 tr((K_m^T K_m)^-1)``; ``std^2 / ||m*k||^2`` for a vector."""
    matrix = constraints.reshape(len(constraints), -1)
    rows = matrix if mask is None else matrix[mask]
    return std**2 * float(torch.linalg.inv(rows.T @ rows).trace())


def theorem51_lower_bound(constraints: torch.Tensor, *, std: float, keep_fraction: float) -> float:
    """Eq. 17: ``E_m[E[||x - x_hat||^2]] >= std^2 / (keep_fraction * ||k||^2)`` (vector ``k``).

    Jensen's inequality on ``1 / ||m * k||^2`` with ``E||m * k||^2 = keep_fraction * ||k||^2``
    (any uniformly random mask with that kept fraction). ``keep_fraction = 1 - r`` is Eq. 17;
    equality when every ``|k_i|`` is the same (``||m * k||^2`` is then the same for every mask).
    """
    return std**2 / (keep_fraction * float(constraints.pow(2).sum()))


# --- the victim ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PrivacySetting:
    """How the victim's update is privatized (an engine ``mechanism`` and its parameters).

    Attributes:
        label: name in tables and plots.
        mechanism: ``"clipped"`` (no noise: non-private up to the clipping scale, which a
            cosine attack cannot see), ``"noisy"`` (no clipping, noise ``m * N(0, (sigma C)^2)``:
            the paper's Fig. 5 noise with ``C = 1``) or ``"dpsgd"``.
        noise_multiplier: sigma.
        max_grad_norm: C.
        target_epsilon: the epsilon sigma was calibrated for (``None``: not DP).
    """

    label: str
    mechanism: MechanismName
    noise_multiplier: float
    max_grad_norm: float
    target_epsilon: float | None = None


def victim_update(
    model: nn.Module,
    image: torch.Tensor,
    label: int,
    *,
    privacy: PrivacySetting,
    mask: torch.Tensor | None,
    lr: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """The model delta of one ``SparseDPOptimizer`` step on the batch ``{(image, label)}``.

    The step is the engine's own: sparsify -> clip -> sum -> ``m * N(0, (sigma C)^2)`` -> divide
    by the batch size (1) -> SGD with ``lr``, on a copy of ``model``. The delta is exactly zero
    off the mask. The attacker's observed gradient is ``-delta / lr`` (``lr`` is public).
    """
    local = copy.deepcopy(model)
    before = torch.cat([p.detach().reshape(-1) for p in local.parameters() if p.requires_grad])
    labels = torch.tensor([label])
    with quiet_known_warnings():
        engine = SparseDPEngine(accountant="rdp", mechanism=privacy.mechanism)
        module, optimizer, _ = engine.make_private(
            module=local,
            optimizer=torch.optim.SGD(local.parameters(), lr=lr),
            data_loader=DataLoader(TensorDataset(image, labels), batch_size=1),
            noise_multiplier=privacy.noise_multiplier,
            max_grad_norm=privacy.max_grad_norm,
            poisson_sampling=False,
            noise_generator=generator,
        )
    engine.set_mask(mask)
    optimizer.zero_grad(set_to_none=True)
    with quiet_known_warnings():  # Opacus's hooks on a first layer: its input needs no gradient
        nn.functional.cross_entropy(module(image), labels).backward()
    optimizer.step()
    after = torch.cat([p.detach().reshape(-1) for p in local.parameters() if p.requires_grad])
    return after - before


# --- the experiment -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """The reconstruction grid (privacy fields first, then the attack and run knobs).

    The DP victim is a client of the default federation (``pyproject.toml``: batch 32, 1 local
    epoch, 10 rounds; digits' 1,437 training images over 10 IID clients, as in
    ``docs/sweep-digits``: about 144 examples each):
    sigma is calibrated so that those ``steps_per_epoch * rounds`` steps at Opacus's sampling
    rate spend ``epsilon`` at ``delta``; the attacked update is one such step on a batch of one
    (the attacker's best case: no other example's gradient in the sum).
    """

    rates: tuple[float, ...] = (0.0, 0.5, 0.9, 0.99)
    epsilons: tuple[float, ...] = (1.0, 8.0)
    fixed_noise_variance: float = 1e-3
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    client_examples: int = 144
    batch_size: int = 32
    rounds: int = 10
    lr: float = 0.5
    attack: InversionConfig = field(default_factory=InversionConfig)
    tv_grid: tuple[float, ...] = (1e-3, 1e-2, 1e-1)
    tuning_images: int = 4
    num_images: int = 48
    shown_images: int = 4
    model_seed: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rates or any(not 0.0 <= r < 1.0 for r in self.rates):
            raise ValueError(f"rates={self.rates}: expected values with 0 <= r < 1")
        if 0.0 not in self.rates:
            raise ValueError(f"rates={self.rates}: expected 0 among them (the paired baseline)")
        if any(not (math.isfinite(e) and e > 0) for e in self.epsilons):
            raise ValueError(f"epsilons={self.epsilons}: expected finite values > 0")
        if not (math.isfinite(self.fixed_noise_variance) and self.fixed_noise_variance > 0):
            raise ValueError(f"fixed_noise_variance={self.fixed_noise_variance}: expected > 0")
        for name in ("client_examples", "batch_size", "rounds", "num_images", "tuning_images"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: expected >= 1")
        if not 0 <= self.shown_images <= self.num_images:
            raise ValueError(f"shown_images={self.shown_images}: expected 0..num_images")
        if any(not (math.isfinite(w) and w >= 0) for w in self.tv_grid) or not self.tv_grid:
            raise ValueError(f"tv_grid={self.tv_grid}: expected finite values >= 0")

    @property
    def client_steps(self) -> int:
        """Noisy steps a client takes over the run (what sigma is calibrated for)."""
        return steps_per_epoch(self.client_examples, self.batch_size) * self.rounds

    @property
    def client_sample_rate(self) -> float:
        """Opacus's per-step sampling rate for the client's data."""
        return sample_rate(self.client_examples, self.batch_size)


def privacy_settings(config: ExperimentConfig) -> list[PrivacySetting]:
    """Non-private, the paper's fixed noise, then DP at each epsilon (sigma from the accountant)."""
    settings = [
        PrivacySetting(
            label="non-private",
            mechanism="clipped",
            noise_multiplier=0.0,
            max_grad_norm=config.max_grad_norm,
        ),
        PrivacySetting(
            label=f"noise N(0,{config.fixed_noise_variance:g})",
            mechanism="noisy",
            noise_multiplier=math.sqrt(config.fixed_noise_variance),
            max_grad_norm=1.0,
        ),
    ]
    for epsilon in config.epsilons:
        sigma = calibrate_noise_multiplier(
            target_epsilon=epsilon,
            delta=config.delta,
            sample_rate=config.client_sample_rate,
            steps=config.client_steps,
            accountant="rdp",
        )
        settings.append(
            PrivacySetting(
                label=f"DP eps={epsilon:g}",
                mechanism="dpsgd",
                noise_multiplier=sigma,
                max_grad_norm=config.max_grad_norm,
                target_epsilon=epsilon,
            )
        )
    return settings


NULL_LABEL = "null: noise only"
"""The reference cell: IG on ``m * N(0, I)`` (nothing about the image), label known."""


def single_step_epsilon(privacy: PrivacySetting, *, delta: float) -> float:
    """RDP epsilon of one un-subsampled step (q = 1) of ``privacy``; inf if not DP."""
    if privacy.mechanism != "dpsgd":
        return math.inf
    return compute_epsilon(
        noise_multiplier=privacy.noise_multiplier,
        sample_rate=1.0,
        steps=1,
        delta=delta,
        accountant="rdp",
    )


@dataclass(frozen=True, kw_only=True)
class AttackRow:
    """One attack of the grid: a CSV row."""

    setting: str
    target_epsilon: float
    noise_multiplier: float
    rate: float
    keep: int
    image: int
    label: int
    inferred_label: int
    mse: float
    psnr: float
    mse_normalized: float
    objective: float
    gradient_norm: float
    seconds: float


@dataclass
class _Victims:
    """What every attack shares: model, data, scale, the attacked images."""

    model: nn.Module
    images: torch.Tensor
    labels: torch.Tensor
    indices: list[int]
    scale: PixelScale
    numel: int


def _make_victims(
    config: ExperimentConfig, x: torch.Tensor, y: torch.Tensor, indices: list[int]
) -> _Victims:
    model = build_model("digits-cnn", seed=config.model_seed)
    return _Victims(
        model=model,
        images=x[indices],
        labels=y[indices],
        indices=indices,
        scale=PixelScale.of_standardized(x),
        numel=sum(p.numel() for p in model.parameters() if p.requires_grad),
    )


def _pick(count: int, population: int, *, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return sorted(int(i) for i in rng.choice(population, size=count, replace=False))


def _observe(
    victims: _Victims,
    position: int,
    *,
    privacy: PrivacySetting | None,
    mask: torch.Tensor | None,
    config: ExperimentConfig,
) -> torch.Tensor:
    """The attacker's observed gradient: ``-delta / lr`` of the victim, or the null's noise."""
    seed = derive_seed(config.seed, AttackStream.VICTIM_NOISE, position)
    if privacy is None:
        # The noise the engine would draw from this seed, at sigma C = 1, without the data.
        generator = torch.Generator().manual_seed(seed)
        params = [p for p in victims.model.parameters() if p.requires_grad]
        draws = [torch.normal(0.0, 1.0, size=p.shape, generator=generator) for p in params]
        noise = torch.cat([d.reshape(-1) for d in draws])
        return noise if mask is None else noise * mask
    update = victim_update(
        victims.model,
        victims.images[position : position + 1],
        int(victims.labels[position]),
        privacy=privacy,
        mask=mask,
        lr=config.lr,
        generator=torch.Generator().manual_seed(seed),
    )
    return -update / config.lr


def attack_one(
    victims: _Victims,
    position: int,
    *,
    privacy: PrivacySetting | None,
    rate: float,
    config: ExperimentConfig,
    attack: InversionConfig,
) -> tuple[AttackRow, torch.Tensor]:
    """IG on image ``position``'s observed gradient in one cell (``privacy=None``: the null)."""
    start = time.perf_counter()
    image = victims.images[position : position + 1]
    label = int(victims.labels[position])
    keep = keep_count(victims.numel, rate=rate)
    mask_seed = derive_seed(config.seed, AttackStream.MASK, position)
    mask = sample_mask(victims.numel, keep=keep, seed=mask_seed) if keep < victims.numel else None
    observed = _observe(victims, position, privacy=privacy, mask=mask, config=config)
    dummy_seed = derive_seed(config.seed, AttackStream.DUMMY, position)
    result = invert_gradients(
        victims.model,
        observed,
        mask=mask,
        label=label,
        image_shape=tuple(image.shape[1:]),
        bounds=victims.scale.bounds,
        config=attack,
        generator=torch.Generator().manual_seed(dummy_seed),
    )
    mse, psnr = reconstruction_error(result.image, image, scale=victims.scale)
    epsilon = None if privacy is None else privacy.target_epsilon
    row = AttackRow(
        setting=NULL_LABEL if privacy is None else privacy.label,
        target_epsilon=math.inf if epsilon is None else epsilon,
        noise_multiplier=math.inf if privacy is None else privacy.noise_multiplier,
        rate=rate,
        keep=keep,
        image=victims.indices[position],
        label=label,
        inferred_label=infer_label(observed, mask, num_classes=10),
        mse=mse,
        psnr=psnr,
        mse_normalized=float((result.image - image).pow(2).mean()),
        objective=result.objective,
        gradient_norm=float(observed.norm()),
        seconds=time.perf_counter() - start,
    )
    return row, result.image


def tune_tv_weight(
    config: ExperimentConfig, settings: Sequence[PrivacySetting]
) -> dict[float, float]:
    """Mean pixel MSE per TV weight on training images (not the evaluated test images).

    Tuned where the weight matters, under the paper's fixed noise at the two rates nearest
    0.5 and 0.9; an attacker may tune on public data this way.
    """
    train, _ = load_dataset("digits", seed=0)
    pick_seed = derive_seed(config.seed, AttackStream.IMAGES, 1)
    victims = _make_victims(
        config, train.x, train.y, _pick(config.tuning_images, len(train), seed=pick_seed)
    )
    noisy = next(s for s in settings if s.mechanism == "noisy")
    rates = sorted(config.rates, key=lambda r: min(abs(r - 0.5), abs(r - 0.9)))[:2]
    scores: dict[float, float] = {}
    for weight in config.tv_grid:
        attack = InversionConfig(**{**asdict(config.attack), "tv_weight": weight})
        mses = [
            attack_one(
                victims,
                pos,
                privacy=noisy,
                rate=rate,
                config=config,
                attack=attack,
            )[0].mse
            for rate in rates
            for pos in range(config.tuning_images)
        ]
        scores[weight] = float(np.mean(mses))
    return scores


@dataclass
class Results:
    """The grid's rows (null cells included), shown reconstructions, settings, tuning."""

    rows: list[AttackRow]
    images: dict[tuple[str, float], torch.Tensor]  # (setting, rate) -> shown reconstructions
    truth: torch.Tensor
    settings: list[PrivacySetting]
    tv_scores: dict[float, float]
    tv_weight: float
    mean_image_mse: tuple[float, float]
    scale: PixelScale
    seconds: float
    cpu_seconds: float


def run(config: ExperimentConfig, *, log: bool = True) -> Results:
    """Tunes the TV weight, then attacks every (setting, rate, image) cell and the null."""
    start, cpu_start = time.perf_counter(), time.process_time()
    settings = privacy_settings(config)
    tv_scores = tune_tv_weight(config, settings)
    tv_weight = min(tv_scores, key=lambda w: tv_scores[w])
    if log:
        print(f"TV weight {tv_weight:g} (mean MSE by weight: {tv_scores})", flush=True)
    attack = InversionConfig(**{**asdict(config.attack), "tv_weight": tv_weight})
    train, test = load_dataset("digits", seed=0)
    pick_seed = derive_seed(config.seed, AttackStream.IMAGES, 0)
    victims = _make_victims(
        config, test.x, test.y, _pick(config.num_images, len(test), seed=pick_seed)
    )
    # The test split is standardized with the training split's statistics: one scale.
    victims.scale = PixelScale.of_standardized(train.x)
    mean_image = train.x.mean(dim=0, keepdim=True)
    rows: list[AttackRow] = []
    shown: dict[tuple[str, float], list[torch.Tensor]] = {}
    cells: list[PrivacySetting | None] = [*settings, None]
    for privacy in cells:
        for rate in config.rates:
            for pos in range(config.num_images):
                row, image = attack_one(
                    victims,
                    pos,
                    privacy=privacy,
                    rate=rate,
                    config=config,
                    attack=attack,
                )
                rows.append(row)
                if pos < config.shown_images:
                    shown.setdefault((row.setting, rate), []).append(image[0])
            if log:
                mse = np.mean([r.mse for r in rows[-config.num_images :]])
                print(f"{rows[-1].setting:>18} r={rate:<5g} MSE {mse:.4f}", flush=True)
    return Results(
        rows=rows,
        images={k: torch.stack(v) for k, v in shown.items()},
        truth=victims.images[: config.shown_images],
        settings=settings,
        tv_scores=tv_scores,
        tv_weight=tv_weight,
        mean_image_mse=mean_se(
            reconstruction_error(mean_image, img[None], scale=victims.scale)[0]
            for img in victims.images
        ),
        scale=victims.scale,
        seconds=time.perf_counter() - start,
        cpu_seconds=time.process_time() - cpu_start,
    )


# --- outputs ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CellSummary:
    """Mean ± SE over images of one (setting, rate) cell, and paired changes (same images)."""

    setting: str
    rate: float
    n: int
    mse: tuple[float, float]
    psnr: tuple[float, float]
    label_accuracy: float
    diff_vs_dense: tuple[float, float]  # MSE(r) - MSE(r = 0), same setting
    diff_vs_null: tuple[float, float]  # MSE - MSE(null), same r
    #: How much of the attack's advantage over the null r removes, paired:
    #: (MSE - null)(r) - (MSE - null)(0). Robust to the null's own drift with r.
    advantage_lost: tuple[float, float]

    @property
    def leaks(self) -> bool:
        """The attack beats IG on pure noise by more than 2 SE (paired)."""
        diff, se = self.diff_vs_null
        return diff + 2 * se < 0


def summarize(results: Results) -> list[CellSummary]:
    """One summary per cell, settings in grid order, then the null."""
    mse = {(r.setting, r.rate, r.image): r.mse for r in results.rows}
    cells: list[CellSummary] = []
    for setting in [*(s.label for s in results.settings), NULL_LABEL]:
        rows = [r for r in results.rows if r.setting == setting]
        for rate in dict.fromkeys(r.rate for r in rows):
            cell = [r for r in rows if r.rate == rate]
            cells.append(
                CellSummary(
                    setting=setting,
                    rate=rate,
                    n=len(cell),
                    mse=mean_se(r.mse for r in cell),
                    psnr=mean_se(r.psnr for r in cell),
                    label_accuracy=float(np.mean([r.inferred_label == r.label for r in cell])),
                    diff_vs_dense=mean_se(r.mse - mse[setting, 0.0, r.image] for r in cell),
                    diff_vs_null=mean_se(r.mse - mse[NULL_LABEL, rate, r.image] for r in cell),
                    advantage_lost=mean_se(
                        r.mse
                        - mse[NULL_LABEL, rate, r.image]
                        - mse[setting, 0.0, r.image]
                        + mse[NULL_LABEL, 0.0, r.image]
                        for r in cell
                    ),
                )
            )
    return cells


def write_csv(results: Results, path: Path) -> None:
    """One row per attack (``AttackRow`` fields), the null cells included."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(AttackRow.__dataclass_fields__))
        writer.writeheader()
        writer.writerows(asdict(row) for row in results.rows)


def plot_mse(results: Results, cells: Sequence[CellSummary], path: Path) -> None:
    """MSE vs r per setting, the null and the mean-image levels: like RS Fig. 5."""
    fig = Figure(figsize=(9.0, 4.4))
    ax = fig.add_subplot()
    for setting in [*(s.label for s in results.settings), NULL_LABEL]:
        own = [c for c in cells if c.setting == setting]
        null = setting == NULL_LABEL
        ax.errorbar(
            [c.rate for c in own],
            [c.mse[0] for c in own],
            yerr=[c.mse[1] for c in own],
            marker="o",
            capsize=3,
            label=f"{setting} (IG on pure noise)" if null else setting,
            color="gray" if null else None,
            linestyle="--" if null else "-",
        )
    ax.axhline(results.mean_image_mse[0], color="gray", linestyle=":", label="training-mean image")
    ax.set_xlabel("sparsification rate r")
    ax.set_ylabel("reconstruction MSE (pixels in [0, 1])")
    ax.set_yscale("log")
    ax.set_title("Inverting Gradients vs RS, digits-cnn (mean ± SE over images)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_examples(results: Results, rates: Sequence[float], path: Path) -> None:
    """Per setting, a block: rows are images, columns the true image then each r."""
    settings = [s.label for s in results.settings]
    n = len(results.truth)
    fig = Figure(figsize=(0.62 * len(settings) * (len(rates) + 1) + 0.4, 0.66 * n + 0.7))
    blocks = fig.subfigures(1, len(settings), squeeze=False)
    for block, setting in zip(blocks.flat, settings, strict=True):
        block.suptitle(setting, fontsize=9)
        axes = block.subplots(n, len(rates) + 1, squeeze=False)
        for i in range(n):
            columns = [("true", results.truth[i])]
            columns += [(f"r={r:g}", results.images[setting, r][i]) for r in rates]
            for ax, (title, image) in zip(axes[i], columns, strict=True):
                pixels = results.scale.to_pixels(image).clamp(0, 1)[0].numpy()
                ax.imshow(pixels, cmap="gray_r", vmin=0, vmax=1)
                ax.set_xticks([])
                ax.set_yticks([])
                if i == 0:
                    ax.set_title(title, fontsize=8)
    fig.savefig(path, dpi=120)


def _fmt(pair: tuple[float, float], digits: int | None = None) -> str:
    """``mean ± SE``: fixed-point with ``digits``, else scientific (MSEs span 1e-5..0.3)."""
    mean, se = pair
    if digits is None:
        return f"{mean:.2e} ± {se:.1e}"
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def _z(pair: tuple[float, float]) -> float:
    mean, se = pair
    return mean / se if se > 0 else math.copysign(math.inf, mean) if mean else 0.0


def verdict(setting: str, cells: Sequence[CellSummary]) -> str:
    """'MSE rises with r' for one setting, judged by paired changes at 2 SE (z > 2).

    The first word is the raw MSE's trend from r = 0 to the largest r (the paper's claim);
    the sentence adds the attack's advantage over the null and how much of it r removed.
    Only meaningful where the attack leaks at r = 0 (beats IG on pure noise); otherwise there
    is nothing for RS to reduce, and the verdict is 'inconclusive'.
    """
    own = [c for c in cells if c.setting == setting]
    dense, top = own[0], own[-1]
    change = f"paired MSE(r={top.rate:g}) - MSE(0) = {_fmt(top.diff_vs_dense)}"
    if not dense.leaks:
        return (
            f"inconclusive: at r = 0 the attack does no better than on pure noise "
            f"(MSE - null = {_fmt(dense.diff_vs_null)}), so there is no leak for RS to "
            f"reduce ({change})"
        )
    z = _z(top.diff_vs_dense)
    trend = "rises" if z > 2 else "falls" if z < -2 else "no detectable change"
    leaking = [f"{c.rate:g}" for c in own if c.leaks] or ["none"]
    advantage = (
        f"advantage over the null {_fmt(_neg(dense.diff_vs_null))} at r = 0 and "
        f"{_fmt(_neg(top.diff_vs_null))} at r = {top.rate:g}, reduced by "
        f"{_fmt(top.advantage_lost)} (z = {_z(top.advantage_lost):.1f})"
    )
    return (
        f"{trend}: {change} (z = {z:.1f}); {advantage}; the attack beats the null at "
        f"r = {', '.join(leaking)}"
    )


def _neg(pair: tuple[float, float]) -> tuple[float, float]:
    return -pair[0], pair[1]


@dataclass(frozen=True, kw_only=True)
class LinearCheck:
    """Thm 5.1 by simulation at one rate: the linear attack's error against its theory."""

    rate: float
    keep_fraction: float
    empirical: tuple[float, float]  # mean ± SE of ||x - x_hat||^2 over trials
    exact: float  # mean over the same masks of std^2 / ||m * k||^2 (Eq. 110 given m)
    bound: float  # Eq. 17 with keep / d


def theorem51_check(
    rates: Sequence[float], *, dim: int = 1000, trials: int = 2000, std: float = 1.0, seed: int = 0
) -> list[LinearCheck]:
    """The scalar linear attack of Thm 5.1 over ``trials`` masks and noise draws per rate."""
    stream = derive_seed(seed, AttackStream.LINEAR)
    k = torch.randn(dim, generator=torch.Generator().manual_seed(stream), dtype=torch.float64)
    x = torch.tensor([0.7], dtype=torch.float64)
    checks = []
    for rate in rates:
        keep = keep_count(dim, rate=rate)
        errors, exact = [], []
        for trial in range(trials):
            mask = sample_mask(dim, keep=keep, seed=derive_seed(stream, 0, trial))
            noise_gen = torch.Generator().manual_seed(derive_seed(stream, 1, trial))
            noise = torch.randn(dim, generator=noise_gen, dtype=torch.float64)
            observed = mask * (k * x + std * noise)
            errors.append(float((linear_attack(k, observed, mask) - x).pow(2).sum()))
            exact.append(linear_attack_expected_error(k, mask, std=std))
        checks.append(
            LinearCheck(
                rate=rate,
                keep_fraction=keep / dim,
                empirical=mean_se(errors),
                exact=float(np.mean(exact)),
                bound=theorem51_lower_bound(k, std=std, keep_fraction=keep / dim),
            )
        )
    return checks


def write_report(
    results: Results,
    config: ExperimentConfig,
    cells: Sequence[CellSummary],
    checks: Sequence[LinearCheck],
    path: Path,
    *,
    command: str,
) -> None:
    """``report.md``: setup, table, verdicts, comparison with the paper, Thm 5.1, limits."""
    sections = [
        _setup(results, config, command),
        _results_table(cells),
        ["## Verdict: does the MSE rise with r?", ""]
        + [f"- **{s.label}**: {verdict(s.label, cells)}." for s in results.settings]
        + ["", *_discussion(results, cells, config)],
        _theorem51_table(checks),
        _limitations(config),
    ]
    path.write_text("\n".join(line for section in sections for line in [*section, ""]))


def _setup(results: Results, config: ExperimentConfig, command: str) -> list[str]:
    rows, attack = results.rows, config.attack
    images = sorted({r.image for r in rows})
    lines = [
        "# Gradient inversion vs random sparsification (RS paper Sec. 5, Fig. 5)",
        "",
        f"Produced by `{command}`: {len(rows)} attacks, {results.seconds / 60:.1f} min wall, "
        f"{results.cpu_seconds / 60:.1f} min CPU (one torch thread; tuning included).",
        "",
        "## Setup",
        "",
        "- **Victim model**: `digits-cnn` (38,282 parameters, tanh) at its initial weights "
        f"(`build_model(seed={config.model_seed})`: the global model of round 1).",
        f"- **Victim data**: {config.num_images} digits test images (8x8), drawn with seed "
        f"{config.seed}: test indices {', '.join(map(str, images))}.",
        "- **Victim update**: one step of the repository's `SparseDPOptimizer` "
        "(`SparseDPEngine.make_private`, Opacus per-sample gradients) on a batch of one: "
        "mask -> clip at C -> sum -> noise `m * N(0, (sigma C)^2)` -> SGD with "
        f"lr = {config.lr}. The attacker sees the model delta and the public mask, and "
        "matches `-delta / lr` on the mask's support only.",
        "- **Attack**: Inverting Gradients (Geiping et al. 2020): 1 - cosine similarity + "
        f"TV, Adam (lr {attack.lr}, signed gradients, x0.1 at 3/8, 5/8, 7/8), "
        f"{attack.iterations} iterations, {attack.restarts} restart(s), pixels boxed to "
        "[0, 1]. **Label known** to the attacker (IG's reference code, `inversefed`, takes it "
        "as an input); the iDLG column "
        "says how often it could have been inferred from the observed output-layer bias.",
        f"- **TV weight** {results.tv_weight:g}, chosen on {config.tuning_images} *training* "
        "images (not the evaluated ones) under the fixed noise at r = 0.5 and 0.9, by mean "
        "pixel MSE: " + ", ".join(f"{w:g} -> {s:.4f}" for w, s in results.tv_scores.items()) + ".",
        "- **Masks and noise**: `sample_mask`, keep = d - floor(r d). Per image one mask "
        "seed for every r (nested masks) and one noise draw xi for every setting and r, "
        "scaled by sigma C (the engine draws full-size noise, then masks it): cells are "
        "compared paired, on the same images, masks and noise.",
        "- **Error**: pixel scale [0, 1] (ink level / 16): MSE over the 64 pixels, "
        "PSNR = 10 log10(1 / MSE). `results.csv` also has `mse_normalized`, in the model's "
        f"standardized units (x {1 / results.scale.std**2:.2f}), the units IG's code reports.",
        f"- **References**: `{NULL_LABEL}` is the same attack on `m * xi` alone (DP's "
        "sigma -> infinity), which says nothing about the image (label still known): a cell "
        "*leaks* when its MSE is below the null's at the same r by more than 2 paired SE "
        "(one-sided). The training-mean image has MSE "
        f"{_fmt(results.mean_image_mse)}.",
        "",
        "| setting | engine mechanism | sigma | C | noise std / coordinate | "
        "mean observed-gradient norm at r = 0 | epsilon of the attacked step alone |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in results.settings:
        norms = [r.gradient_norm for r in rows if r.setting == s.label and r.rate == 0.0]
        clip = "none" if s.mechanism == "noisy" else f"{s.max_grad_norm:g}"
        alone = single_step_epsilon(s, delta=config.delta)
        lines.append(
            f"| {s.label} | {s.mechanism} | {s.noise_multiplier:.4g} | {clip} | "
            f"{s.noise_multiplier * s.max_grad_norm:.4g} | {np.mean(norms):.3g} | "
            f"{'—' if math.isinf(alone) else f'{alone:.2f}'} |"
        )
    lines += [
        "",
        f"DP sigma: RDP accountant, delta = {config.delta:g}, for a client of the default "
        f"federation ({config.client_examples} examples, batch {config.batch_size}: "
        f"q = {config.client_sample_rate:g}, {config.client_steps} steps over "
        f"{config.rounds} rounds of 1 local epoch); the attacked update is one of those steps. "
        "The last column is the RDP epsilon at the same delta of that step on its own, "
        "without subsampling (q = 1: the victim is surely in its batch of one), which is "
        "what a server seeing this one update faces.",
    ]
    return lines


def _results_table(cells: Sequence[CellSummary]) -> list[str]:
    lines = [
        "## Results (mean ± SE over images; SE = sample std / sqrt(n))",
        "",
        "| setting | r | n | MSE | PSNR dB | MSE(r) - MSE(0), paired | MSE - null, paired "
        "| advantage over the null lost since r = 0, paired | iDLG label acc. |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        dense = "—" if c.rate == 0.0 else _fmt(c.diff_vs_dense)
        null = "—" if c.setting == NULL_LABEL else _fmt(c.diff_vs_null)
        lost = "—" if c.setting == NULL_LABEL or c.rate == 0.0 else _fmt(c.advantage_lost)
        lines.append(
            f"| {c.setting} | {c.rate:g} | {c.n} | {_fmt(c.mse)} | {_fmt(c.psnr, 1)} | "
            f"{dense} | {null} | {lost} | {c.label_accuracy:.2f} |"
        )
    lines += ["", "![MSE vs r](mse_vs_rate.png)", "", "![examples](examples.png)"]
    return lines


def _cell(cells: Sequence[CellSummary], setting: str, rate: float) -> CellSummary:
    return next(c for c in cells if c.setting == setting and c.rate == rate)


def _discussion(
    results: Results, cells: Sequence[CellSummary], config: ExperimentConfig
) -> list[str]:
    """The comparison with the paper, numbers filled in from the cells."""
    plain, noisy = results.settings[0].label, results.settings[1].label
    top = max(c.rate for c in cells)
    n0, ntop = _cell(cells, noisy, 0.0), _cell(cells, noisy, top)
    p0, ptop = _cell(cells, plain, 0.0), _cell(cells, plain, top)
    dp = [c for c in cells if c.setting in {s.label for s in results.settings[2:]}]
    dp_leaks = [f"{c.setting} r={c.rate:g}" for c in dp if c.leaks]
    noisy_verdict = verdict(noisy, cells).split(":")[0]
    outcome = {"rises": "reproduced", "inconclusive": "inconclusive"}.get(noisy_verdict, "not")
    lines = [
        f"**Against the paper: {outcome}.** Fig. 5 (IG on ResNet34, CIFAR-10, 200 images, "
        "noise N(0, 1e-3)) shows the MSE rising with r above the non-private 0.02 ± 0.02. "
        f"Here, under the same fixed noise, the MSE goes from {_fmt(n0.mse)} at r = 0 to "
        f"{_fmt(ntop.mse)} at r = {top:g} (paired change {_fmt(ntop.diff_vs_dense)}); "
        f"without noise, from {_fmt(p0.mse)} to {_fmt(ptop.mse)}. Absolute values are not "
        "comparable with Fig. 5 (another model, 8x8 images; IG's code reports MSE in "
        "standardized units, see `mse_normalized`).",
        "",
        f"Without noise, at r = {top:g} the {_keep_at(results, top)} kept coordinates give "
        f"PSNR {_fmt(ptop.psnr, 1)} dB against {_fmt(p0.psnr, 1)} dB dense"
        + (
            ": RS alone does not stop IG on this model (20 dB is the same digit to the eye). "
            if ptop.psnr[0] >= 20
            else ". "
        )
        + "What r does is take signal away while the noise on each kept coordinate stays "
        "the same, Thm 5.1's mechanism: under the fixed noise the PSNR goes from "
        f"{_fmt(n0.psnr, 1)} to {_fmt(ntop.psnr, 1)} dB.",
        "",
    ]
    if dp_leaks:
        lines += _dp_leak_discussion(results, cells, config)
    else:
        lines.append(
            "Under DP (one step of a client whose sigma is calibrated for the whole run), no "
            "cell beats the null: noise of std sigma C on each of tens of thousands of "
            "coordinates swamps a per-example gradient of norm at most C, so the attack "
            "learns nothing about the image at any r. There the claim is neither confirmed "
            "nor refuted by this attack: the protection is DP's noise, and any change of "
            "MSE with r is the null's own (IG on noise drifts differently with fewer "
            "coordinates), not privacy."
        )
    return lines


def _keep_at(results: Results, rate: float) -> int:
    return next(r.keep for r in results.rows if r.rate == rate)


def _dp_leak_discussion(
    results: Results, cells: Sequence[CellSummary], config: ExperimentConfig
) -> list[str]:
    """Where a DP cell beats the null: how much, whether RS reduces it, and what DP allows."""
    lines = ["Under DP the attack beats the null in some cells (advantage = null - MSE):", ""]
    tests = 0
    for s in results.settings[2:]:
        own = [c for c in cells if c.setting == s.label]
        tests += len(own)
        leaking = [f"{c.rate:g}" for c in own if c.leaks] or ["none"]
        per_rate = "; ".join(f"r = {c.rate:g}: {_fmt(_neg(c.diff_vs_null))}" for c in own)
        top = own[-1]
        lines.append(
            f"- {s.label} (its step alone: epsilon "
            f"{single_step_epsilon(s, delta=config.delta):.2f}): advantage by rate: "
            f"{per_rate}; beats the null at r = {', '.join(leaking)}; r = {top.rate:g} "
            f"removes {_fmt(top.advantage_lost)} of it (z = {_z(top.advantage_lost):.1f}), "
            f"while the raw MSE changes by {_fmt(top.diff_vs_dense)} (z = "
            f"{_z(top.diff_vs_dense):.1f}): IG on noise alone drifts with r too."
        )
    lines += [
        "",
        "A small leak is what DP permits, not a failure of it: the server sees one "
        "un-subsampled step of a batch of one, whose own epsilon is in the table above; the "
        "run's epsilon is for the subsampled run. These leaks are small next to the "
        "non-private ones (compare the MSE columns: the DP reconstructions are not "
        f"recognizable, see the images). Each of the {tests} DP cells is tested at 2 SE "
        f"one-sided (~2.3% false positives each, ~{1 - 0.977**tests:.0%} chance of at least "
        "one by chance alone): an isolated cell is weak evidence, a pattern across the rates "
        "of one setting stronger; a reduction with z between 2 and 3 is suggestive, not "
        "established.",
    ]
    return lines


def _theorem51_table(checks: Sequence[LinearCheck]) -> list[str]:
    lines = [
        "## Theorem 5.1 (linear attack) by simulation",
        "",
        "Scalar x, fixed k ~ N(0, I_1000), noise std 1, 2000 masks and noise draws per r "
        "(`theorem51_check`; `tests/lab/test_inverting.py` checks the same at 5 SE). "
        "'exact' is sigma^2 / ||m * k||^2 averaged over the same masks (Eq. 110 given m); "
        "'bound' is Eq. 17 with keep / d = 1 - r.",
        "",
        "| r | empirical E‖x − x̂‖² | exact | Eq. 17 bound |",
        "|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {c.rate:g} | {_fmt(c.empirical, 5)} | {c.exact:.5f} | {c.bound:.5f} |" for c in checks
    ]
    return lines


def _limitations(config: ExperimentConfig) -> list[str]:
    return [
        "## Limits of this evidence",
        "",
        f"- {config.num_images} images (the paper: 200), one model at its initial weights, "
        "one restart. Trained weights, and real clients' batches (a sum of ~"
        f"{config.batch_size} clipped gradients per step, several steps per round) make IG "
        "harder: these cells are the attacker's best case.",
        f"- {config.attack.iterations} iterations per attack (IG: 24,000 on ImageNet-size "
        "models), to keep the grid near 20 CPU-minutes on a shared 2-core machine; the "
        "noise-free r = 0 cell shows the attack converges within it.",
        "- Label known to the attacker; the iDLG column shows how often it could have been "
        "inferred (it needs the true class's output-bias coordinate on the mask, and little "
        "noise).",
        "- Thm 5.1 is about a linear (single-layer) attack; Fig. 5 and this grid test its "
        "intuition on IG, which the theorem does not cover.",
    ]


def write_outputs(results: Results, config: ExperimentConfig, out: Path, *, command: str) -> None:
    """Writes ``results.csv``, ``mse_vs_rate.png``, ``examples.png`` and ``report.md``."""
    out.mkdir(parents=True, exist_ok=True)
    cells = summarize(results)
    write_csv(results, out / "results.csv")
    plot_mse(results, cells, out / "mse_vs_rate.png")
    plot_examples(results, config.rates, out / "examples.png")
    checks = theorem51_check([r for r in config.rates if r <= 0.9])
    write_report(results, config, cells, checks, out / "report.md", command=command)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedsparse.lab.research.inversion --out DIR``: run the grid and write its
    outputs."""
    parser = argparse.ArgumentParser(
        prog="python -m fedsparse.lab.research.inversion", description=__doc__
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--images", type=int, default=ExperimentConfig.num_images)
    parser.add_argument("--iterations", type=int, default=InversionConfig.iterations)
    parser.add_argument("--restarts", type=int, default=InversionConfig.restarts)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (performance)")
    args = parser.parse_args(argv)
    try:
        config = ExperimentConfig(
            num_images=args.images,
            seed=args.seed,
            attack=InversionConfig(iterations=args.iterations, restarts=args.restarts),
        )
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    results = run(config)
    given = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python -m fedsparse.lab.research.inversion", *given])
    write_outputs(results, config, args.out, command=command)
    print(f"wrote {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
