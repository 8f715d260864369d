"""Tests for fedsparse.common.layout: flat vectors <-> named trainable parameters, by name."""

import warnings

import pytest
import torch
from opacus import GradSampleModule
from torch import nn

from fedsparse.common.layout import ParamLayout, unwrap_name
from fedsparse.common.models.classifiers import MODEL_NAMES, build_model, count_parameters

# Parameter counts documented in fedsparse.common.models.classifiers (num_classes=10).
DOCUMENTED_NUMEL = {
    "dpcnn": 550_570,
    "dpcnn-mnist": 26_010,
    "digits-cnn": 38_282,
    "cifar10-hcnn": 187_210,
    "mnist-hcnn": 33_066,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a float32 tensor: equality of these is bit-for-bit equality."""
    assert t.dtype == torch.float32
    return t.contiguous().view(torch.int32)


def odd_values(n: int, seed: int) -> torch.Tensor:
    """Random float32 values plus signed zeros, subnormals, huge and non-finite entries."""
    flat = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    specials = torch.tensor(
        [-0.0, 1e-45, -3e-40, 3.4e38, float("inf"), float("-inf"), float("nan")]
    )
    flat[: len(specials)] = specials
    flat[-len(specials) :] = specials
    return flat


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_layout_of_real_models_matches_named_parameters(name: str) -> None:
    model = build_model(name, seed=0)
    layout = ParamLayout.from_module(model)
    params = list(model.named_parameters())
    assert layout.names == tuple(n for n, _ in params)
    assert layout.shapes == tuple(tuple(p.shape) for _, p in params)
    assert layout.numels == tuple(p.numel() for _, p in params)
    assert layout.numel == count_parameters(model) == DOCUMENTED_NUMEL[name]
    # slices: contiguous, in order, starting at 0 and ending at numel, shapes echoed.
    offset = 0
    for (sl_name, sl, shape), n, s in zip(
        layout.slices(), layout.names, layout.shapes, strict=True
    ):
        assert (sl_name, shape) == (n, s)
        assert sl.start == offset and sl.stop - sl.start == torch.Size(shape).numel()
        assert sl.step is None
        offset = sl.stop
    assert offset == layout.numel


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_flatten_module_is_named_parameters_concatenated(name: str) -> None:
    model = build_model(name, seed=0)
    layout = ParamLayout.from_module(model)
    flat = layout.flatten_module(model)
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert flat.shape == (layout.numel,)
    assert torch.equal(bits(flat), bits(expected))
    # A copy, not a view of the parameters.
    flat.add_(1.0)
    assert torch.equal(layout.flatten_module(model), expected)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_load_then_flatten_round_trips_bit_exactly(name: str) -> None:
    source, target = build_model(name, seed=0), build_model(name, seed=1)
    layout = ParamLayout.from_module(source)
    flat = layout.flatten_module(source)
    assert not torch.equal(flat, layout.flatten_module(target))  # the test has something to do
    layout.load_flat_(target, flat)
    assert torch.equal(bits(layout.flatten_module(target)), bits(flat))
    for (n, p), (m, q) in zip(source.named_parameters(), target.named_parameters(), strict=True):
        assert n == m and torch.equal(bits(p.detach()), bits(q.detach()))


def test_arbitrary_bit_patterns_survive_load_and_flatten() -> None:
    model = build_model("digits-cnn", seed=0)
    layout = ParamLayout.from_module(model)
    flat = odd_values(layout.numel, seed=3)
    layout.load_flat_(model, flat)
    assert torch.equal(bits(layout.flatten_module(model)), bits(flat))
    # load_flat_ copies: changing the source afterwards does not reach the model.
    before = bits(layout.flatten_module(model)).clone()
    flat.zero_()
    assert torch.equal(bits(layout.flatten_module(model)), before)


def test_split_gives_views_in_parameter_shapes_and_flatten_inverts_it() -> None:
    model = build_model("dpcnn-mnist", seed=0)
    layout = ParamLayout.from_module(model)
    flat = odd_values(layout.numel, seed=4)
    views = layout.split(flat)
    assert list(views) == list(layout.names)
    for (name, p), (sl_name, sl, _) in zip(model.named_parameters(), layout.slices(), strict=True):
        assert views[name].shape == p.shape and name == sl_name
        assert torch.equal(bits(views[name].reshape(-1)), bits(flat[sl]))
        assert views[name].data_ptr() == flat[sl].data_ptr()  # a view: no copy
    assert torch.equal(bits(layout.flatten(views)), bits(flat))
    # Views alias the flat vector: writing through one shows up in ``flat``.
    first = layout.names[0]
    views[first].fill_(7.0)
    assert bool((flat[: layout.numels[0]] == 7.0).all())


def test_flatten_of_a_state_dict_ignores_buffers_and_extra_keys() -> None:
    model = build_model("digits-cnn", seed=0)
    layout = ParamLayout.from_module(model)
    tensors = dict(model.state_dict())
    tensors["not_a_param"] = torch.zeros(3)
    assert torch.equal(layout.flatten(tensors), layout.flatten_module(model))


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)
        self.register_buffer("running", torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.frozen(x)))


def frozen_model(seed: int) -> TwoLayer:
    torch.manual_seed(seed)
    model = TwoLayer()
    model.frozen.requires_grad_(False)
    return model


def test_frozen_parameters_are_left_out_and_left_alone() -> None:
    model = frozen_model(0)
    layout = ParamLayout.from_module(model)
    assert layout.names == ("head.weight", "head.bias")
    assert layout.shapes == ((2, 4), (2,))
    assert layout.numel == 10 == count_parameters(model)
    assert count_parameters(model, trainable_only=False) == 26
    expected = torch.cat([model.head.weight.detach().reshape(-1), model.head.bias.detach()])
    assert torch.equal(layout.flatten_module(model), expected)

    frozen_before = [p.detach().clone() for p in model.frozen.parameters()]
    layout.load_flat_(model, torch.arange(10, dtype=torch.float32))
    assert torch.equal(model.head.weight.detach(), torch.arange(8.0).view(2, 4))
    assert torch.equal(model.head.bias.detach(), torch.tensor([8.0, 9.0]))
    for p, q in zip(model.frozen.parameters(), frozen_before, strict=True):
        assert torch.equal(bits(p.detach()), bits(q))
    assert torch.equal(model.running, torch.ones(5))


def test_freezing_the_first_layer_does_not_shift_the_others() -> None:
    """Keyed by name: the head's coordinates are the same whether or not a layer is frozen."""
    full = ParamLayout.from_module(TwoLayer())
    partial = ParamLayout.from_module(frozen_model(0))
    full_slices = {n: sl for n, sl, _ in full.slices()}
    partial_slices = {n: sl for n, sl, _ in partial.slices()}
    assert set(partial_slices) < set(full_slices)
    assert partial_slices["head.weight"] == slice(0, 8)
    assert full_slices["head.weight"] == slice(16, 24)


def test_opacus_wrapper_has_the_same_layout_and_loads_by_name() -> None:
    model = build_model("digits-cnn", seed=0)
    layout = ParamLayout.from_module(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = GradSampleModule(model)
    assert next(n for n, _ in wrapped.named_parameters()).startswith("_module.")
    assert ParamLayout.from_module(wrapped) == layout
    flat = odd_values(layout.numel, seed=5)
    layout.load_flat_(wrapped, flat)
    assert torch.equal(bits(layout.flatten_module(model)), bits(flat))
    assert torch.equal(bits(layout.flatten_module(wrapped)), bits(flat))


@pytest.mark.parametrize(
    ("name", "unwrapped"),
    [
        ("_module.features.0.weight", "features.0.weight"),
        ("_module._module.head.bias", "head.bias"),
        ("head.bias", "head.bias"),
        ("features._module.weight", "features._module.weight"),  # only a leading prefix
        ("_modulex.weight", "_modulex.weight"),
    ],
)
def test_unwrap_name_strips_leading_wrapper_prefixes_only(name: str, unwrapped: str) -> None:
    assert unwrap_name(name) == unwrapped


@pytest.mark.parametrize("size_delta", [-1, 1])
def test_loading_a_wrong_size_vector_names_the_size(size_delta: int) -> None:
    model = build_model("digits-cnn", seed=0)
    layout = ParamLayout.from_module(model)
    before = layout.flatten_module(model)
    n = layout.numel + size_delta
    with pytest.raises(ValueError, match=rf"flat has shape \({n},\): expected \(38282,\)"):
        layout.load_flat_(model, torch.zeros(n))
    assert torch.equal(layout.flatten_module(model), before)  # nothing half-written


def test_split_rejects_right_count_wrong_rank_and_names_the_field() -> None:
    layout = ParamLayout(names=("a", "b"), shapes=((2, 3), (4,)))
    assert layout.numel == 10
    with pytest.raises(ValueError, match=r"mask has shape \(2, 5\): expected \(10,\).*2 param"):
        layout.split(torch.zeros(2, 5, dtype=torch.bool), field="mask")
    with pytest.raises(ValueError, match=r"flat has shape \(\): expected \(10,\)"):
        layout.split(torch.tensor(1.0))


def test_flatten_rejects_missing_names_and_wrong_shapes() -> None:
    layout = ParamLayout(names=("a", "b"), shapes=((2, 3), (4,)))
    with pytest.raises(KeyError, match=r"parameter 'b' missing"):
        layout.flatten({"a": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"parameter 'a' has shape \(3, 2\): expected \(2, 3\)"):
        layout.flatten({"a": torch.zeros(3, 2), "b": torch.zeros(4)})


def test_flatten_orders_by_layout_not_by_mapping_order() -> None:
    layout = ParamLayout(names=("a", "b"), shapes=((2,), (1,)))
    flat = layout.flatten({"b": torch.tensor([3.0]), "a": torch.tensor([1.0, 2.0])})
    assert torch.equal(flat, torch.tensor([1.0, 2.0, 3.0]))


def test_masks_split_per_parameter_like_values() -> None:
    layout = ParamLayout(names=("w", "b"), shapes=((2, 2), (3,)))
    mask = torch.tensor([True, False, False, True, False, True, True])
    views = layout.split(mask, field="mask")
    assert views["w"].dtype == torch.bool
    assert views["w"].tolist() == [[True, False], [False, True]]
    assert views["b"].tolist() == [False, True, True]


def test_empty_layout() -> None:
    layout = ParamLayout.from_module(nn.Tanh())
    assert layout.names == () and layout.numel == 0
    assert layout.flatten({}).shape == (0,)
    assert layout.split(torch.zeros(0)) == {}
    layout.load_flat_(nn.Tanh(), torch.zeros(0))


def test_constructor_validates_names_and_shapes() -> None:
    with pytest.raises(ValueError, match=r"names has 2 entries but shapes 1"):
        ParamLayout(names=("a", "b"), shapes=((1,),))
    with pytest.raises(ValueError, match=r"duplicate parameter names"):
        ParamLayout(names=("a", "a"), shapes=((1,), (2,)))
    with pytest.raises(TypeError):
        ParamLayout(("a",), ((1,),))  # type: ignore[misc]  # keyword-only


def test_layout_is_a_frozen_value() -> None:
    a = ParamLayout.from_module(build_model("digits-cnn", seed=0))
    b = ParamLayout.from_module(build_model("digits-cnn", seed=7))
    assert a == b and hash(a) == hash(b)  # weights differ, layout does not
    with pytest.raises(AttributeError):
        a.names = ()  # type: ignore[misc]
