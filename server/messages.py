"""Flower messages of the round: building train instructions and measuring messages."""

from __future__ import annotations

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedsparse.common.protocol import CONFIG_RECORD, RESUMED_FROM, TrainInstruction

__all__ = ["message_bytes", "train_message"]


def message_bytes(message: Message) -> int:
    """Serialized size of a Flower message: the sum of its content-addressed objects.

    Flower ships a message as separate objects (message, records, arrays, chunks); this is what
    crosses the Fleet API for its content, before gRPC/HTTP/TCP framing.
    """
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


def train_message(instruction: TrainInstruction, *, node: int, resumed_from: int = 0) -> Message:
    """The ``train`` message carrying ``instruction`` to ``node``.

    A resumed run adds ``resumed-from``, the round of the checkpoint it continues: the rounds
    a simulated node may restore its state from (``client/state.py``).
    """
    record = instruction.to_record()
    if resumed_from:
        record[RESUMED_FROM] = resumed_from
    return Message(
        content=RecordDict({CONFIG_RECORD: ConfigRecord(record)}),
        dst_node_id=node,
        message_type=MessageType.TRAIN,
        group_id=str(instruction.server_round),
    )
