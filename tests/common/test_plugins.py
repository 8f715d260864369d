"""A user's model and dataset from a package outside the repository (``common/plugins.py``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedsparse.client.node_data import NodeData
from fedsparse.common import plugins
from fedsparse.common.data.datasets import Split, dataset_input_shape, load_dataset
from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import build_model, model_input_shape
from fedsparse.common.training.centralized import train_centralized
from fedsparse.common.training.configs import PrivacyConfig, SparsityConfig, TrainConfig
from tests.plugin_package import user_package


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The user package (``tests/plugin_package.py``) as ``mylab_<n>``, on the import path,
    outside the repository."""
    name = f"mylab_{abs(hash(tmp_path)) % 10**8}"
    with user_package(tmp_path, monkeypatch, name) as package:
        yield package


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("pkg.mod:factory", True),
        ("pkg:Cls.make", True),
        ("mod_1:_f", True),
        ("digits-cnn", False),
        ("pkg.mod", False),
        ("pkg.mod:", False),
        (":f", False),
        ("pkg/mod:f", False),
        ("pkg.mod:f; import os", False),
    ],
)
def test_references_are_told_from_names_without_importing(name: str, expected: bool) -> None:
    assert plugins.is_reference(name) is expected


def test_a_user_model_is_seeded_like_the_built_in_ones(lab: str) -> None:
    flat = lambda m: ParamLayout.from_module(m).flatten_module(m)  # noqa: E731
    one = build_model(f"{lab}:tiny_cnn", num_classes=6, seed=4)
    again = build_model(f"{lab}:tiny_cnn", num_classes=6, seed=4)
    other = build_model(f"{lab}:tiny_cnn", num_classes=6, seed=5)
    assert torch.equal(flat(one), flat(again))
    assert not torch.equal(flat(one), flat(other))
    assert one(torch.zeros(2, 1, 6, 6)).shape == (2, 6)
    state = torch.get_rng_state()
    build_model(f"{lab}:tiny_cnn", num_classes=6, seed=4)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is left alone
    assert model_input_shape(f"{lab}:tiny_cnn") == (1, 6, 6)
    assert model_input_shape("digits-cnn") == (1, 8, 8)


def test_a_user_dataset_loads_as_splits(lab: str) -> None:
    train, test = load_dataset(f"{lab}:stripes", seed=1)  # type: ignore[arg-type]
    assert isinstance(train, Split) and (len(train), len(test)) == (60, 30)
    again, _ = load_dataset(f"{lab}:stripes", seed=1)  # type: ignore[arg-type]
    assert torch.equal(train.x, again.x)
    assert dataset_input_shape(f"{lab}:stripes") == (1, 6, 6)
    assert NodeData(dataset=f"{lab}:stripes").dataset == f"{lab}:stripes"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "attribute", "match"),
    [
        ("model", "not_a_factory", "expected a callable"),
        ("model", "returns_a_tensor", "returned Tensor, expected an nn.Module"),
        ("model", "missing", "has no attribute 'missing'"),
        ("dataset", "returns_one_split", r"returned Split, expected \(train, test\)"),
        ("dataset", "not_a_factory", "expected a callable"),
    ],
)
def test_a_bad_user_object_is_named(lab: str, field: str, attribute: str, match: str) -> None:
    reference = f"{lab}:{attribute}"
    with pytest.raises(ValueError, match=f"{field}='{reference}': .*{match}"):
        if field == "model":
            build_model(reference)
        else:
            load_dataset(reference)  # type: ignore[arg-type]


def test_an_uninstalled_module_and_a_bad_name_are_named() -> None:
    with pytest.raises(ValueError, match="model='no_such_lab.nets:cnn': cannot import"):
        build_model("no_such_lab.nets:cnn")
    with pytest.raises(ValueError, match="expected one of .* or package.module:attribute"):
        build_model("digit-cnn")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="node data: dataset='mnist.gz'"):
        NodeData(dataset="mnist.gz")  # type: ignore[arg-type]


def test_an_activation_is_refused_for_a_user_model(lab: str) -> None:
    from fedsparse.common.models.classifiers import ActivationConfig

    with pytest.raises(ValueError, match="activation applies to the built-in models only"):
        build_model(f"{lab}:tiny_cnn", activation=ActivationConfig(name="tanh"))


def test_a_user_model_and_dataset_train_centralized(lab: str) -> None:
    train, test = load_dataset(f"{lab}:stripes", seed=0)  # type: ignore[arg-type]
    model = build_model(f"{lab}:tiny_cnn", num_classes=6, seed=0)
    history = train_centralized(
        model,
        (train.x, train.y),
        (test.x, test.y),
        privacy=PrivacyConfig(noise_multiplier=0.5),
        sparsity=SparsityConfig(schedule="gradual", final_rate=0.5, mask_seed=1),
        train=TrainConfig(epochs=4, batch_size=20, lr=0.5, seed=0),
    )
    assert history[-1].test_accuracy >= 0.9  # 6 bright rows: easy, even with noise
    assert 0 < history[-1].epsilon < float("inf")


def test_an_import_error_names_the_missing_module_not_the_nodes_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a deployed node this message is the reply the server reads.
    (tmp_path / "brokenlab_x1").mkdir()
    (tmp_path / "brokenlab_x1" / "__init__.py").write_text("import not_installed_dep_x1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as info:
        build_model("brokenlab_x1:cnn")
    message = str(info.value)
    assert "cannot import 'brokenlab_x1' (no module 'not_installed_dep_x1')" in message
    assert str(tmp_path) not in message and "/" not in message
    sys.modules.pop("brokenlab_x1", None)


def test_a_plugin_that_fails_as_it_imports_tells_only_the_exceptions_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any import-time failure, not only ImportError: its text can name the node's files."""
    secret = tmp_path / "private-records.csv"
    (tmp_path / "brokenlab_x2").mkdir()
    (tmp_path / "brokenlab_x2" / "__init__.py").write_text(f"open({str(secret)!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as info:
        build_model("brokenlab_x2:cnn")
    message = str(info.value)
    assert "importing 'brokenlab_x2' raised FileNotFoundError" in message
    assert "private-records" not in message and str(tmp_path) not in message
    sys.modules.pop("brokenlab_x2", None)
