"""One coercion rule for the run config, the node policy and the node's data declaration."""

import pytest

from fedsparse.client.node_data import NodeData
from fedsparse.client.node_policy import NodePolicy
from fedsparse.common.coerce import coerce, format_pairs, parse_pairs, unknown_key
from fedsparse.common.config import FederatedConfig


@pytest.mark.parametrize(
    ("value", "kind", "expected"),
    [
        (True, bool, True),
        ("TRUE", bool, True),
        ("0", bool, False),
        ("false", bool, False),
        (3, int, 3),
        (3.0, int, 3),
        ("7", int, 7),
        (2, float, 2.0),
        ("1e-5", float, 1e-5),
        ("a, b,,c", tuple, ("a", "b", "c")),
        (["a", " b"], tuple, ("a", "b")),
        ("digits", str, "digits"),
        (5, str, "5"),
    ],
)
def test_values_convert_by_one_rule(value, kind, expected) -> None:
    result = coerce("k", value, kind)
    assert result == expected and type(result) is type(expected)


@pytest.mark.parametrize(
    ("value", "kind", "expected"),
    [
        ("yes", bool, "k='yes': expected true or false"),
        (2, bool, "k=2: expected true or false"),
        (True, int, "k=True: expected int"),
        (1.5, int, "k=1.5: expected int"),
        ("x", float, "k='x': expected float"),
        (False, float, "k=False: expected float"),
        (True, str, "k=True: expected str"),
    ],
)
def test_a_value_that_does_not_convert_names_the_key(value, kind, expected) -> None:
    with pytest.raises(ValueError, match=f"^where: {expected}$".replace("(", r"\(")):
        coerce("k", value, kind, where="where")


def test_the_run_config_the_policy_and_the_declaration_agree() -> None:
    """The copies used to disagree: the policy refused "1"/"0" that the run config took."""
    assert FederatedConfig.from_run_config({"secure-mode": "1"}).secure_mode is True
    assert NodePolicy.from_sources({"release-train-loss": "1"}).release_train_loss is True
    declared = NodeData.from_sources({"dataset": "digits", "hold-out-validation": "1"})
    assert declared is not None and declared.hold_out_validation is True
    with pytest.raises(ValueError, match="num-rounds=True: expected int"):
        FederatedConfig.from_run_config({"num-rounds": True})
    with pytest.raises(ValueError, match="node policy: max-local-epochs=True: expected int"):
        NodePolicy.from_sources({"max-local-epochs": True})


def test_an_unknown_key_names_the_closest_ones_else_all() -> None:
    known = ["num_rounds", "num_partitions", "seed"]
    assert unknown_key("run config key", "num-round", known) == (
        "run config key 'num-round' is unknown; did you mean 'num-rounds'?"
    )
    assert unknown_key("k", "zzz", known) == (
        "k 'zzz' is unknown; known keys: num-partitions, num-rounds, seed"
    )
    with pytest.raises(ValueError, match="did you mean 'num-rounds'"):
        FederatedConfig.from_run_config({"num-round": 2})


def test_pairs_travel_in_one_string() -> None:
    assert parse_pairs("k", " a = 1 ;; b=x=y; ") == {"a": "1", "b": "x=y"}
    assert parse_pairs("k", "") == {}
    values = {"n": 3, "r": 0.1, "on": True, "names": ("a", "b"), "s": "x"}
    text = format_pairs("k", values)
    assert text == "n=3;r=0.1;on=true;names=a,b;s=x"
    back = {key: coerce(key, v, type(values[key])) for key, v in parse_pairs("k", text).items()}
    assert back == values


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stride", "k='stride': expected key=value;key=value ('stride')"),
        ("a=1;=3", "k='a=1;=3': expected key=value;key=value ('=3')"),
        ("a=1;a=2", "k='a=1;a=2': expected each key once ('a' twice)"),
        (3, "k=3: expected key=value;key=value (a string)"),
    ],
)
def test_a_malformed_pairs_string_is_named(text: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_pairs("k", text)
    assert str(info.value) == message


def test_a_value_that_cannot_travel_in_pairs_is_named() -> None:
    with pytest.raises(ValueError, match=r"^k: s='a;b': expected no ; and no edge spaces$"):
        format_pairs("k", {"s": "a;b"})
    with pytest.raises(ValueError, match=r"^k: t=\('a,b',\): expected items without , or ;$"):
        format_pairs("k", {"t": ("a,b",)})
