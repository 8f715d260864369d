"""Flower messages of the round: building train instructions and measuring messages.

``message_bytes`` counts what Flower 1.39 ships for a message: the sum of its content-addressed
objects (``get_all_nested_objects``), each ``deflate()``-d to ``<head>\\x00<body>`` with the
head ``"<class> <child ids, comma-separated> <body length>"``. For the shapes this protocol
uses it computes that sum from the parts, without serializing (or hashing) the payload:

* ``Message``: the body is the ``ProtoMessage`` of the metadata (``message_id`` cleared) and
  the error, serialized here (a few dozen bytes, no payload); the head names the
  ``RecordDict``'s id (64 hex digits) if there is content.
* ``RecordDict``: the body is ``json.dumps({name: id})`` (ids are 64 hex digits, so it is
  computed on placeholder ids); the head lists the records' ids.
* ``ConfigRecord``/``MetricRecord`` of scalars: a protobuf ``repeated Item {key, value}`` whose
  size follows from the key lengths, the values' oneof fields and their varint lengths.

Anything else is measured by serializing (``serialized_bytes``): an ``ArrayRecord`` (arrays
and chunks are deduplicated by content), list values, values of other types, and two records
of the same class in one message (they could have the same id and be shipped once). The count
is the serialized one byte for byte (``tests/server/test_message_bytes.py``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.serde_utils import error_to_proto, metadata_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=E0611
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    DOWNLINK_KIND,
    RESUMED_FROM,
    SERVER_SUPPORT,
    TrainInstruction,
)

__all__ = [
    "framed_bytes",
    "message_bytes",
    "serialized_bytes",
    "train_message",
    "train_messages",
]

_ID_LEN = 64  # an object id: the SHA-256 hex digest of the deflated object
_INT64_MAX = 2**63 - 1
# ConfigRecordValue/MetricRecordValue oneof fields 1..6 (double, sint64, uint64, bool, string,
# bytes) and Item fields 1..2 all have one-byte tags.
_TAG = 1


def serialized_bytes(message: Message) -> int:
    """Serialized size of a Flower message: the sum of its content-addressed objects.

    Flower ships a message as separate objects (message, records, arrays, chunks); this is what
    crosses the Fleet API for its content, before gRPC/HTTP/TCP framing. Serializes (and
    hashes) every object: the reference ``message_bytes`` computes without doing so.
    """
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


def message_bytes(message: Message, *, sizes: dict[int, int | None] | None = None) -> int:
    """``serialized_bytes(message)``, computed from its parts where ``framed_bytes`` can.

    ``sizes``: a memo of record body sizes by ``id(record)``, for messages that share records
    the caller keeps alive and unchanged while it uses the memo (``train_messages``).
    """
    size = framed_bytes(message, sizes=sizes)
    return serialized_bytes(message) if size is None else size


def framed_bytes(message: Message, *, sizes: dict[int, int | None] | None = None) -> int | None:
    """``serialized_bytes(message)`` without serializing the payload; None: not covered.

    Covered: a message without content, or whose content holds scalar ``ConfigRecord``s and
    ``MetricRecord``s, at most one of each class (see the module docstring). ``sizes``: as
    ``message_bytes``'s.
    """
    name, body = type(message).__qualname__, _message_body_bytes(message)
    if not message.has_content():
        return _object_bytes(name, 0, body)
    content = message.content
    records = list(content.values())
    if len({type(record) for record in records}) != len(records):
        return None  # two records of one class may share an id: Flower ships it once
    total = _object_bytes(name, 1, body)
    refs = _refs_bytes(tuple(content))
    total += _object_bytes(type(content).__qualname__, len(records), refs)
    for record in records:
        if sizes is None:
            size = _record_body_bytes(record)
        else:
            if id(record) not in sizes:
                sizes[id(record)] = _record_body_bytes(record)
            size = sizes[id(record)]
        if size is None:
            return None
        total += _object_bytes(type(record).__qualname__, 0, size)
    return total


@functools.lru_cache(maxsize=64)
def _refs_bytes(keys: tuple[str, ...]) -> int:
    """Size of a ``RecordDict``'s body: its keys mapped to object ids, as JSON."""
    return len(json.dumps({key: "0" * _ID_LEN for key in keys}).encode("utf-8"))


def _object_bytes(class_name: str, children: int, body: int) -> int:
    """``len(add_header_to_object_body(body, obj))``: ``"<class> <ids> <len>\\x00<body>"``."""
    ids = children * _ID_LEN + max(children - 1, 0)
    return len(class_name) + 1 + ids + 1 + len(str(body)) + 1 + body


def _message_body_bytes(message: Message) -> int:
    """Size of ``Message.deflate``'s body: metadata without ``message_id``, and the error."""
    metadata = metadata_to_proto(message.metadata)
    metadata.message_id = ""
    error = error_to_proto(message.error) if message.has_error() else None
    return int(ProtoMessage(metadata=metadata, content=None, error=error).ByteSize())


def _varint(value: int) -> int:
    """Bytes of ``value`` (>= 0) as a protobuf varint."""
    return max(1, (value.bit_length() + 6) // 7)


def _length_delimited(size: int) -> int:
    """Bytes of a length-delimited field (tag, length, content) with ``size`` content bytes."""
    return _TAG + _varint(size) + size


def _value_bytes(value: Any, *, config: bool) -> int | None:
    """Size of a ``ConfigRecordValue`` (``config``) or ``MetricRecordValue``; None: other."""
    kind = type(value)
    if kind is bool and config:
        return _TAG + 1
    if kind is int:
        if value > _INT64_MAX:
            return _TAG + _varint(value)  # uint64
        if value < -_INT64_MAX - 1:
            return None
        return _TAG + _varint((value << 1) ^ (value >> 63))  # sint64: zigzag
    if kind is float:
        return _TAG + 8
    if kind is str and config:
        return _length_delimited(len(value.encode("utf-8")))
    if kind is bytes and config:
        return _length_delimited(len(value))
    return None


def _record_body_bytes(record: Any) -> int | None:
    """Size of a scalar ``ConfigRecord``'s/``MetricRecord``'s body; None: not covered."""
    if type(record) not in (ConfigRecord, MetricRecord):
        return None
    config = type(record) is ConfigRecord
    total = 0
    for key, value in record.items():
        size = _value_bytes(value, config=config)
        if size is None:
            return None
        key_bytes = len(key.encode("utf-8"))
        item = (_length_delimited(key_bytes) if key_bytes else 0) + _length_delimited(size)
        total += _length_delimited(item)
    return total


def train_message(
    instruction: TrainInstruction,
    *,
    node: int,
    resumed_from: int = 0,
    support: bytes = b"",
    downlink_kind: str = "values",
) -> Message:
    """The ``train`` message carrying ``instruction`` to ``node``.

    A resumed run adds ``resumed-from``, the round of the checkpoint it continues: the rounds
    a simulated node may restore its state from (``client/state.py``).
    """
    record = _train_record(instruction, resumed_from, support, downlink_kind)
    return _addressed(record, node, instruction.server_round)


def train_messages(
    instructions: Sequence[tuple[int, TrainInstruction, str]],
    *,
    resumed_from: int = 0,
    support: bytes = b"",
) -> tuple[list[Message], list[int]]:
    """``train_message`` for each ``(node, instruction, downlink_kind)``, and each message's
    ``message_bytes``: equal instructions (a round's broadcast) share one validated record.

    The messages are those ``train_message`` builds, but that nodes given equal instructions
    hold the same ``ConfigRecord`` (read, never changed, by the ClientApp); building and
    validating it once per distinct instruction is what a round of N clients saves.
    """
    records: dict[tuple[TrainInstruction, str], ConfigRecord] = {}
    sizes: dict[int, int | None] = {}
    messages, counts = [], []
    for node, instruction, kind in instructions:
        record = records.get((instruction, kind))
        if record is None:
            record = _train_record(instruction, resumed_from, support, kind)
            records[instruction, kind] = record
        message = _addressed(record, node, instruction.server_round)
        messages.append(message)
        counts.append(message_bytes(message, sizes=sizes))
    return messages, counts


def _train_record(
    instruction: TrainInstruction, resumed_from: int, support: bytes, downlink_kind: str
) -> ConfigRecord:
    record = instruction.to_record()
    if resumed_from:
        record[RESUMED_FROM] = resumed_from
    if support:  # method=ranked: the server's mask (common/methods/ranked.py)
        record[SERVER_SUPPORT] = support
    if downlink_kind != "values":  # a lossy downlink-dtype's change (server/downlink.py)
        record[DOWNLINK_KIND] = downlink_kind
    return ConfigRecord(record)


def _addressed(record: ConfigRecord, node: int, server_round: int) -> Message:
    return Message(
        content=RecordDict({CONFIG_RECORD: record}),
        dst_node_id=node,
        message_type=MessageType.TRAIN,
        group_id=str(server_round),
    )
