"""encode_update and decode_update: round trips, golden bytes, the decoder's trust boundary.

Round trips over every codec and value encoding (format version 1: seeded/dense/COO with
fp32/fp16/bf16; version 2: delta, bitmap, int8, zstd, ``auto``) with exact analytic sizes, the
golden version-1 bytes, the table of malformed payloads the decoder must reject, and the
encoder's input checks. The fuzzes of the decoder are in test_api_fuzz.py; the decoder's checks
of the version-2 fields are tested with their codecs (test_indices.py, test_values.py,
test_compression.py, test_schema.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fedsparse.common.masks import sample_mask
from fedsparse.common.wire.payload import (
    COMPRESSIONS,
    ENCODINGS,
    FORMAT_VERSION,
    VALUE_DTYPES,
    PayloadError,
    decode_update,
    encode_update,
    payload_size,
)
from fedsparse.v1 import payload_pb2 as pb
from tests.common.wire.payload.helpers import (
    BITMAP,
    F32_MAX,
    TORCH_DTYPES,
    V1_ENCODINGS,
    V1_VALUE_DTYPES,
    VALID_VALUES,
    ZSTD,
    encode,
    message,
    serialize,
    size_for,
    size_of,
    update_args,
    v2,
    zstd_frame,
)

SMALLEST_SUBNORMAL = np.float32(2.0**-149)


def bits(x: torch.Tensor) -> list[int]:
    """Bit patterns of a float32 tensor (distinguishes -0.0 from 0.0)."""
    return x.contiguous().view(torch.int32).tolist()


def cast(values: torch.Tensor, value_dtype: str) -> torch.Tensor:
    """Torch's round-to-nearest-even cast to the wire dtype, widened back to float32."""
    return values.to(TORCH_DTYPES[value_dtype]).float()


def expected_values(values: torch.Tensor, value_dtype: str) -> torch.Tensor:
    """What the decoder must return for ``values`` sent as ``value_dtype``.

    int8: all zeros (or nothing) when ``max|v| == 0``; otherwise the scale is ``max|v| / 127``
    in float32, floored at the smallest subnormal (for ``max|v| <= 63 * 2**-149`` the quotient
    underflows to 0, and the encoder sends exact multiples of ``2**-149`` instead), and each
    value is ``round-half-even(v / scale)``, clipped to [-127, 127], times the scale. Where
    float32 rounding would break the contract, the scale is the nearest float32 that keeps
    it: at least ``max|v| / 127.5`` (error <= scale/2) and at most ``F32_MAX / 127`` (the
    decoded maximum stays finite).
    """
    if value_dtype != "int8":
        return values.to(TORCH_DTYPES[value_dtype]).float()
    v = values.numpy().astype(np.float32)
    max_abs = np.float32(np.abs(v).max()) if v.size else np.float32(0)
    if max_abs == 0:
        return torch.zeros_like(values)
    scale = max(np.float32(max_abs / np.float32(127)), SMALLEST_SUBNORMAL)
    floor = float(max_abs) / 127.5
    if float(scale) < floor:  # the smallest float32 >= floor
        scale = np.float32(floor)
        scale = scale if float(scale) >= floor else np.nextafter(scale, np.float32(np.inf))
    ceiling = np.float32(F32_MAX) / np.float32(127)
    with np.errstate(over="ignore"):
        if not np.isfinite(np.float32(127) * scale):
            scale = ceiling
            while not np.isfinite(np.float32(127) * scale):
                scale = np.nextafter(scale, np.float32(0))
    q = np.clip(np.rint(v / scale), -127, 127).astype(np.float32)
    return torch.from_numpy(q * scale)


@st.composite
def codec_args(draw: st.DrawFn, *, max_keep: int = 64, max_dense: int = 3000) -> dict[str, Any]:
    """A valid ``encode_update`` call over every codec: kwargs incl. ``values``."""
    encoding = draw(st.sampled_from((*ENCODINGS, "auto")))
    value_dtype = draw(st.sampled_from(VALUE_DTYPES))
    if encoding == "dense":
        dense_size = keep = draw(st.integers(1, max_keep))
    else:
        dense_size = draw(st.integers(1, max_dense))
        keep = draw(st.integers(0, min(dense_size, max_keep)))
    bound = 1e4 if value_dtype == "fp16" else float(np.float32(1e30))
    floats = st.floats(-bound, bound, width=32, allow_nan=False, allow_infinity=False)
    kwargs: dict[str, Any] = {
        "values": torch.tensor(draw(st.lists(floats, min_size=keep, max_size=keep))).float(),
        "dense_size": dense_size,
        "round": draw(st.integers(0, 2**32 - 1)),
        "encoding": encoding,
        "value_dtype": value_dtype,
        "compression": draw(st.sampled_from(COMPRESSIONS)),
    }
    if encoding == "seeded" or (encoding == "auto" and draw(st.booleans())):
        kwargs["mask_seed"] = draw(st.integers(0, 2**64 - 1))
    elif encoding != "dense":
        idx = draw(st.sets(st.integers(0, dense_size - 1), min_size=keep, max_size=keep))
        kwargs["indices"] = torch.tensor(sorted(idx), dtype=torch.int64)
    return kwargs


# --- round trips and golden bytes -----------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(update_args())
def test_round_trip(case: tuple[torch.Tensor, dict[str, Any], str]) -> None:
    values, kwargs, encoding = case
    data = encode_update(values, **kwargs)
    update = decode_update(
        data,
        expected_dense_size=kwargs["dense_size"],
        expected_round=kwargs["round"],
        expected_mask_seed=kwargs.get("mask_seed"),
        expected_encoding=encoding,
        expected_keep=len(values),
    )
    assert update.encoding == encoding
    assert update.dense_size == kwargs["dense_size"]
    assert update.round == kwargs["round"]
    assert update.value_dtype == kwargs["value_dtype"]
    assert update.mask_seed == kwargs.get("mask_seed")
    assert update.values.dtype == torch.float32 and update.keep == len(values)
    assert bits(update.values) == bits(cast(values, kwargs["value_dtype"]))
    if kwargs["value_dtype"] == "fp32":
        assert bits(update.values) == bits(values)
    if encoding == "coo":
        assert update.indices is not None and update.indices.dtype == torch.int64
        assert torch.equal(update.indices, kwargs["indices"])
    else:
        assert update.indices is None
    assert len(data) == size_of(kwargs, keep=len(values), encoding=encoding)
    assert encode_update(update.values, **kwargs) == data  # decoded values re-encode exactly


def edge_case(values: list[float], value_dtype: str, **kwargs: Any) -> dict[str, Any]:
    """An explicit ``codec_args`` example (dense unless ``kwargs`` say otherwise)."""
    args = {"dense_size": len(values), "round": 0, "encoding": "dense", "compression": "none"}
    return {"values": torch.tensor(values), "value_dtype": value_dtype, **args, **kwargs}


F32_BELOW_MAX = float(np.nextafter(np.float32(F32_MAX), np.float32(0)))


@settings(max_examples=400, deadline=None)
@given(codec_args())
@example(edge_case([6.5861e-44], "int8"))  # 47 * 2**-149: max|v| / 127 underflows to 0
@example(edge_case([1e-45, -1e-45, 0.0, -0.0], "int8", compression="zstd"))
@example(edge_case([F32_BELOW_MAX, -F32_BELOW_MAX, 1e-45, -2.5], "int8"))
@example(edge_case([F32_MAX, -F32_MAX, 1e-45], "fp32", encoding="coo", indices=torch.arange(3)))
@example(edge_case([0.0, -0.0, 0.0], "int8", encoding="bitmap", indices=torch.arange(3)))
@example(edge_case([], "int8", dense_size=5, encoding="seeded", mask_seed=0))
@example(edge_case([], "fp16", dense_size=9, encoding="delta", indices=torch.zeros(0, dtype=int)))
def test_every_codec_round_trips_with_exact_size(kwargs: dict[str, Any]) -> None:
    data = encode(kwargs)
    update = decode_update(data, expected_dense_size=kwargs["dense_size"])
    values = kwargs["values"]
    assert update.keep == len(values) and update.value_dtype == kwargs["value_dtype"]
    assert update.compression == kwargs["compression"]
    if kwargs["encoding"] != "auto":
        assert update.encoding == kwargs["encoding"]
    support = update.support()
    if support is None:  # dense: every coordinate ("auto" picks it when keep == dense_size)
        support = torch.arange(kwargs["dense_size"])
    if "indices" in kwargs:
        assert torch.equal(support, kwargs["indices"])
    elif "mask_seed" in kwargs:
        mask = sample_mask(kwargs["dense_size"], keep=len(values), seed=kwargs["mask_seed"])
        assert torch.equal(support, torch.nonzero(mask).flatten())
    assert torch.equal(update.values, expected_values(values, kwargs["value_dtype"]))
    if kwargs["value_dtype"] == "int8" and len(values):
        scale = update.value_scale
        assert scale is not None
        assert float((update.values - values).abs().max()) <= scale / 2 * (1 + 1e-6) + 1e-45
    assert len(data) == size_for(update, data)
    if kwargs["compression"] == "none":
        assert len(data) == payload_size(
            keep=len(values),
            dense_size=kwargs["dense_size"],
            round=kwargs["round"],
            encoding=update.encoding,
            value_dtype=kwargs["value_dtype"],
            mask_seed=update.mask_seed or 0,
            indices=kwargs.get("indices"),
        )
    version = pb.SparseUpdate.FromString(data).format_version
    v1 = (
        update.encoding in ("seeded", "dense", "coo")
        and update.value_dtype != "int8"
        and update.compression == "none"
    )
    assert version == (1 if v1 else 2)


def test_golden_bytes() -> None:
    """Pins the wire layout (field numbers, enums, little-endian values)."""
    v = torch.tensor([1.0, -2.0])
    fp32 = encode_update(v, dense_size=10, round=3, mask_seed=5)
    assert fp32.hex() == "0801100a180320012805300240015a080000803f000000c0"
    fp16 = encode_update(v, dense_size=10, round=3, mask_seed=5, value_dtype="fp16")
    assert fp16.hex() == "0801100a180320012805300240025a04003c00c0"
    bf16 = encode_update(v, dense_size=10, round=3, mask_seed=5, value_dtype="bf16")
    assert bf16.hex() == "0801100a180320012805300240035a04803f00c0"
    coo = encode_update(v, dense_size=10, round=0, indices=torch.tensor([2, 7]), encoding="coo")
    assert coo.hex() == "0801100a200330024001520802000000070000005a080000803f000000c0"
    # Zero-valued fields cost nothing: round 0, mask seed 0, keep 0, no values.
    empty = encode_update(torch.zeros(0), dense_size=1, round=0, mask_seed=0)
    assert empty.hex() == "0801100120014001"
    assert FORMAT_VERSION == 2  # version-1 payloads are still written as version 1


def test_bytes_like_inputs_and_decoded_tensors_are_owned() -> None:
    data = encode_update(torch.tensor([1.0, 2.0]), dense_size=4, round=0, mask_seed=1)
    for view in (bytearray(data), memoryview(data)):
        assert decode_update(view).values.tolist() == [1.0, 2.0]
    update = decode_update(data)
    update.values.add_(1)  # writable, not a view of the immutable bytes
    assert decode_update(data).values.tolist() == [1.0, 2.0]
    with pytest.raises(TypeError, match="data"):
        decode_update("not bytes")  # type: ignore[arg-type]


# --- the decoder trust boundary -------------------------------------------------------------------


def with_fields(encoding: str = "seeded", **fields: Any) -> bytes:
    msg = message(encoding, value_dtype=fields.pop("value_dtype", "fp32"))
    for name, value in fields.items():
        setattr(msg, name, value)
    return serialize(msg)


def test_valid_fixtures_decode() -> None:
    for encoding in V1_ENCODINGS:
        for value_dtype in V1_VALUE_DTYPES:
            decode_update(serialize(message(encoding, value_dtype=value_dtype)))


def lowbit_with(value_dtype: str = "int4", **fields: Any) -> bytes:
    """A valid seeded low-bit payload (keep=3, value_block=2: two steps), ``fields`` changed."""
    data = encode_update(
        torch.tensor([0.5, -1.0, 0.25]),
        dense_size=10,
        round=3,
        mask_seed=77,
        value_dtype=value_dtype,
        value_block=2,
        rounding=np.random.default_rng(0),
    )
    msg = pb.SparseUpdate.FromString(data)
    for name, value in fields.items():
        if value is None:
            msg.ClearField(name)
        else:
            setattr(msg, name, value)
    return serialize(msg)


MALFORMED: list[tuple[str, bytes, dict[str, Any], str]] = [
    ("empty", b"", {}, r"^format_version: 0, expected one of \(1, 2\)"),
    ("version 2", with_fields(format_version=2), {}, r"^format_version: 2, expected 1"),
    ("dense_size 0", with_fields(dense_size=0), {}, r"^dense_size: 0, expected > 0"),
    ("keep > dense_size", with_fields(keep=11), {}, r"^keep: 11, expected <= dense_size=10"),
    ("dense keep", with_fields("dense", dense_size=5), {}, r"^keep: 4, expected dense_size=5"),
    ("seeded indices", with_fields(indices=b"\x00" * 16), {}, r"^indices: 16 bytes, expected 0"),
    ("dense indices", with_fields("dense", indices=b"\x00" * 16), {}, r"^indices: 16 bytes"),
    ("coo seed", with_fields("coo", mask_seed=5), {}, r"^mask_seed: 5, expected 0 for coo"),
    ("dense seed", with_fields("dense", mask_seed=5), {}, r"^mask_seed: 5, expected 0 for dense"),
    ("values short", with_fields(values=b"\x00" * 15), {}, r"^values: 15 bytes, expected 16"),
    ("values long", with_fields(values=b"\x00" * 17), {}, r"^values: 17 bytes, expected 16"),
    ("values none", with_fields(values=b""), {}, r"^values: 0 bytes, expected 16"),
    ("fp16 length", with_fields(value_dtype="fp16", values=b"\x00" * 16), {}, r"^values: 16 bytes"),
    ("coo indices short", with_fields("coo", indices=b"\x00" * 12), {}, r"^indices: 12 bytes"),
    ("coo missing", with_fields("coo", indices=b""), {}, r"^indices: 0 bytes, expected 16"),
    (
        "coo duplicate",
        with_fields("coo", indices=np.array([0, 3, 3, 5], "<i4").tobytes()),
        {},
        r"^indices: 3 at position 2 after 3, expected strictly increasing",
    ),
    (
        "coo decreasing",
        with_fields("coo", indices=np.array([0, 5, 3, 6], "<i4").tobytes()),
        {},
        r"^indices: 3 at position 2 after 5",
    ),
    (
        "coo out of range",
        with_fields("coo", indices=np.array([0, 1, 2, 10], "<i4").tobytes()),
        {},
        r"^indices: 10 at position 3, expected in \[0, 10\)",
    ),
    (
        "coo negative",
        with_fields("coo", indices=np.array([-1, 1, 2, 3], "<i4").tobytes()),
        {},
        r"^indices: -1 at position 0",
    ),
    (
        "coo big-endian",
        with_fields("coo", indices=np.array([0, 1, 2, 3], ">i4").tobytes()),
        {},
        r"^indices: 16777216 at position 1, expected in \[0, 10\)",
    ),
    ("dense_size mismatch", with_fields(), {"expected_dense_size": 11}, r"^dense_size: 10, exp"),
    ("round mismatch", with_fields(), {"expected_round": 4}, r"^round: 3, expected 4"),
    ("seed mismatch", with_fields(), {"expected_mask_seed": 78}, r"^mask_seed: 77, expected 78"),
    ("keep mismatch", with_fields(), {"expected_keep": 5}, r"^keep: 4, expected 5"),
    (
        "encoding mismatch",
        with_fields("coo"),
        {"expected_encoding": "seeded"},
        r"^index_encoding: 'coo', expected 'seeded'",
    ),
    ("too big", with_fields(), {"max_bytes": 20}, r"^payload: \d+ bytes, exceeds max_bytes=20"),
    ("truncated", with_fields()[:-1], {}, r"^payload: not a fedsparse.v1.SparseUpdate"),
    ("random", bytes(range(7, 250, 3)), {}, r"^payload: not a fedsparse.v1.SparseUpdate"),
    (
        "unknown field",
        with_fields() + b"\x60\x01",
        {},
        r"^payload: unknown field number\(s\) \[12\]",
    ),
    ("field 7", b"\x38\x01" + with_fields(), {}, r"^payload: unknown field number\(s\) \[7\]"),
    ("duplicate field", with_fields() + b"\x18\x03", {}, r"^payload: \d+ bytes not in canonical"),
    ("zero written", b"\x28\x00" + with_fields("coo"), {}, r"canonical"),
    ("overlong varint", b"\x08\x81\x00" + with_fields()[2:], {}, r"^payload: .* canonical"),
    (
        "int4 no block",
        lowbit_with(value_block=None),
        {},
        r"^value_block: 0, expected >= 1 for int4",
    ),
    (
        "fp32 block",
        with_fields(value_block=4),
        {},
        r"^value_block: 4, expected 0 \(absent\) for fp32",
    ),
    ("fp32 steps", with_fields(value_scales=bytes(4)), {}, r"^value_scales: 4 bytes, expected 0"),
    ("int2 step count", lowbit_with("int2", value_scales=bytes(4)), {}, r"^value_scales: 4 bytes"),
    (
        "int1 negative step",
        lowbit_with("int1", value_scales=np.array([-1, 1], "<f4").tobytes()),
        {},
        r"^value_scales: -1.0 at block 0, expected finite >= 0",
    ),
    ("int4 padding", lowbit_with(values=b"\x00\xf0"), {}, r"^values: unused high bits"),
    ("int4 -8", lowbit_with(values=b"\x08\x00"), {}, r"^values: -8 at position 0"),
    ("int2 length", lowbit_with("int2", values=b"\x00\x00"), {}, r"^values: 2 bytes, expected 1"),
    (
        "int1 version 1",
        lowbit_with("int1", format_version=1),
        {},
        r"^format_version: 1, expected 2",
    ),
]


@pytest.mark.parametrize(
    ("data", "kwargs", "match"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_malformed_payloads_are_rejected(data: bytes, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        decode_update(data, **kwargs)


def test_exact_length_error_message() -> None:
    msg = message(keep=100)
    msg.dense_size, msg.values = 1000, b"\x00" * 396
    with pytest.raises(PayloadError) as info:
        decode_update(serialize(msg))
    assert str(info.value) == "values: 396 bytes, expected 400 (keep=100 x 4 bytes fp32)"


def test_every_truncation_is_rejected() -> None:
    for encoding in V1_ENCODINGS:
        data = serialize(message(encoding))
        for cut in range(len(data)):
            with pytest.raises(PayloadError):
                decode_update(data[:cut])


def test_fixture_is_valid() -> None:
    update = decode_update(v2())
    assert update.indices.tolist() == [5, 6, 135] and update.values.tolist() == [0.5, 1.0, -0.5]
    zipped = decode_update(
        v2(**ZSTD, indices=zstd_frame(bytes([5, 0, 0x80, 0x01])), values=zstd_frame(VALID_VALUES))
    )
    assert zipped.indices.tolist() == [5, 6, 135] and zipped.compression == "zstd"
    assert decode_update(v2(**BITMAP, indices=b"\x07\x00")).indices.tolist() == [0, 1, 2]


def test_expected_encodings_accept_a_set() -> None:
    data = v2()
    assert decode_update(data, expected_encoding={"delta", "bitmap"}).encoding == "delta"
    with pytest.raises(PayloadError, match=r"^index_encoding: 'delta', expected one of"):
        decode_update(data, expected_encoding=("seeded", "coo"))
    with pytest.raises(ValueError, match="encoding='zip'"):
        decode_update(data, expected_encoding="zip")


# --- encoder input validation ---------------------------------------------------------------------

V4 = torch.tensor([1.0, 2.0, 3.0, 4.0])


@pytest.mark.parametrize(
    ("values", "kwargs", "match"),
    [
        (V4.reshape(2, 2), {"dense_size": 4}, r"^values: .*expected a 1-D float tensor"),
        (torch.arange(4), {"dense_size": 4}, r"^values: torch.int64"),
        (torch.tensor([1.0, math.nan, 2.0]), {"dense_size": 3}, r"^values: 1 non-finite.*1"),
        (torch.tensor([1.0, -math.inf]), {"dense_size": 2}, r"^values: 1 non-finite.*-inf"),
        (
            torch.tensor([1.0, -7e4]),
            {"dense_size": 2, "value_dtype": "fp16"},
            r"^values: max \|v\| = 70000 overflows fp16 \(max 65504\)",
        ),
        (
            torch.tensor([3.4e38]),
            {"dense_size": 1, "value_dtype": "bf16"},
            r"^values: max \|v\| = 3.4e\+38 overflows bf16",
        ),
        (
            torch.tensor([1e300], dtype=torch.float64),
            {"dense_size": 1},
            r"^values: max \|v\| = 1e\+300 overflows fp32",
        ),
        (V4, {"dense_size": 4, "value_dtype": "fp8"}, r"^value_dtype='fp8'"),
        (V4, {"dense_size": 0}, r"^dense_size=0"),
        (V4, {"dense_size": True}, r"^dense_size=True: expected an integer"),
        (V4, {"dense_size": 2**64}, r"^dense_size=18446744073709551616"),
        (V4, {"dense_size": 3, "mask_seed": 1}, r"^values: 4 values, expected <= dense_size=3"),
        (V4, {"dense_size": 5}, r"^values: 4 values for dense_size=5; a sparse update needs"),
        (V4, {"dense_size": 9, "round": -1}, r"^round=-1"),
        (V4, {"dense_size": 9, "round": 2**32}, r"^round=4294967296"),
        (V4, {"dense_size": 9, "mask_seed": -1}, r"^mask_seed=-1"),
        (V4, {"dense_size": 9, "mask_seed": 2**64}, r"^mask_seed=18446744073709551616"),
        (
            V4,
            {"dense_size": 9, "mask_seed": 1, "indices": torch.arange(4)},
            r"^mask_seed and indices",
        ),
        (V4, {"dense_size": 9, "indices": torch.arange(3)}, r"^indices: 3 entries, expected 4"),
        (V4, {"dense_size": 9, "indices": torch.arange(4.0)}, r"^indices: torch.float32"),
        (
            V4,
            {"dense_size": 9, "indices": torch.tensor([0, 2, 2, 3])},
            r"^indices: 2 at position 2 after 2, expected strictly increasing",
        ),
        (
            V4,
            {"dense_size": 9, "indices": torch.tensor([0, 3, 2, 5])},
            r"^indices: 2 at position 2 after 3",
        ),
        (
            V4,
            {"dense_size": 9, "indices": torch.tensor([0, 1, 2, 9])},
            r"^indices: 9 at position 3, expected in \[0, 9\)",
        ),
        (
            V4,
            {"dense_size": 2**40, "indices": torch.tensor([0, 1, 2, 2**31]), "encoding": "coo"},
            r"^indices: 2147483648 at position 3, expected in \[0, 2147483648\)",
        ),
    ],
)
def test_encoder_rejects_bad_inputs(
    values: torch.Tensor, kwargs: dict[str, Any], match: str
) -> None:
    kwargs.setdefault("round", 0)
    with pytest.raises(ValueError, match=match):
        encode_update(values, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"encoding": "zip"}, r"^encoding='zip': expected one of"),
        ({"compression": "gzip"}, r"^compression='gzip': expected one of"),
        ({"encoding": "seeded"}, r"^encoding='seeded': needs mask_seed="),
        ({"encoding": "delta"}, r"^encoding='delta': needs indices= or mask_seed="),
        ({"encoding": "dense"}, r"^values: 2 values, encoding='dense' needs dense_size=5"),
        ({"encoding": "auto"}, r"^values: 2 values for dense_size=5; a sparse update needs"),
        (
            {"encoding": "bitmap", "indices": torch.tensor([0, 1]), "dense_size": 2**62},
            r"^dense_size=4611686018427387904: expected < 2\*\*62 for bitmap",
        ),
    ],
)
def test_encoder_errors_name_the_argument(kwargs: dict[str, Any], match: str) -> None:
    args = {"dense_size": 5, "round": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        encode_update(torch.ones(2), **args)
