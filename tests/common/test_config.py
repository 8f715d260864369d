"""Tests for the federated run config (fedsparse.common.config): defaults, names, model rule."""

import tomllib
import types
import typing
from pathlib import Path

import pytest
import torch
from opacus.accountants import create_accountant

from fedsparse.common.aggregation.norm_bounds import DP_NORM_BOUNDS, NORM_ACTIONS
from fedsparse.common.aggregation.sparse import AGGREGATORS, WEIGHTINGS
from fedsparse.common.config import (
    ADDED_KEYS,
    CODECS,
    MASK_SCOPES,
    RESUME_MAY_DIFFER,
    FederatedConfig,
)
from fedsparse.common.data.datasets import (
    DATASET_INPUT_SHAPES,
    DATASET_NAMES,
    EVAL_SPLITS,
    load_dataset,
)
from fedsparse.common.data.partition import PARTITIONER_NAMES
from fedsparse.common.dp.accounting import ACCOUNTANTS
from fedsparse.common.dp.central import CENTRAL_NOISE_SOURCES, DP_LEVELS
from fedsparse.common.dp.engines import ENGINES
from fedsparse.common.dp.optimizer import MECHANISMS
from fedsparse.common.dp.worst_case import worst_case_noise_multiplier
from fedsparse.common.methods import FEDERATED_METHODS, SELECTION_MODES, SELECTIONS
from fedsparse.common.methods.schedules import SCHEDULES
from fedsparse.common.models.classifiers import (
    DEFAULT_MODELS,
    MODEL_INPUT_SHAPES,
    MODEL_NAMES,
    build_model,
)
from fedsparse.common.training.configs import DEVICES
from fedsparse.common.wire.payload import COMPRESSIONS, LOWBIT_DTYPES, PAYLOAD_DTYPES, VALUE_DTYPES

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

# Every run-config key whose value is a name, with the names it accepts (the owners' tuples).
NAMED_KEYS = {
    "engine": ENGINES,
    "device": DEVICES,
    "mechanism": MECHANISMS,
    "accountant": ACCOUNTANTS,
    "schedule": SCHEDULES,
    "method": FEDERATED_METHODS,
    "selection": SELECTIONS,
    "selection-mode": SELECTION_MODES,
    "mask-scope": MASK_SCOPES,
    "codec": CODECS,
    "value-dtype": PAYLOAD_DTYPES,
    "downlink-dtype": PAYLOAD_DTYPES,
    "compression": COMPRESSIONS,
    "dataset": DATASET_NAMES,
    "eval-split": EVAL_SPLITS,
    "dp-level": DP_LEVELS,
    "central-noise": CENTRAL_NOISE_SOURCES,
    "partitioner": PARTITIONER_NAMES,
    "weighting": WEIGHTINGS,
    "aggregator": AGGREGATORS,
    "norm-action": NORM_ACTIONS,
    "dp-norm-bound": DP_NORM_BOUNDS,
    "model": MODEL_NAMES,
}


def literal_names(hint: object) -> tuple[object, ...]:
    """The values of a ``Literal`` type, or of a union of them (``()`` for anything else)."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = [literal_names(arg) for arg in typing.get_args(hint)]
        return tuple(v for part in parts for v in part) if all(parts) else ()
    return ()


def config_for(key: str, name: str) -> dict[str, object]:
    """A run config setting ``key`` to ``name``, plus what that name needs to be valid."""
    overrides: dict[str, object] = {key: name}
    if key == "model":  # a dataset whose images the model takes
        overrides["dataset"] = next(
            d for d in DATASET_NAMES if DATASET_INPUT_SHAPES[d] == MODEL_INPUT_SHAPES[name]
        )
    if key == "schedule" and name == "steps":
        overrides["rate-steps"] = "0,0.5"
    if key == "mechanism" and name != "dpsgd":  # the ablations take a fixed sigma
        overrides.update({"target-epsilon": 0.0, "noise-multiplier": 0.0})
    if key == "dp-level" and name == "user":  # DP-FedAvg's fixed expected users per round
        overrides["clients-per-round"] = 2
    return overrides


def test_pyproject_run_config_equals_the_dataclass_defaults() -> None:
    declared = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    defaults = FederatedConfig().to_run_config()
    assert list(declared) == list(defaults)  # same keys, same order
    for key, value in defaults.items():
        assert (declared[key], type(declared[key])) == (value, type(value)), key
    assert FederatedConfig.from_run_config(declared) == FederatedConfig()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("dataset", "imagenet"),
        ("model", "resnet"),
        ("partitioner", "zipf"),
        ("schedule", "zigzag"),
        ("accountant", "moments"),
        ("mechanism", "laplace"),
        ("mask-scope", "global"),
        ("codec", "zip"),
        ("value-dtype", "fp64"),
        ("compression", "gzip"),
        ("dataset", "Digits"),  # names are case-sensitive
        ("partitioner", ""),
        ("weighting", "claimed"),
        ("aggregator", "krum"),
        ("norm-action", "ignore"),
        ("engine", "jax"),
        ("device", "tpu"),
        ("device", "CUDA"),
    ],
)
def test_an_unknown_name_fails_at_parse_time_in_one_line(key: str, value: str) -> None:
    with pytest.raises(ValueError) as info:
        FederatedConfig.from_run_config({key: value})
    message = str(info.value)
    names = ", ".join(NAMED_KEYS[key])
    expected = f"{key}={value!r}: expected one of {names}"
    if key == "model":
        expected += " ('' for the dataset's default) or package.module:factory"
    if key == "dataset":
        expected += " or package.module:loader"  # a user's own (common/plugins.py)
    if key == "engine":
        expected += ", or package.module:attribute (an EngineSpec)"
    assert message == expected
    assert "\n" not in message


@pytest.mark.parametrize(
    ("key", "name"), [(key, name) for key, names in NAMED_KEYS.items() for name in names]
)
def test_every_listed_name_is_accepted(key: str, name: str) -> None:
    cfg = FederatedConfig.from_run_config(config_for(key, name))
    assert getattr(cfg, key.replace("-", "_")) == name
    assert cfg.to_run_config()[key] == name


def test_field_types_list_exactly_the_accepted_names() -> None:
    """Each name field's Literal type is the owner's tuple, so mypy and the parser agree."""
    hints = typing.get_type_hints(FederatedConfig)
    literal_fields = {f: literal_names(h) for f, h in hints.items() if literal_names(h)}
    assert set(literal_fields) == {k.replace("-", "_") for k in NAMED_KEYS}
    for field, names in literal_fields.items():
        key = field.replace("_", "-")
        assert names == NAMED_KEYS[key] + (("",) if key == "model" else ()), key


@pytest.mark.filterwarnings("ignore:GDP accounting is experimental:UserWarning")
def test_the_names_are_what_their_implementations_accept() -> None:
    for accountant in ACCOUNTANTS:
        assert create_accountant(mechanism=accountant).mechanism() == accountant
    assert set(DEFAULT_MODELS) == set(DATASET_NAMES)
    assert set(MODEL_INPUT_SHAPES) == set(MODEL_NAMES)
    assert set(DATASET_INPUT_SHAPES) == set(DATASET_NAMES)
    train, _ = load_dataset("digits")  # the one dataset available without files
    assert tuple(train.x.shape[1:]) == DATASET_INPUT_SHAPES["digits"]


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_model_input_shapes_are_the_ones_the_models_take(model: str) -> None:
    net = build_model(model).eval()
    with torch.no_grad():
        assert net(torch.zeros(2, *MODEL_INPUT_SHAPES[model])).shape == (2, 10)
        for shape in set(DATASET_INPUT_SHAPES.values()) - {MODEL_INPUT_SHAPES[model]}:
            with pytest.raises(RuntimeError):
                net(torch.zeros(2, *shape))


@pytest.mark.parametrize("dataset", DATASET_NAMES)
def test_model_name_defaults_to_the_datasets_model(dataset: str) -> None:
    cfg = FederatedConfig.from_run_config({"dataset": dataset})
    assert cfg.model == ""
    assert cfg.model_name == DEFAULT_MODELS[dataset]
    assert MODEL_INPUT_SHAPES[cfg.model_name] == DATASET_INPUT_SHAPES[dataset]


def test_an_explicit_model_wins_over_the_default() -> None:
    cfg = FederatedConfig.from_run_config({"dataset": "svhn", "model": "dpcnn"})
    assert cfg.model_name == "dpcnn"
    assert FederatedConfig().model_name == "digits-cnn"


@pytest.mark.parametrize(
    ("dataset", "model"),
    [(d, m) for d in DATASET_NAMES for m in MODEL_NAMES],
)
def test_a_model_that_does_not_fit_the_dataset_fails_at_parse_time(
    dataset: str, model: str
) -> None:
    run_config = {"dataset": dataset, "model": model}
    if MODEL_INPUT_SHAPES[model] == DATASET_INPUT_SHAPES[dataset]:
        assert FederatedConfig.from_run_config(run_config).model_name == model
        return
    with pytest.raises(ValueError) as info:
        FederatedConfig.from_run_config(run_config)
    message = str(info.value)
    assert message.startswith(f"model={model!r}: expected a model for dataset={dataset!r} (")
    assert "\n" not in message
    fits = [m for m in MODEL_NAMES if MODEL_INPUT_SHAPES[m] == DATASET_INPUT_SHAPES[dataset]]
    assert message.endswith(f": one of {', '.join(fits)} or ''")


def test_other_errors_keep_their_format() -> None:
    with pytest.raises(ValueError, match=r"^final-rate=1\.2: expected 0 <= r < 1$"):
        FederatedConfig.from_run_config({"final-rate": 1.2})
    with pytest.raises(ValueError, match=r"^run config key 'datasets' is unknown"):
        FederatedConfig.from_run_config({"datasets": "digits"})


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ({"trim-fraction": 0.5}, "trim-fraction=0.5: expected 0 <= f < 0.5"),
        ({"trim-fraction": -0.1}, "trim-fraction=-0.1: expected 0 <= f < 0.5"),
        ({"max-norm-ratio": 0.5}, "max-norm-ratio=0.5: expected >= 1 (0: off); below 1 it"),
        ({"max-norm-ratio": -1}, "max-norm-ratio=-1.0: expected a finite value >= 0 (0: off)"),
        ({"max-update-norm": "inf"}, "max-update-norm=inf: expected a finite value >= 0"),
        ({"max-failed-rounds": -1}, "max-failed-rounds=-1: expected >= 0 (0: never end the run)"),
        (
            {"aggregator": "median", "weighting": "examples"},
            "weighting='examples': expected 'uniform' with aggregator='median' (robust "
            "aggregators weigh every update equally)",
        ),
    ],
)
def test_robustness_keys_are_checked_at_parse_time(run_config: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        FederatedConfig.from_run_config(run_config)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_robustness_defaults_protect_and_can_be_turned_off() -> None:
    cfg = FederatedConfig()
    assert (cfg.weighting, cfg.aggregator, cfg.norm_action) == ("uniform", "mean", "reject")
    assert cfg.norm_bound().bound([1.0, 2.0, 4.0])[0] == 6.0  # 3 x the median
    assert cfg.max_failed_rounds == 3
    off = FederatedConfig.from_run_config({"max-norm-ratio": 0, "max-update-norm": 0})
    assert off.norm_bound().bound([1.0, 2.0, 1e30])[0] == float("inf")
    # per-client masks combine with a robust aggregator (per coordinate over the coverers)
    both = FederatedConfig.from_run_config({"mask-scope": "client", "aggregator": "median"})
    assert (both.mask_scope, both.aggregator) == ("client", "median")


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ({"dp-norm-bound": "on"}, "dp-norm-bound='on': expected one of auto, off"),
        ({"max-client-examples": -1}, "max-client-examples=-1: expected >= 0 (0: the training"),
        ({"max-client-examples": "many"}, "max-client-examples='many': expected int"),
        ({"max-client-examples": 1.5}, "max-client-examples=1.5: expected int"),
        ({"min-client-examples": -1}, "min-client-examples=-1: expected >= 0 (0: not declared)"),
        (
            {"min-client-examples": 50, "max-client-examples": 40},
            "min-client-examples=50: expected <= max-client-examples=40",
        ),
        (
            {"target-epsilon": 0.02},
            "target-epsilon=0.02: expected > 0.03 with dp-norm-bound='auto' (its worst-case "
            "sigma), or dp-norm-bound='off'",
        ),
    ],
)
def test_dp_norm_bound_keys_are_checked_at_parse_time(run_config: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        FederatedConfig.from_run_config(run_config)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_dp_norm_bound_keys_parse() -> None:
    cfg = FederatedConfig()
    assert (cfg.dp_norm_bound, cfg.max_client_examples) == ("auto", 0)
    cfg = FederatedConfig.from_run_config({"dp-norm-bound": "off", "max-client-examples": "600"})
    assert (cfg.dp_norm_bound, cfg.max_client_examples) == ("off", 600)
    assert cfg.to_run_config()["max-client-examples"] == 600
    # a tiny target is fine where no worst-case sigma is needed
    for other in ({"dp-norm-bound": "off"}, {"mechanism": "noisy"}):
        FederatedConfig.from_run_config({"target-epsilon": 0.02, **other})
    assert ADDED_KEYS["dp-norm-bound"] == "auto" and ADDED_KEYS["max-client-examples"] == 0
    assert ADDED_KEYS["min-client-examples"] == 0 == cfg.min_client_examples


@pytest.mark.filterwarnings("ignore:Optimal order is the:UserWarning")
def test_the_dp_norm_bound_applies_where_the_dp_parameters_bound_an_update() -> None:
    caps = FederatedConfig().honest_client_bound(1437)
    assert caps is not None
    assert caps.noise_multiplier == worst_case_noise_multiplier(
        target_epsilon=3.0, delta=1e-5, epochs=10, accountant="rdp"
    )
    assert (caps.lr, caps.momentum, caps.max_grad_norm) == (0.25, 0.0, 1.0)
    assert (caps.batch_size, caps.local_epochs, caps.max_examples) == (32, 1, 1437)
    assert (caps.value_dtype, caps.adaptive_support) == ("fp32", False)
    assert caps.bound(38_282) == pytest.approx(67.32421636003357, rel=1e-9)  # digits' default
    # max-client-examples replaces the training split's size
    assert FederatedConfig(max_client_examples=100).honest_client_bound(1437).max_examples == 100
    # min-client-examples declares the fewest; at most what a client can hold
    assert FederatedConfig(min_client_examples=2).honest_client_bound(1437).min_examples == 2
    with pytest.raises(ValueError, match=r"^min-client-examples=1438: expected <= 1437, the "):
        FederatedConfig(min_client_examples=1438).honest_client_bound(1437)
    # the fixed noise multiplier when there is no target (and for the clipped mechanism)
    fixed = FederatedConfig(target_epsilon=0.0, noise_multiplier=1.3, local_epochs=3)
    assert fixed.honest_client_bound(10).noise_multiplier == 1.3
    assert fixed.honest_client_bound(10).local_epochs == 3
    clipped = FederatedConfig(mechanism="clipped", target_epsilon=0.0)
    assert clipped.honest_client_bound(10).noise_multiplier == 0.0
    # GIP calibrates for eps1 = 0.99 epsilon: more noise; its supports depend on the data
    gip = FederatedConfig(method="gip").honest_client_bound(10)
    assert gip.adaptive_support and gip.noise_multiplier > caps.noise_multiplier
    # epochs = num-rounds x local-epochs; PRV's error is allowed for
    longer = FederatedConfig(num_rounds=5, local_epochs=2).worst_case_noise_multiplier()
    assert longer == caps.noise_multiplier
    assert FederatedConfig(accountant="prv").worst_case_noise_multiplier() > longer
    assert FederatedConfig(value_dtype="int8").honest_client_bound(10).value_dtype == "int8"
    # nothing bounds a noisy (unclipped) update; under dp-level=user the server clips
    for off in (
        FederatedConfig(dp_norm_bound="off"),
        FederatedConfig(mechanism="noisy", target_epsilon=0.0),
        FederatedConfig(dp_level="user", clients_per_round=2),
    ):
        assert off.honest_client_bound(1437) is None and not off.dp_norm_bound_applies


def test_resume_is_a_run_config_flag_and_its_free_keys_are_real_keys() -> None:
    assert FederatedConfig().resume is False
    assert FederatedConfig.from_run_config({"resume": "true"}).resume is True
    with pytest.raises(ValueError, match="resume='yes': expected true or false"):
        FederatedConfig.from_run_config({"resume": "yes"})
    keys = set(FederatedConfig().to_run_config())
    assert keys >= RESUME_MAY_DIFFER
    # What the run computes may not change on resume.
    assert not RESUME_MAY_DIFFER & {"num-rounds", "seed", "lr", "clients-per-round", "final-rate"}


def test_value_dtype_takes_every_payload_dtype_and_value_block_its_range() -> None:
    assert (*VALUE_DTYPES, *LOWBIT_DTYPES) == PAYLOAD_DTYPES
    for name in ("int4", "int2", "int1"):
        cfg = FederatedConfig.from_run_config({"value-dtype": name, "value-block": "64"})
        assert (cfg.value_dtype, cfg.value_block) == (name, 64)
        assert cfg.to_run_config()["value-block"] == 64
        assert cfg.honest_client_bound(1437).value_dtype == name  # type: ignore[union-attr]
    assert FederatedConfig().value_block == 256
    assert FederatedConfig(value_block=1).value_block == 1
    assert FederatedConfig(value_block=2**32 - 1).value_block == 2**32 - 1
    for bad in (0, -1, 2**32):
        with pytest.raises(ValueError) as info:
            FederatedConfig.from_run_config({"value-block": bad})
        assert str(info.value) == f"value-block={bad!r}: expected 1 <= value-block < 2**32"
    # the block changes the bytes and the rounding: a resumed run keeps it
    assert "value-block" not in RESUME_MAY_DIFFER


def test_method_options_carries_a_plugins_keys_only() -> None:
    cfg = FederatedConfig()
    assert cfg.to_run_config()["method-options"] == "" and cfg.plugin_options() == ()
    assert ADDED_KEYS["method-options"] == ""  # no earlier run had a plug-in key
    with pytest.raises(ValueError) as info:
        FederatedConfig.from_run_config({"method-options": "stride=3"})
    expected = "method-options='stride=3': expected '' (method='rs' declares no options)"
    assert str(info.value) == expected
    with pytest.raises(ValueError, match=r"^method-options='stride': expected key=value;key=value"):
        FederatedConfig.from_run_config({"method-options": "stride"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({}, "secure-aggregation=True: expected false, or with it dp-level='user'"),
        ({"dp_level": "user", "clients_per_round": 4, "value_dtype": "int8"}, "value-dtype"),
        ({"dp_level": "user", "clients_per_round": 4, "downlink_dtype": "int4"}, "downlink"),
        ({"dp_level": "user", "clients_per_round": 4, "save_updates": True}, "save-updates"),
        ({"dp_level": "user", "clients_per_round": 4, "secagg_colluders": -1}, "colluders"),
    ],
)
def test_secure_aggregation_is_distributed_dp_fedavg_in_fp32(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        FederatedConfig(secure_aggregation=True, **overrides)  # type: ignore[arg-type]
    ok = FederatedConfig(secure_aggregation=True, dp_level="user", clients_per_round=4)
    assert ok.to_run_config()["secure-aggregation"] is True


#: a ring's shape key -> a value it takes (ten clients a round, under secure aggregation)
RING_SHAPES = {"secagg-neighbours": 8, "secagg-ring-bits": 12}


@pytest.mark.parametrize(
    ("key", "value", "secure", "message"),
    [
        ("secagg-neighbours", 3, True, r"=3: expected 0 \(the complete graph\) or an even"),
        ("secagg-neighbours", -2, True, "=-2: expected 0"),
        ("secagg-neighbours", 4, False, "=4: expected 0, or with it secure-aggregation=true"),
        ("secagg-neighbours", 10, True, "=10: expected at most clients-per-round - 2 = 8"),
        ("secagg-ring-bits", 7, True, r"=7: expected 0 \(the exact ring\) or in \[8, 54\]"),
        ("secagg-ring-bits", 55, True, r"=55: expected 0 \(the exact ring\) or in \[8, 54\]"),
        ("secagg-ring-bits", -1, True, "=-1: expected 0"),
        ("secagg-ring-bits", 12, False, "=12: expected 0, or with it secure-aggregation=true"),
    ],
)
def test_a_sparse_or_small_ring_is_checked_and_needs_secure_aggregation(
    key: str, value: int, secure: bool, message: str
) -> None:
    """A sparse ring: an even degree below the round; a small ring: 8 to 54 bits; both only
    under secure aggregation, and both through the run config and back."""
    level = "user" if secure else "sample"
    field = key.replace("-", "_")
    with pytest.raises(ValueError, match=f"{key}{message}"):
        FederatedConfig(
            secure_aggregation=secure,
            dp_level=level,  # type: ignore[arg-type]
            clients_per_round=10,
            **{field: value},
        )
    good = RING_SHAPES[key]
    ok = FederatedConfig(
        secure_aggregation=True, dp_level="user", clients_per_round=10, **{field: good}
    )
    assert ok.to_run_config()[key] == good
    assert getattr(FederatedConfig.from_run_config(ok.to_run_config()), field) == good
