"""A non-finite per-sample gradient contributes exactly zero, on every engine
(``common/dp/optimizer.py``).

The attack: a hostile server sends a finite model on which one chosen example's per-sample
gradient is NaN or inf. Without the rule the NaN survives clipping (``C / (NaN + 1e-6)``) and an
inf turns into NaN in the sum (``0 * inf``), so the client's update is non-finite exactly when
that example was in its Poisson batch. With it, the clipped sum of a batch with the poisoned
example equals the clipped sum of the batch without it, on every engine (Opacus's hooks, func,
factored), masked or not, on linear and convolutional layers, for the mechanism and its
ablations, and a whole local epoch ends with finite weights.

The same work, too: a step that did more for a poisoned example (zeroing its rows, rerunning
the sum) would take longer, and Flower reports each reply's runtime to the server. The step
on a clean batch and on the same batch poisoned must run the same operators on the same input
shapes in the same order (``torch.profiler``, deterministic: no timing here; the times are
``benchmarks/nonfinite.py``'s), and read no tensor value back to Python.

Poisons (example ``POISONED`` of a batch of ``N``, the input coordinates ``COORDS``):
  - ``nan``: they are NaN; the example's per-sample gradient is NaN.
  - ``inf``: they are 3e38 (finite) and the model is crafted: the first layer's weights that
    read them are 0 (the forward pass stays finite and unsaturated), the last layer is scaled
    up and the example's label is the class the model ranks last, so that entries
    ``b_j * 3e38`` of the first layer's per-sample gradient overflow to +-inf (no NaN): the
    norm is inf, and ``0 * inf`` is NaN in the sum.
  - ``overflow``: the same model, the coordinates 1e25: every entry is finite, the float32
    norm overflows to inf (treated as zero too, ``dp``'s docstring; it already was).
``check_poison`` asserts the kind on the example's own (kept) gradient, by plain autograd.
"""

from __future__ import annotations

import functools
import math
import platform
import subprocess
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

import fedsparse.common.dp.engines.factored_layers as factored_layers
from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.dp.engines.factored import FactoredDPEngine
from fedsparse.common.dp.engines.func import FuncDPEngine
from fedsparse.common.dp.optimizer import zero_non_finite
from fedsparse.common.methods.index_selection import IndexBudget, StepSelector
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.training.configs import PrivacyConfig, TrainConfig
from fedsparse.common.training.local import make_private, train_one_epoch
from tests.common.dp.engine_helpers import backward, digits, flat, private, set_rate

warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message=".*non-full backward hook.*")

ENGINES: dict[str, type[SparseDPEngine]] = {
    "opacus": SparseDPEngine,
    "func": FuncDPEngine,
    "factored": FactoredDPEngine,
}
N, POISONED = 8, 3
KINDS = ("nan", "inf", "overflow")
#: The poisoned input coordinates of each model (indices into one example), and the input
#: features of its first layer that read them (zeroed by the crafted models; a convolution's
#: weights all read every pixel, so they are all zeroed).
COORDS: dict[str, list[tuple[int, ...]]] = {
    "mlp": [(0, 3, c) for c in range(4, 8)],
    "cnn": [(0, 3, 4)],  # one pixel: two would meet in a sum (inf - inf is NaN)
    "seq": [(2, 0), (2, 1)],
}
FEATURES: dict[str, list[int]] = {"mlp": [28, 29, 30, 31], "seq": [0, 1]}
#: Clipped sums with and without the poisoned example: the same terms but for zero ones, summed
#: by kernels that may block a batch of N otherwise than one of N - 1 (float32 rounding, ~3e-6
#: relative at most measured; ``test_factored_dp.py``'s tolerance).
RTOL, ATOL = 1e-5, 1e-7
#: The crafted models' last layer is scaled by this.
SCALE = 100.0


def _model(name: str) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        if name == "mlp":  # Linear layers only
            return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 3))
        if name == "cnn":  # a Conv2d, then a Linear
            return nn.Sequential(
                nn.Conv2d(1, 4, 3, padding=1),
                nn.Tanh(),
                nn.MaxPool2d(2),
                nn.Flatten(),
                nn.Linear(4 * 4 * 4, 3),
            )
        if name == "seq":  # a Linear over a sequence (the factored engine materializes it)
            return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Flatten(), nn.Linear(30, 3))
    raise ValueError(name)


def clean_inputs(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): the batch of ``N`` that ``poisoned`` poisons, before it does."""
    g = torch.Generator().manual_seed(0)
    shape = (5, 3) if name == "seq" else (1, 8, 8)
    x = torch.randn(N, *shape, generator=g)
    y = torch.randint(0, 3, (N,), generator=g)
    return x, y


def poisoned(name: str, kind: str) -> tuple[Callable[[], nn.Module], torch.Tensor, torch.Tensor]:
    """(model factory, x, y): a batch of ``N`` whose example ``POISONED`` is poisoned."""
    x, y = clean_inputs(name)
    value = {"nan": math.nan, "inf": 3e38, "overflow": 1e25}[kind]
    for coord in COORDS[name]:
        x[(POISONED, *coord)] = value

    def model_fn() -> nn.Module:
        model = _model(name)
        if kind == "nan":
            return model
        first, last = model[1 if name == "mlp" else 0], model[-1]
        assert isinstance(first, (nn.Linear, nn.Conv2d)) and isinstance(last, nn.Linear)
        with torch.no_grad():
            if isinstance(first, nn.Conv2d):
                first.weight.zero_()
            else:
                first.weight[:, FEATURES[name]] = 0.0
            last.weight.mul_(SCALE)
        return model

    if kind != "nan":  # its label is the class its logits rank last: CE's gradient is large
        with torch.no_grad():
            y[POISONED] = model_fn()(x[POISONED : POISONED + 1]).argmin()
    return model_fn, x, y


def example_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One example's gradient by plain autograd, flat in ``parameters()`` order."""
    model.zero_grad()
    nn.functional.cross_entropy(model(x[None]), y[None]).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def check_poison(kind: str, gradient: torch.Tensor) -> None:
    """The poisoned example's (kept) gradient is non-finite the way ``kind`` says."""
    norm = float(gradient.norm())
    if kind == "nan":
        assert math.isnan(norm)
    elif kind == "inf":
        assert math.isinf(norm) and not bool(gradient.isnan().any())
        assert bool(gradient.isinf().any())
    else:
        assert math.isinf(norm) and bool(gradient.isfinite().all())


def step(
    engine_cls: Callable[..., SparseDPEngine],
    model_fn: Callable[[], nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    rate: float,
    sigma: float = 0.0,
    selector: Callable[[int], StepSelector] | None = None,
    ops: list[tuple[str, list[list[int]]]] | None = None,
    physical: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, nn.Module, SparseDPEngine]:
    """One step on ``(x, y)`` (C = 0.5, lr 0.1): (clipped sum before the noise, the step's
    gradient, the model after it, the engine).

    ``ops``: a list that gets the operations ``optimizer.step()`` ran (``step_operations``).
    ``physical``: the batch goes through the backward pass in physical batches of that many
    examples, accumulated before the one step (0: one batch)."""
    model = model_fn()
    engine, module, optimizer = private(
        engine_cls,
        model,
        x,
        y,
        noise_multiplier=sigma,
        noise_generator=torch.Generator().manual_seed(7),
    )
    set_rate(engine, rate)
    if selector is not None:
        engine.set_step_selector(selector(engine.layout.numel))
    optimizer.zero_grad()
    for start in range(0, len(x), physical) if physical else [0]:
        stop = start + physical if physical else len(x)
        backward(module, x[start:stop], y[start:stop], nn.CrossEntropyLoss())
    if ops is None:
        optimizer.step()
    else:
        ops.extend(step_operations(optimizer.step))
    params = list(model.parameters())
    summed = torch.cat([p.summed_grad.reshape(-1) for p in params])  # type: ignore[attr-defined]
    grad = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
    return summed, grad, model, engine


def step_operations(run: Callable[[], object]) -> list[tuple[str, list[list[int]]]]:
    """The operators ``run()`` calls, in the order they start, with their inputs' shapes
    (``torch.profiler``: every ATen operator, nested ones included)."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
    ) as prof:
        run()
    return [(event.name, [list(shape) for shape in event.input_shapes]) for event in prof.events()]


def without_poisoned(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep = torch.arange(len(x)) != POISONED
    return x[keep], y[keep]


def assert_finite_model(model: nn.Module) -> None:
    assert all(bool(p.isfinite().all()) for p in model.parameters())


# --- the clipped sum drops exactly the poisoned example ----------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("rate", [0.0, 0.5], ids=["unmasked", "masked"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_non_finite_example_contributes_zero(
    engine: str, rate: float, name: str, kind: str
) -> None:
    model_fn, x, y = poisoned(name, kind)
    summed, grad, model, dp = step(ENGINES[engine], model_fn, x, y, rate=rate)
    mask = dp.mask
    assert (mask is None) == (rate == 0.0)
    gradient = example_gradient(model_fn(), x[POISONED], y[POISONED])
    check_poison(kind, gradient if mask is None else gradient[mask])
    clean, *_ = step(ENGINES[engine], model_fn, *without_poisoned(x, y), rate=rate)
    assert bool(summed.isfinite().all()) and bool(grad.isfinite().all())
    assert_finite_model(model)
    torch.testing.assert_close(summed, clean, rtol=RTOL, atol=ATOL)
    assert float(clean.abs().max()) > 1e-2  # the other examples do contribute
    if mask is not None:
        assert torch.count_nonzero(summed[~mask]) == 0
    # The noise-free step is that sum over the batch size (Opacus's scaling, N examples).
    torch.testing.assert_close(grad, summed / N, rtol=0, atol=0)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_other_example_is_clipped_as_before(engine: str) -> None:
    """The clean batch's sum is the reference, not a degenerate one: per-example autograd,
    each clipped at C = 0.5 (most are: their norms exceed it)."""
    model_fn, x, y = poisoned("cnn", "nan")
    x, y = without_poisoned(x, y)
    clean, *_ = step(ENGINES[engine], model_fn, x, y, rate=0.0)
    expected = torch.zeros_like(clean)
    clipped = 0
    for i in range(len(x)):
        g = example_gradient(model_fn(), x[i], y[i])
        norm = float(g.norm())
        clipped += norm > 0.5
        expected += g * min(1.0, 0.5 / (norm + 1e-6))
    assert clipped >= len(x) // 2
    torch.testing.assert_close(clean, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rate", [0.0, 0.5], ids=["unmasked", "masked"])
@pytest.mark.parametrize(
    "path", ["conv-recomputed", "linear-sequence"], ids=["conv-recomputed", "linear-sequence"]
)
def test_factored_paths_drop_the_example(
    path: str, rate: float, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The factored engine's other layer paths: a convolution's sum recomputed from scaled
    backpropagations (its factors' rows zeroed, not just its factor), and a Linear over a
    sequence (per-sample gradients materialized)."""
    if path == "conv-recomputed":
        monkeypatch.setattr(factored_layers, "_KEEP_MIN_POSITIONS", 10**9)
        monkeypatch.setattr(factored_layers, "_KEEP_MAX_VALUES", 0)
    name = "cnn" if path == "conv-recomputed" else "seq"
    model_fn, x, y = poisoned(name, kind)
    summed, grad, model, dp = step(FactoredDPEngine, model_fn, x, y, rate=rate)
    gradient = example_gradient(model_fn(), x[POISONED], y[POISONED])
    check_poison(kind, gradient if dp.mask is None else gradient[dp.mask])
    clean, *_ = step(FactoredDPEngine, model_fn, *without_poisoned(x, y), rate=rate)
    hooks, *_ = step(SparseDPEngine, model_fn, *without_poisoned(x, y), rate=rate)
    assert bool(grad.isfinite().all())
    assert_finite_model(model)
    torch.testing.assert_close(summed, clean, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(summed, hooks, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("engine", ENGINES)
def test_several_poisoned_examples_and_an_all_poisoned_batch(engine: str) -> None:
    """Two poisoned examples (NaN and inf kinds mixed) drop both; a batch of poisoned examples
    only sums to exactly zero."""
    model_fn, x, y = poisoned("mlp", "inf")
    x[5, 0, 0, 0] = math.nan
    summed, *_ = step(ENGINES[engine], model_fn, x, y, rate=0.5)
    keep = torch.tensor([i not in (POISONED, 5) for i in range(N)])
    clean, *_ = step(ENGINES[engine], model_fn, x[keep], y[keep], rate=0.5)
    torch.testing.assert_close(summed, clean, rtol=RTOL, atol=ATOL)
    bad = torch.tensor([POISONED, 5])
    for rate in (0.0, 0.5):
        summed, grad, model, _ = step(ENGINES[engine], model_fn, x[bad], y[bad], rate=rate)
        assert torch.count_nonzero(summed) == 0 and torch.count_nonzero(grad) == 0
        assert_finite_model(model)


# --- GIP and the ablations --------------------------------------------------------------------


def _gip(numel: int) -> StepSelector:
    budget = IndexBudget(epsilon=1.0, planned_steps=1, group_size=16)
    return StepSelector(
        "gip", numel=numel, keep_fraction=0.25, budget=budget, group_size=16, seed=0
    )


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("setting", ["gip", "noisy", "clipped"])
@pytest.mark.parametrize("engine", ENGINES)
def test_gip_and_the_ablations_drop_the_example(engine: str, setting: str, kind: str) -> None:
    """GIP's selector sees the finite sum of the others; the noisy ablation (no clipping) and
    the clipped one (no noise) drop the example too. Masked for the ablations, whole for GIP."""
    cls = ENGINES[engine]
    engine_cls = cls if setting == "gip" else functools.partial(cls, mechanism=setting)
    rate = 0.0 if setting == "gip" else 0.5
    sigma = 0.0 if setting == "clipped" else 1.0
    selector = _gip if setting == "gip" else None
    model_fn, x, y = poisoned("cnn", kind)
    summed, grad, model, _ = step(
        engine_cls, model_fn, x, y, rate=rate, sigma=sigma, selector=selector
    )
    clean, *_ = step(
        engine_cls, model_fn, *without_poisoned(x, y), rate=rate, sigma=sigma, selector=selector
    )
    assert bool(grad.isfinite().all())
    assert_finite_model(model)
    torch.testing.assert_close(summed, clean, rtol=RTOL, atol=ATOL)
    if setting == "noisy":  # not clipped: the others' sum exceeds what C would allow
        assert float(clean.norm()) > (N - 1) * 0.5
    if setting == "gip":  # the selection kept a quarter of the coordinates
        assert 0.2 < float((grad != 0).float().mean()) < 0.3


# --- the same work whatever the data (no timing side channel) ---------------------------------

#: Operators that read a tensor's value back to Python (``bool(t)``, ``t.item()``,
#: ``float(t)``): a step that branched on its data would call one.
HOST_READS = frozenset({"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero"})


def assert_same_operations(
    engine_cls: Callable[..., SparseDPEngine],
    name: str,
    kind: str,
    *,
    rate: float,
    sigma: float = 1.0,
    selector: Callable[[int], StepSelector] | None = None,
    physical: int = 0,
) -> None:
    """The DP step (clip and accumulate, noise, scale, update) on a clean batch and on the same
    batch with example ``POISONED`` poisoned runs the same operators on the same input shapes,
    in the same order: the poisoned example changes values, not work. (A step that did more
    work for a non-finite example would take longer, and the runtime a node reports would
    reveal whether the example was in its batch.) Deterministic: operators, not times."""
    model_fn, x, y = poisoned(name, kind)
    clean_x, _ = clean_inputs(name)
    clean: list[tuple[str, list[list[int]]]] = []
    dirty: list[tuple[str, list[list[int]]]] = []
    options = {"rate": rate, "sigma": sigma, "selector": selector, "physical": physical}
    step(engine_cls, model_fn, clean_x, y, ops=clean, **options)  # type: ignore[arg-type]
    summed, *_ = step(engine_cls, model_fn, x, y, ops=dirty, **options)  # type: ignore[arg-type]
    assert bool(summed.isfinite().all())  # the poisoned example was dropped
    assert any(op == "aten::isfinite" for op, _ in clean)
    assert len(clean) > 50
    first = next((i for i, (a, b) in enumerate(zip(clean, dirty, strict=False)) if a != b), None)
    assert first is None and len(clean) == len(dirty), (
        f"the steps differ from operator {first} on ({len(clean)} clean, {len(dirty)} "
        f"poisoned): clean {clean[first : first + 3] if first is not None else clean[-3:]}, "
        f"poisoned {dirty[first : first + 3] if first is not None else dirty[-3:]}"
    )
    if selector is None:  # (GIP's selector counts what it kept: one read, data-independent)
        assert not HOST_READS & {op for op, _ in clean}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rate", [0.0, 0.5], ids=["unmasked", "masked"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_poisoned_example_changes_no_operation_of_the_step(
    engine: str, rate: float, kind: str
) -> None:
    """Every engine, masked and not (the unmasked Opacus engine: Opacus's own arithmetic)."""
    assert_same_operations(ENGINES[engine], "cnn", kind, rate=rate)


@pytest.mark.parametrize("rate", [0.0, 0.5], ids=["unmasked", "masked"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_poisoned_example_changes_no_operation_across_physical_batches(
    engine: str, rate: float
) -> None:
    """Per-sample gradients of three physical batches accumulated before one step (Opacus's
    lists, the factored engine's pending batches); the poisoned example is in the second."""
    assert_same_operations(ENGINES[engine], "cnn", "nan", rate=rate, physical=3)


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("rate", [0.0, 0.5], ids=["unmasked", "masked"])
@pytest.mark.parametrize("path", ["conv-recomputed", "linear-sequence"])
def test_a_poisoned_example_changes_no_operation_on_the_factored_paths(
    path: str, rate: float, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "conv-recomputed":
        monkeypatch.setattr(factored_layers, "_KEEP_MIN_POSITIONS", 10**9)
        monkeypatch.setattr(factored_layers, "_KEEP_MAX_VALUES", 0)
    name = "cnn" if path == "conv-recomputed" else "seq"
    assert_same_operations(FactoredDPEngine, name, kind, rate=rate)


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize(
    "setting",
    ["gip", "noisy-unmasked", "noisy-masked", "clipped-unmasked", "clipped-masked"],
)
def test_a_poisoned_example_changes_no_operation_with_gip_or_the_ablations(
    setting: str, kind: str
) -> None:
    """GIP's selector (on the Opacus engine's whole-gradient path) and the ablations."""
    mechanism, _, masking = setting.partition("-")
    if mechanism == "gip":
        assert_same_operations(SparseDPEngine, "cnn", kind, rate=0.0, selector=_gip)
        return
    engine_cls = functools.partial(SparseDPEngine, mechanism=mechanism)
    sigma = 0.0 if mechanism == "clipped" else 1.0
    rate = 0.5 if masking == "masked" else 0.0
    assert_same_operations(engine_cls, "cnn", kind, rate=rate, sigma=sigma)


def test_a_finite_batch_is_opacus_clip_and_accumulate_bit_for_bit() -> None:
    """The unmasked Opacus path reimplements Opacus's ``clip_and_accumulate`` with the
    non-finite handling in line: on finite per-sample gradients its sums are Opacus's, bit for
    bit, for one batch and for physical batches (Opacus's lists, and a skipped step's sum
    accumulated into the next)."""
    x, y = clean_inputs("cnn")
    for split in ([8], [3, 3, 2]):
        sums = []
        for cls in (PrivacyEngine, SparseDPEngine):
            model = _model("cnn")
            _, module, optimizer = private(cls, model, x, y)
            optimizer.zero_grad()
            start = 0
            for i, size in enumerate(split):  # a skipped step after the first physical batch
                backward(
                    module, x[start : start + size], y[start : start + size], nn.CrossEntropyLoss()
                )
                start += size
                if i == 0 and len(split) > 1:
                    optimizer.signal_skip_step(do_skip=True)
                    optimizer.step()
                    optimizer.zero_grad()
            optimizer.step()
            sums.append(torch.cat([p.summed_grad.reshape(-1) for p in model.parameters()]))
        assert float(sums[0].abs().max()) > 1e-2
        assert torch.equal(sums[0], sums[1])


def test_zero_non_finite_keeps_finite_values_bit_for_bit() -> None:
    x = torch.tensor([[1.5, -0.0, math.nan], [math.inf, -math.inf, 3e38]])
    expected = torch.tensor([[1.5, -0.0, 0.0], [0.0, 0.0, 3e38]])
    copy = zero_non_finite(x)
    assert copy is not x and torch.equal(copy, expected) and bool(x.isnan().any())
    assert torch.equal(copy.signbit(), expected.signbit())  # -0.0 stays -0.0
    same = zero_non_finite(x, in_place=True)
    assert same is x and torch.equal(x, expected)
    # A layout where entries share memory (an expanded row) is never written: a copy.
    row = torch.tensor([math.nan, 2.0])
    expanded = row.expand(3, 2)
    out = zero_non_finite(expanded, in_place=True)
    assert torch.equal(out, torch.tensor([[0.0, 2.0]] * 3)) and bool(row.isnan().any())


_FLUSH_PROBE = """
import torch
torch.set_num_threads(2)
if {late}:
    torch.ones(1 << 20) * 2  # starts the intra-op threads before the call
from fedsparse.common.dp.engine import flush_denormals
took = flush_denormals()
tiny = torch.full((1 << 20,), 1e-30) * 1e-10  # subnormal unless flushed
print(took, bool((tiny == 0).all()))
"""


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="x86's FTZ/DAZ modes"
)
def test_flush_denormals_flushes_every_thread_when_called_first() -> None:
    """In a process of its own (it changes the process's state): called before torch's
    intra-op threads start, every thread flushes; called after, the check says it did not."""
    results = {}
    for late in (False, True):
        script = _FLUSH_PROBE.format(late=late)
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True
        )
        results[late] = out.stdout.split()
    assert results[False] == ["True", "True"]
    assert results[True] == ["False", "False"]


# --- a whole local epoch ----------------------------------------------------------------------


def _poisoned_epoch(engine: str, *, rate: float, physical: int = 0) -> tuple[torch.Tensor, float]:
    """One epoch of ``make_private`` + ``train_one_epoch`` (noise 1, q = 1/4) of the digits CNN
    on 64 digits, one of them NaN: (the weights after it, the reported loss)."""
    x, y = digits(64)
    x = x.clone()
    x[10, 0, 4, 4] = math.nan
    model = build_model("digits-cnn", seed=3)
    train = TrainConfig(batch_size=16, lr=0.5, seed=2, engine=engine, device="cpu")  # type: ignore[arg-type]
    dp, module, optimizer, loader = make_private(
        model,
        x,
        y,
        privacy=PrivacyConfig(noise_multiplier=1.0),
        train=train,
        epochs_for_target=1,
    )
    if rate:
        set_rate(dp, rate)
    loss, examples = train_one_epoch(module, optimizer, loader, max_physical_batch_size=physical)
    assert examples > 0
    return flat(model), loss


@pytest.mark.parametrize("rate", [0.0, 0.5], ids=["unmasked", "masked"])
def test_a_local_epoch_with_a_poisoned_example_ends_finite_on_every_engine(rate: float) -> None:
    before = flat(build_model("digits-cnn", seed=3))
    weights = {}
    for engine in ENGINES:
        weights[engine], loss = _poisoned_epoch(engine, rate=rate)
        assert math.isnan(loss)  # the poisoned example was in a batch (its loss is NaN)
        assert bool(weights[engine].isfinite().all())
        assert float((weights[engine] - before).abs().max()) > 1e-2
    # The engines drop the same example: they still agree (test_engines.py's tolerance).
    for engine in ("func", "factored"):
        torch.testing.assert_close(weights[engine], weights["opacus"], rtol=0, atol=2e-6)


@pytest.mark.parametrize("engine", ENGINES)
def test_physical_batches_drop_the_example_in_the_physical_batch_it_falls_in(engine: str) -> None:
    """BatchMemoryManager (Opacus's accumulation, the factored engine's pending batches): the
    same epoch as whole batches, and finite."""
    whole, _ = _poisoned_epoch(engine, rate=0.5)
    split, loss = _poisoned_epoch(engine, rate=0.5, physical=5)
    assert math.isnan(loss)
    assert bool(split.isfinite().all())
    torch.testing.assert_close(split, whole, rtol=0, atol=2e-6)
