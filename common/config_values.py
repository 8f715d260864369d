"""The run config's value checks that need no heavy import: ranges, names and combinations.

``check_values`` is what ``FederatedConfig`` checks first (``common/config.py``), and what
``fedsparse``'s commands check before they import torch or Opacus (``lab/cli/utils.py:
check_run_config``): a bad value is refused in milliseconds with the message the full parse
gives (``final-rate=1.5: expected 0 <= r < 1``, ``dataset='digit': expected one of ...``).
The checks that need a method's class or the model (a plug-in's own rules, the method's
parameters, the norm bound) run in ``FederatedConfig`` after it. A setting that needs
others names all of them in its first error (``secure-aggregation=true``). Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final

from fedsparse.common import plugins
from fedsparse.common.aggregation.quantized_norms import feedback_contraction
from fedsparse.common.dp.mechanisms import clips_per_sample, is_private
from fedsparse.common.names import (
    ACCOUNTANTS,
    AGGREGATORS,
    CENTRAL_NOISE_SOURCES,
    CODECS,
    COMPRESSIONS,
    DATASET_INPUT_SHAPES,
    DATASET_NAMES,
    DEFAULT_MODELS,
    DEVICES,
    DP_LEVELS,
    DP_NORM_BOUNDS,
    ENGINES,
    EVAL_SPLITS,
    MASK_SCOPES,
    MECHANISMS,
    METHOD_NAMES,
    MODEL_INPUT_SHAPES,
    MODEL_NAMES,
    NORM_ACTIONS,
    PARTITIONER_NAMES,
    PAYLOAD_DTYPES,
    PER_STEP_METHODS,
    SCHEDULES,
    SELECTION_MODES,
    SELECTIONS,
    TRACKERS,
    WEIGHTINGS,
)
from fedsparse.common.wire.value_formats import is_exact

SMALL_RING_BITS: Final = 54
"""The widest small ring (``common/aggregation/secure.py: DECODE_BITS``, tested equal; not
imported: the value checks import nothing heavy)."""

__all__ = [
    "MIN_TARGET",
    "NAMED_FIELDS",
    "NO_ERROR_FEEDBACK",
    "check_values",
    "dp_norm_bound_applies",
    "trackers",
]

#: Fields whose value is a name, and the names they accept (``common/names.py``).
NAMED_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "engine": ENGINES,
    "device": DEVICES,
    "mechanism": MECHANISMS,
    "accountant": ACCOUNTANTS,
    "schedule": SCHEDULES,
    "selection": SELECTIONS,
    "selection_mode": SELECTION_MODES,
    "mask_scope": MASK_SCOPES,
    "codec": CODECS,
    "value_dtype": PAYLOAD_DTYPES,
    "downlink_dtype": PAYLOAD_DTYPES,
    "compression": COMPRESSIONS,
    "dataset": DATASET_NAMES,
    "eval_split": EVAL_SPLITS,
    "dp_level": DP_LEVELS,
    "central_noise": CENTRAL_NOISE_SOURCES,
    "partitioner": PARTITIONER_NAMES,
    "weighting": WEIGHTINGS,
    "aggregator": AGGREGATORS,
    "norm_action": NORM_ACTIONS,
    "dp_norm_bound": DP_NORM_BOUNDS,
}

#: Named fields that also take a user's ``package.module:attribute``, and what it names.
_PLUGIN_FIELDS: Final[dict[str, str]] = {
    "dataset": " or package.module:loader",
    "engine": ", or package.module:attribute (an EngineSpec)",
}

#: The value dtypes ``error-feedback`` refuses, and why. Error feedback corrects a compressor
#: whose error is smaller than what it compresses (a contraction); int2's and int1's unbiased
#: stochastic rounding is not one: its expected squared error is ``s ||x||_1 - ||x||^2`` for
#: a block step ``s`` equal to the block's largest magnitude, about 1.4 times ``||x||^2`` on
#: Gaussian blocks of 256, and it is zero-mean, so there is nothing to correct. Fed back, the
#: stochastic sign's residual grows geometrically; int2's settles at about six times the
#: values, and the model moves by a fresh error of that size every round (digits at ε = 3,
#: r = 0.9: 0.36 against 0.76 without feedback; dense, r = 0: 0.24 against 0.79;
#: docs/explanation/bandwidth.md, "Error feedback"; tests/client/test_error_feedback.py).
NO_ERROR_FEEDBACK: Final[dict[str, str]] = {
    "fp32": "lossless: no error to feed back",
    "int2": "its unbiased stochastic rounding does not contract: fed back, the residual "
    "settles at several times the values and each round's model moves by it",
    "int1": "the stochastic sign's residual grows geometrically when fed back",
}

#: The smallest target epsilon a worst-case sigma serves (``worst_case_noise_multiplier`` lowers
#: the target by its tolerances first).
MIN_TARGET: Final = 0.03

Fail = Callable[[str, str], None]


def trackers(log: str) -> tuple[str, ...]:
    """``log``'s tracker names, in order."""
    return tuple(name.strip() for name in log.split(",") if name.strip())


def dp_norm_bound_applies(v: Mapping[str, Any]) -> bool:
    """``dp-norm-bound=auto`` and the DP parameters bound an update: ``dp-level=sample`` (under
    ``user`` the server clips every update itself, ``central-clip``) with a mechanism that
    clips per sample (``noisy`` does not: nothing bounds its gradients)."""
    return (
        v["dp_norm_bound"] == "auto"
        and v["dp_level"] == "sample"
        and clips_per_sample(v["mechanism"])
    )


def check_values(v: Mapping[str, Any]) -> None:
    """Checks a run config's values (``v``: every field of ``FederatedConfig``, by field name).

    Raises:
        ValueError: ``key=value: expected ...`` for the first bad value.
    """

    def fail(field: str, expected: str) -> None:
        raise ValueError(f"{field.replace('_', '-')}={v[field]!r}: expected {expected}")

    _check_numbers(v, fail)
    _check_names(v, fail)
    _check_error_feedback(v, fail)
    _check_robustness(v, fail)
    _check_dp_level(v, fail)
    _check_schedule(v, fail)


def _check_numbers(v: Mapping[str, Any], fail: Fail) -> None:
    for field in ("num_rounds", "local_epochs", "batch_size", "min_clients"):
        if v[field] < 1:
            fail(field, ">= 1")
    if v["clients_per_round"] < 0:
        fail("clients_per_round", ">= 0 (0 = all connected clients)")
    for field in ("round_timeout", "lr", "max_grad_norm"):
        if not (math.isfinite(v[field]) and v[field] > 0):
            fail(field, "a finite value > 0")
    if not 0.0 <= v["momentum"] < 1.0:
        fail("momentum", "0 <= momentum < 1")
    if not (math.isfinite(v["noise_multiplier"]) and v["noise_multiplier"] >= 0):
        fail("noise_multiplier", "a finite value >= 0")
    if not (math.isfinite(v["target_epsilon"]) and v["target_epsilon"] >= 0):
        fail("target_epsilon", "a finite value >= 0 (0: use noise-multiplier)")
    if not 0 < v["delta"] < 1:
        fail("delta", "0 < delta < 1")
    if not 0 <= v["seed"] < 2**63:
        fail("seed", "0 <= seed < 2**63")
    if not 1 <= v["value_block"] < 2**32:
        fail("value_block", "1 <= value-block < 2**32")
    if not -1 <= v["split_seed"] < 2**63:
        fail("split_seed", "-1 (the run's seed) or 0 <= split-seed < 2**63")
    if v["dirichlet_alpha"] <= 0:
        fail("dirichlet_alpha", "> 0")
    if v["nominal_size"] < 0:
        fail("nominal_size", ">= 0 (0: each simulated node's real count)")


def _check_names(v: Mapping[str, Any], fail: Fail) -> None:
    """Each name against the names its key accepts (a user's ``package.module:attribute`` is
    checked where it is imported), and the model against the dataset's image shape."""
    for field, names in NAMED_FIELDS.items():
        value = v[field]
        if field in _PLUGIN_FIELDS and plugins.is_reference(value):
            continue  # a user's loader or engine (common/plugins.py): checked where it loads
        if value not in names:
            fail(field, f"one of {', '.join(names)}{_PLUGIN_FIELDS.get(field, '')}")
    if v["method"] not in METHOD_NAMES and not plugins.is_reference(v["method"]):
        fail(
            "method",
            f"one of {', '.join(METHOD_NAMES)}, or package.module:Class (a "
            "fedsparse.common.methods.Method subclass)",
        )
    if any(name not in TRACKERS for name in trackers(v["log"])):
        fail("log", f"some of {', '.join(TRACKERS)}, comma-separated ('' for none)")
    model, dataset = v["model"], v["dataset"]
    user_model, user_dataset = plugins.is_reference(model), plugins.is_reference(dataset)
    if model not in ("", *MODEL_NAMES) and not user_model:
        fail(
            "model",
            f"one of {', '.join(MODEL_NAMES)} ('' for the dataset's default) or "
            "package.module:factory",
        )
    if user_dataset and model == "":
        fail("model", f"a model for dataset={dataset!r} (a user's dataset has no default)")
    if not (user_model or user_dataset):  # a user's shapes are checked where they load
        name = model or DEFAULT_MODELS[dataset]
        model_shape, data_shape = MODEL_INPUT_SHAPES[name], DATASET_INPUT_SHAPES[dataset]
        if model_shape != data_shape:
            fits = [m for m in MODEL_NAMES if MODEL_INPUT_SHAPES[m] == data_shape]
            fail(
                "model",
                f"a model for dataset={dataset!r} ({_shape(data_shape)} images; "
                f"{name} takes {_shape(model_shape)}): one of {', '.join(fits)} or ''",
            )


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _check_error_feedback(v: Mapping[str, Any], fail: Fail) -> None:
    """``error-feedback`` against the value dtype and ``dp-norm-bound``."""
    if not v["error_feedback"]:
        return
    dtype = v["value_dtype"]
    if dtype in NO_ERROR_FEEDBACK:
        fail("error_feedback", f"false with value-dtype={dtype!r} ({NO_ERROR_FEEDBACK[dtype]})")
    # the derived bound covers v + e where the dtype's rounding error contracts
    if dp_norm_bound_applies(v) and feedback_contraction(dtype) is None:
        fail(
            "error_feedback",
            f"false with dp-norm-bound='auto' and value-dtype={dtype!r} (its rounding "
            "error does not contract when fed back: no update bound); set dp-norm-bound='off'",
        )


def _check_robustness(v: Mapping[str, Any], fail: Fail) -> None:
    if not 0.0 <= v["trim_fraction"] < 0.5:
        fail("trim_fraction", "0 <= f < 0.5")
    if v["max_failed_rounds"] < 0:
        fail("max_failed_rounds", ">= 0 (0: never end the run)")
    if v["max_client_examples"] < 0:
        fail("max_client_examples", ">= 0 (0: the training split's size)")
    if v["min_client_examples"] < 0:
        fail("min_client_examples", ">= 0 (0: not declared)")
    if 0 < v["max_client_examples"] < v["min_client_examples"]:
        fail("min_client_examples", f"<= max-client-examples={v['max_client_examples']}")
    targeted = is_private(v["mechanism"]) and v["target_epsilon"] > 0
    if dp_norm_bound_applies(v) and targeted and v["target_epsilon"] <= MIN_TARGET:
        fail(
            "target_epsilon",
            f"> {MIN_TARGET:g} with dp-norm-bound='auto' (its worst-case sigma), or "
            "dp-norm-bound='off'",
        )
    if v["aggregator"] != "mean" and v["weighting"] != "uniform":
        fail(
            "weighting",
            f"'uniform' with aggregator={v['aggregator']!r} (robust aggregators weigh "
            "every update equally)",
        )
    for field in ("max_norm_ratio", "max_update_norm"):
        if not (math.isfinite(v[field]) and v[field] >= 0):
            fail(field, "a finite value >= 0 (0: off)")
    if 0 < v["max_norm_ratio"] < 1:
        fail("max_norm_ratio", ">= 1 (0: off); below 1 it rejects the median update itself")


def _check_dp_level(v: Mapping[str, Any], fail: Fail) -> None:
    """The user-level DP keys (``dp-level``, ``central-*``, ``secure-aggregation``); a setting
    that needs others names every one of them at once."""
    if not (math.isfinite(v["central_clip"]) and v["central_clip"] > 0):
        fail("central_clip", "a finite value > 0")
    if not (math.isfinite(v["central_noise_multiplier"]) and v["central_noise_multiplier"] >= 0):
        fail("central_noise_multiplier", "a finite value >= 0")
    target = v["central_target_epsilon"]
    if not (math.isfinite(target) and target >= 0):
        fail("central_target_epsilon", "a finite value >= 0 (0: off)")
    if target > 0 and v["dp_level"] != "user":
        fail("central_target_epsilon", "0 (off), or with it dp-level='user'")
    if v["secagg_colluders"] < 0:
        fail("secagg_colluders", ">= 0")
    neighbours = v["secagg_neighbours"]
    if neighbours < 0 or neighbours % 2 or neighbours == 1:
        fail("secagg_neighbours", "0 (the complete graph) or an even number >= 2")
    if neighbours and not v["secure_aggregation"]:
        fail("secagg_neighbours", "0, or with it secure-aggregation=true")
    if neighbours and 0 < v["clients_per_round"] < neighbours + 2:
        fail("secagg_neighbours", f"at most clients-per-round - 2 = {v['clients_per_round'] - 2}")
    bits = v["secagg_ring_bits"]
    if bits and not 8 <= bits <= SMALL_RING_BITS:
        fail("secagg_ring_bits", f"0 (the exact ring) or in [8, {SMALL_RING_BITS}]")
    if bits and not v["secure_aggregation"]:
        fail("secagg_ring_bits", "0, or with it secure-aggregation=true")
    if v["secure_aggregation"]:
        # the server sees no single update: nothing to encode lossily, feed back or save
        needs = _user_level_needs(v)
        if not is_exact(v["value_dtype"]):
            needs.append("value-dtype='fp32'")
        if not is_exact(v["downlink_dtype"]):
            needs.append("downlink-dtype='fp32'")
        if v["error_feedback"]:
            needs.append("error-feedback=false")
        if v["save_updates"]:
            needs.append("save-updates=false (no single update is seen)")
        if needs:
            fail(
                "secure_aggregation",
                f"false, or with it {', '.join(needs)} (distributed DP-FedAvg: the server "
                "decodes only the round's noisy sum)",
            )
        return
    if v["dp_level"] != "user":
        return
    needs = _user_level_needs(v)
    if needs:
        fail("dp_level", f"'sample', or with dp-level=user {', '.join(needs)}")


def _user_level_needs(v: Mapping[str, Any]) -> list[str]:
    """What ``dp-level=user`` (DP-FedAvg) needs of the other keys, each as ``key=value``."""
    needs = [] if v["dp_level"] == "user" else ["dp-level='user'"]
    if v["clients_per_round"] < 1:
        needs.append("clients-per-round >= 1 (the expected users per round)")
    if v["mask_scope"] != "round":
        needs.append("mask-scope='round' (the noise needs one public mask)")
    if v["aggregator"] != "mean" or v["weighting"] != "uniform":
        needs.append("aggregator='mean' and weighting='uniform'")
    if v["secure_mode"] and v["central_noise"] != "fresh":
        needs.append("central-noise='fresh' with secure-mode=true (hardened noise takes no seed)")
    if v["method"] in PER_STEP_METHODS:  # a plug-in's is checked where its class is imported
        needs.append("a method other than gip or random-k (the clients choose supports)")
    return needs


def _check_schedule(v: Mapping[str, Any], fail: Fail) -> None:
    """The rate schedule's and the methods' parameters' own ranges (``common/methods/``
    checks them again, with what depends on a method's class)."""
    if not 0.0 <= v["final_rate"] < 1.0:
        fail("final_rate", "0 <= r < 1")
    if v["cooling_rounds"] < 1:
        fail("cooling_rounds", ">= 1")
    for field in ("initial_keep", "final_keep"):
        if not 0.0 < v[field] <= 1.0:
            fail(field, "0 < k <= 1")
    try:
        rates = tuple(float(x) for x in v["rate_steps"].split(",") if x.strip())
    except ValueError:
        fail("rate_steps", "comma-separated rates")
        return
    if any(not 0.0 <= rate < 1.0 for rate in rates):
        raise ValueError(f"rate-steps={rates}: each rate must satisfy 0 <= r < 1")
    if v["schedule"] == "steps" and not rates:
        raise ValueError("rate-steps=(): the 'steps' schedule needs at least one rate")
    for field, low in (("freeze_layers", 1), ("freeze_after", 0), ("public_epochs", 0)):
        if v[field] < low:
            fail(field, f">= {low}")
    if v["group_size"] < 2:
        fail("group_size", ">= 2")
    for field in ("public_fraction", "index_budget_fraction"):
        if not 0.0 < v[field] < 1.0:
            fail(field, "0 < f < 1")
