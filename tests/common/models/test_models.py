"""Tests for fedsparse.common.models.classifiers: shapes, parameter counts, Opacus compatibility."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from opacus import GradSampleModule
from opacus.validators import ModuleValidator
from torch import nn

from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.models.classifiers import (
    _REGISTRY,
    MODEL_NAMES,
    ActivationConfig,
    TemperedSigmoid,
    build_model,
    count_parameters,
)

INPUT_SHAPES = {
    "dpcnn": (3, 32, 32),
    "dpcnn-mnist": (1, 28, 28),
    "digits-cnn": (1, 8, 8),
    "cifar10-hcnn": (3, 32, 32),
    "mnist-hcnn": (1, 28, 28),
}
PARAM_COUNTS = {
    "dpcnn": 550_570,
    "dpcnn-mnist": 26_010,
    "digits-cnn": 38_282,
    "cifar10-hcnn": 187_210,
    "mnist-hcnn": 33_066,
}
TEMPERED = ActivationConfig(name="tempered_sigmoid")


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    # These models are tiny: intra-op threads only add overhead, and oversubscribed cores
    # (e.g. a parallel test run) slow multi-threaded torch down ~10x.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _inputs(name: str, batch: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *INPUT_SHAPES[name], generator=gen)


def test_registry_names() -> None:
    assert set(MODEL_NAMES) == set(INPUT_SHAPES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_parameter_count(name: str) -> None:
    model = build_model(name)
    assert count_parameters(model) == PARAM_COUNTS[name]
    assert count_parameters(model, trainable_only=False) == PARAM_COUNTS[name]


def test_dpcnn_parameter_count_by_layer() -> None:
    # conv 3->32, 32->32, 32->64, 64->64, 64->128, 128->128 (3x3 + bias), fc 2048->128, 128->10.
    convs = [(3, 32), (32, 32), (32, 64), (64, 64), (64, 128), (128, 128)]
    expected = sum(i * o * 9 + o for i, o in convs) + (2048 * 128 + 128) + (128 * 10 + 10)
    assert expected == 550_570
    shapes = [tuple(p.shape) for p in build_model("dpcnn").parameters()]
    assert shapes[0] == (32, 3, 3, 3)
    assert shapes[-4:] == [(128, 2048), (128,), (10, 128), (10,)]


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("num_classes", [10, 7])
def test_output_shape(name: str, num_classes: int) -> None:
    model = build_model(name, num_classes=num_classes)
    out = model(_inputs(name, 4))
    assert out.shape == (4, num_classes)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_no_batchnorm_anywhere() -> None:
    for name in MODEL_NAMES:
        for module in build_model(name).modules():
            assert not isinstance(module, nn.modules.batchnorm._BatchNorm), name


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="resnet") as info:
        build_model("resnet")
    for name in MODEL_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize("num_classes", [1, 0, 2.5])
def test_bad_num_classes(num_classes: int) -> None:
    with pytest.raises(ValueError, match="num_classes"):
        build_model("digits-cnn", num_classes=num_classes)


@pytest.mark.parametrize("name", ["digits-cnn", "dpcnn-mnist", "dpcnn"])
def test_seeded_weights_are_torch_manual_seeds(name: str) -> None:
    """Seeding the CPU generator alone draws the weights ``torch.manual_seed`` drew (the
    records of earlier runs stay bit-identical)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        reference = _REGISTRY[name](num_classes=10, activation=None)
    model = build_model(name, seed=11)
    for want, got in zip(reference.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(want, got)


def test_seed_reproducible_and_global_rng_untouched() -> None:
    state = torch.get_rng_state()
    a = build_model("dpcnn-mnist", seed=3)
    b = build_model("dpcnn-mnist", seed=3)
    c = build_model("dpcnn-mnist", seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    for (ka, va), (kb, vb), (_, vc) in zip(
        a.state_dict().items(), b.state_dict().items(), c.state_dict().items(), strict=True
    ):
        assert ka == kb
        assert torch.equal(va, vb)
        assert not torch.equal(va, vc)


def test_tempered_sigmoid_defaults_equal_tanh() -> None:
    x = torch.linspace(-6, 6, 1001)
    torch.testing.assert_close(TemperedSigmoid()(x), torch.tanh(x), atol=1e-6, rtol=0)


def test_tempered_sigmoid_custom_values() -> None:
    act = TemperedSigmoid(scale=3.0, inverse_temperature=0.5, offset=0.25)
    x = torch.tensor([-2.0, 0.0, 1.0, 100.0, -100.0])
    expected = 3.0 / (1.0 + torch.exp(-0.5 * x)) - 0.25
    torch.testing.assert_close(act(x), expected)
    assert act(torch.tensor(0.0)).item() == pytest.approx(1.25)
    assert act(torch.tensor(100.0)).item() == pytest.approx(2.75)  # s - o
    assert act(torch.tensor(-100.0)).item() == pytest.approx(-0.25)  # -o


def test_tempered_sigmoid_model_matches_tanh_model() -> None:
    tanh_model = build_model("digits-cnn", seed=1)
    tempered = build_model("digits-cnn", activation=TEMPERED, seed=1)
    assert any(isinstance(m, TemperedSigmoid) for m in tempered.modules())
    assert not any(isinstance(m, TemperedSigmoid) for m in tanh_model.modules())
    x = _inputs("digits-cnn", 8)
    torch.testing.assert_close(tempered(x), tanh_model(x), atol=1e-5, rtol=0)


def test_tempered_sigmoid_params_reach_the_model() -> None:
    config = ActivationConfig(
        name="tempered_sigmoid", scale=1.5, inverse_temperature=3.0, offset=0.5
    )
    model = build_model("dpcnn", activation=config)
    tempered = [m for m in model.modules() if isinstance(m, TemperedSigmoid)]
    assert len(tempered) == 7  # six convolutions and one hidden linear layer
    assert {(m.scale, m.inverse_temperature, m.offset) for m in tempered} == {(1.5, 3.0, 0.5)}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "relu"}, "name='relu'"),
        ({"scale": 0.0}, "scale=0.0"),
        ({"inverse_temperature": -1.0}, "inverse_temperature=-1.0"),
        ({"offset": float("nan")}, "offset=nan"),
    ],
)
def test_activation_config_validation(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ActivationConfig(**kwargs)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("activation", [None, TEMPERED])
def test_opacus_validator_accepts(name: str, activation: ActivationConfig | None) -> None:
    model = build_model(name, activation=activation)
    assert ModuleValidator.validate(model, strict=True) == []


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_per_sample_gradients_match_individual_gradients(name: str) -> None:
    batch = 3
    # float64 so the comparison is tight: float32 sums over 32x32 pixels differ by ~1e-4.
    model = build_model(name, activation=TEMPERED if name == "dpcnn-mnist" else None).double()
    gsm = GradSampleModule(model, loss_reduction="sum")
    x = _inputs(name, batch).double()
    y = torch.tensor([0, 3, 9])
    nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()
    per_sample = {n: p.grad_sample.detach().clone() for n, p in gsm.named_parameters()}
    assert len(per_sample) == len(list(model.parameters()))
    for pname, param in gsm.named_parameters():
        assert per_sample[pname].shape == (batch, *param.shape)
    # Each example's per-sample gradient equals the gradient of its loss alone.
    reference = build_model(name, activation=TEMPERED if name == "dpcnn-mnist" else None).double()
    reference.load_state_dict(model.state_dict())
    for i in range(batch):
        reference.zero_grad()
        nn.functional.cross_entropy(reference(x[i : i + 1]), y[i : i + 1]).backward()
        for (pname, _), ref_param in zip(
            gsm.named_parameters(), reference.parameters(), strict=True
        ):
            assert ref_param.grad is not None
            torch.testing.assert_close(per_sample[pname][i], ref_param.grad, atol=1e-10, rtol=1e-8)


def test_digits_cnn_trains_above_90_percent() -> None:
    train, test = load_dataset("digits", seed=0)
    model = build_model("digits-cnn", seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):  # ~0.98 test accuracy at seeds 0-2
        order = torch.randperm(len(train), generator=gen)
        for start in range(0, len(train), 32):
            idx = order[start : start + 32]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(train.x[idx]), train.y[idx]).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(test.x).argmax(dim=1) == test.y).float().mean().item()
    assert accuracy > 0.9
