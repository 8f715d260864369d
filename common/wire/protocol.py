"""What the server and the clients say to each other each round: typed messages, no Flower.

Each message is a frozen dataclass with ``to_record``/``from_record``; the apps only wrap the
plain mappings in Flower records (``ConfigRecord``/``MetricRecord``), so the wire schema is
written here once and both sides read it through the same checks.

Downlink (server -> client, message type ``train``): ``TrainInstruction``, one
``ConfigRecord`` ``"fedsparse"``: the round, the round's mask seed and ``keep``, the mask
scope, the local hyperparameters, ``base-version`` (the model version the payload patches;
-1 = dense model), ``model-version``, and ``model`` (bytes: a ``SparseUpdate`` of the global
model's VALUES on the coordinates the client is missing, so applying it is exact).

Uplink (client -> server): ``TrainReply``, one ``ConfigRecord`` ``"fedsparse"`` with
``update`` (bytes: a ``SparseUpdate`` of the local model delta on the client's mask, values
only) and one ``MetricRecord`` ``"metrics"`` (``num-examples``, ``train-loss``, ``epsilon``,
...). One bytes object per direction: every record and array is its own transfer in Flower.

``from_record`` is a trust boundary: a missing key, a value of the wrong type (``bool`` is not
an ``int``; an ``int`` is accepted where a ``float`` is expected) or out of range raises one
``ProtocolError`` naming the message, the key and the value, before anything is used.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Self, TypeVar

from fedsparse.common.names import MASK_SCOPES, MaskScope
from fedsparse.common.seeds import Stream, stream_seed

__all__ = [
    "CONFIG_RECORD",
    "DOWNLINK_KIND",
    "DOWNLINK_KINDS",
    "MASK_SCOPES",
    "MaskScope",
    "METRICS_RECORD",
    "SERVER_SUPPORT",
    "RESUMED_FROM",
    "STATE_MODEL",
    "STATE_RECORD",
    "EvaluateInstruction",
    "EvaluateReply",
    "ProtocolError",
    "TrainInstruction",
    "TrainReply",
    "client_mask_seed",
    "round_seed",
    "typed_record",
]

CONFIG_RECORD = "fedsparse"
METRICS_RECORD = "metrics"
STATE_RECORD = "fedsparse-state"
STATE_MODEL = "fedsparse-model"
#: Train-message config key: the checkpoint round a resumed run continues (absent: 0).
RESUMED_FROM = "resumed-from"
#: Train-message config key (method=ranked from round 2, method=dpssgd): the round's mask,
#: chosen by the server, as a bitmap of ``d`` bits (absent: no explicit support). Outside
#: ``TrainInstruction`` so that every other run's messages keep their bytes.
SERVER_SUPPORT = "server-support"
#: Train-message config key: what ``model`` holds, ``"values"`` (global-model values; absent:
#: this) or ``"delta"`` (a lossy ``downlink-dtype``'s decoded change from ``base-version``,
#: added to the node's copy). Outside ``TrainInstruction`` so that fp32 runs keep their bytes.
DOWNLINK_KIND = "downlink-kind"
DOWNLINK_KINDS: Final = ("values", "delta")


_INT64 = 2**63
_R = TypeVar("_R")


class ProtocolError(ValueError):
    """A message record that does not match the protocol (the key and value are named)."""


def round_seed(seed: int, server_round: int) -> int:
    """The mask seed the server broadcasts in round ``server_round`` (1-based)."""
    return stream_seed(seed, Stream.ROUND_MASK, server_round)


def client_mask_seed(round_mask_seed: int, node_id: int) -> int:
    """``mask-scope=client``: the per-client mask seed, derivable by server and client alike."""
    return stream_seed(round_mask_seed, Stream.CLIENT_MASK, node_id % 2**64)


def typed_record(records: Mapping[str, object], key: str, kind: type[_R]) -> _R:
    """``records[key]`` if it is a ``kind`` (a Flower ``RecordDict``'s ``config_records[key]``
    without building that view: the view copies every record, about 90 µs a message).

    Raises:
        KeyError: no record of that kind under ``key`` (as the view raises).
    """
    value = records.get(key)
    if not isinstance(value, kind):
        raise KeyError(key)
    return value


@functools.cache
def _fields(cls: type[_Record]) -> tuple[tuple[str, str, type], ...]:
    """(field, record key, type) of each of ``cls``'s fields, in order."""
    types = {"int": int, "float": float, "str": str, "bytes": bytes, "bool": bool}
    return tuple(
        (f.name, cls._record_key(f.name), types[str(f.type)])
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
    )


def _key(name: str) -> str:
    return name.replace("_", "-")


def _read(message: str, record: Mapping[str, Any], key: str, kind: type) -> Any:
    """``record[key]`` checked to be of ``kind`` (ints widen to float; bools are not ints)."""
    if key not in record:
        raise ProtocolError(f"{message}: missing key {key!r}")
    value = record[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        shown = repr(value) if not isinstance(value, bytes) else f"<{len(value)} bytes>"
        raise ProtocolError(
            f"{message}: {key}={shown[:80]}: expected {kind.__name__}, got {type(value).__name__}"
        )
    if isinstance(value, int) and not -_INT64 <= value < _INT64:
        raise ProtocolError(f"{message}: {key}={value}: expected a 64-bit integer")
    return value


def _fail(message: str, key: str, value: Any, expected: str) -> None:
    raise ProtocolError(f"{message}: {key}={value!r}: expected {expected}")


class _Record:
    """``to_record``/``from_record`` for a flat dataclass; keys are field names, dashed."""

    MESSAGE: ClassVar[str]
    KEYS: ClassVar[Mapping[str, str]] = {}  # field -> record key, where not the dashed name

    @classmethod
    def _record_key(cls, name: str) -> str:
        return cls.KEYS.get(name, _key(name))

    def to_record(self) -> dict[str, Any]:
        """The record's plain mapping, in field order (what the Flower record wraps)."""
        return {
            self._record_key(f.name): getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Self:
        """Parses and validates ``record``; raises ``ProtocolError`` naming the bad key."""
        if not isinstance(record, Mapping):
            raise ProtocolError(f"{cls.MESSAGE}: expected a record, got {type(record).__name__}")
        message = cls.MESSAGE
        fields = _fields(cls)  # type: ignore[arg-type]
        kwargs = {name: _read(message, record, key, kind) for name, key, kind in fields}
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class TrainInstruction(_Record):
    """Server -> client: train one round from the global model in ``model``."""

    MESSAGE: ClassVar[str] = "train instruction"
    KEYS: ClassVar[Mapping[str, str]] = {"server_round": "round"}

    server_round: int
    num_rounds: int
    mask_seed: int
    keep: int  # coordinates the round's mask keeps (= d: no mask)
    mask_scope: str  # "round": one mask for all; "client": per-client masks
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    base_version: int  # model version ``model`` patches; -1: ``model`` is dense
    model_version: int  # version of the global model after patching
    model: bytes  # SparseUpdate of global-model values

    def __post_init__(self) -> None:
        msg = self.MESSAGE
        if not 1 <= self.server_round <= self.num_rounds:
            _fail(msg, "round", self.server_round, f"1 <= round <= num-rounds={self.num_rounds}")
        if self.keep < 0:
            _fail(msg, "keep", self.keep, ">= 0")
        if not 0 <= self.mask_seed < _INT64:
            _fail(msg, "mask-seed", self.mask_seed, "0 <= seed < 2**63")
        if self.mask_scope not in MASK_SCOPES:
            _fail(msg, "mask-scope", self.mask_scope, f"one of {', '.join(MASK_SCOPES)}")
        for name in ("local_epochs", "batch_size"):
            if getattr(self, name) < 1:
                _fail(msg, _key(name), getattr(self, name), ">= 1")
        if not (math.isfinite(self.lr) and self.lr > 0):
            _fail(msg, "lr", self.lr, "a finite value > 0")
        if not 0.0 <= self.momentum < 1.0:
            _fail(msg, "momentum", self.momentum, "0 <= momentum < 1")
        if self.base_version < -1 or self.model_version < 0:
            _fail(msg, "base-version", (self.base_version, self.model_version), "-1 / >= 0")


@dataclass(frozen=True, kw_only=True)
class TrainReply:
    """Client -> server: the round's sparse update and what the client reports about it."""

    MESSAGE: ClassVar[str] = "train reply"

    update: bytes  # SparseUpdate of the local model delta on the round's mask
    num_examples: int  # aggregation weight
    examples_seen: int
    train_loss: float
    epsilon: float  # the client's sample-level epsilon so far (inf: not private)
    noise_multiplier: float
    keep: int
    #: 1: the client's noise and sampling came from seeded streams (simulation), so anyone who
    #: knows the run config can rebuild them; 0: fresh OS entropy, never sent anywhere.
    seeded_noise: int = 0

    def __post_init__(self) -> None:
        msg = self.MESSAGE
        if self.seeded_noise not in (0, 1):
            _fail(msg, "seeded-noise", self.seeded_noise, "0 or 1")
        if self.num_examples < 0 or self.examples_seen < 0 or self.keep < 0:
            counts = (self.num_examples, self.examples_seen, self.keep)
            _fail(msg, "num-examples/examples-seen/keep", counts, "counts >= 0")
        if math.isnan(self.epsilon) or self.epsilon < 0:
            _fail(msg, "epsilon", self.epsilon, ">= 0 (inf: not private)")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            _fail(msg, "noise-multiplier", self.noise_multiplier, "a finite value >= 0")

    def to_records(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the ``"fedsparse"`` config record, the ``"metrics"`` metric record) mappings.

        An infinite epsilon travels as -1.0 (a ``MetricRecord`` holds finite numbers).
        """
        metrics = {
            "num-examples": self.num_examples,
            "examples-seen": self.examples_seen,
            "train-loss": self.train_loss,
            "epsilon": self.epsilon if math.isfinite(self.epsilon) else -1.0,
            "noise-multiplier": self.noise_multiplier,
            "keep": self.keep,
            "seeded-noise": self.seeded_noise,
        }
        return {"update": self.update}, metrics

    @classmethod
    def from_records(cls, config: Mapping[str, Any], metrics: Mapping[str, Any]) -> Self:
        """Parses both records; raises ``ProtocolError`` naming the bad key."""
        msg = cls.MESSAGE
        for name, record in (("config record", config), ("metric record", metrics)):
            if not isinstance(record, Mapping):
                raise ProtocolError(f"{msg}: {name}: expected a record, got {type(record)}")
        epsilon = _read(msg, metrics, "epsilon", float)
        return cls(
            update=_read(msg, config, "update", bytes),
            num_examples=_read(msg, metrics, "num-examples", int),
            examples_seen=_read(msg, metrics, "examples-seen", int),
            train_loss=_read(msg, metrics, "train-loss", float),
            epsilon=math.inf if epsilon == -1.0 else epsilon,
            noise_multiplier=_read(msg, metrics, "noise-multiplier", float),
            keep=_read(msg, metrics, "keep", int),
            seeded_noise=_read(msg, metrics, "seeded-noise", int),
        )


@dataclass(frozen=True, kw_only=True)
class EvaluateInstruction(_Record):
    """Server -> client: evaluate the dense global model in ``model`` (a SparseUpdate)."""

    MESSAGE: ClassVar[str] = "evaluate instruction"

    model: bytes


@dataclass(frozen=True, kw_only=True)
class EvaluateReply(_Record):
    """Client -> server: loss and accuracy of the global model on the client's data."""

    MESSAGE: ClassVar[str] = "evaluate reply"

    num_examples: int
    loss: float
    accuracy: float

    def __post_init__(self) -> None:
        if self.num_examples < 0:
            _fail(self.MESSAGE, "num-examples", self.num_examples, ">= 0")
        if not 0.0 <= self.accuracy <= 1.0:
            _fail(self.MESSAGE, "accuracy", self.accuracy, "0 <= accuracy <= 1")
