"""What a node keeps between rounds in Flower's ``Context.state``, and the downlink patch.

The node keeps the global model version it last received (to patch sparse downlinks exactly)
and its Opacus accountant history (to account every round it trained, across rounds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context

from fedsparse.common.payload import decode_update
from fedsparse.common.privacy import history_from_record, history_to_record
from fedsparse.common.protocol import STATE_MODEL, STATE_RECORD

__all__ = ["NodeState", "apply_downlink"]

AccountantHistory = list[tuple[float, float, int]]


@dataclass
class NodeState:
    """The node's copy of the global model (None before its first round) and its history."""

    model: torch.Tensor | None = None
    version: int = -1
    history: AccountantHistory = field(default_factory=list)
    last_round: int = 0  # the last round this node trained in the run (0: none)

    @classmethod
    def load(cls, context: Context, numel: int) -> NodeState:
        """The state stored in ``context`` (a model of another size is dropped)."""
        if STATE_RECORD not in context.state.config_records:
            return cls()
        record = context.state.config_records[STATE_RECORD]
        history = history_from_record(record)
        version, last_round = record["version"], record["last-round"]
        if not isinstance(last_round, int):
            raise TypeError(f"last-round={last_round!r}: expected int")
        flat = context.state.array_records[STATE_MODEL]["flat"].numpy()
        if flat.size != numel or not isinstance(version, int):
            return cls(history=history, last_round=last_round)
        return cls(torch.from_numpy(flat.copy()), version, history, last_round)

    def save(self, context: Context) -> None:
        """Stores the state in ``context`` (needs a model)."""
        if self.model is None:
            raise ValueError("model=None: nothing to store")
        context.state.config_records[STATE_RECORD] = ConfigRecord(
            {
                "version": self.version,
                "last-round": self.last_round,
                **history_to_record(self.history),
            }
        )
        context.state.array_records[STATE_MODEL] = ArrayRecord({"flat": Array(self.model.numpy())})


def apply_downlink(
    stored: torch.Tensor | None,
    stored_version: int,
    payload: bytes,
    *,
    base_version: int,
    numel: int,
    server_round: int,
) -> torch.Tensor:
    """The global model after patching ``stored`` with the downlink ``payload`` (exact).

    Raises:
        PayloadError: the payload does not decode for this model and round.
        ValueError: a sparse patch for a version this node does not hold.
    """
    update = decode_update(payload, expected_dense_size=numel, expected_round=server_round)
    support = update.support()
    if support is None:
        return update.values.clone()
    if stored is None or stored_version != base_version:
        raise ValueError(
            f"base-version={base_version}: this node holds model version {stored_version}; "
            "the server must send the dense model"
        )
    flat = stored.clone()
    flat[support] = update.values
    return flat
