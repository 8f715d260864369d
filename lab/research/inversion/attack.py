"""The two attacks of the gradient-inversion study on one client's update, and the victim
that sends it: Inverting Gradients (``invert_gradients``; ``infer_label``, the iDLG
label), the closed-form linear attack of Thm 5.1 with its expected error and lower bound,
and ``victim_update``, one step of the repository's ``SparseDPOptimizer`` on a batch of one.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.dp.optimizer import MechanismName
from fedsparse.common.known_warnings import quiet_known_warnings

__all__ = [
    "InversionConfig",
    "PixelScale",
    "PrivacySetting",
    "Reconstruction",
    "flat_gradient",
    "infer_label",
    "invert_gradients",
    "linear_attack",
    "linear_attack_expected_error",
    "reconstruction_error",
    "theorem51_lower_bound",
    "total_variation",
    "victim_update",
]


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
