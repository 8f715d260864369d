"""What a node keeps between rounds in Flower's ``Context.state``, and the downlink patch.

The node keeps the global model version it last received (to patch sparse downlinks exactly)
and its Opacus accountant history (to account every round it trained, across rounds).

``Context.state`` lives as long as the Flower run; a resumed run (``resume=true``) is a new
Flower run, and its nodes start empty. A simulated node (policy ``state-dir``, only with
seeded noise) therefore also writes its accountant history and last round to
``<state-dir>/node-<partition-id>/round-<r>.json`` after each round ``r`` it trains
(``StateFiles``). When its ``Context`` is empty and the train message says the run resumed
from checkpoint round ``R`` (``resumed-from``), it drops the files of rounds after ``R``
(training the killed run did after its last checkpoint, which the resumed run repeats) and
restores the latest remaining one; in a new run (no ``resumed-from``) it drops them all. The
model copy is not restored: the server sends every node the dense model the first time it
selects it in a resumed run (``server/checkpoint.py``). A deployed node keeps no such files:
its persistent ledger, not the server's resume point, holds what it spent.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from flwr.app import ConfigRecord, Context

from fedsparse.common.atomic import PRIVATE, write_atomically
from fedsparse.common.dp.accounting import history_from_record, history_to_record
from fedsparse.common.wire.payload import SparseUpdate, decode_update
from fedsparse.common.wire.protocol import (
    DOWNLINK_KIND,
    DOWNLINK_KINDS,
    RESUMED_FROM,
    STATE_MODEL,
    STATE_RECORD,
    ProtocolError,
)

__all__ = [
    "RESUMED_FROM",
    "NodeState",
    "StateFiles",
    "apply_downlink",
    "residual_bytes",
    "residual_vector",
    "resumed_from",
]


#: Version of a state file's contents.
_STATE_FORMAT: Final = 1
_ROUND_FILE = re.compile(r"round-([0-9]+)\.json")

AccountantHistory = list[tuple[float, float, int]]

#: The state's key for the error-feedback residual (absent: none, a run without it).
_RESIDUAL: Final = "ef-residual"
_FLOAT32_LE: Final = np.dtype("<f4")


def residual_bytes(residual: torch.Tensor) -> bytes:
    """``residual`` (float32, 1-D) as the state stores it: float32 little-endian bytes (the
    model copy likewise)."""
    return residual.detach().cpu().numpy().astype(_FLOAT32_LE, copy=False).tobytes()


def residual_vector(raw: bytes, numel: int) -> torch.Tensor:
    """The residual stored as ``raw`` (zeros when empty: no round fed back yet).

    Raises:
        ValueError: ``raw`` does not hold ``numel`` float32 values (one line, naming both sizes).
    """
    if not raw:
        return torch.zeros(numel, dtype=torch.float32)
    if len(raw) != 4 * numel:
        raise ValueError(
            f"node state: {_RESIDUAL} holds {len(raw)} bytes, expected {4 * numel} "
            f"(float32 little-endian, d={numel})"
        )
    values = np.frombuffer(raw, dtype=_FLOAT32_LE).astype(np.float32)  # a native copy
    return torch.from_numpy(values)


#: The model copy a node of this process stored last, and a private copy of the tensor it was
#: made from (no one else holds it, so nothing writes it): nodes that hold equal copies (a
#: simulated population after a dense downlink) store one bytes object, not one each.
#: With them, the tensor stored last and its write counter then (``_version``): the same
#: tensor, not written since (``apply_downlink``'s shared model), is not compared again. One
#: tuple, replaced in one assignment: never a source paired with another model's bytes.
_LAST_MODEL: tuple[bytes, torch.Tensor | None, torch.Tensor | None, int] = (b"", None, None, -1)
#: The model tensor a node of this process loaded last, and the bytes object it came from.
_LAST_LOADED: tuple[bytes, torch.Tensor] | None = None


def _shared_bytes(model: torch.Tensor) -> bytes:
    """``residual_bytes(model)``, the same object as the last stored copy when equal (not
    even copied when ``model`` holds the same bits as the model stored last)."""
    global _LAST_MODEL
    last, kept, source, writes = _LAST_MODEL
    if kept is not None and source is model and _version(model) == writes:
        return last
    if kept is not None and _same_bits(model, kept):
        _LAST_MODEL = (last, kept, model, _version(model))
        return last
    raw = residual_bytes(model)
    if raw != last:
        last = raw
    copy = model.detach().to("cpu", torch.float32, copy=True)
    _LAST_MODEL = (last, copy, model, _version(model))
    return last


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two float32 CPU tensors hold the same bits (-0.0 is not 0.0, NaNs compare by
    pattern), without copying either."""
    if a is b:
        return True
    kinds = (a.dtype, b.dtype, a.device.type, b.device.type)
    if kinds != (torch.float32, torch.float32, "cpu", "cpu") or a.shape != b.shape:
        return False
    if not (a.is_contiguous() and b.is_contiguous()):
        return False
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _shared_tensor(raw: bytes) -> torch.Tensor:
    """The float32 model ``raw`` holds (a native copy), the same tensor for the same bytes
    object as the last call: read only."""
    global _LAST_LOADED
    if _LAST_LOADED is not None and _LAST_LOADED[0] is raw:
        return _LAST_LOADED[1]
    flat = torch.from_numpy(np.frombuffer(raw, dtype=_FLOAT32_LE).astype(np.float32))
    _LAST_LOADED = (raw, flat)
    return flat


@dataclass
class NodeState:
    """The node's copy of the global model (None before its first round) and its history."""

    model: torch.Tensor | None = None
    version: int = -1
    history: AccountantHistory = field(default_factory=list)
    last_round: int = 0  # the last round this node trained in the run (0: none)
    index_epsilon: float = 0.0  # GIP: the index selections' pure ε in the run so far
    # error-feedback: the residual as float32 little-endian bytes (b"": none yet, or EF off)
    residual: bytes = b""

    @staticmethod
    def in_context(context: Context) -> bool:
        """Whether ``context`` holds a state (this node trained before in this Flower run)."""
        return isinstance(context.state.get(STATE_RECORD), ConfigRecord)

    @classmethod
    def load(cls, context: Context, numel: int) -> NodeState:
        """The state stored in ``context`` (a model of another size is dropped). Its model is
        only read (``apply_downlink`` patches a copy): nodes that stored one bytes object
        (``_shared_bytes``) load one tensor."""
        record = context.state.get(STATE_RECORD)
        if not isinstance(record, ConfigRecord):
            return cls()
        history = history_from_record(record)
        version, last_round = record["version"], record["last-round"]
        if not isinstance(last_round, int):
            raise TypeError(f"last-round={last_round!r}: expected int")
        index = float(record.get("index-epsilon", 0.0))  # type: ignore[arg-type]
        residual = record.get(_RESIDUAL, b"")
        if not isinstance(residual, bytes):
            raise TypeError(f"{_RESIDUAL}: expected bytes, got {type(residual).__name__}")
        if residual:  # its format, checked (ValueError); empty: none (no zeros made)
            residual_vector(residual, numel)
        raw = record.get(STATE_MODEL, b"")
        if not isinstance(raw, bytes) or len(raw) != 4 * numel or not isinstance(version, int):
            return cls(
                history=history, last_round=last_round, index_epsilon=index, residual=residual
            )
        return cls(_shared_tensor(raw), version, history, last_round, index, residual)

    def save(self, context: Context) -> None:
        """Stores the state in ``context`` (needs a model)."""
        if self.model is None:
            raise ValueError("model=None: nothing to store")
        context.state[STATE_RECORD] = ConfigRecord(
            {
                "version": self.version,
                "last-round": self.last_round,
                **history_to_record(self.history),
                # GIP only: other methods' records stay as they were
                **({"index-epsilon": self.index_epsilon} if self.index_epsilon else {}),
                # error-feedback only, likewise
                **({_RESIDUAL: self.residual} if self.residual else {}),
                # float32 little-endian bytes: an Array would np.save/np.load them (~0.3 ms)
                STATE_MODEL: _shared_bytes(self.model),
            }
        )


def resumed_from(record: Mapping[str, Any]) -> int:
    """The train message's ``resumed-from`` (0 when absent: not a resumed run).

    Raises:
        ProtocolError: not an integer >= 0.
    """
    value = record.get(RESUMED_FROM, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"train instruction: {RESUMED_FROM}={value!r}: expected an int >= 0")
    return value


@dataclass(frozen=True)
class StateFiles:
    """One simulated node's state files, ``<root>/node-<partition_id>/round-<r>.json``."""

    root: Path
    partition_id: int

    @property
    def folder(self) -> Path:
        """The node's folder."""
        return Path(self.root).expanduser() / f"node-{self.partition_id}"

    def rounds(self) -> list[int]:
        """The rounds with a state file, in order."""
        if not self.folder.is_dir():
            return []
        found = (_ROUND_FILE.fullmatch(p.name) for p in self.folder.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def save(self, state: NodeState) -> None:
        """Writes ``state`` as the file of round ``state.last_round`` (atomically, private to the
        node: ``fedsparse.common.atomic``)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        data: dict[str, Any] = {"format": _STATE_FORMAT, "last-round": state.last_round}
        if state.index_epsilon:  # GIP only: other methods' files stay as they were
            data["index-epsilon"] = state.index_epsilon
        if state.residual:  # error-feedback only, likewise
            data[_RESIDUAL] = base64.b64encode(state.residual).decode("ascii")
        data.update(history_to_record(state.history))
        path = self.folder / f"round-{state.last_round}.json"
        write_atomically(path, json.dumps(data), mode=PRIVATE)  # floats as repr: exact

    def discard_after(self, server_round: int) -> None:
        """Deletes the files of rounds after ``server_round`` (0: every file)."""
        for r in self.rounds():
            if r > server_round:
                (self.folder / f"round-{r}.json").unlink(missing_ok=True)

    def restore(self, *, up_to: int, numel: int | None = None) -> NodeState:
        """The state of the latest file of a round <= ``up_to`` (empty if there is none).

        Args:
            numel: the model's size, which a stored residual must have (None: not checked).

        Raises:
            ValueError: that file is unreadable (a damaged file must not read as a fresh
                accountant, nor a residual of another length as this model's); the message
                names it.
        """
        rounds = [r for r in self.rounds() if r <= up_to]
        if not rounds:
            return NodeState()
        path = self.folder / f"round-{rounds[-1]}.json"
        try:
            data = json.loads(path.read_text())
            if data.get("format") != _STATE_FORMAT:
                raise ValueError(f"format={data.get('format')!r}: expected {_STATE_FORMAT}")
            last_round = data["last-round"]
            if last_round != rounds[-1]:
                raise ValueError(f"last-round={last_round!r}: expected {rounds[-1]}")
            history = history_from_record(data)
            index = float(data.get("index-epsilon", 0.0))
            residual = base64.b64decode(data.get(_RESIDUAL, ""), validate=True)
            if numel is not None:
                residual_vector(residual, numel)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            raise ValueError(f"node state {path}: unreadable ({err})") from None
        return NodeState(
            history=history, last_round=last_round, index_epsilon=index, residual=residual
        )


def apply_downlink(
    stored: torch.Tensor | None,
    stored_version: int,
    payload: bytes,
    *,
    base_version: int,
    numel: int,
    server_round: int,
    kind: object = "values",
) -> torch.Tensor:
    """The global model after patching ``stored`` with the downlink ``payload`` (exact;
    ``stored`` is only read). Read only: the nodes of a process that patch the same stored
    tensor with the same payload (a simulated population: ``_shared_tensor``) get one tensor,
    not a model copy each (``_LAST_PATCH``).

    ``kind`` (the train message's ``downlink-kind``): ``"values"``, global-model values that
    replace the node's; ``"delta"``, a lossy ``downlink-dtype``'s decoded change, added to the
    node's copy of ``base_version`` exactly as the server added it (``server/downlink.py:
    add_delta``), so both hold the same model bit for bit.

    Raises:
        ProtocolError: ``kind`` is not one of ``DOWNLINK_KINDS`` (named with its value).
        PayloadError: the payload does not decode for this model and round.
        ValueError: a sparse patch or a change for a version this node does not hold, or a
            patched model with non-finite values.
    """
    if not isinstance(kind, str) or kind not in DOWNLINK_KINDS:
        raise ProtocolError(
            f"train instruction: {DOWNLINK_KIND}={kind!r}: expected one of "
            f"{', '.join(DOWNLINK_KINDS)}"
        )
    update = _decoded_downlink(payload, numel=numel, server_round=server_round)
    # seeded: every node of a process patches from the same mask (``seeded_support``, shared:
    # only read, as an index)
    support = update.support(shared=True)  # read only
    delta = kind == "delta"
    if support is None and not delta:
        stored = None  # the values replace the node's: whatever it holds gives this model
    elif stored is None or stored_version != base_version:
        raise ValueError(
            f"base-version={base_version}: this node holds model version {stored_version}; "
            "the server must send the dense model"
        )
    global _LAST_PATCH
    last = _LAST_PATCH
    if last is not None and last.made_from(stored, update, kind):
        return last.model
    flat = _patched(stored, update, support, delta=delta, stored_version=stored_version)
    _LAST_PATCH = _Patch(stored, _version(stored), update, kind, flat, _version(flat))
    return flat


def _patched(
    stored: torch.Tensor | None,
    update: SparseUpdate,
    support: torch.Tensor | None,
    *,
    delta: bool,
    stored_version: int,
) -> torch.Tensor:
    """``apply_downlink``'s model, a new tensor (``stored`` None: the update's values)."""
    if stored is None:
        return update.values.clone()
    kind = "delta" if delta else "values"
    flat = stored.clone()
    if support is None:
        flat += update.values
    elif delta:
        flat[support] += update.values
    else:
        flat[support] = update.values
    bad = int((~torch.isfinite(flat)).sum())
    if bad:  # finite values and a finite model can still sum past the float32 limit
        raise ValueError(
            f"downlink-kind={kind}: patching model version {stored_version} gives {bad} "
            "non-finite values"
        )
    return flat


def _version(tensor: torch.Tensor | None) -> int:
    """``tensor``'s in-place write counter (torch's ``_version``; -1 for None)."""
    return -1 if tensor is None else int(tensor._version)


@dataclass(frozen=True, eq=False)
class _Patch:
    """A model ``apply_downlink`` returned and what it was made from, with the write
    counters of the stored tensor and of the model at that time: a tensor written in place
    since (by anyone) is not reused."""

    stored: torch.Tensor | None
    stored_writes: int
    update: SparseUpdate
    kind: str
    model: torch.Tensor
    model_writes: int

    def made_from(self, stored: torch.Tensor | None, update: SparseUpdate, kind: str) -> bool:
        """Whether patching ``stored`` with ``update`` (as ``kind``) gives ``model``."""
        return (
            self.stored is stored
            and self.update is update
            and self.kind == kind
            and _version(stored) == self.stored_writes
            and _version(self.model) == self.model_writes
        )


#: The model ``apply_downlink`` returned last (None: none yet).
_LAST_PATCH: _Patch | None = None


#: The last downlink decoded in this process, (payload, numel, round, update): the nodes a
#: process simulates receive the same payload in a round, decoded once. The update is only read.
_LAST_DOWNLINK: tuple[bytes, int, int, SparseUpdate] | None = None


def _decoded_downlink(payload: bytes, *, numel: int, server_round: int) -> SparseUpdate:
    """``decode_update(payload, ...)``, reusing the last decoding of an equal payload (a
    byte comparison: a payload is checked once whatever object carries it)."""
    global _LAST_DOWNLINK
    last = _LAST_DOWNLINK
    if last is not None and last[1:3] == (numel, server_round) and last[0] == payload:
        return last[3]
    update = decode_update(payload, expected_dense_size=numel, expected_round=server_round)
    if isinstance(payload, bytes):
        _LAST_DOWNLINK = (payload, numel, server_round, update)
    return update
