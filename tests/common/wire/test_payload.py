"""Tests for fedsparse.common.wire.payload: round trips, exact sizes, and the decoder trust
boundary."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fedsparse.common.masks import derive_seed, keep_count, sample_mask
from fedsparse.common.wire.payload import (
    FORMAT_VERSION,
    PayloadError,
    SparseUpdate,
    decode_update,
    encode_update,
    information_limit,
    payload_size,
)
from fedsparse.v1 import payload_pb2 as pb

# This file pins format version 1 (seeded/dense/COO, fp32/fp16/bf16); the version-2 codecs
# (delta, bitmap, int8, zstd, auto) are tested in test_codecs.py, the low-bit ones (int4, int2,
# int1) in payload/test_lowbit.py; the exact-size test, the fuzz and the malformed table here
# include the low-bit dtypes too.
ENCODINGS = ("seeded", "dense", "coo")
VALUE_DTYPES = ("fp32", "fp16", "bf16")
LOWBIT_DTYPES = ("int4", "int2", "int1")
BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int4": 4, "int2": 2, "int1": 1}
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
U32, U64 = 2**32, 2**64


def bits(x: torch.Tensor) -> list[int]:
    """Bit patterns of a float32 tensor (distinguishes -0.0 from 0.0)."""
    return x.contiguous().view(torch.int32).tolist()


def cast(values: torch.Tensor, value_dtype: str) -> torch.Tensor:
    """Torch's round-to-nearest-even cast to the wire dtype, widened back to float32."""
    return values.to(TORCH_DTYPES[value_dtype]).float()


@st.composite
def update_args(
    draw: st.DrawFn, *, max_keep: int = 48, max_dense: int = 5000
) -> tuple[torch.Tensor, dict[str, Any], str]:
    """A valid ``encode_update`` call: (values, kwargs, encoding)."""
    value_dtype = draw(st.sampled_from(VALUE_DTYPES))
    encoding = draw(st.sampled_from(ENCODINGS))
    if encoding == "dense":
        dense_size = keep = draw(st.integers(1, max_keep))
    else:
        dense_size = draw(st.integers(1, max_dense))
        keep = draw(st.integers(0, min(dense_size, max_keep)))
    bound = float(torch.finfo(TORCH_DTYPES[value_dtype]).max)
    floats = st.floats(-bound, bound, width=32, allow_nan=False, allow_infinity=False)
    values = torch.tensor(draw(st.lists(floats, min_size=keep, max_size=keep)), dtype=torch.float32)
    kwargs: dict[str, Any] = {
        "dense_size": dense_size,
        "round": draw(st.integers(0, U32 - 1)),
        "value_dtype": value_dtype,
        "encoding": encoding,
    }
    if encoding == "seeded":
        kwargs["mask_seed"] = draw(st.integers(0, U64 - 1))
    elif encoding == "coo":
        idx = draw(st.sets(st.integers(0, dense_size - 1), min_size=keep, max_size=keep))
        kwargs["indices"] = torch.tensor(sorted(idx), dtype=torch.int64)
    return values, kwargs, encoding


def size_of(kwargs: dict[str, Any], *, keep: int, encoding: str) -> int:
    return payload_size(
        keep=keep,
        dense_size=kwargs["dense_size"],
        round=kwargs["round"],
        encoding=encoding,
        value_dtype=kwargs["value_dtype"],
        mask_seed=kwargs.get("mask_seed", 0),
        **({"value_block": kwargs["value_block"]} if "value_block" in kwargs else {}),
    )


# --- round trips and sizes --------------------------------------------------------------------


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


@settings(max_examples=400, deadline=None)
@given(
    keep=st.integers(0, 300),
    dense_size=st.integers(1, U64 - 1),
    round_=st.integers(0, U32 - 1),
    encoding=st.sampled_from(ENCODINGS),
    value_dtype=st.sampled_from((*VALUE_DTYPES, *LOWBIT_DTYPES)),
    mask_seed=st.integers(0, U64 - 1),
    data=st.data(),
)
def test_analytic_size_is_exact(
    keep: int,
    dense_size: int,
    round_: int,
    encoding: str,
    value_dtype: str,
    mask_seed: int,
    data: st.DataObject,
) -> None:
    kwargs: dict[str, Any] = {"round": round_, "value_dtype": value_dtype, "encoding": encoding}
    if encoding == "dense":
        dense_size = keep = max(keep, 1)
    keep = min(keep, dense_size)
    if encoding == "seeded":
        kwargs["mask_seed"] = mask_seed
    elif encoding == "coo":
        hi = min(dense_size, 2**31)
        idx = data.draw(st.sets(st.integers(0, hi - 1), min_size=keep, max_size=keep))
        kwargs["indices"] = torch.tensor(sorted(idx), dtype=torch.int64)
    kwargs["dense_size"] = dense_size
    if value_dtype in LOWBIT_DTYPES:
        kwargs["value_block"] = data.draw(st.one_of(st.integers(1, 64), st.integers(1, U32 - 1)))
        kwargs["rounding"] = np.random.default_rng(data.draw(st.integers(0, U32)))
    payload = encode_update(torch.linspace(-1, 1, keep), **kwargs)
    assert len(payload) == size_of(kwargs, keep=keep, encoding=encoding)
    value_bytes = math.ceil(keep * BITS[value_dtype] / 8)  # packed, no padding past the last byte
    assert information_limit(keep=keep, value_dtype=value_dtype) == value_bytes
    msg = pb.SparseUpdate.FromString(payload)
    assert len(msg.values) == value_bytes
    blocks = math.ceil(keep / kwargs["value_block"]) if value_dtype in LOWBIT_DTYPES else 0
    assert len(msg.value_scales) == 4 * blocks


@settings(max_examples=200, deadline=None)
@given(
    dense_size=st.integers(1, 10**8),
    keep_fraction=st.floats(0, 1),
    round_=st.integers(0, U32 - 1),
    mask_seed=st.integers(0, U64 - 1),
    value_dtype=st.sampled_from(VALUE_DTYPES),
)
def test_seeded_overhead_is_a_small_header(
    dense_size: int, keep_fraction: float, round_: int, mask_seed: int, value_dtype: str
) -> None:
    # Large keeps are checked analytically (the exact-size test ties it to real bytes).
    keep = math.floor(keep_fraction * dense_size)
    size = payload_size(
        keep=keep,
        dense_size=dense_size,
        round=round_,
        encoding="seeded",
        value_dtype=value_dtype,
        mask_seed=mask_seed,
    )
    assert 0 < size - information_limit(keep=keep, value_dtype=value_dtype) <= 64
    small = min(keep, 20_000)
    payload = encode_update(
        torch.ones(small),
        dense_size=dense_size,
        round=round_,
        mask_seed=mask_seed,
        value_dtype=value_dtype,
    )
    assert len(payload) - information_limit(keep=small, value_dtype=value_dtype) <= 64


def test_dpcnn_seeded_header_bytes() -> None:
    """DP-CNN (d = 550,570) at r = 0.9: the header is 30 bytes; indices would cost 220 KB."""
    d = 550_570
    keep = keep_count(d, rate=0.9)
    seed = derive_seed(2024, 5)  # a 63-bit round seed: a 9-byte varint
    assert keep == 55_057 and seed.bit_length() == 63
    values = torch.randn(keep, generator=torch.Generator().manual_seed(0))
    for value_dtype, total in [("fp32", 220_258), ("fp16", 110_144), ("bf16", 110_144)]:
        payload = encode_update(
            values, dense_size=d, round=5, mask_seed=seed, value_dtype=value_dtype
        )
        assert len(payload) == total
        assert len(payload) - information_limit(keep=keep, value_dtype=value_dtype) == 30
    coo = encode_update(values, dense_size=d, round=5, indices=torch.arange(keep), encoding="coo")
    assert len(coo) - len(encode_update(values, dense_size=d, round=5, mask_seed=seed)) == (
        4 * keep + 4 - 10  # index bytes + their tag/length, minus the mask seed field
    )


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


def test_bf16_and_fp16_round_to_nearest_even() -> None:
    # 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one (1).
    # 1 + 3*2^-8 ties between 1 + 2^-7 and 1 + 2^-6 and goes up; 1 + 2^-11 is an fp16 tie.
    v = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 65504.0, -6e-8])
    bf = decode_update(encode_update(v, dense_size=5, round=0, value_dtype="bf16")).values
    assert bf[:2].tolist() == [1.0, 1 + 2**-6]
    half = decode_update(encode_update(v, dense_size=5, round=0, value_dtype="fp16")).values
    assert half[2:4].tolist() == [1.0, 65504.0]
    assert half[4].item() == -(2**-24)  # the smallest fp16 subnormal, sign kept


def test_seeded_support_is_the_public_mask() -> None:
    d, keep, seed = 300_000, 12_345, derive_seed(9, 1)
    mask = sample_mask(d, keep=keep, seed=seed)
    dense = torch.randn(d, generator=torch.Generator().manual_seed(1))
    update = decode_update(encode_update(dense[mask], dense_size=d, round=1, mask_seed=seed))
    support = update.support()
    assert support is not None and support.dtype == torch.int64
    assert torch.equal(support, torch.nonzero(mask).flatten())
    assert torch.equal(update.to_dense(), torch.where(mask, dense, torch.zeros(())))


@pytest.mark.parametrize("value_dtype", VALUE_DTYPES)
def test_to_dense_places_values(value_dtype: str) -> None:
    values = torch.tensor([0.5, -1.25, 3.0])
    coo = decode_update(
        encode_update(
            values,
            dense_size=8,
            round=0,
            indices=torch.tensor([1, 4, 7]),
            encoding="coo",
            value_dtype=value_dtype,
        )
    )
    assert coo.to_dense().tolist() == [0, 0.5, 0, 0, -1.25, 0, 0, 3.0]
    dense = decode_update(encode_update(values, dense_size=3, round=0, value_dtype=value_dtype))
    assert dense.support() is None and dense.to_dense().tolist() == [0.5, -1.25, 3.0]
    seeded = decode_update(
        encode_update(values, dense_size=8, round=0, mask_seed=11, value_dtype=value_dtype)
    )
    expected = torch.zeros(8)
    expected[sample_mask(8, keep=3, seed=11)] = values
    assert torch.equal(seeded.to_dense(), expected)
    empty = decode_update(encode_update(torch.zeros(0), dense_size=8, round=0, mask_seed=3))
    assert empty.keep == 0 and torch.equal(empty.to_dense(), torch.zeros(8))


def test_bytes_like_inputs_and_decoded_tensors_are_owned() -> None:
    data = encode_update(torch.tensor([1.0, 2.0]), dense_size=4, round=0, mask_seed=1)
    for view in (bytearray(data), memoryview(data)):
        assert decode_update(view).values.tolist() == [1.0, 2.0]
    update = decode_update(data)
    update.values.add_(1)  # writable, not a view of the immutable bytes
    assert decode_update(data).values.tolist() == [1.0, 2.0]
    with pytest.raises(TypeError, match="data"):
        decode_update("not bytes")  # type: ignore[arg-type]


# --- the decoder trust boundary ----------------------------------------------------------------


def message(encoding: str = "seeded", keep: int = 4, value_dtype: str = "fp32") -> pb.SparseUpdate:
    """A valid message (dense_size=10, round=3) to break one field at a time."""
    nbytes = DTYPE_BYTES[value_dtype]
    msg = pb.SparseUpdate(
        format_version=1,
        dense_size=keep if encoding == "dense" else 10,
        round=3,
        index_encoding={"seeded": 1, "dense": 2, "coo": 3}[encoding],
        keep=keep,
        value_dtype={"fp32": 1, "fp16": 2, "bf16": 3}[value_dtype],
        values=b"\x00" * (nbytes * keep),
    )
    if encoding == "seeded":
        msg.mask_seed = 77
    if encoding == "coo":
        msg.indices = np.arange(0, 2 * keep, 2, dtype="<i4").tobytes()
    return msg


def serialize(msg: pb.SparseUpdate) -> bytes:
    return msg.SerializeToString(deterministic=True)


def with_fields(encoding: str = "seeded", **fields: Any) -> bytes:
    msg = message(encoding, value_dtype=fields.pop("value_dtype", "fp32"))
    for name, value in fields.items():
        setattr(msg, name, value)
    return serialize(msg)


def test_valid_fixtures_decode() -> None:
    for encoding in ENCODINGS:
        for value_dtype in VALUE_DTYPES:
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


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("value_dtype", 0, r"^value_dtype: 0, expected one of"),
        ("value_dtype", 9, r"^value_dtype: 9, expected one of"),
        ("index_encoding", 0, r"^index_encoding: 0, expected one of"),
        ("index_encoding", 7, r"^index_encoding: 7, expected one of"),
    ],
)
def test_unknown_enums_are_rejected(field: str, value: int, match: str) -> None:
    msg = message()
    setattr(msg, field, value)  # proto3 enums are open: unknown numbers parse
    with pytest.raises(PayloadError, match=match):
        decode_update(serialize(msg))


def test_exact_length_error_message() -> None:
    msg = message(keep=100)
    msg.dense_size, msg.values = 1000, b"\x00" * 396
    with pytest.raises(PayloadError) as info:
        decode_update(serialize(msg))
    assert str(info.value) == "values: 396 bytes, expected 400 (keep=100 x 4 bytes fp32)"


@pytest.mark.parametrize(
    ("value_dtype", "raw", "match"),
    [
        ("fp32", np.array([0, np.nan, 1, np.inf], "<f4"), r"^values: 2 non-finite .* position 1"),
        ("fp32", np.array([0, 1, 2, -np.inf], "<f4"), r"^values: 1 non-finite .* 3 \(-inf\)"),
        ("fp16", np.array([0, 0, 0x7C00, 0x7E00], "<u2"), r"^values: 2 non-finite \(fp16\).* 2"),
        ("bf16", np.array([0x7F80, 0, 0, 0x7FC1], "<u2"), r"^values: 2 non-finite \(bf16\).* 0"),
    ],
)
def test_non_finite_values_are_rejected(value_dtype: str, raw: np.ndarray, match: str) -> None:
    msg = message(value_dtype=value_dtype)
    msg.values = raw.tobytes()
    with pytest.raises(PayloadError, match=match):
        decode_update(serialize(msg))


def test_every_truncation_is_rejected() -> None:
    for encoding in ENCODINGS:
        data = serialize(message(encoding))
        for cut in range(len(data)):
            with pytest.raises(PayloadError):
                decode_update(data[:cut])


# --- encoder input validation -----------------------------------------------------------------

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


def test_payload_size_rejects_bad_arguments() -> None:
    common: dict[str, Any] = {"round": 0, "value_dtype": "fp32"}
    with pytest.raises(ValueError, match="keep=5"):
        payload_size(keep=5, dense_size=6, encoding="dense", **common)
    with pytest.raises(ValueError, match="keep=7"):
        payload_size(keep=7, dense_size=6, encoding="seeded", **common)
    with pytest.raises(ValueError, match="mask_seed=3"):
        payload_size(keep=5, dense_size=6, encoding="coo", mask_seed=3, **common)
    with pytest.raises(ValueError, match="encoding='rle'"):
        payload_size(keep=5, dense_size=6, encoding="rle", **common)


def test_sparse_update_validates_its_fields() -> None:
    ok: dict[str, Any] = {"dense_size": 4, "round": 0, "values": torch.zeros(2)}
    SparseUpdate(encoding="seeded", mask_seed=0, **ok)
    with pytest.raises(ValueError, match="mask_seed"):
        SparseUpdate(encoding="seeded", **ok)
    with pytest.raises(ValueError, match="indices"):
        SparseUpdate(encoding="coo", **ok)
    with pytest.raises(ValueError, match="values"):
        SparseUpdate(encoding="dense", **ok)
    with pytest.raises(ValueError, match="values: torch.float64"):
        SparseUpdate(encoding="seeded", mask_seed=0, **{**ok, "values": torch.zeros(2).double()})


# --- fuzzing ---------------------------------------------------------------------------------


@st.composite
def mutated_payloads(draw: st.DrawFn) -> tuple[bytes, dict[str, Any]]:
    values, kwargs, encoding = draw(update_args(max_keep=16, max_dense=200))
    if draw(st.booleans()):  # the same call in a low-bit dtype
        kwargs["value_dtype"] = draw(st.sampled_from(LOWBIT_DTYPES))
        kwargs["value_block"] = draw(st.integers(1, 20))
        kwargs["rounding"] = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    data = bytearray(encode_update(values, **kwargs))
    kind = draw(st.sampled_from(["flip", "truncate", "splice", "random"]))
    if kind == "flip":
        for bit in draw(st.lists(st.integers(0, 8 * len(data) - 1), min_size=1, max_size=4)):
            data[bit // 8] ^= 1 << (bit % 8)
    elif kind == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif kind == "splice":
        at = draw(st.integers(0, len(data)))
        cut = draw(st.integers(0, 8))
        data[at : at + cut] = draw(st.binary(max_size=12))
    else:
        data = bytearray(draw(st.binary(max_size=80)))
    checks = draw(st.booleans())
    expected = {"expected_dense_size": kwargs["dense_size"]} if checks else {}
    return bytes(data), expected


@settings(
    max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
@given(mutated_payloads())
def test_fuzzed_payloads_decode_or_raise_payload_error(case: tuple[bytes, dict[str, Any]]) -> None:
    data, expected = case
    try:
        update = decode_update(data, **expected)
    except PayloadError as exc:
        event(f"rejected: {str(exc).split(':')[0]}")
        return
    event(f"accepted {update.value_dtype}")
    # Accepted payloads are canonical: exact analytic size, and they re-encode byte for byte
    # (the low-bit ones round at random: their size and values are checked instead).
    kwargs: dict[str, Any] = {
        "dense_size": update.dense_size,
        "round": update.round,
        "value_dtype": update.value_dtype,
        "encoding": update.encoding,
    }
    if update.mask_seed is not None:
        kwargs["mask_seed"] = update.mask_seed
    if update.indices is not None:
        kwargs["indices"] = update.indices
    if update.value_block is not None:
        kwargs["value_block"] = update.value_block
        assert bool(update.values.isfinite().all())
    else:
        assert encode_update(update.values, **kwargs) == data
    assert len(data) == size_of(kwargs, keep=update.keep, encoding=update.encoding)
    if update.dense_size <= 10**6:
        assert update.to_dense().shape == (update.dense_size,)
