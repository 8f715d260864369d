"""The run config's key table: which names each named key accepts, which keys were added
after runs were recorded (and the value those runs ran under), which a resumed run may change,
and the wire codecs and trackers a run can name.

What ``FederatedConfig`` (``common/config/federated.py``) checks its values against and what
reads a saved run config (a checkpoint, a finished sweep run) needs; the allowed names are the
``Literal`` types of the modules that implement them (``data.DatasetName``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, get_args

from fedsparse.common.aggregation.robust import DP_NORM_BOUNDS, NORM_ACTIONS
from fedsparse.common.aggregation.sparse import AGGREGATORS, WEIGHTINGS
from fedsparse.common.data.datasets import DATASET_NAMES, EVAL_SPLITS
from fedsparse.common.data.partition import PARTITIONER_NAMES
from fedsparse.common.dp.accounting import ACCOUNTANTS
from fedsparse.common.dp.central import CENTRAL_NOISE_SOURCES, DP_LEVELS
from fedsparse.common.dp.engines import ENGINES
from fedsparse.common.dp.optimizer import MECHANISMS
from fedsparse.common.methods import SELECTION_MODES, SELECTIONS
from fedsparse.common.methods.index_selection import DEFAULT_INDEX_FRACTION
from fedsparse.common.methods.schedules import SCHEDULES
from fedsparse.common.training.local import DEVICES
from fedsparse.common.wire.payload import (
    COMPRESSIONS,
    DEFAULT_VALUE_BLOCK,
    PAYLOAD_DTYPES,
    IndexEncoding,
)
from fedsparse.common.wire.protocol import MASK_SCOPES

__all__ = [
    "ADDED_KEYS",
    "CODECS",
    "NAMED_FIELDS",
    "RESUME_MAY_DIFFER",
    "TRACKERS",
    "CodecName",
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
#: factored engine since 2026-11-25: the same mechanism, equal to float rounding, so a run or
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
    # The bound never binds on an honest update (common/aggregation/robust.py: HonestClientBound,
    # with
    # probability 1 - 1e-9 per update), so a run recorded without it is what it would have
    # recorded with it, bit for bit, unless a client sent what no honest client can.
    "dp-norm-bound": "auto",
    "max-client-examples": 0,
    # Only the low-bit value dtypes (added with it) read it: an earlier run ran at any value.
    "value-block": DEFAULT_VALUE_BLOCK,
    # A plug-in method's own keys travelled as top-level keys before it (and no built-in
    # method has any): a run recorded without it ran with none.
    "method-options": "",
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
