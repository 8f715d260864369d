"""The run config's key table: which names each named key accepts, which keys were added
after runs were recorded (and the value those runs ran under), which a resumed run may change,
the wire codecs and trackers a run can name, and the format of ``method-options``, the one key
that carries a plug-in method's own keys.

What ``FederatedConfig`` (``common/config.py``, which exports these names too) checks its
values against and what reads a saved run config (a checkpoint, a finished sweep run) needs;
the allowed names are the ``Literal`` types of the modules that implement them
(``data.DatasetName``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, get_args

from fedsparse.common import plugins
from fedsparse.common.aggregation.norm_bounds import DP_NORM_BOUNDS, NORM_ACTIONS
from fedsparse.common.aggregation.quantized_norms import feedback_contraction
from fedsparse.common.aggregation.sparse import AGGREGATORS, WEIGHTINGS
from fedsparse.common.coerce import coerce, parse_pairs, unknown_key
from fedsparse.common.data.datasets import DATASET_INPUT_SHAPES, DATASET_NAMES, EVAL_SPLITS
from fedsparse.common.data.partition import PARTITIONER_NAMES
from fedsparse.common.dp.accounting import ACCOUNTANTS
from fedsparse.common.dp.central import CENTRAL_NOISE_SOURCES, DP_LEVELS
from fedsparse.common.dp.engines import ENGINES
from fedsparse.common.dp.optimizer import MECHANISMS
from fedsparse.common.methods import SELECTION_MODES, SELECTIONS, check_method_name
from fedsparse.common.methods.index_selection import DEFAULT_INDEX_FRACTION
from fedsparse.common.methods.schedules import SCHEDULES
from fedsparse.common.models.classifiers import MODEL_INPUT_SHAPES, MODEL_NAMES
from fedsparse.common.training.configs import DEVICES
from fedsparse.common.wire.payload import (
    COMPRESSIONS,
    DEFAULT_VALUE_BLOCK,
    PAYLOAD_DTYPES,
    IndexEncoding,
)
from fedsparse.common.wire.protocol import MASK_SCOPES

if TYPE_CHECKING:
    from fedsparse.common.config import FederatedConfig

__all__ = [
    "ADDED_KEYS",
    "CODECS",
    "METHOD_OPTIONS",
    "NO_ERROR_FEEDBACK",
    "NAMED_FIELDS",
    "RESUME_MAY_DIFFER",
    "TRACKERS",
    "CodecName",
    "check_dp_level",
    "check_error_feedback",
    "check_names",
    "method_option_values",
    "with_added_keys",
    "wire_encoding",
]

CodecName = Literal["values", "coo", "delta", "bitmap", "auto"]
"""How a sparse update's support travels (payload): "values" sends values only and lets the
receiver regenerate the support from the broadcast seed; "coo", "delta" and "bitmap" send it
explicitly (what a system without seed sharing pays); "auto" picks the smallest, which is
"values" whenever a seed is known."""

CODECS: Final[tuple[CodecName, ...]] = get_args(CodecName)


#: Run-config keys a resumed run may set differently from the run it continues: none of them
#: changes a number the run computes (where records go and how long the server waits). Every
#: other key, ``num-rounds`` included (the rate schedule and a calibrated sigma depend on it),
#: must equal the checkpoint's.
RESUME_MAY_DIFFER: Final[frozenset[str]] = frozenset(
    {"resume", "out-dir", "data-dir", "round-timeout", "min-clients", "save-updates", "log"}
)

#: Run-config keys added after runs were recorded, with the value under which a run recorded
#: before them ran: ``auto`` was the Opacus engine on the CPU when those runs ran (it is the
#: factored engine now (CHANGELOG.md): the same mechanism, equal to float rounding, so a run or
#: checkpoint recorded under the old ``auto`` is read as the same config; ``engine=opacus``
#: repeats it bit for bit), and ``method=rs`` (with its unused ``freeze-*`` defaults) is what
#: every earlier run did. A checkpoint or a finished sweep run written without them is read
#: through ``with_added_keys``.
ADDED_KEYS: Final[dict[str, Any]] = {
    "log": "",
    "engine": "auto",
    "device": "auto",
    "method": "rs",
    "freeze-layers": 1,
    "freeze-after": 0,
    "public-fraction": 0.1,
    "public-epochs": 5,
    "selection": "magnitude",
    "selection-mode": "freeze",
    "index-budget-fraction": DEFAULT_INDEX_FRACTION,
    "group-size": 256,
    "eval-split": "test",
    "split-seed": -1,
    "dp-level": "sample",
    "central-noise-multiplier": 1.0,
    "central-clip": 1.0,
    "central-noise": "fresh",
    # The bound never binds on an honest update (common/aggregation/norm_bounds.py:
    # HonestClientBound, with probability 1 - 1e-9 per update), so a run recorded without it
    # is what it would have recorded with it, bit for bit, unless a client sent what no
    # honest client can.
    "dp-norm-bound": "auto",
    "max-client-examples": 0,
    # Undeclared is what the bound assumed before it.
    "min-client-examples": 0,
    # Only the low-bit value dtypes (added with it) read it: an earlier run ran at any value.
    "value-block": DEFAULT_VALUE_BLOCK,
    # Off is what every run did before it.
    "error-feedback": False,
    # A plug-in method's own keys travelled as top-level keys before it (and no built-in
    # method has any): a run recorded without it ran with none.
    "method-options": "",
    # Exact fp32 values are what every downlink carried before it.
    "downlink-dtype": "fp32",
    # Every earlier run aggregated in the clear.
    "secure-aggregation": False,
    "secagg-colluders": 0,
    # Every simulated node sampled at its real count's rate before it.
    "nominal-size": 0,
}


#: The value dtypes ``error-feedback`` refuses, and why. The stochastic sign's error is about
#: ``max |v|`` a value, larger than the values it rounds: fed back, the residual grows by a
#: constant factor a round (diverging within tens of rounds), while int2's stays about a step.
NO_ERROR_FEEDBACK: Final[dict[str, str]] = {
    "fp32": "lossless: no error to feed back",
    "int1": "the stochastic sign's residual grows geometrically when fed back",
}


def with_added_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a saved run config) with the keys it predates at their ``ADDED_KEYS`` value."""
    return {**ADDED_KEYS, **config}


def wire_encoding(codec: CodecName, *, sparse: bool) -> IndexEncoding:
    """The ``payload.encode_update`` encoding for a run-config ``codec``.

    A full update (``sparse=False``: rate 0, or the first dense download) always travels
    ``"dense"``: every codec agrees that no indices are needed.
    """
    if codec not in CODECS:
        raise ValueError(f"codec={codec!r}: expected one of {', '.join(CODECS)}")
    if not sparse:
        return "dense"
    if codec == "values":
        return "seeded"
    return codec


#: Experiment trackers a run can log to (``log``; ``server/tracking.py``).
TRACKERS: Final = ("tensorboard", "mlflow")


#: Fields whose value is a name, and the names they accept (from the modules that implement them).
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


#: The run-config key that carries a plug-in method's own keys (``Method.options``) as
#: ``key=value;key=value``: ``flwr run`` passes only the keys ``pyproject.toml`` declares.
METHOD_OPTIONS: Final = "method-options"


def method_option_values(
    text: str, *, method: str, declared: Mapping[str, Any], known: Iterable[str]
) -> tuple[tuple[str, Any], ...]:
    """``method-options``'s ``text`` parsed: the keys of method ``method`` and their values,
    typed by their defaults (``declared``: its ``Method.options``), sorted by key.

    Args:
        known: the run-config keys, for the closest key an unknown one may have meant.

    Raises:
        ValueError: a malformed ``text``, a key the method does not declare or a value of the
            wrong type (naming the key and the value).
    """
    given = parse_pairs(METHOD_OPTIONS, text)
    if not given:
        return ()
    if not declared:
        raise ValueError(
            f"{METHOD_OPTIONS}={text!r}: expected '' (method={method!r} declares no options)"
        )
    for key in given:
        if key not in declared:
            where = f"method={method!r}: {METHOD_OPTIONS} key"
            raise ValueError(unknown_key(where, key, [*declared, *known]))
    return tuple(
        (key, coerce(key, given[key], type(declared[key]), where=METHOD_OPTIONS))
        for key in sorted(given)
    )


def check_names(cfg: FederatedConfig, fail: Callable[[str, str], None]) -> None:
    """Checks each of ``cfg``'s names against the names its key accepts (``NAMED_FIELDS``,
    the built-in methods, models and trackers; a user's ``package.module:attribute`` is
    checked where it is imported) and the model against the dataset's image shape.

    Args:
        fail: called with the field and what it expected (raises).
    """
    for field, names in NAMED_FIELDS.items():
        value = getattr(cfg, field)
        if field == "dataset" and plugins.is_reference(value):
            continue  # a user's loader (common/plugins.py): imported where it is loaded
        if value not in names:
            more = " or package.module:loader" if field == "dataset" else ""
            fail(field, f"one of {', '.join(names)}{more}")
    check_method_name(cfg.method)
    for target in cfg.trackers:
        if target not in TRACKERS:
            fail("log", f"some of {', '.join(TRACKERS)}, comma-separated ('' for none)")
    user_model = plugins.is_reference(cfg.model)
    user_dataset = plugins.is_reference(cfg.dataset)
    if cfg.model not in ("", *MODEL_NAMES) and not user_model:
        fail(
            "model",
            f"one of {', '.join(MODEL_NAMES)} ('' for the dataset's default) or "
            "package.module:factory",
        )
    if user_dataset and cfg.model == "":
        fail("model", f"a model for dataset={cfg.dataset!r} (a user's dataset has no default)")
    if not (user_model or user_dataset):  # a user's shapes are checked where they load
        model_shape = MODEL_INPUT_SHAPES[cfg.model_name]
        data_shape = DATASET_INPUT_SHAPES[cfg.dataset]
        if model_shape != data_shape:
            fits = [m for m in MODEL_NAMES if MODEL_INPUT_SHAPES[m] == data_shape]
            fail(
                "model",
                f"a model for dataset={cfg.dataset!r} ({_shape(data_shape)} images; "
                f"{cfg.model} takes {_shape(model_shape)}): one of {', '.join(fits)} or ''",
            )


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def check_error_feedback(cfg: FederatedConfig, fail: Callable[[str, str], None]) -> None:
    """Checks ``error-feedback`` against the value dtype and ``dp-norm-bound``.

    Args:
        fail: called with the field and what it expected (raises).
    """
    if not cfg.error_feedback:
        return
    if cfg.value_dtype in NO_ERROR_FEEDBACK:
        fail(
            "error_feedback",
            f"false with value-dtype={cfg.value_dtype!r} ({NO_ERROR_FEEDBACK[cfg.value_dtype]})",
        )
    # the derived bound covers v + e where the dtype's rounding error contracts
    if cfg.dp_norm_bound_applies and feedback_contraction(cfg.value_dtype) is None:
        fail(
            "error_feedback",
            f"false with dp-norm-bound='auto' and value-dtype={cfg.value_dtype!r} (its rounding "
            "error does not contract when fed back: no update bound); set dp-norm-bound='off'",
        )


def check_dp_level(cfg: FederatedConfig, fail: Callable[[str, str], None]) -> None:
    """Checks the user-level DP keys (``dp-level``, ``central-*``, ``secure-aggregation``).

    Args:
        fail: called with the field and what it expected (raises).
    """
    if not (math.isfinite(cfg.central_clip) and cfg.central_clip > 0):
        fail("central_clip", "a finite value > 0")
    if not (math.isfinite(cfg.central_noise_multiplier) and cfg.central_noise_multiplier >= 0):
        fail("central_noise_multiplier", "a finite value >= 0")
    if cfg.secagg_colluders < 0:
        fail("secagg_colluders", ">= 0")
    if cfg.secure_aggregation:
        # the server sees no single update: nothing to encode lossily, feed back or save
        if cfg.dp_level != "user":
            fail("secure_aggregation", "false unless dp-level=user (distributed DP-FedAvg)")
        if cfg.value_dtype != "fp32" or cfg.error_feedback or cfg.downlink_dtype != "fp32":
            fail(
                "secure_aggregation",
                "false with value-dtype or downlink-dtype other than fp32, or error-feedback",
            )
        if cfg.save_updates:
            fail("save_updates", "false with secure-aggregation=true (no single update is seen)")
    if cfg.dp_level != "user":
        return
    if cfg.clients_per_round < 1:
        fail("clients_per_round", ">= 1 with dp-level=user (the expected users per round)")
    if cfg.method_class().selects_per_step:
        fail("dp_level", "'sample' with method gip or random-k (the clients choose supports)")
    if cfg.mask_scope != "round":
        fail("dp_level", "'sample' with mask-scope=client (the noise needs one public mask)")
    if cfg.aggregator != "mean" or cfg.weighting != "uniform":
        fail("dp_level", "'sample' unless aggregator=mean and weighting=uniform")
    if cfg.secure_mode and cfg.central_noise != "fresh":
        fail("central_noise", "'fresh' with secure-mode=true (hardened noise takes no seed)")
