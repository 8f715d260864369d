"""Tests for the factored DP engine (fedsparse.common.dp.engines.factored): what is its own.

Its equivalence with the Opacus engine after an epoch, the mechanism (masked clipping, the
noise, empty batches, secure mode) and the engine choice are tested for every engine in
``test_engines.py`` (with the tolerance's derivation); here, one step against Opacus's on
every model and layer path, the convolution paths against autograd, and what it refuses.
"""

import functools
import warnings

import pytest
import torch
from torch import nn

import fedsparse.common.dp.engines.factored_layers as factored_layers
from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.dp.engines import select_engine
from fedsparse.common.dp.engines.factored import (
    FactoredDPEngine,
    FactoredDPOptimizer,
    FactoredGradSampleModule,
)
from fedsparse.common.dp.engines.factored_layers import (
    conv2d_grad_sample,
    conv2d_weight_grad,
    factored_support_error,
)
from fedsparse.common.masks import keep_count, sample_mask
from fedsparse.common.models.classifiers import MODEL_INPUT_SHAPES, MODEL_NAMES, build_model
from tests.common.dp.engine_helpers import (
    backward,
    private,
    set_rate,
)

warnings.filterwarnings("ignore", message="Secure RNG turned off")

CPU = torch.device("cpu")


def one_step_grad(engine_cls, model_fn, x, y, *, rate: float, clip: float = 0.5, selector=None):
    """The gradient (noise-free) one step leaves on ``model_fn()``'s parameters, flat."""
    model = model_fn()
    engine, module, optimizer = private(engine_cls, model, x, y, max_grad_norm=clip)
    set_rate(engine, rate)
    if selector is not None:
        optimizer.set_step_selector(selector)
    optimizer.zero_grad()
    backward(module, x, y, nn.CrossEntropyLoss())
    optimizer.step()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])


# --- equivalence with the Opacus engine -------------------------------------------------------


@pytest.mark.parametrize("rate", [0.0, 0.7])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_clipped_sums_equal_opacus_for_every_model(name: str, rate: float) -> None:
    """Every model: the masked, clipped, summed gradient (C = 0.5 clips every example)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, *MODEL_INPUT_SHAPES[name], generator=g)
    y = torch.randint(0, 10, (6,), generator=g)
    model_fn = functools.partial(build_model, name, seed=1)
    hooks = one_step_grad(SparseDPEngine, model_fn, x, y, rate=rate)
    factored = one_step_grad(FactoredDPEngine, model_fn, x, y, rate=rate)
    assert factored.shape == hooks.shape
    torch.testing.assert_close(factored, hooks, rtol=1e-5, atol=1e-6 * float(hooks.abs().max()))
    if rate:
        mask = sample_mask(len(hooks), keep=keep_count(len(hooks), rate=rate), seed=3)
        assert torch.count_nonzero(factored[~mask]) == 0


@pytest.mark.parametrize(
    "conv",
    [
        dict(kernel_size=3, padding=1),
        dict(kernel_size=(3, 2), stride=2, padding=(2, 0)),
        dict(kernel_size=3, dilation=2, padding="same"),
        dict(kernel_size=2, stride=(1, 2), padding="valid", bias=False),
    ],
    ids=["3x3-pad1", "3x2-stride2", "dilated-same", "2x2-valid"],
)
def test_conv_per_sample_gradients_equal_autograd_per_example(conv: dict) -> None:
    """The grouped convolution backward's per-sample gradients, against autograd on each
    example alone; the summed weight gradient, against the sum of those."""
    torch.manual_seed(0)
    layer = nn.Conv2d(3, 4, **conv)
    x = torch.randn(5, 3, 9, 10)
    out = layer(x)
    weights = torch.randn_like(out)  # loss_i = <w_i, out_i>: its output gradient is w_i
    per_sample = conv2d_grad_sample(layer, x, weights)
    assert per_sample.shape == (5, layer.weight.numel())
    for i in range(5):
        layer.zero_grad()
        (layer(x[i : i + 1]) * weights[i : i + 1]).sum().backward()
        torch.testing.assert_close(per_sample[i], layer.weight.grad.reshape(-1))
    summed = conv2d_weight_grad(layer, x, weights)
    torch.testing.assert_close(summed.reshape(-1), per_sample.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keep_min_positions", [0, 10**9], ids=["kept", "recomputed"])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_conv_chunks_and_either_sum_give_opacus_s_step(
    chunk: int, keep_min_positions: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk sizes that do and do not divide the batch; per-sample gradients kept for the
    sum, or the sum recomputed from the scaled backpropagations: the same clipped sum."""
    monkeypatch.setattr(factored_layers, "_CHUNK", chunk)
    monkeypatch.setattr(factored_layers, "_KEEP_MIN_POSITIONS", keep_min_positions)
    monkeypatch.setattr(factored_layers, "_KEEP_MAX_VALUES", 0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, *MODEL_INPUT_SHAPES["dpcnn-mnist"], generator=g)
    y = torch.randint(0, 10, (7,), generator=g)
    model_fn = functools.partial(build_model, "dpcnn-mnist", seed=1)
    for rate in (0.0, 0.6):
        hooks = one_step_grad(SparseDPEngine, model_fn, x, y, rate=rate)
        factored = one_step_grad(FactoredDPEngine, model_fn, x, y, rate=rate)
        torch.testing.assert_close(factored, hooks, rtol=1e-5, atol=1e-7)


def test_a_linear_layer_over_a_sequence_sums_its_positions() -> None:
    """``Linear`` on ``(B, T, in)``: g_i = sum_t b_it a_it^T (materialized), as Opacus."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 5, 3, generator=g), torch.randint(0, 2, (4,), generator=g)

    def model_fn() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Flatten(), nn.Linear(30, 2))

    for rate in (0.0, 0.5):
        hooks = one_step_grad(SparseDPEngine, model_fn, x, y, rate=rate, clip=0.1)
        factored = one_step_grad(FactoredDPEngine, model_fn, x, y, rate=rate, clip=0.1)
        torch.testing.assert_close(factored, hooks, rtol=1e-5, atol=1e-7)


def test_frozen_parameters_keep_no_gradient_and_the_rest_equal_opacus() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 3, generator=g), torch.randint(0, 2, (5,), generator=g)

    def model_fn() -> nn.Module:
        torch.manual_seed(2)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Linear(2, 2))
        model[0].weight.requires_grad_(False)  # a trainable bias alone
        model[2].bias.requires_grad_(False)  # a trainable weight alone
        return model

    hooks = one_step_grad(SparseDPEngine, model_fn, x, y, rate=0.4, clip=0.2)
    factored = one_step_grad(FactoredDPEngine, model_fn, x, y, rate=0.4, clip=0.2)
    assert factored.numel() == 4 + 8 + 4 + 2
    torch.testing.assert_close(factored, hooks, rtol=1e-5, atol=1e-7)


def test_a_step_selector_sees_the_same_clipped_sum() -> None:
    """GIP's per-step selection (no public mask) runs on the factored engine's sum."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g)
    seen: dict[type, torch.Tensor] = {}

    def selector_for(cls):
        def select(summed: torch.Tensor) -> torch.Tensor:
            seen[cls] = summed.clone()
            return summed.abs() > summed.abs().median()

        return select

    model_fn = functools.partial(build_model, "digits-cnn", seed=1)
    grads = {
        cls: one_step_grad(cls, model_fn, x, y, rate=0.0, selector=selector_for(cls))
        for cls in (SparseDPEngine, FactoredDPEngine)
    }
    torch.testing.assert_close(seen[FactoredDPEngine], seen[SparseDPEngine], rtol=1e-5, atol=1e-7)
    assert torch.equal(grads[FactoredDPEngine] != 0, grads[SparseDPEngine] != 0)
    assert 0.4 < float((grads[FactoredDPEngine] != 0).float().mean()) < 0.6


def test_two_accumulated_batches_clip_each_example_once() -> None:
    """Without Poisson sampling two batches may accumulate before a step: the same step as
    one batch of both (every example clipped on its own), scaled by Opacus for 2 batches."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
    model_fn = functools.partial(build_model, "digits-cnn", seed=1)
    whole = one_step_grad(FactoredDPEngine, model_fn, x, y, rate=0.5)
    model = model_fn()
    engine, module, optimizer = private(FactoredDPEngine, model, x, y)
    set_rate(engine, 0.5)
    optimizer.zero_grad()
    module.backward_per_sample(x[:3], y[:3], criterion=nn.CrossEntropyLoss())
    module.backward_per_sample(x[3:], y[3:], criterion=nn.CrossEntropyLoss())
    assert isinstance(optimizer, FactoredDPOptimizer)
    optimizer.step()
    assert optimizer.accumulated_iterations == 2
    split = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(split * 2, whole, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="no per-sample gradients for this step"):
        optimizer.step()  # consumed: a second step needs another backward_per_sample


# --- the mechanism, on the factored engine ----------------------------------------------------


def test_no_hooks_or_parameter_gradients_are_left_by_a_backward() -> None:
    model = build_model("digits-cnn")
    module = FactoredGradSampleModule(model)
    x, y = torch.randn(3, 1, 8, 8), torch.randint(0, 10, (3,))
    loss = module.backward_per_sample(x, y, criterion=nn.CrossEntropyLoss())
    assert all(not layer._forward_hooks for layer in model.modules())
    assert all(p.grad is None for p in model.parameters())  # no summed gradient was formed
    assert len(module.pending) == 1 and len(module.pending[0]) == 4  # 2 convs, 2 linears
    with torch.no_grad():
        assert float(loss) == pytest.approx(float(nn.functional.cross_entropy(model(x), y)))


# --- what the engine refuses ------------------------------------------------------------------


def test_unsupported_models_are_refused_naming_the_layer() -> None:
    cases = {
        "layer '1' (BatchNorm2d) mixes the examples": nn.Sequential(
            nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)
        ),
        "layer '1' (GroupNorm) has trainable parameters": nn.Sequential(
            nn.Conv2d(2, 2, 3), nn.GroupNorm(1, 2)
        ),
        "layer '0' (Conv2d) has groups=2": nn.Sequential(nn.Conv2d(2, 2, 3, groups=2)),
        "layer '0' (Conv2d) has padding='same' with an even kernel": nn.Sequential(
            nn.Conv2d(2, 2, 2, padding="same")
        ),
    }
    shared = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    shared[1].weight = shared[0].weight
    cases["layers '0' and '1' share a parameter"] = shared
    for message, module in cases.items():
        assert message in str(factored_support_error(module))
        # auto falls back to Opacus on the CPU (which trains GroupNorm and refuses BatchNorm).
        assert select_engine("auto", module=module, device=CPU) == "opacus"
        with pytest.raises(ValueError, match=r"^engine='factored': layer"):
            select_engine("factored", module=module, device=CPU)
        with pytest.raises(ValueError, match=r"^engine='factored': layer"):
            FactoredGradSampleModule(module)
    # Parameter-free layers are fine, dropout included (each example's graph is its own).
    ok = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.1), nn.GroupNorm(2, 8, affine=False))
    assert factored_support_error(ok) is None


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class _Idle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.idle = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class _Pairs(nn.Module):  # examples folded into the batch dimension: (B, 4) -> (2B, 2)
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.reshape(-1, 2)).reshape(len(x), 4)


def test_a_layer_run_twice_idle_folded_or_modified_in_place_is_refused() -> None:
    x, y = torch.randn(3, 2), torch.randint(0, 2, (3,))
    cases = {
        r"layer 'lin' ran 2 times in one forward pass": (_Twice(), x),
        r"layer 'idle' has trainable parameters but did not run": (_Idle(), x),
        r"layer 'lin' saw input \(6, 2\) and output \(6, 2\) for a batch of 3": (
            _Pairs(),
            torch.randn(3, 4),
        ),
        r"output of layer '0' was modified in place": (
            nn.Sequential(nn.Linear(2, 4), nn.ReLU(inplace=True)),
            x,
        ),
    }
    for message, (model, inputs) in cases.items():
        module = FactoredGradSampleModule(model)
        with pytest.raises(ValueError, match=message):
            module.backward_per_sample(inputs, y, criterion=nn.CrossEntropyLoss())
        assert not module.pending and all(not m._forward_hooks for m in model.modules())
    with pytest.raises(ValueError, match=r"loss_reduction='none': expected 'mean' or 'sum'"):
        FactoredGradSampleModule(nn.Linear(2, 2), loss_reduction="none")


def test_an_input_changed_before_the_step_is_refused() -> None:
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    _, module, optimizer = private(FactoredDPEngine, nn.Sequential(nn.Linear(3, 2)), x, y)
    module.backward_per_sample(x, y, criterion=nn.CrossEntropyLoss())
    x.mul_(2.0)  # the factors hold the input: the step would not be the loss's gradient
    with pytest.raises(ValueError, match=r"the input of layer '0' was modified in place"):
        optimizer.step()


def test_zero_grad_drops_recorded_factors() -> None:
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    _, module, optimizer = private(FactoredDPEngine, nn.Sequential(nn.Linear(3, 2)), x, y)
    module.backward_per_sample(x, y, criterion=nn.CrossEntropyLoss())
    optimizer.zero_grad()
    assert module.pending == []
    with pytest.raises(ValueError, match="no per-sample gradients for this step"):
        optimizer.step()


class _ScaledLinear(nn.Linear):  # a subclass computes its own way: refused
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


class _Gain(nn.Module):  # a trainable parameter outside any Linear/Conv2d
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.gain = nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain


def test_subclasses_extra_parameters_and_later_unfreezing_are_refused() -> None:
    assert "(_ScaledLinear) has trainable parameters" in str(
        factored_support_error(nn.Sequential(_ScaledLinear(2, 2)))
    )
    extra = nn.Linear(2, 2)
    extra.register_parameter("scale", nn.Parameter(torch.ones(1)))
    assert "has parameters ['scale'] besides weight and bias" in str(
        factored_support_error(nn.Sequential(extra))
    )
    model = _Gain()
    module = FactoredGradSampleModule(model)  # gain frozen: accepted
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    module.backward_per_sample(x, y, criterion=nn.CrossEntropyLoss())
    model.gain.requires_grad_(True)  # unfrozen after wrapping: checked again, refused
    with pytest.raises(ValueError, match=r"layer '' \(_Gain\) has trainable parameters"):
        module.backward_per_sample(x, y, criterion=nn.CrossEntropyLoss())


def test_loss_reduction_sum_equals_opacus() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g)
    grads = []
    for cls in (SparseDPEngine, FactoredDPEngine):
        model = build_model("digits-cnn", seed=1)
        engine, module, optimizer = private(cls, model, x, y, loss_reduction="sum")
        set_rate(engine, 0.5)
        optimizer.zero_grad()
        backward(module, x, y, nn.CrossEntropyLoss(reduction="sum"))
        optimizer.step()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_some_examples_clipped_and_some_not_and_frozen_conv_parts_equal_opacus() -> None:
    """C at the median per-example norm: half the examples are clipped, half kept whole; a
    convolution with a frozen weight (its bias trains) and one with a frozen bias."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)

    def model_fn() -> nn.Module:
        model = build_model("digits-cnn", seed=1)
        convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
        convs[0].weight.requires_grad_(False)
        convs[1].bias.requires_grad_(False)
        return model

    model = model_fn()
    norms = []
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads = [p.grad.reshape(-1) for p in model.parameters() if p.requires_grad]
        norms.append(float(torch.cat(grads).norm()))
    clip = sorted(norms)[len(norms) // 2]
    assert min(norms) < clip < max(norms)
    hooks = one_step_grad(SparseDPEngine, model_fn, x, y, rate=0.0, clip=clip)
    factored = one_step_grad(FactoredDPEngine, model_fn, x, y, rate=0.0, clip=clip)
    torch.testing.assert_close(factored, hooks, rtol=1e-5, atol=1e-7)


def test_accumulated_batches_equal_opacus_s_accumulation() -> None:
    """Two batches before one step, without Poisson sampling: the same step as Opacus's
    (each example clipped once, the sum scaled for 2 batches), the accountant charged alike."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
    results = []
    for cls in (SparseDPEngine, FactoredDPEngine):
        model = build_model("digits-cnn", seed=1)
        generator = torch.Generator().manual_seed(9)
        engine, module, optimizer = private(
            cls, model, x, y, noise_multiplier=1.0, noise_generator=generator
        )
        set_rate(engine, 0.5)
        optimizer.zero_grad()
        backward(module, x[:3], y[:3], nn.CrossEntropyLoss())
        backward(module, x[3:], y[3:], nn.CrossEntropyLoss())
        optimizer.step()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        results.append((grad, list(engine.accountant.history)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    assert results[1][1] == results[0][1]


@pytest.mark.parametrize("rate", [0.0, 0.7])
def test_the_readmes_loop_runs_with_opacus_default_zero_grad(rate: float) -> None:
    """``optimizer.zero_grad()`` with Opacus's default (``set_to_none=False``) on the DP-CNN:
    the gradients carry no graph (they used to, and the second step failed)."""
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    from fedsparse.common.dp.engines.factored import FactoredDPEngine
    from fedsparse.common.masks import keep_count, sample_mask
    from fedsparse.common.models.classifiers import build_model

    g = torch.Generator().manual_seed(0)
    model = build_model("dpcnn", seed=0)
    data = TensorDataset(torch.randn(48, 3, 32, 32, generator=g), torch.randint(0, 10, (48,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = FactoredDPEngine(accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=DataLoader(data, batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    if rate:
        d = engine.layout.numel
        engine.set_mask(sample_mask(d, keep=keep_count(d, rate=rate), seed=1))
    steps = 0
    for x, y in loader:
        optimizer.zero_grad()
        module.backward_per_sample(x, y, criterion=torch.nn.CrossEntropyLoss())
        optimizer.step()
        steps += 1
        assert all(p.grad is None or p.grad.grad_fn is None for p in model.parameters())
    assert steps >= 2
