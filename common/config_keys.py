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

from collections.abc import Iterable, Mapping
from typing import Any, Final

from fedsparse.common.coerce import coerce, parse_pairs, unknown_key
from fedsparse.common.config_values import NAMED_FIELDS, NO_ERROR_FEEDBACK
from fedsparse.common.methods.index_selection import DEFAULT_INDEX_FRACTION
from fedsparse.common.names import CODECS, TRACKERS, CodecName
from fedsparse.common.wire.payload import DEFAULT_VALUE_BLOCK

__all__ = [
    "ADDED_KEYS",
    "CODECS",
    "METHOD_OPTIONS",
    "NO_ERROR_FEEDBACK",
    "NAMED_FIELDS",
    "RESUME_MAY_DIFFER",
    "TRACKERS",
    "CodecName",
    "method_option_values",
    "with_added_keys",
]


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
    # Every earlier run masked over the complete graph.
    "secagg-neighbours": 0,
    # Every earlier run masked in the exact ring.
    "secagg-ring-bits": 0,
    # Every simulated node sampled at its real count's rate before it.
    "nominal-size": 0,
    # Every earlier user-level run took central-noise-multiplier as given.
    "central-target-epsilon": 0.0,
}


def with_added_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a saved run config) with the keys it predates at their ``ADDED_KEYS`` value."""
    return {**ADDED_KEYS, **config}


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
