"""Opacus's own ``make_private`` tests, with the func and factored engines as ``PrivacyEngine``.

The tests are Opacus 1.6.0's (``opacus_suite/``, vendored), run with ``opacus.PrivacyEngine``
replaced by ``FuncDPEngine`` or ``FactoredDPEngine``:

* ``BasePrivacyEngineTest`` (``privacy_engine_test.py``) on its sample models. The engines
  follow Opacus's convention for fast gradient clipping (``make_private(..., criterion=...,
  grad_sample_mode="ghost")`` returns the criterion whose ``loss.backward()`` does the
  per-sample work), so the replacement passes the test's criterion and ``"ghost"``, and the
  test's loop, ``loss = criterion(model(x), y); loss.backward(); optimizer.step()``, runs with
  the criterion ``make_private`` returned, unchanged otherwise.
* Two of the fast-gradient-clipping tests (``grad_sample_module_fast_gradient_clipping_test
  .py``): one step of ghost clipping against Opacus's per-sample-gradient step, with the
  engine's ``make_private`` as the ghost side (the tests below say what they port).

Where an engine does not support the model (its ``*_support_error``) or an argument of
``make_private`` (``wrap_model=False``, per-layer clipping: the ``NotImplementedError`` it
raises), the test skips with that message as the reason; so does a test of what an engine
does not have (``NOT_APPLICABLE``: the factored engine forms no ``p.grad_sample``).

The subset, and why (all of ``BasePrivacyEngineTest`` on its 25 cases, with hypothesis's 100
examples per property, takes many minutes; this takes ~50 s of CPU):

* Cases: the five model cases of the file (``ConvNet``, ``ConvNetFrozen``, ``Text``,
  ``TiedWeights``, ``CustomLayer``), one ``wrap_model=False`` case (``ConvNetHooks``; the
  others differ from theirs only in that) and one on fedsparse's DP-CNN (``digits-cnn``:
  Linear and Conv2d only), because the factored engine supports none of Opacus's sample
  models. The ``Functorch``/``ExpandedWeights`` variants differ only in Opacus's
  ``grad_sample_mode``, which the engines replace.
* Tests: all of ``BasePrivacyEngineTest`` (``FULL`` and ``MODEL_FREE``) on one case per engine
  (``FULL_CASE``: ConvNet for func, the DP-CNN for factored), the ones that take one to three
  steps (``LIGHT``) on the other cases; the property tests on fixed examples
  (``test_compare_to_vanilla``: matching and not, with and without a closure, 1 and 3 steps;
  ``test_checkpoints``: both schedulers).
* Left out: ``test_noise_level``, whose loop backpropagates ``sum(logits)`` against a zero
  gradient instead of the criterion's loss: under the criterion convention only
  ``criterion(module(x), y).backward()`` computes per-sample gradients (Opacus's own ghost
  clipping needs the criterion's loss too). Of the fast-gradient-clipping tests, those of
  Opacus's internals (``_norm_sample``, ``DPTensorFastGradientClipping`` arithmetic, which
  ``PerSampleLoss`` refuses by design) and the multi-GPU ones.
"""

from __future__ import annotations

import contextlib
import copy
import unittest
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizer
from opacus.utils.per_sample_gradients_utils import clone_module
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.dp.engines.factored import FactoredDPEngine, factored_support_error
from fedsparse.common.dp.engines.func import FuncDPEngine, func_support_error
from fedsparse.common.models.classifiers import build_model
from tests.common.dp.engine_helpers import digits
from tests.common.dp.opacus_suite import fast_gradient_clipping as fgc
from tests.common.dp.opacus_suite import models as suite
from tests.common.dp.opacus_suite import privacy_engine as base

Test = tuple[str, dict[str, Any] | None]

ENGINES: dict[str, tuple[type[SparseDPEngine], Any]] = {
    "func": (FuncDPEngine, func_support_error),
    "factored": (FactoredDPEngine, factored_support_error),
}


def _digits_cnn_case() -> type:
    """Opacus's tests on fedsparse's DP-CNN (``digits-cnn``, on 8x8 digits): Linear and Conv2d
    layers only, so that the factored engine, which supports none of Opacus's sample models,
    runs them too. (Built in a function: a module-level ``TestCase`` would be collected.)"""

    class DigitsCnnTest(base.BasePrivacyEngineTest, unittest.TestCase):
        def _init_data(self) -> DataLoader:
            return DataLoader(TensorDataset(*digits(self.DATA_SIZE)), batch_size=self.BATCH_SIZE)

        def _init_model(self) -> nn.Module:
            # Seeded from torch's generator, as Opacus's models are (the tests reseed it).
            return build_model("digits-cnn", seed=int(torch.randint(2**31, ())))

    return DigitsCnnTest


#: Opacus's test cases (``opacus_suite/models.py``) and one on fedsparse's model, by name.
CASES: dict[str, type] = {
    "convnet": suite.PrivacyEngineConvNetTest,
    "convnet-frozen": suite.PrivacyEngineConvNetFrozenTest,
    "text": suite.PrivacyEngineTextTest,
    "tied-weights": suite.PrivacyEngineTiedWeightsTest,
    "custom-layer": suite.PrivacyEngineCustomLayerTest,
    "convnet-hooks": suite.PrivacyEngineConvNetHooksTest,
    "digits-cnn": _digits_cnn_case(),
}


def _vanilla(clip: bool, noise: bool, closure: bool, steps: int) -> Test:
    example = {"do_clip": clip, "do_noise": noise, "use_closure": closure, "max_steps": steps}
    return ("test_compare_to_vanilla", example)


#: Opacus's tests (method, the arguments of a hypothesis test's example or None) that train
#: the case's model: all of them on the first case of each engine (``FULL``), the ``LIGHT``
#: ones (a step or three each) on the others.
LIGHT: list[Test] = [
    _vanilla(False, False, False, 3),
    _vanilla(True, False, False, 1),
    ("test_flat_clipping", None),
    ("test_sample_grad_aggregation", None),
    ("test_noise_changes_every_time", None),
    ("test_parameters_match", None),
]
FULL: list[Test] = [
    *LIGHT,
    _vanilla(False, False, True, 1),
    _vanilla(False, True, True, 3),
    ("test_basic", None),
    ("test_per_layer_clipping", None),
    ("test_make_private_with_epsilon", None),
    ("test_deterministic_run", None),
    ("test_checkpoints", {"has_noise_scheduler": True, "has_grad_clip_scheduler": True}),
]
#: The tests that do not train the case's model: once per engine.
MODEL_FREE: list[Test] = [
    ("test_get_compatible_module_inaction", None),
    ("test_model_validator", None),
    ("test_model_validator_after_fix", None),
]

#: engine -> the case that runs ``FULL`` (and ``MODEL_FREE``): the first the engine supports.
FULL_CASE = {"func": "convnet", "factored": "digits-cnn"}

#: Tests that look at what an engine does not have, with the reason.
NOT_APPLICABLE = {
    ("factored", "test_sample_grad_aggregation"): (
        "the factored engine forms no per-sample gradients (p.grad_sample), only their "
        "norms and clipped sum"
    ),
}


def _runs() -> Iterator[Any]:
    for engine in ENGINES:
        for case in CASES:
            tests = FULL + MODEL_FREE if case == FULL_CASE[engine] else LIGHT
            for name, example in tests:
                test_id = name
                if example:
                    test_id += "[" + ",".join(f"{k}={v}" for k, v in example.items()) + "]"
                yield pytest.param(engine, case, name, example, id=f"{engine}-{case}-{test_id}")


def opacus_user(case: Any, engine_cls: type[SparseDPEngine]) -> type[SparseDPEngine]:
    """``engine_cls`` as the test's ``PrivacyEngine``: ``make_private`` gets the test's
    criterion and ``grad_sample_mode="ghost"``, returns Opacus's usual triple and leaves the
    criterion for the test's loop (``case.criteria``); an argument the engine refuses
    (``NotImplementedError``) skips the test with the engine's message."""

    class OpacusUserEngine(engine_cls):  # type: ignore[valid-type,misc]
        def __init__(self, *, secure_mode: bool = False) -> None:
            super().__init__(secure_mode=secure_mode)

        def make_private(self, **kwargs: Any) -> Any:
            kwargs.setdefault("criterion", case.criterion)
            kwargs["grad_sample_mode"] = "ghost"
            try:
                module, optimizer, criterion, loader = super().make_private(**kwargs)
            except NotImplementedError as error:
                pytest.skip(f"{engine_cls.__name__}: {error}")
            case.criteria[id(module)] = criterion
            return module, optimizer, loader

    return OpacusUserEngine


def engine_case(cls: type, engine_cls: type[SparseDPEngine]) -> type:
    """Opacus's test case ``cls`` whose loops use the criterion ``make_private`` returned."""

    class EngineCase(cls):  # type: ignore[valid-type,misc]
        def setUp(self) -> None:
            super().setUp()
            self.criteria: dict[int, Any] = {}

        @contextlib.contextmanager
        def _criterion_of(self, model: nn.Module) -> Iterator[None]:
            plain = self.criterion
            self.criterion = self.criteria.get(id(model), plain)
            try:
                yield
            finally:
                self.criterion = plain

        def _train_steps(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
            with self._criterion_of(model):
                super()._train_steps(model, *args, **kwargs)

        def _train_steps_with_closure(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
            with self._criterion_of(model):
                super()._train_steps_with_closure(model, *args, **kwargs)

    EngineCase.__name__ = f"{cls.__name__}On{engine_cls.__name__}"
    return EngineCase


@pytest.mark.parametrize(("engine", "case_name", "name", "example"), list(_runs()))
def test_opacus_privacy_engine_suite(
    engine: str,
    case_name: str,
    name: str,
    example: dict[str, Any] | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if (engine, name) in NOT_APPLICABLE:
        pytest.skip(NOT_APPLICABLE[engine, name])
    engine_cls, support_error = ENGINES[engine]
    case = engine_case(CASES[case_name], engine_cls)(methodName=name)
    case.setUp()
    if name == "test_model_validator":
        model = None  # the test is that make_private refuses the model
    elif name == "test_model_validator_after_fix":
        model = base.PrivacyEngine.get_compatible_module(base.batch_norm_net())
    else:
        model = case._init_model()
    error = None if model is None else support_error(model)
    if error is not None:
        pytest.skip(error)
    monkeypatch.setattr(base, "PrivacyEngine", opacus_user(case, engine_cls))
    method = getattr(type(case), name)
    if example is None:
        method(case)
    else:
        method.hypothesis.inner_test(case, **example)


def _ghost_step(
    engine: str, module: nn.Module, loader: DataLoader, criterion: Any, x: Any, y: Any
) -> None:
    """One step of ``engine`` through Opacus's ghost-clipping loop (no noise, clip at 1), in
    place of Opacus's ``GradSampleModuleFastGradientClipping``, ``DPOptimizerFastGradient
    Clipping`` and ``DPLossFastGradientClipping``."""
    engine_cls, support_error = ENGINES[engine]
    error = support_error(module)
    if error is not None:
        pytest.skip(error)
    gs_module, optimizer, criterion_gc, _ = engine_cls().make_private(
        module=module,
        optimizer=torch.optim.SGD(module.parameters(), lr=1),
        data_loader=loader,
        criterion=criterion,
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode="ghost",
    )
    optimizer.zero_grad()
    loss_gc = criterion_gc(gs_module(x), y)
    loss_gc.backward()
    optimizer.step()


@pytest.mark.parametrize("engine", ENGINES)
def test_opacus_weight_update_fast_gradient_clipping(engine: str) -> None:
    """Opacus's ``GradSampleModuleFastGradientClippingTest.test_weight_update_fast_gradient_
    clipping`` (its hypothesis example, size 10, length 5, dim 2): one step of ghost clipping
    updates the weights as Opacus's per-sample-gradient step does."""
    torch.manual_seed(0)
    size, length, dim = 10, 5, 2
    dl = DataLoader(fgc.SyntheticDataset(size, length, dim), batch_size=size, shuffle=True)
    criterion = torch.nn.CrossEntropyLoss()
    sample_module = fgc.SampleModule()
    model_normal = GradSampleModule(clone_module(sample_module))
    optimizer_normal = DPOptimizer(
        torch.optim.SGD(model_normal.parameters(), lr=1),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=size,
    )
    (input_data, target_data) = list(dl)[0]
    optimizer_normal.zero_grad()
    loss_normal = torch.mean(criterion(model_normal(input_data), target_data), dim=0)
    loss_normal.backward()
    optimizer_normal.step()
    flat_params_normal = torch.cat([p.flatten() for p in model_normal.parameters()])

    model_gc = clone_module(sample_module)
    _ghost_step(engine, model_gc, dl, copy.deepcopy(criterion), input_data, target_data)
    flat_params_gc = torch.cat([p.flatten() for p in model_gc.parameters()])
    assert torch.allclose(flat_params_normal, flat_params_gc, atol=1e-3)


@pytest.mark.parametrize("engine", ENGINES)
def test_opacus_embedding_gradient_calculation(engine: str) -> None:
    """Opacus's ``GradSampleModuleFastGradientClippingEmbeddingLayerTest.test_gradient_
    calculation``: the clipped sum of an embedding's gradients (``p.summed_grad``) and the
    step are Opacus's (here compared like with like: Opacus compares its ``summed_grad`` with
    the fast-clipping optimizer's ``p.grad``)."""
    input_data = torch.tensor([[1, 1], [2, 0], [2, 0]], dtype=torch.long)
    target_data = torch.tensor([[[0.1], [0.1]], [[0.2], [0.3]], [[0.2], [0.3]]])
    criterion = torch.nn.CrossEntropyLoss()
    sample_module = fgc.SampleEmbeddingModule(3, 1)
    model_normal = GradSampleModule(clone_module(sample_module))
    optimizer_normal = DPOptimizer(
        torch.optim.SGD(model_normal.parameters(), lr=1),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=3,
    )
    optimizer_normal.zero_grad()
    loss_normal = torch.mean(criterion(model_normal(input_data), target_data), dim=0)
    loss_normal.backward()
    optimizer_normal.step()

    model_gc = clone_module(sample_module)
    loader = DataLoader(TensorDataset(input_data, target_data), batch_size=3)
    _ghost_step(engine, model_gc, loader, criterion, input_data, target_data)
    for p_normal, p_gc in zip(model_normal.parameters(), model_gc.parameters(), strict=True):
        assert torch.allclose(p_normal.summed_grad, p_gc.summed_grad, atol=1e-3)
        assert torch.allclose(p_normal, p_gc, atol=1e-3)
