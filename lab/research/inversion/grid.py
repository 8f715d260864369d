"""The gradient-inversion experiment: its grid (``ExperimentConfig``: rates x privacy
settings, the null cell), its seed streams (``AttackStream``), the TV-weight tuning, and
``run``, which attacks every (setting, rate, image) cell.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn

from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.dp.accounting import (
    calibrate_noise_multiplier,
    compute_epsilon,
    sample_rate,
    steps_per_epoch,
)
from fedsparse.common.dp.mechanisms import is_private, mechanism_of
from fedsparse.common.masks import derive_seed, keep_count, sample_mask
from fedsparse.common.models.classifiers import build_model
from fedsparse.lab.experiments.stats import mean_se
from fedsparse.lab.research.inversion.attack import (
    InversionConfig,
    PixelScale,
    PrivacySetting,
    infer_label,
    invert_gradients,
    reconstruction_error,
    victim_update,
)

__all__ = [
    "NULL_LABEL",
    "AttackRow",
    "AttackStream",
    "ExperimentConfig",
    "Results",
    "attack_one",
    "privacy_settings",
    "run",
    "single_step_epsilon",
    "tune_tv_weight",
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
    if not is_private(privacy.mechanism):
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
    noisy = next(s for s in settings if not mechanism_of(s.mechanism).clips)
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
