"""Sparse update payloads: the ``fedsparse.v1.SparseUpdate`` wire codec and its trust boundary.

A payload carries ``keep`` of the ``dense_size`` coordinates of a flat vector (an uplink model
delta or a downlink model value) as two sections, the support (which coordinates) and the
values, plus a small header (``protos/fedsparse/v1/payload.proto``).

Index encodings (how the support travels):

- ``"seeded"``: no index bytes. The support is the public mask
  ``masks.sample_mask(dense_size, keep=keep, seed=mask_seed)``, which every party regenerates
  bit for bit, so random sparsification costs ``keep * value bytes`` plus a header of a few
  dozen bytes (RS paper, Sec. 5).
- ``"dense"``: every coordinate, ``keep == dense_size``, no index bytes.
- ``"coo"``: strictly increasing little-endian int32 indices, ``4 * keep`` bytes.
- ``"delta"``: the gaps between consecutive indices as LEB128 varints, about
  ``keep * ceil(log2(dense_size / keep) / 7)`` bytes (1 byte per index while the mean gap is
  below 128).
- ``"bitmap"``: one bit per coordinate, ``ceil(dense_size / 8)`` bytes whatever ``keep`` is.
- ``"auto"`` (encoder only): the smallest of the above for the support at hand (exact sizes
  from ``payload_size``; ties go to the earlier one in ``INDEX_ENCODINGS``).

Value encodings: ``"fp32"``, ``"fp16"``, ``"bf16"`` (round-to-nearest-even casts by torch;
overflow is an error, never a silent infinity) and ``"int8"``: symmetric quantization with one
float32 scale per update, ``q = round(v / s)`` with ``s = max|v| / 127``, so the error per value
is at most ``s / 2``. The low-bit ``"int4"``, ``"int2"`` (ternary) and ``"int1"`` (stochastic
sign) round each value at random so that ``E[decoded] = value``, with one float32 step per block
of ``value_block`` values (default ``DEFAULT_VALUE_BLOCK``), packed 2, 4 or 8 codes per byte;
encoding them needs a ``numpy.random.Generator`` (``rounding=``), see ``lowbit``. They are not
in ``VALUE_DTYPES`` (the deterministic dtypes a run config accepts today) but in
``LOWBIT_DTYPES``; ``PAYLOAD_DTYPES`` holds all seven. Everything decodes to float32.
Optionally the index and value sections are each compressed with Zstandard
(``compression="zstd"``).

Privacy: encoding, quantizing and compressing happen after the DP noise has been added, on the
already-privatized update, so they are post-processing and cost no privacy (Dwork & Roth 2014,
Prop. 2.1). The support of a DP-SGD update is the data-independent mask, so sending it
explicitly (``coo``/``delta``/``bitmap``) reveals nothing that the seed does not.

``decode_update`` is the trust boundary: for any byte string it returns a fully validated
``SparseUpdate`` or raises ``PayloadError`` naming the offending field and value. Accepted
payloads are exactly the canonical (deterministic) serializations, so ``len(data) ==
payload_size(...)`` for every accepted payload (for zstd, given the compressed section sizes).
Decoding allocates at most a few times the payload's own size (bitmaps: 8 bytes per payload
bit; int1 values: about 16; zstd sections: their declared, validated content size), never
anything of size ``dense_size`` unless the sender paid for it; pass ``expected_dense_size``
before calling ``to_dense`` or ``support`` on an update from an untrusted peer.

Layers, one module each (each imports only the ones above it):

- ``schema``: the names (``Encoding``, ``ValueDType``, ``Compression`` and their tuples), the
  proto enum numbers, ``PayloadError``, and the checks on a parsed message's header fields.
- ``values``: fp32/fp16/bf16/int8 value codecs. ``lowbit``: the blocked int4/int2/int1 codecs.
  ``indices``: coo/delta/bitmap index codecs.
  ``compression``: the zstd stage.
- ``sizing``: ``payload_size`` and friends, and ``choose_encoding`` (what ``"auto"`` picks).
- ``update``: the decoded ``SparseUpdate``. ``api``: ``encode_update`` and ``decode_update``.

The names exported here are the public API; the submodules are internal.
"""

from fedsparse.common.wire.payload.api import decode_update, encode_update
from fedsparse.common.wire.payload.compression import ZSTD_LEVEL
from fedsparse.common.wire.payload.schema import (
    COMPRESSIONS,
    DEFAULT_VALUE_BLOCK,
    ENCODINGS,
    EXPLICIT_ENCODINGS,
    FORMAT_VERSION,
    INDEX_ENCODINGS,
    LOWBIT_DTYPES,
    PAYLOAD_DTYPES,
    SUPPORTED_VERSIONS,
    VALUE_DTYPES,
    Compression,
    Encoding,
    ExplicitEncoding,
    IndexEncoding,
    LowBitDType,
    PayloadDType,
    PayloadError,
    ValueDType,
)
from fedsparse.common.wire.payload.sizing import (
    choose_encoding,
    index_section_size,
    information_limit,
    payload_size,
    scale_section_size,
)
from fedsparse.common.wire.payload.update import SparseUpdate
from fedsparse.common.wire.payload.values import value_section_size

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_VALUE_BLOCK",
    "ENCODINGS",
    "EXPLICIT_ENCODINGS",
    "FORMAT_VERSION",
    "INDEX_ENCODINGS",
    "LOWBIT_DTYPES",
    "PAYLOAD_DTYPES",
    "SUPPORTED_VERSIONS",
    "VALUE_DTYPES",
    "ZSTD_LEVEL",
    "Compression",
    "Encoding",
    "ExplicitEncoding",
    "IndexEncoding",
    "LowBitDType",
    "PayloadDType",
    "PayloadError",
    "SparseUpdate",
    "ValueDType",
    "choose_encoding",
    "decode_update",
    "encode_update",
    "index_section_size",
    "information_limit",
    "payload_size",
    "scale_section_size",
    "value_section_size",
]
