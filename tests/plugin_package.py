"""The user package the plug-in tests import: a lab's own method, model and data, written to a
folder outside the repository and put on the import path (fedsparse is not touched).

- ``<name>.even:EvenCoordinates``: a ``Method`` that trains every ``stride``-th coordinate
  only, every round and epoch (its own run-config key ``stride``, default 2), so its effect is
  exact: every other coordinate ends where it started;
- ``<name>:tiny_cnn``: a model factory for 1x6x6 images;
- ``<name>:stripes`` (60 train, 30 test images) and ``<name>:more_stripes`` (240, 120): 6
  classes, class k a bright row k on noise;
- ``not_a_factory``, ``returns_a_tensor``, ``returns_one_split``: what a loader must refuse;
- ``<name>.engines:counting``: a DP engine (``EngineSpec``): the func engine, counting the
  batches it computes per-sample gradients of (``BATCHES``); ``builds_something_else``,
  ``no_conv`` and ``not_a_spec``: what ``engine=`` must refuse;
- ``<name>.backends:counting``: a backend (``BackendSpec``): ``InProcessGrid`` counting the
  messages of each send (``SENT``); ``on_a_cluster``: what ``backend=`` must refuse.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = [
    "BACKEND",
    "ENGINE",
    "LAB",
    "METHOD",
    "PACKAGE",
    "forget",
    "user_package",
    "write_user_package",
]

#: The package's default name.
PACKAGE = "fedsparse_example_plugin"

#: ``<name>/even.py``: the method.
METHOD = '''
"""A user's method: every stride-th coordinate trains, every round and epoch; no other."""

import torch

from fedsparse.common.methods import Method, RoundPlan
from fedsparse.common.methods.base import explicit_support
from fedsparse.common.wire.protocol import ProtocolError

LOADED = True


class EvenCoordinates(Method):
    sends_support = True  # the server sends the support (a bitmap) with each instruction
    options = {"stride": 2}  # its own run-config key, and its default

    def coordinates(self, numel):
        return torch.arange(0, numel, self.option("stride"))

    def plan_round(self, *, server_round, weights, schedule, frozen, layout, seed):
        support = self.coordinates(weights.numel())
        rate = 1.0 - support.numel() / weights.numel()
        return RoundPlan(rate=rate, keep=support.numel(), support=support)

    def client_support(self, task, raw, layout, *, schedule, final_rate):
        expected = self.coordinates(layout.numel)
        support = explicit_support(
            task, raw, layout, expected=expected.numel(), detail="even coordinates"
        )
        if support is None or not torch.equal(support, expected):
            raise ProtocolError("train instruction: expected every stride-th coordinate")
        return support

    def epoch_mask(self, ctx):
        mask = torch.zeros(ctx.layout.numel, dtype=torch.bool)
        mask[self.coordinates(ctx.layout.numel)] = True
        return 1.0 - 1.0 / self.option("stride"), mask, False
'''

#: ``<name>/engines.py``: the DP engine.
ENGINE = '''
"""A user's DP engine: the func engine's per-sample gradients, each batch counted."""

from fedsparse.common.dp.engines import EngineSpec
from fedsparse.common.dp.engines.func import (
    FuncDPEngine,
    FuncGradSampleModule,
    func_support_error,
)

BATCHES = []


class CountingModule(FuncGradSampleModule):
    def backward_per_sample(self, x, y, *, criterion):
        BATCHES.append(len(x))
        return super().backward_per_sample(x, y, criterion=criterion)


class CountingEngine(FuncDPEngine):
    def _prepare_model(self, module, **kwargs):
        wrapped = super()._prepare_model(module, **kwargs)  # the func engine's checks
        return wrapped if isinstance(wrapped, CountingModule) else CountingModule(module)


counting = EngineSpec(name="counting", make=CountingEngine, support_error=func_support_error)


class NotAnEngine:
    def __init__(self, **kwargs):
        pass


builds_something_else = EngineSpec(name="else", make=NotAnEngine)


def _no_conv(module):
    if any(type(m).__name__ == "Conv2d" for m in module.modules()):
        return "engine='no-conv': this engine trains no Conv2d layer"
    return None


no_conv = EngineSpec(name="no-conv", make=CountingEngine, support_error=_no_conv)
not_a_spec = 3
'''

#: ``<name>/backends.py``: the backend.
BACKEND = '''
"""A user's backend: the in-process grid, each send's messages counted."""

from fedsparse.lab.launch.backends import BackendSpec, BackendTraits
from fedsparse.lab.simulation.inprocess import InProcessGrid

SENT = []


class CountingGrid(InProcessGrid):
    def push_messages(self, messages):
        messages = list(messages)
        SENT.append(len(messages))
        return super().push_messages(messages)


counting = BackendSpec(name="counting", grid=CountingGrid)
on_a_cluster = BackendSpec(name="cluster", grid=CountingGrid, traits=BackendTraits(cluster=True))
'''

#: ``<name>/__init__.py``: the model and the data.
LAB = '''
"""A lab's own model and data, installed beside fedsparse (not part of it)."""
import torch
from torch import nn

from fedsparse.common.data.datasets import Split


def tiny_cnn(*, num_classes):
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 6 * 6, num_classes)
    )


tiny_cnn.input_shape = (1, 6, 6)


def _stripes(seed, n_train, n_test):
    """Class k: a bright row k (of 6) on noise."""
    g = torch.Generator().manual_seed(seed)

    def split(n):
        y = torch.arange(n) % 6
        x = 0.1 * torch.randn(n, 1, 6, 6, generator=g)
        x[torch.arange(n), 0, y, :] += 1.0
        return Split(x=x, y=y)

    return split(n_train), split(n_test)


def stripes(*, data_dir, seed):
    """60 train and 30 test images."""
    return _stripes(seed, 60, 30)


def more_stripes(*, data_dir, seed):
    """240 train and 120 test images."""
    return _stripes(seed, 240, 120)


not_a_factory = 3


def returns_a_tensor(*, num_classes):
    return torch.zeros(num_classes)


def returns_one_split(*, data_dir, seed):
    return stripes(data_dir=data_dir, seed=seed)[0]
'''


def write_user_package(root: Path, name: str = PACKAGE) -> Path:
    """Writes package ``name`` (``__init__.py``: ``LAB``; ``even.py``: ``METHOD``;
    ``engines.py``: ``ENGINE``; ``backends.py``: ``BACKEND``) under ``root``; returns
    ``root`` (the folder to put on the import path)."""
    package = root / name
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(textwrap.dedent(LAB))
    (package / "even.py").write_text(textwrap.dedent(METHOD))
    (package / "engines.py").write_text(textwrap.dedent(ENGINE))
    (package / "backends.py").write_text(textwrap.dedent(BACKEND))
    return root


def forget(name: str) -> None:
    """Drops package ``name`` and its modules from ``sys.modules``."""
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[module]


@contextmanager
def user_package(root: Path, monkeypatch: pytest.MonkeyPatch, name: str = PACKAGE) -> Iterator[str]:
    """Package ``name`` written under ``root`` and on ``sys.path``, not yet imported; its name.
    Its modules are forgotten again on exit."""
    write_user_package(root, name)
    monkeypatch.syspath_prepend(str(root))
    forget(name)
    try:
        yield name
    finally:
        forget(name)
