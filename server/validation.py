"""Reply validation at the server's trust boundary: every reply is checked before it is used.

A reply passes only if its records parse as a ``TrainReply`` (types and ranges, see
``common/wire/protocol.py``), its payload is no longer than the largest valid payload for the round
(``max_payload_bytes``, checked before the payload is parsed) and decodes with the round's
expected size, round, seed, encoding, ``keep``, value dtype, value block and compression
(``decode_update``), an explicit support equals the round's public mask (the server never
aggregates values on coordinates a client chose itself, except under method=gip or random-k,
whose supports are the clients' by design: ``client_support``), and its ``num-examples`` is
in range.
Anything else raises ``RejectedReply`` with one line naming the field; the round drops that
reply and aggregates the rest.

The aggregation weight is the run's ``weighting``: 1 for every update (``"uniform"``: a client
cannot inflate its influence, and need not release its example count, so 0 is accepted) or
the claimed ``num-examples`` (``"examples"``: at least 1, at most ``MAX_WEIGHT``).
Norm bounds need the whole round: ``server/norm_bound.py`` (``common/aggregation/norm_bounds.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flwr.app import ConfigRecord, Message, MetricRecord

from fedsparse.common.aggregation.sparse import Weighting
from fedsparse.common.config import CodecName
from fedsparse.common.masks import seeded_support
from fedsparse.common.wire.payload import (
    DEFAULT_VALUE_BLOCK,
    ENCODINGS,
    EXPLICIT_ENCODINGS,
    LOWBIT_DTYPES,
    Compression,
    Encoding,
    PayloadDType,
    PayloadError,
    decode_update,
    payload_size,
    value_section_size,
)
from fedsparse.common.wire.payload.sizing import index_section_bounds
from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    METRICS_RECORD,
    ProtocolError,
    TrainReply,
    typed_record,
)
from fedsparse.common.wire.value_formats import wire_encoding

__all__ = [
    "MAX_WEIGHT",
    "RejectedReply",
    "ValidUpdate",
    "accepted_encodings",
    "check_reply",
    "max_payload_bytes",
]

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
    weight: float  # the aggregation weight under the run's weighting
    payload_bytes: int


def accepted_encodings(codec: CodecName, *, sparse: bool) -> tuple[Encoding, ...]:
    """Encodings a reply may use: the configured one (any sparse one for ``auto``)."""
    encoding = wire_encoding(codec, sparse=sparse)
    if encoding == "auto":
        return tuple(e for e in ENCODINGS if e != "dense")
    return (encoding,)


def _zstd_bound(size: int) -> int:
    """zstd's worst-case frame size for ``size`` input bytes (``ZSTD_COMPRESSBOUND``)."""
    if size == 0:
        return 0
    small = ((128 << 10) - size) >> 11 if size < (128 << 10) else 0
    return size + (size >> 8) + small


def max_payload_bytes(
    *,
    d: int,
    server_round: int,
    keep: int,
    expected_seed: int | None,
    encodings: tuple[Encoding, ...],
    value_dtype: PayloadDType,
    compression: Compression,
    value_block: int = DEFAULT_VALUE_BLOCK,
) -> int:
    """The size of the largest valid payload for the round (an upper bound within 2 bytes).

    Each encoding's sections at their largest (varint gaps at 9 bytes each, zstd frames at
    their worst case), sized as a zstd payload, whose only extra field is the compression enum.
    """
    sizes = []
    seed = expected_seed if expected_seed is not None else 0
    for encoding in encodings:
        index_bytes = index_section_bounds(encoding, keep, d)[1]
        value_bytes = value_section_size(keep, value_dtype)  # the low-bit steps: never zstd
        if compression == "zstd":
            index_bytes, value_bytes = _zstd_bound(index_bytes), _zstd_bound(value_bytes)
        sizes.append(
            payload_size(
                keep=keep,
                dense_size=d,
                round=server_round,
                encoding=encoding,
                value_dtype=value_dtype,
                value_block=value_block,
                mask_seed=seed if encoding == "seeded" else 0,
                compression="zstd",
                compressed_sizes=(index_bytes, value_bytes),
            )
        )
    return max(sizes)


def check_reply(
    message: Message,
    *,
    d: int,
    server_round: int,
    expected_seed: int | None,
    keep: int,
    codec: CodecName = "values",
    value_dtype: PayloadDType = "fp32",
    compression: Compression = "none",
    value_block: int = DEFAULT_VALUE_BLOCK,
    weighting: Weighting = "uniform",
    mask_support: torch.Tensor | None = None,
    client_support: bool = False,
) -> ValidUpdate:
    """Validates one reply to a train instruction.

    Args:
        d: model size (dense coordinates).
        expected_seed: the mask seed the reply must carry (None: a dense round, ``keep = d``).
        keep: coordinates the round's mask keeps.
        codec, value_dtype, compression: the run's (which payloads are accepted).
        value_block: the run's values per step (int4/int2/int1 replies must carry it).
        weighting: the run's aggregation weights.
        mask_support: ``torch.nonzero(sample_mask(d, keep=keep, seed=expected_seed))``, the
            mask's int64 support, when the caller has it (a round's replies share one mask:
            sampled once a round, not per reply); None: sampled here when needed. A seeded
            reply's support is this one (its seed and ``keep`` were checked), shared as is.
        client_support: method=gip or random-k: the support is the client's own (the union
            of its steps' supports), explicit (coo, delta, bitmap, or dense), any ``keep``;
            ``expected_seed`` and ``keep`` are not used.

    Raises:
        RejectedReply: the reply is malformed, inconsistent with the round, or out of range.
    """
    if client_support:
        chosen = wire_encoding(codec, sparse=True)
        explicit = EXPLICIT_ENCODINGS if chosen in ("seeded", "auto") else (chosen,)
        encodings: tuple[Encoding, ...] = (*explicit, "dense")
        keep, expected_seed = d, None  # the largest payload: every coordinate
    else:
        encodings = accepted_encodings(codec, sparse=keep < d)
    limit = max_payload_bytes(
        d=d,
        server_round=server_round,
        keep=keep,
        expected_seed=expected_seed,
        encodings=encodings,
        value_dtype=value_dtype,
        compression=compression,
        value_block=value_block,
    )
    try:
        content = message.content
        reply = TrainReply.from_records(
            typed_record(content, CONFIG_RECORD, ConfigRecord),
            typed_record(content, METRICS_RECORD, MetricRecord),
        )
        update = decode_update(
            reply.update,
            expected_dense_size=d,
            expected_round=server_round,
            expected_mask_seed=expected_seed,
            expected_encoding=encodings,
            expected_keep=None if client_support else keep,
            max_bytes=limit,
        )
    except KeyError as err:
        raise RejectedReply(f"reply content: missing record {err}") from None
    except (ProtocolError, PayloadError) as err:
        raise RejectedReply(str(err)) from None
    for name, got, wanted in (
        ("value_dtype", update.value_dtype, value_dtype),
        ("compression", update.compression, compression),
        ("value_block", update.value_block, value_block if value_dtype in LOWBIT_DTYPES else None),
    ):
        if got != wanted:
            raise RejectedReply(f"{name}: {got!r}, expected {wanted!r} (the run's)")
    if client_support:
        # the client's own choice (norm bounds still apply)
        mask_support = update.support(shared=True)
    if update.encoding in ("seeded", *EXPLICIT_ENCODINGS) and mask_support is None:
        assert expected_seed is not None  # keep < d
        mask_support = seeded_support(d, keep, expected_seed)
    support = mask_support if update.encoding == "seeded" else update.support(shared=True)
    if update.encoding in EXPLICIT_ENCODINGS:
        assert support is not None and mask_support is not None  # keep < d
        if not torch.equal(support, mask_support):
            raise RejectedReply(f"indices: the {update.encoding} support is not the round's mask")
    low = 1 if weighting == "examples" else 0
    if not low <= reply.num_examples <= MAX_WEIGHT:
        raise RejectedReply(
            f"num-examples={reply.num_examples!r}: expected an integer in [{low}, {MAX_WEIGHT:.0e}]"
        )
    return ValidUpdate(
        reply=reply,
        values=update.values,
        support=support,
        weight=float(reply.num_examples) if weighting == "examples" else 1.0,
        payload_bytes=len(reply.update),
    )
