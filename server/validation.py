"""Reply validation at the server's trust boundary: every reply is checked before it is used.

A reply passes only if its records parse as a ``TrainReply`` (types and ranges, see
``common/protocol.py``), its payload decodes with the round's expected size, round, seed,
encoding and ``keep`` (``decode_update``), an explicit support equals the round's public mask
(the server never aggregates values on coordinates a client chose itself), and its weight is
in range. Anything else raises ``RejectedReply`` with one line naming the field; the round
drops that reply and aggregates the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flwr.app import Message

from fedsparse.common.config import CodecName, wire_encoding
from fedsparse.common.masks import sample_mask
from fedsparse.common.payload import (
    ENCODINGS,
    EXPLICIT_ENCODINGS,
    Encoding,
    PayloadError,
    decode_update,
)
from fedsparse.common.protocol import CONFIG_RECORD, METRICS_RECORD, ProtocolError, TrainReply

__all__ = ["MAX_WEIGHT", "RejectedReply", "ValidUpdate", "accepted_encodings", "check_reply"]

#: Largest aggregation weight (``num-examples``) a reply may claim.
MAX_WEIGHT = 10**9


class RejectedReply(ValueError):
    """A reply the round drops; the message names the field and the value."""


@dataclass(frozen=True)
class ValidUpdate:
    """A reply that passed every check."""

    reply: TrainReply
    values: torch.Tensor  # float32, on ``support``
    support: torch.Tensor | None  # int64 indices; None: dense
    weight: float
    payload_bytes: int


def accepted_encodings(codec: CodecName, *, sparse: bool) -> tuple[Encoding, ...]:
    """Encodings a reply may use: the configured one (any sparse one for ``auto``)."""
    encoding = wire_encoding(codec, sparse=sparse)
    if encoding == "auto":
        return tuple(e for e in ENCODINGS if e != "dense")
    return (encoding,)


def check_reply(
    message: Message,
    *,
    d: int,
    server_round: int,
    expected_seed: int | None,
    keep: int,
    codec: CodecName = "values",
) -> ValidUpdate:
    """Validates one reply to a train instruction.

    Args:
        d: model size (dense coordinates).
        expected_seed: the mask seed the reply must carry (None: a dense round, ``keep = d``).
        keep: coordinates the round's mask keeps.
        codec: the run's codec (which encodings are accepted).

    Raises:
        RejectedReply: the reply is malformed, inconsistent with the round, or out of range.
    """
    try:
        content = message.content
        reply = TrainReply.from_records(
            content.config_records[CONFIG_RECORD], content.metric_records[METRICS_RECORD]
        )
        update = decode_update(
            reply.update,
            expected_dense_size=d,
            expected_round=server_round,
            expected_mask_seed=expected_seed,
            expected_encoding=accepted_encodings(codec, sparse=keep < d),
            expected_keep=keep,
        )
    except KeyError as err:
        raise RejectedReply(f"reply content: missing record {err}") from None
    except (ProtocolError, PayloadError) as err:
        raise RejectedReply(str(err)) from None
    support = update.support()
    if update.encoding in EXPLICIT_ENCODINGS:
        assert expected_seed is not None and support is not None  # keep < d
        mask = sample_mask(d, keep=keep, seed=expected_seed)
        if not torch.equal(support, torch.nonzero(mask).flatten()):
            raise RejectedReply(f"indices: the {update.encoding} support is not the round's mask")
    if not 0 < reply.num_examples <= MAX_WEIGHT:
        raise RejectedReply(
            f"num-examples={reply.num_examples!r}: expected an integer in [1, {MAX_WEIGHT:.0e}]"
        )
    return ValidUpdate(
        reply=reply,
        values=update.values,
        support=support,
        weight=float(reply.num_examples),
        payload_bytes=len(reply.update),
    )
