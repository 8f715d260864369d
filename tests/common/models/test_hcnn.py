"""Tests for the H-CNNs (fedsparse.common.models.classifiers) and their scattering front end.

The scattering reference values below were computed with kymatio 0.3.0's ``Scattering2D``
(J=2, L=8; torch 2.13, scipy 1.17) on ``_pattern`` images; where kymatio is installed,
``test_scattering_equals_kymatio`` also compares whole outputs against it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from opacus import GradSampleModule
from opacus.validators import ModuleValidator
from torch import nn

from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import (
    HCNN,
    MODEL_INPUT_SHAPES,
    HCNNMnist,
    build_model,
    count_parameters,
)
from fedsparse.common.models.scattering import Scattering2D, morlet_filter_bank, scattering_channels
from fedsparse.common.training.configs import PrivacyConfig, TrainConfig
from fedsparse.common.training.local import make_private, train_one_epoch

warnings.filterwarnings("ignore", message="Secure RNG turned off")

HCNNS = ("cifar10-hcnn", "mnist-hcnn")

# kymatio 0.3.0 on _pattern(28, 28): per-channel spatial mean and _weights-weighted mean.
KYMATIO_28_MEAN = [
    0.35131, 0.134345, 0.167386, 0.172138, 0.154864, 0.0973349, 0.0534094, 0.051638, 0.0847355,
    0.176009, 0.236899, 0.300704, 0.265653, 0.132053, 0.0642048, 0.0597596, 0.115179, 0.010334,
    0.0115312, 0.00990214, 0.00918471, 0.00875485, 0.00836785, 0.0086555, 0.00888998, 0.0160803,
    0.0161218, 0.0135553, 0.0117662, 0.0106777, 0.0128581, 0.0140303, 0.0151098, 0.0164142,
    0.0170482, 0.0184012, 0.015674, 0.0116615, 0.0112094, 0.0121325, 0.0142109, 0.00855213,
    0.0101804, 0.0169729, 0.0238788, 0.0153281, 0.00850493, 0.00675816, 0.00672849, 0.00657581,
    0.00731511, 0.0121345, 0.0152674, 0.0112506, 0.00823047, 0.00753998, 0.00656353, 0.00678899,
    0.00821691, 0.00844625, 0.00939812, 0.0075844, 0.00733266, 0.00738248, 0.00649169,
    0.00562723, 0.00582738, 0.00636919, 0.00646653, 0.00679847, 0.0067207, 0.00564873,
    0.00563741, 0.00532146, 0.00528043, 0.00518408, 0.00559616, 0.00550381, 0.00508323,
    0.00487987, 0.00512247,
]  # fmt: skip
KYMATIO_28_WEIGHTED = [
    0.0432736, -0.00189947, -0.00396594, -0.00276286, 3.22677e-06, -0.000429905, 1.13239e-05,
    0.00176863, 0.00152143, -0.00484754, -0.00344701, -0.00713346, -0.00805863, -0.000778207,
    0.00100599, -0.00223077, 0.000764317, -0.000337271, -0.00033749, 0.000192706, -0.000130943,
    -0.000312909, -0.000188291, -0.000202118, -0.000555779, -3.80296e-05, -1.48321e-05,
    0.000525551, -3.83847e-05, -0.00058035, -0.000498764, -0.000181307, -0.000331155,
    -2.07192e-05, 0.000199153, 3.22629e-06, -0.00127, -0.000681898, -0.000144378, -0.000145952,
    -0.000308516, 0.000224187, -0.000250507, -0.000778067, -0.00203845, -0.000995006,
    0.000264054, 0.000330507, 0.000316007, 1.51039e-05, -0.000229533, -0.000709368, -0.00118715,
    0.000126317, 0.000670794, 0.000266187, -0.000236012, 1.6432e-06, -0.000309223, -0.000287518,
    -0.000173536, 0.000393681, 0.000318932, -0.000114378, -0.000269734, 8.86641e-05,
    2.81332e-05, 8.87912e-05, -0.000197852, -5.79865e-05, -0.000116882, -0.000117972,
    -0.000433556, -0.000135384, 6.71995e-05, -2.71038e-05, -0.000337896, -0.000298224,
    4.74808e-05, -2.84769e-05, -0.00038654,
]  # fmt: skip
KYMATIO_32_MEAN = [
    0.308231, 0.150264, 0.190196, 0.188927, 0.163397, 0.0996955, 0.0514158, 0.0512408, 0.0912413,
    0.170815, 0.237022, 0.309763, 0.263284, 0.123888, 0.0575313, 0.0512366, 0.108787, 0.0111414,
    0.0119865, 0.0105852, 0.00903843, 0.00826901, 0.00822532, 0.00867642, 0.00968388, 0.0179405,
    0.0172247, 0.0143327, 0.0113153, 0.00992145, 0.0118637, 0.013888, 0.0163805, 0.0187623,
    0.019086, 0.0199456, 0.0144096, 0.00999172, 0.00976461, 0.0116567, 0.0153381, 0.00914954,
    0.011343, 0.0176099, 0.0211661, 0.0131644, 0.00858792, 0.0074371, 0.00776972, 0.00651157,
    0.00685818, 0.0118269, 0.013845, 0.0109642, 0.0082487, 0.00713248, 0.0066449, 0.00660206,
    0.00762434, 0.00819375, 0.00866818, 0.00763808, 0.00694222, 0.00652003, 0.0062868,
    0.00500085, 0.00563902, 0.00567598, 0.00600302, 0.00633309, 0.00586395, 0.00494226,
    0.0047747, 0.00533577, 0.00505312, 0.00531536, 0.0054625, 0.00518097, 0.0051123, 0.00497332,
    0.00530037,
]  # fmt: skip


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pattern(h: int, w: int) -> torch.Tensor:
    """A deterministic ``h x w`` image with edges at many angles and scales (no RNG)."""
    i = torch.arange(h, dtype=torch.float64)[:, None]
    j = torch.arange(w, dtype=torch.float64)[None, :]
    bar = (i - h / 3).abs().lt(3).double()
    return (torch.sin(0.7 * i + 0.3 * j) + torch.cos(0.05 * i * j) + bar).float()


def _weights(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64)
    return torch.cos(k)[:, None] * torch.sin(k + 1)[None, :]


def _images(name: str, batch: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *MODEL_INPUT_SHAPES[name], generator=gen)


# --- architecture ------------------------------------------------------------------------------


def test_cifar10_hcnn_has_exactly_187210_trainable_parameters() -> None:
    model = build_model("cifar10-hcnn")
    assert isinstance(model, HCNN)
    # conv 243->64 (3x3 + bias), conv 64->64, linear 64*4*4 -> 10.
    expected = (243 * 64 * 9 + 64) + (64 * 64 * 9 + 64) + (1024 * 10 + 10)
    assert expected == 187_210
    assert count_parameters(model) == count_parameters(model, trainable_only=False) == 187_210
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [(64, 243, 3, 3), (64,), (64, 64, 3, 3), (64,), (10, 1024), (10,)]
    assert ParamLayout.from_module(model).numel == 187_210


def test_mnist_hcnn_has_exactly_33066_trainable_parameters() -> None:
    model = build_model("mnist-hcnn")
    assert isinstance(model, HCNNMnist)
    expected = (81 * 16 * 9 + 16) + (16 * 32 * 9 + 32) + (512 * 32 + 32) + (32 * 10 + 10)
    assert expected == 33_066
    assert count_parameters(model) == count_parameters(model, trainable_only=False) == 33_066
    assert ParamLayout.from_module(model).numel == 33_066


@pytest.mark.parametrize("name", HCNNS)
def test_front_end_has_no_parameters_and_fixed_buffers(name: str) -> None:
    model = build_model(name, seed=0)
    assert list(model.scattering.parameters()) == []
    assert list(model.norm.parameters()) == []  # GroupNorm(affine=False)
    buffers = dict(model.scattering.named_buffers())
    assert buffers and not any(b.requires_grad for b in buffers.values())
    # Not in state_dict (nothing to send or checkpoint); rebuilt identically anyway.
    assert all(key.startswith(("features.", "classifier.")) for key in model.state_dict())
    other = dict(build_model(name, seed=1).scattering.named_buffers())
    assert all(torch.equal(buffers[k], other[k]) for k in buffers)


@pytest.mark.parametrize("name", HCNNS)
def test_output_shapes(name: str) -> None:
    model = build_model(name)
    x = _images(name, 3)
    channels, size = MODEL_INPUT_SHAPES[name][0], MODEL_INPUT_SHAPES[name][1] // 4
    assert model.scattering(x).shape == (3, channels, 81, size, size)
    assert model(x).shape == (3, 10)
    assert build_model(name, num_classes=7)(x).shape == (3, 7)
    assert model(x[:0]).shape == (0, 10)  # an empty Poisson batch
    with pytest.raises(RuntimeError, match="expected"):
        model(torch.zeros(2, 1, 8, 8))


def test_scattering_channel_count_and_bank_sizes() -> None:
    assert scattering_channels(J=2, L=8) == 81
    assert scattering_channels(J=3, L=8) == 1 + 24 + 64 * 3
    phi, psi = morlet_filter_bank(40, 40, J=2, L=8)
    assert [p.shape for p in phi] == [(40, 40), (20, 20)]
    assert [[len(levels) for levels in per_angle] for per_angle in psi] == [[1] * 8, [1] * 8]
    with pytest.raises(ValueError, match="shape"):
        Scattering2D(shape=(3, 3), J=2)


# --- the scattering transform itself -----------------------------------------------------------


def test_scattering_is_deterministic_and_per_image() -> None:
    scattering = Scattering2D(shape=(32, 32))
    x = _images("cifar10-hcnn", 4)
    out = scattering(x)
    assert torch.equal(out, scattering(x))
    assert torch.equal(out, Scattering2D(shape=(32, 32))(x))
    # Each image alone gives its own features: no statistics across the batch.
    alone = torch.cat([scattering(x[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(alone, out, rtol=1e-5, atol=1e-6)
    colour = scattering(x[:, 1:2].contiguous())
    torch.testing.assert_close(colour[:, 0], out[:, 1], rtol=1e-5, atol=1e-6)


def test_scattering_matches_kymatio_reference_values() -> None:
    for size, means in ((28, KYMATIO_28_MEAN), (32, KYMATIO_32_MEAN)):
        out = Scattering2D(shape=(size, size))(_pattern(size, size)).double()
        expected = torch.tensor(means, dtype=torch.float64)
        torch.testing.assert_close(out.mean(dim=(-2, -1)), expected, rtol=1e-5, atol=1e-8)
    out = Scattering2D(shape=(28, 28))(_pattern(28, 28)).double()
    weighted = (out * _weights(7)).mean(dim=(-2, -1))
    expected = torch.tensor(KYMATIO_28_WEIGHTED, dtype=torch.float64)
    torch.testing.assert_close(weighted, expected, rtol=1e-4, atol=1e-8)


def test_scattering_equals_kymatio() -> None:
    # kymatio.torch fails to import with scipy >= 1.17 (its 3-D filter bank), the 2-D frontend
    # alone still imports: compare with it where it is installed.
    frontend = pytest.importorskip("kymatio.scattering2d.frontend.torch_frontend")
    x = torch.cat([_images("cifar10-hcnn", 2), _pattern(32, 32).expand(1, 3, 32, 32)])
    for size in (32, 28):
        image = x[..., :size, :size].contiguous()
        ours = Scattering2D(shape=(size, size))(image)
        theirs = frontend.ScatteringTorch2D(J=2, shape=(size, size), L=8)(image)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6 * float(theirs.abs().max()))


# --- DP-SGD ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HCNNS)
def test_opacus_accepts_the_model(name: str) -> None:
    model = build_model(name)
    assert ModuleValidator.validate(model, strict=True) == []
    GradSampleModule(model)  # hooks mode; refuses unsupported trainable layers
    # Hooks on the trainable layers only: the scattering and GroupNorm are not touched.
    hooked = {type(m).__name__ for m in model.modules() if m._forward_hooks}
    assert hooked == {"Conv2d", "Linear"}
    assert not model.scattering._forward_hooks and not model.norm._forward_hooks


@pytest.mark.parametrize("name", HCNNS)
def test_one_dp_sgd_step_moves_only_the_cnn(name: str) -> None:
    model = build_model(name, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    x, y = _images(name, 6, seed=1), torch.tensor([0, 1, 2, 3, 4, 5])
    train = TrainConfig(
        batch_size=6, lr=0.5, poisson_sampling=False, engine="opacus", seed=0, device="cpu"
    )
    engine, module, optimizer, loader = make_private(
        model,
        x,
        y,
        privacy=PrivacyConfig(noise_multiplier=1.0),
        train=train,
        epochs_for_target=1,
    )
    assert isinstance(module, GradSampleModule)
    assert engine.layout.numel == count_parameters(model)
    loss, examples = train_one_epoch(module, optimizer, loader)
    assert examples == 6 and torch.isfinite(torch.tensor(loss))
    assert len(engine.accountant.history) == 1  # one step was accounted
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), n  # every CNN tensor moved (noise alone would)
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n  # the scattering filters did not


@pytest.mark.parametrize("name", HCNNS)
def test_opacus_per_sample_gradients_equal_per_example_autograd(name: str) -> None:
    model = build_model(name, seed=2)
    x, y = _images(name, 2, seed=3), torch.tensor([3, 7])
    gsm = GradSampleModule(model, loss_reduction="sum")
    nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()
    per_sample = {n: p.grad_sample.detach().clone() for n, p in model.named_parameters()}
    for i in range(2):
        reference = build_model(name, seed=2)
        nn.functional.cross_entropy(reference(x[i : i + 1]), y[i : i + 1]).backward()
        for n, p in reference.named_parameters():
            assert p.grad is not None and per_sample[n].shape == (2, *p.shape)
            assert float(p.grad.abs().max()) > 0, n
            torch.testing.assert_close(per_sample[n][i], p.grad, rtol=1e-5, atol=1e-5)
    # And the two examples' gradients differ, so the comparison is not vacuous.
    first = per_sample["features.0.weight"]
    assert not torch.allclose(first[0], first[1])
