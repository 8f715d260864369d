"""Tests for the torch.func DP engine (fedsparse.common.dp.engines.func): what is its own.

Its equivalence with the Opacus engine after an epoch, the mechanism (masked clipping, the
noise, empty batches, secure mode) and the engine choice are tested for every engine in
``test_engines.py``; here, its per-sample gradients themselves and the layers it refuses.
"""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.dp.engines import select_engine
from fedsparse.common.dp.engines.func import FuncDPEngine, FuncGradSampleModule, func_support_error
from fedsparse.common.models.classifiers import MODEL_INPUT_SHAPES, MODEL_NAMES, build_model
from fedsparse.common.training.configs import PrivacyConfig, TrainConfig
from fedsparse.common.training.local import make_private
from tests.common.dp.engine_helpers import backward

warnings.filterwarnings("ignore", message="Secure RNG turned off")

CPU = torch.device("cpu")


# --- equivalence with the Opacus engine -------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_per_sample_gradients_equal_opacus_hooks_for_every_model(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, *MODEL_INPUT_SHAPES[name], generator=g)
    y = torch.randint(0, 10, (4,), generator=g)
    grads = {}
    for engine_cls in (SparseDPEngine, FuncDPEngine):
        model = build_model(name)
        module, optimizer, _ = engine_cls().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )
        backward(module, x, y, nn.CrossEntropyLoss())
        grads[engine_cls] = [p.grad_sample for p in model.parameters()]
    for hooks, func in zip(grads[SparseDPEngine], grads[FuncDPEngine], strict=True):
        assert func.shape == hooks.shape == (4, *hooks.shape[1:])
        torch.testing.assert_close(func, hooks, rtol=1e-5, atol=1e-6 * float(hooks.abs().max()))


# --- the mechanism, on the func engine --------------------------------------------------------


def test_frozen_parameters_get_no_per_sample_gradient() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    module = FuncGradSampleModule(model)
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    loss = module.backward_per_sample(x, y, criterion=nn.CrossEntropyLoss())
    assert getattr(model[0].weight, "grad_sample", None) is None
    assert [tuple(p.grad_sample.shape) for p in model.parameters() if p.requires_grad] == [
        (5, 4),
        (5, 2, 4),
        (5, 2),
    ]
    # Example 0's own gradient, by plain autograd.
    model.zero_grad()
    nn.functional.cross_entropy(model(x[:1]), y[:1]).backward()
    torch.testing.assert_close(model[2].weight.grad_sample[0], model[2].weight.grad)
    with torch.no_grad():
        assert float(loss) == pytest.approx(float(nn.functional.cross_entropy(model(x), y)))


# --- which engine, which device ---------------------------------------------------------------


def test_unsupported_layers_are_named() -> None:
    batchnorm = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    dropout = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.5)))
    stats_norm = nn.Sequential(nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2, track_running_stats=True))
    assert "layer '1' (BatchNorm2d) mixes the examples" in str(func_support_error(batchnorm))
    assert "layer '1.0' (Dropout) draws randomness" in str(func_support_error(dropout))
    assert "layer '1' (InstanceNorm2d) updates running statistics" in str(
        func_support_error(stats_norm)
    )
    for module in (batchnorm, dropout):
        with pytest.raises(ValueError, match=r"^engine='func': layer '1"):
            select_engine("func", module=module, device=CPU)
        with pytest.raises(ValueError, match=r"^engine='func': layer '1"):
            FuncGradSampleModule(module)
        # auto falls back to Opacus (which trains Dropout and refuses BatchNorm itself).
        assert select_engine("auto", module=module, device=torch.device("cuda")) == "opacus"
    model = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.1), nn.Linear(8, 2))
    x, y = torch.randn(16, 2), torch.randint(0, 2, (16,))
    with pytest.raises(ValueError, match=r"^engine='func': layer '1' \(Dropout\)"):
        make_private(
            model,
            x,
            y,
            privacy=PrivacyConfig(noise_multiplier=1.0),
            train=TrainConfig(engine="func", device="cpu"),
            epochs_for_target=1,
        )
