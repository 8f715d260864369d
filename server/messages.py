"""Flower messages of the round: building train instructions and measuring messages."""

from __future__ import annotations

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedsparse.common.protocol import CONFIG_RECORD, TrainInstruction

__all__ = ["message_bytes", "train_message"]


def message_bytes(message: Message) -> int:
    """Serialized size of a Flower message: the sum of its content-addressed objects.

    Flower ships a message as separate objects (message, records, arrays, chunks); this is what
    crosses the Fleet API for its content, before gRPC/HTTP/TCP framing.
    """
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


def train_message(instruction: TrainInstruction, *, node: int) -> Message:
    """The ``train`` message carrying ``instruction`` to ``node``."""
    return Message(
        content=RecordDict({CONFIG_RECORD: ConfigRecord(instruction.to_record())}),
        dst_node_id=node,
        message_type=MessageType.TRAIN,
        group_id=str(instruction.server_round),
    )
