"""Gradient inversion (``lab/research/inversion/attack.py``): IG works, reads only the mask,
Thm 5.1 holds.

The IG tests attack ``digits-cnn`` at its initial weights on one digits test image. The
Thm 5.1 tests run the closed-form linear attack over thousands of masks and noise draws and
compare the mean squared error with its exact expectation (given each mask, ``sigma^2 /
||m * k||^2``) and with Eq. 17's bound, at 5 standard errors, for r in {0, 0.5, 0.9}.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.masks import derive_seed, keep_count, sample_mask
from fedsparse.common.models.classifiers import build_model
from fedsparse.lab.research.inversion.attack import (
    InversionConfig,
    PixelScale,
    PrivacySetting,
    Reconstruction,
    flat_gradient,
    infer_label,
    invert_gradients,
    linear_attack,
    linear_attack_expected_error,
    reconstruction_error,
    theorem51_lower_bound,
    victim_update,
)

# Seed streams of this module: derive_seed(SEED, stream, ...).
SEED = 20231
MASKS, NOISE, CONSTRAINTS, DUMMY = range(4)
IMAGE = 7  # a test image ("3"); any other converges as well in the experiment's grid
LR = 0.5
TRIALS = 2000
DIM = 100  # r * DIM is an integer for every tested r: keep / d is exactly 1 - r
RATES = (0.0, 0.5, 0.9)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread: the IG loop is tiny, and threads only contend on a shared machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PixelScale]:
    """The attacked image and label, the training-mean image and the pixel scale."""
    train, test = load_dataset("digits", seed=0)
    return (
        test.x[IMAGE : IMAGE + 1],
        test.y[IMAGE : IMAGE + 1],
        train.x.mean(dim=0, keepdim=True),
        PixelScale.of_standardized(train.x),
    )


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model("digits-cnn", seed=0)


def _generator(*path: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(SEED, *path))


def _mask(numel: int, rate: float, seed: int) -> torch.Tensor:
    return sample_mask(numel, keep=keep_count(numel, rate=rate), seed=seed)


def _invert(
    model: torch.nn.Module,
    observed: torch.Tensor,
    mask: torch.Tensor | None,
    label: int,
    scale: PixelScale,
    iterations: int,
    seed: int = 0,
) -> Reconstruction:
    return invert_gradients(
        model,
        observed,
        mask=mask,
        label=label,
        image_shape=(1, 8, 8),
        bounds=scale.bounds,
        config=InversionConfig(iterations=iterations, tv_weight=1e-2),
        generator=_generator(DUMMY, seed),
    )


# --- inverting gradients ------------------------------------------------------------------


def test_pixel_scale_recovers_the_ink_levels(digits):
    image, _, mean_image, scale = digits
    pixels = scale.to_pixels(torch.cat([image, mean_image]))
    assert float(pixels.min()) >= -1e-6 and float(pixels.max()) <= 1 + 1e-6
    levels = scale.to_pixels(image) * 16  # digits are 0..16 ink levels
    assert torch.allclose(levels, levels.round(), atol=1e-4)
    assert scale.bounds == pytest.approx((-scale.mean / scale.std, (1 - scale.mean) / scale.std))


def test_ig_recovers_a_digit_without_noise_or_sparsification(digits, model):
    """Plain gradient (r = 0, no noise): IG finds the image.

    Threshold 0.01 pixel MSE (PSNR 20 dB: the same digit to the eye). The training-mean
    image, which knows nothing of this one, is at ~0.1 (asserted); 100 iterations reach
    ~0.002 on this image, as the experiment's 300 do on its non-private r = 0 cell: 0.01
    leaves a 5x margin for float differences across platforms while failing any attack that
    did not find the image.
    """
    image, label, mean_image, scale = digits
    observed = flat_gradient(model, image, label)
    result = _invert(model, observed, None, int(label), scale, iterations=100)
    mse, psnr = reconstruction_error(result.image, image, scale=scale)
    mean_mse, _ = reconstruction_error(mean_image, image, scale=scale)
    assert mean_mse > 0.05
    assert mse < 0.01 and psnr > 20
    assert result.objective < 0.1  # the gradients' directions match
    assert all(p.grad is None for p in model.parameters())  # the model is left as it was


def test_ig_sees_only_the_masks_support(digits, model):
    """Off-mask values of the observed gradient change nothing; on-mask ones do."""
    image, label, _, scale = digits
    gradient = flat_gradient(model, image, label)
    mask = _mask(gradient.numel(), 0.9, seed=derive_seed(SEED, MASKS))
    observed = gradient * mask
    junk = torch.randn(gradient.numel(), generator=_generator(NOISE, 0)) * 100
    off_changed = torch.where(mask, observed, junk)
    on_changed = observed.clone()
    on_changed[torch.nonzero(mask)[:50, 0]] += 1.0
    base = _invert(model, observed, mask, int(label), scale, iterations=12)
    assert torch.equal(base.image, _invert(model, off_changed, mask, int(label), scale, 12).image)
    assert base.objective == _invert(model, off_changed, mask, int(label), scale, 12).objective
    assert not torch.equal(
        base.image, _invert(model, on_changed, mask, int(label), scale, 12).image
    )


def test_ig_same_seed_same_image_other_seed_other_image(digits, model):
    image, label, _, scale = digits
    observed = flat_gradient(model, image, label)
    first = _invert(model, observed, None, int(label), scale, iterations=5, seed=1)
    again = _invert(model, observed, None, int(label), scale, iterations=5, seed=1)
    other = _invert(model, observed, None, int(label), scale, iterations=5, seed=2)
    assert torch.equal(first.image, again.image)
    assert not torch.equal(first.image, other.image)


def test_ig_refuses_an_empty_observation(digits, model):
    image, label, _, scale = digits
    gradient = flat_gradient(model, image, label)
    nothing = torch.zeros(gradient.numel(), dtype=torch.bool)
    with pytest.raises(ValueError, match="observed"):
        _invert(model, gradient, nothing, int(label), scale, iterations=1)
    with pytest.raises(ValueError, match="observed"):
        _invert(model, torch.zeros_like(gradient), None, int(label), scale, iterations=1)


def test_victim_update_is_the_engines_clipped_masked_step(digits, model):
    """No noise: delta = -lr * clip_C(m * g); exactly zero off the mask."""
    image, label, _, _ = digits
    gradient = flat_gradient(model, image, label)
    mask = _mask(gradient.numel(), 0.5, seed=derive_seed(SEED, MASKS, 1))
    clipped = PrivacySetting(
        label="c", mechanism="clipped", noise_multiplier=0.0, max_grad_norm=0.1
    )
    delta = victim_update(
        model, image, int(label), privacy=clipped, mask=mask, lr=LR, generator=_generator(NOISE)
    )
    kept = gradient * mask
    expected = -LR * kept * min(1.0, 0.1 / (float(kept.norm()) + 1e-6))
    assert torch.equal(delta[~mask], torch.zeros(int((~mask).sum())))
    # w - lr * g - w rounds to the weights' ulp (~1e-8 here): atol covers it.
    assert torch.allclose(delta, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rate", [0.0, 0.9])
def test_victim_update_noise_is_sigma_c_on_the_mask_only(digits, model, rate):
    """DP step: (-delta / lr - clipped signal) / (sigma C) is N(0, 1) on the mask, 0 off it.

    Moments at 5 SE (mean: 1 / sqrt(k); variance: sqrt(2 / k)); a noise 1.5x too large is
    rejected by the same variance test.
    """
    image, label, _, _ = digits
    sigma, clip = 1.3, 0.5
    gradient = flat_gradient(model, image, label)
    mask = _mask(gradient.numel(), rate, seed=derive_seed(SEED, MASKS, 2))
    dp = PrivacySetting(label="dp", mechanism="dpsgd", noise_multiplier=sigma, max_grad_norm=clip)
    delta = victim_update(
        model, image, int(label), privacy=dp, mask=mask, lr=LR, generator=_generator(NOISE, 3)
    )
    kept = gradient * mask
    signal = kept * min(1.0, clip / (float(kept.norm()) + 1e-6))
    residual = ((-delta / LR - signal) / (sigma * clip))[mask].double()
    k = residual.numel()
    assert torch.equal(delta[~mask], torch.zeros(int((~mask).sum())))
    assert abs(float(residual.mean())) < 5 / math.sqrt(k)
    assert abs(float(residual.var()) - 1) < 5 * math.sqrt(2 / k)
    assert abs(float((residual / 1.5).var()) - 1) > 5 * math.sqrt(2 / k)


def test_infer_label_reads_the_output_bias(digits, model):
    image, label, _, _ = digits
    gradient = flat_gradient(model, image, label)
    assert infer_label(gradient, None, num_classes=10) == int(label)
    hide = torch.ones(gradient.numel(), dtype=torch.bool)
    hide[-10:] = False
    assert infer_label(gradient, hide, num_classes=10) == -1
    hide[-10 + int(label)] = True  # only the true class's bias coordinate observed
    assert infer_label(gradient, hide, num_classes=10) == int(label)


# --- Theorem 5.1: the linear attack --------------------------------------------------------


def _linear_trials(k: torch.Tensor, rate: float, std: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per trial: the attack's squared error and its exact expectation given the mask."""
    x = torch.tensor([-1.3], dtype=torch.float64)
    keep = keep_count(len(k), rate=rate)
    noise = torch.randn(TRIALS, len(k), generator=_generator(NOISE, 4), dtype=torch.float64)
    errors, exact = [], []
    for trial in range(TRIALS):
        mask = sample_mask(len(k), keep=keep, seed=derive_seed(SEED, MASKS, 3, trial))
        observed = mask * (k * x + std * noise[trial])
        errors.append(float((linear_attack(k, observed, mask) - x).pow(2).sum()))
        exact.append(linear_attack_expected_error(k, mask, std=std))
    return torch.tensor(errors, dtype=torch.float64), torch.tensor(exact, dtype=torch.float64)


@pytest.mark.parametrize("rate", RATES)
def test_linear_attack_error_matches_its_exact_expectation(rate):
    """Given m, the error is (sigma^2 / ||m*k||^2) * chi2_1: sum over trials, z-test at 5 SE.

    The same test rejects the error the attack would have without sparsification,
    sigma^2 / ||k||^2, wherever r > 0.
    """
    std = 0.3
    k = torch.randn(DIM, generator=_generator(CONSTRAINTS), dtype=torch.float64)
    errors, exact = _linear_trials(k, rate, std)
    se = float(torch.sqrt(2 * exact.pow(2).sum()))  # Var[c * chi2_1] = 2 c^2
    assert abs(float(errors.sum() - exact.sum())) < 5 * se
    dense = std**2 / float(k.pow(2).sum())
    z_dense = float(errors.sum() - TRIALS * dense) / (math.sqrt(2 * TRIALS) * dense)
    if rate > 0:
        assert z_dense > 5
    else:
        assert abs(z_dense) < 5


@pytest.mark.parametrize("rate", RATES)
def test_linear_attack_respects_the_theorem51_bound(rate):
    """Eq. 17: the mean error over masks and noise is at least sigma^2 / ((1 - r) ||k||^2)."""
    std = 0.3
    k = torch.randn(DIM, generator=_generator(CONSTRAINTS), dtype=torch.float64)
    errors, exact = _linear_trials(k, rate, std)
    bound = theorem51_lower_bound(k, std=std, keep_fraction=1 - rate)
    se = float(errors.std() / math.sqrt(TRIALS))
    assert float(errors.mean()) > bound - 5 * se
    assert float(exact.mean()) >= bound * (1 - 1e-12)  # Jensen, over the drawn masks


@pytest.mark.parametrize("rate", RATES)
def test_theorem51_bound_is_exact_for_equal_magnitudes(rate):
    """|k_i| all equal: ||m*k||^2 is the same for every mask, and Eq. 17 holds with equality."""
    std = 0.3
    signs = torch.randint(0, 2, (DIM,), generator=_generator(CONSTRAINTS, 1)) * 2 - 1
    k = 0.7 * signs.double()
    errors, _ = _linear_trials(k, rate, std)
    bound = theorem51_lower_bound(k, std=std, keep_fraction=1 - rate)
    se = bound * math.sqrt(2 / TRIALS)  # error = bound * chi2_1 exactly
    assert abs(float(errors.mean()) - bound) < 5 * se
    assert abs(float(errors.mean()) - 1.5 * bound) > 5 * se


def test_linear_attack_ignores_off_mask_rows_and_solves_matrices():
    gen = _generator(CONSTRAINTS, 2)
    matrix = torch.randn(40, 3, generator=gen, dtype=torch.float64)
    x = torch.tensor([0.5, -2.0, 1.25], dtype=torch.float64)
    mask = _mask(40, 0.5, seed=derive_seed(SEED, MASKS, 4))
    observed = torch.where(mask, matrix @ x, torch.full((40,), 1e6, dtype=torch.float64))
    assert torch.allclose(linear_attack(matrix, observed, mask), x, atol=1e-10)
    expected = linear_attack_expected_error(matrix, mask, std=2.0)
    rows = matrix[mask]
    assert expected == pytest.approx(4.0 * float(torch.linalg.inv(rows.T @ rows).trace()))


def test_linear_attack_refuses_an_undetermined_input():
    k = torch.zeros(10, dtype=torch.float64)
    k[0] = 1.0
    mask = torch.zeros(10, dtype=torch.bool)
    mask[1:] = True  # m * k = 0: the paper's "arbitrary reconstruction error"
    with pytest.raises(ValueError, match="mask"):
        linear_attack(k, torch.ones(10, dtype=torch.float64), mask)
