"""The blocked low-bit value codecs (int4, int2, int1): unbiased rounding, exact bytes, trust.

Round trips and exact analytic sizes over every index encoding and compression (hypothesis),
unbiasedness and the analytic variance at fixed seeds with tolerances from the standard error,
golden bytes, edge cases (empty, zeros, one value, a short last block, huge and subnormal
values), the decoder's checks of every new field, and a fuzz of mutated low-bit payloads.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from fedsparse.common.masks import derive_seed, keep_count, sample_mask
from fedsparse.common.wire.payload import (
    COMPRESSIONS,
    DEFAULT_VALUE_BLOCK,
    ENCODINGS,
    LOWBIT_DTYPES,
    PAYLOAD_DTYPES,
    VALUE_DTYPES,
    PayloadError,
    SparseUpdate,
    decode_update,
    encode_update,
    information_limit,
    payload_size,
    scale_section_size,
    value_section_size,
)
from fedsparse.v1 import payload_pb2 as pb

BITS = {"int4": 4, "int2": 2, "int1": 1}
LEVELS = {"int4": 7, "int2": 1, "int1": 1}
F32_MAX = float(np.finfo(np.float32).max)
TINY = float(np.float32(2.0**-149))


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def oracle_steps(values: np.ndarray, value_dtype: str, block: int) -> np.ndarray:
    """Each block's step: the smallest float32 ``s`` with ``levels * s >= max |v|`` (exact)."""
    levels = LEVELS[value_dtype]
    out = []
    for start in range(0, values.size, block):
        m = float(np.abs(values[start : start + block]).max())
        s = np.float32(m / levels)
        while float(s) * levels < m:
            s = np.nextafter(s, np.float32(np.inf))
        while s > 0 and float(np.nextafter(s, np.float32(0))) * levels >= m:
            s = np.nextafter(s, np.float32(0))
        out.append(s)
    return np.array(out, dtype=np.float32)


def sections(data: bytes) -> tuple[int, int]:
    msg = pb.SparseUpdate.FromString(data)
    return len(msg.indices), len(msg.values)


def size_of(update: SparseUpdate, data: bytes) -> int:
    return payload_size(
        keep=update.keep,
        dense_size=update.dense_size,
        round=update.round,
        encoding=update.encoding,
        value_dtype=update.value_dtype,
        mask_seed=update.mask_seed or 0,
        indices=update.indices,
        compression=update.compression,
        compressed_sizes=sections(data) if update.compression == "zstd" else None,
        value_block=update.value_block or DEFAULT_VALUE_BLOCK,
    )


@st.composite
def lowbit_args(draw: st.DrawFn, *, max_keep: int = 80, max_dense: int = 2000) -> dict[str, Any]:
    """A valid low-bit ``encode_update`` call (kwargs incl. ``values``), any encoding."""
    encoding = draw(st.sampled_from((*ENCODINGS, "auto")))
    if encoding == "dense":
        dense_size = keep = draw(st.integers(1, max_keep))
    else:
        dense_size = draw(st.integers(1, max_dense))
        keep = draw(st.integers(0, min(dense_size, max_keep)))
    value_dtype = draw(st.sampled_from(LOWBIT_DTYPES))
    bound = F32_MAX / 8 if value_dtype == "int4" else F32_MAX
    floats = st.floats(-bound, bound, width=32, allow_nan=False, allow_infinity=False)
    kwargs: dict[str, Any] = {
        "values": torch.tensor(draw(st.lists(floats, min_size=keep, max_size=keep))).float(),
        "dense_size": dense_size,
        "round": draw(st.integers(0, 2**32 - 1)),
        "encoding": encoding,
        "value_dtype": value_dtype,
        "compression": draw(st.sampled_from(COMPRESSIONS)),
        "value_block": draw(st.one_of(st.integers(1, 40), st.integers(1, 2**32 - 1))),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }
    if encoding == "seeded" or (encoding == "auto" and draw(st.booleans())):
        kwargs["mask_seed"] = draw(st.integers(0, 2**64 - 1))
    elif encoding != "dense":
        idx = draw(st.sets(st.integers(0, dense_size - 1), min_size=keep, max_size=keep))
        kwargs["indices"] = torch.tensor(sorted(idx), dtype=torch.int64)
    return kwargs


def encode(kwargs: dict[str, Any]) -> bytes:
    args = {k: v for k, v in kwargs.items() if k not in ("values", "seed")}
    return encode_update(kwargs["values"], rounding=rng(kwargs["seed"]), **args)


def case(values: list[float], value_dtype: str, block: int = 3, **kwargs: Any) -> dict[str, Any]:
    """An explicit ``lowbit_args`` example (dense unless ``kwargs`` say otherwise)."""
    args = {"dense_size": len(values), "round": 0, "encoding": "dense", "compression": "none"}
    return {
        "values": torch.tensor(values, dtype=torch.float32),
        "value_dtype": value_dtype,
        "value_block": block,
        "seed": 0,
        **args,
        **kwargs,
    }


# --- round trips and exact sizes ----------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(lowbit_args())
@example(case([], "int4", dense_size=5, encoding="seeded", mask_seed=0))
@example(case([0.0, -0.0, 0.0, 0.0], "int1"))
@example(case([0.0, -0.0, 0.0, 0.0], "int4", compression="zstd"))
@example(case([2.5], "int2", block=1))
@example(case([TINY, -3 * TINY, 7 * TINY, 0.0, 5e-45], "int4", block=2))
@example(case([F32_MAX, -F32_MAX, 1.0, TINY], "int1"))
@example(case([F32_MAX, -F32_MAX, 1.0, TINY], "int2", block=2))
@example(case([F32_MAX / 7.5, -1.0, 3.0], "int4"))
@example(case([1.0, -2.0, 3.0, 4.0, 5.0, 6.0, 7.0], "int4", block=2**32 - 1))
def test_round_trip_exact_size_and_neighbouring_levels(kwargs: dict[str, Any]) -> None:
    data = encode(kwargs)
    update = decode_update(data, expected_dense_size=kwargs["dense_size"])
    values, dtype, block = kwargs["values"].numpy(), kwargs["value_dtype"], kwargs["value_block"]
    assert update.value_dtype == dtype and update.value_block == block
    assert update.keep == values.size and update.value_scale is None
    assert len(data) == size_of(update, data)  # the analytic size is exact
    msg = pb.SparseUpdate.FromString(data)
    if kwargs["compression"] == "none":
        assert len(msg.values) == math.ceil(values.size * BITS[dtype] / 8)
    assert len(msg.value_scales) == 4 * math.ceil(values.size / block)
    assert msg.format_version == 2 and msg.value_block == block
    steps = update.value_scales
    assert steps is not None
    expected_steps = oracle_steps(values, dtype, block) if values.size else np.zeros(0, np.float32)
    assert steps.numpy().tobytes() == expected_steps.tobytes()
    # Each value went to one of its two neighbouring levels, i.e. within one step of it.
    step = steps.numpy().astype(np.float64)[np.arange(values.size) // block]
    q = np.divide(update.values.numpy(), step, out=np.zeros(values.size), where=step > 0)
    x = np.divide(values.astype(np.float64), step, out=np.zeros(values.size), where=step > 0)
    assert np.all(np.abs(q) <= LEVELS[dtype] * (1 + 2**-23))
    if dtype == "int1":
        assert np.all(np.abs(update.values.numpy()) == step.astype(np.float32))
    else:
        tol = 2**-22 * np.abs(x) + 1e-12  # float32 rounding of the decoded q * step
        assert np.all((q >= np.floor(x) - tol) & (q <= np.ceil(x) + tol))
    assert bool(update.values.isfinite().all())
    assert not np.signbit(update.values.numpy()[update.values.numpy() == 0]).any()  # +0.0 only
    assert encode(kwargs) == data  # same generator state, same bytes


@pytest.mark.parametrize("value_dtype", LOWBIT_DTYPES)
def test_seeds_and_generator_use(value_dtype: str) -> None:
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    kw: dict[str, Any] = {"dense_size": 1000, "round": 0, "value_dtype": value_dtype}
    a = encode_update(values, rounding=rng(1), **kw)
    assert a == encode_update(values, rounding=rng(1), **kw)
    assert a != encode_update(values, rounding=rng(2), **kw)
    gen = rng(3)
    encode_update(values, rounding=gen, **kw)
    fresh = rng(3)
    fresh.random(1000)  # exactly one uniform per value
    assert gen.random() == fresh.random()
    untouched = rng(4)
    encode_update(values, rounding=untouched, **{**kw, "value_dtype": "int8"})
    assert untouched.random() == rng(4).random()


def test_golden_lowbit_bytes() -> None:
    """Pins the packing (low nibble / low bits first), two's complement codes and the steps.

    Values on the grid round deterministically: int4 step 1 (max 7), int2/int1 step max|v|.
    """
    v = torch.tensor([7.0, -3.0, 0.0])
    int4 = encode_update(v, dense_size=3, round=0, value_dtype="int4", rounding=rng())
    # 7 = 0x7, -3 = 0xD, 0: bytes 0xD7 0x00; block 256 = varint 80 02; step 1.0 = 0000803f.
    assert int4.hex() == "08021003200230034005" + "5a02d700" + "708002" + "7a040000803f"
    int2 = encode_update(
        torch.tensor([2.0, -2.0, 0.0, 2.0, -2.0]),
        dense_size=5,
        round=0,
        value_dtype="int2",
        value_block=4,
        rounding=rng(),
    )
    # codes 1, -1 (0b11), 0, 1 | -1: byte 0x4D (01 00 11 01), then 0x03; steps 2.0, 2.0.
    assert int2.hex() == "08021005200230054006" + "5a024d03" + "7004" + "7a080000004000000040"
    int1 = encode_update(
        torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0]),
        dense_size=9,
        round=0,
        value_dtype="int1",
        rounding=rng(),
    )
    # bits 1 0 1 1 0 0 0 1 | 1, least significant first: 0x8D 0x01.
    assert int1.hex() == "08021009200230094007" + "5a028d01" + "708002" + "7a040000803f"
    assert decode_update(int4).values.tolist() == [7.0, -3.0, 0.0]
    assert decode_update(int1).values.tolist() == [1, -1, 1, 1, -1, -1, -1, 1, 1]


def test_dpcnn_byte_counts() -> None:
    """DP-CNN (d = 550,570) at r = 0.9: packed values plus one float32 per 256 values."""
    d = 550_570
    keep = keep_count(d, rate=0.9)
    seed = derive_seed(2024, 5)
    values = torch.randn(keep, generator=torch.Generator().manual_seed(0))
    assert keep == 55_057 and math.ceil(keep / 256) == 216
    expected = {"int4": (27_529, 28_429), "int2": (13_765, 14_664), "int1": (6_883, 7_782)}
    for dtype, (value_bytes, total) in expected.items():
        payload = encode_update(
            values, dense_size=d, round=5, mask_seed=seed, value_dtype=dtype, rounding=rng()
        )
        assert information_limit(keep=keep, value_dtype=dtype) == value_bytes
        assert value_section_size(keep, dtype) == value_bytes  # type: ignore[arg-type]
        assert scale_section_size(keep=keep, value_dtype=dtype) == 4 * 216
        # The fp32 header is 30 bytes with a 3-byte values length (2 bytes below 16,384), plus
        # the block field (tag + varint 256: 3 bytes) and the steps (tag + 2-byte length + 864).
        header = 30 if value_bytes >= 2**14 else 29
        assert len(payload) == total == value_bytes + header + 3 + 3 + 864
    assert scale_section_size(keep=keep, value_dtype="int8") == 0


# --- unbiasedness and variance -------------------------------------------------------------------

PATTERN = np.array(
    [1.0, -1.0, 0.0, 0.3, -0.3, 0.5, -0.77, 0.999, 1e-3, -0.12345, 0.25, 2 / 7, 0.7, -0.05, 0.9],
    dtype=np.float32,
)
REPEATS = 20_000


def repeated_rounding(value_dtype: str, pattern: np.ndarray, seed: int) -> np.ndarray:
    """(REPEATS, len(pattern)) decoded samples: one block per copy of the pattern, so every
    copy has the same step and independent rounding draws."""
    values = torch.from_numpy(np.tile(pattern, REPEATS))
    data = encode_update(
        values,
        dense_size=values.numel(),
        round=0,
        value_dtype=value_dtype,
        value_block=pattern.size,
        rounding=rng(seed),
    )
    update = decode_update(data)
    assert update.value_scales is not None
    assert bool((update.value_scales == update.value_scales[0]).all())
    return update.values.numpy().astype(np.float64).reshape(REPEATS, pattern.size)


def analytic_variance(value_dtype: str, pattern: np.ndarray) -> np.ndarray:
    step = float(oracle_steps(pattern, value_dtype, pattern.size)[0])
    v = pattern.astype(np.float64)
    if value_dtype == "int1":
        return step**2 - v**2
    p = v / step - np.floor(v / step)
    return step**2 * p * (1 - p)


@pytest.mark.parametrize("value_dtype", LOWBIT_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 3e-42, 1e37])  # normal, subnormal, huge magnitudes
def test_rounding_is_unbiased_with_the_analytic_variance(value_dtype: str, scale: float) -> None:
    pattern = (PATTERN.astype(np.float64) * scale).astype(np.float32)
    samples = repeated_rounding(value_dtype, pattern, seed=7)
    var = analytic_variance(value_dtype, pattern)
    mean = samples.mean(axis=0)
    se = np.sqrt(var / REPEATS)
    exact = var == 0  # on the grid (or a zero step): no randomness at all
    assert np.array_equal(
        samples[:, exact], np.broadcast_to(pattern[exact], samples[:, exact].shape)
    )
    z = (mean[~exact] - pattern[~exact]) / se[~exact]
    assert np.all(np.abs(z) < 5), z
    # The test has power: a bias of a tenth of a step would be caught.
    step = float(oracle_steps(pattern, value_dtype, pattern.size)[0])
    shifted = (mean[~exact] - pattern[~exact] - step / 10) / se[~exact]
    assert np.any(np.abs(shifted) > 5)
    # Each sample takes one of two values h apart, the upper one with probability p: the
    # sample variance has mean var = h^2 p (1 - p) and variance mu4 / n - var^2 (n - 3) /
    # (n (n - 1)), with mu4 = h^4 p (1 - p) (1 - 3 p (1 - p)). The check accepts the analytic
    # variance and rejects 1.5 times it.
    h, p = (
        (2 * step, (1 + pattern / step) / 2)
        if value_dtype == "int1"
        else (step, pattern / step - np.floor(pattern / step))
    )
    h, p = np.broadcast_to(h, p.shape)[~exact], p.astype(np.float64)[~exact]
    pq = p * (1 - p)
    mu4 = h**4 * pq * (1 - 3 * pq)
    n = REPEATS
    sd_var = np.sqrt(mu4 / n - var[~exact] ** 2 * (n - 3) / (n * (n - 1)))
    sample_var = samples[:, ~exact].var(axis=0, ddof=1)
    assert np.all(np.abs(sample_var - var[~exact]) < 5 * sd_var)
    assert np.any(np.abs(sample_var - 1.5 * var[~exact]) > 5 * sd_var)


def test_unbiased_in_aggregate_on_gaussian_noise() -> None:
    """The mean error over 200,000 Gaussian values is within 5 standard errors of 0."""
    noise = torch.randn(200_000, generator=torch.Generator().manual_seed(4))
    for dtype in LOWBIT_DTYPES:
        out = decode_update(
            encode_update(noise, dense_size=200_000, round=0, value_dtype=dtype, rounding=rng(5))
        )
        assert out.value_scales is not None
        step = out.value_scales[torch.arange(200_000) // DEFAULT_VALUE_BLOCK].double()
        err = (out.values.double() - noise.double()).numpy()
        if dtype == "int1":
            var = (step**2 - noise.double() ** 2).numpy()
        else:
            x = (noise.double() / step).numpy()
            p = x - np.floor(x)
            var = step.numpy() ** 2 * p * (1 - p)
        assert abs(err.sum()) < 5 * math.sqrt(var.sum())
        reach = 2 if dtype == "int1" else 1  # int1 may send v as -s: |error| = s + |v| <= 2 s
        assert np.all(np.abs(err) <= reach * step.numpy() * (1 + 2**-22))


# --- edge cases ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value_dtype", LOWBIT_DTYPES)
def test_edge_cases(value_dtype: str) -> None:
    kw: dict[str, Any] = {"round": 0, "value_dtype": value_dtype, "rounding": rng()}
    empty = encode_update(torch.zeros(0), dense_size=9, mask_seed=1, **kw)
    msg = pb.SparseUpdate.FromString(empty)
    assert msg.value_block == DEFAULT_VALUE_BLOCK and msg.values == b"" and msg.value_scales == b""
    out = decode_update(empty)
    assert out.keep == 0 and out.value_scales is not None and out.value_scales.numel() == 0
    zeros = decode_update(encode_update(torch.tensor([0.0, -0.0, 0.0]), dense_size=3, **kw))
    assert zeros.values.tolist() == [0.0] * 3 and not zeros.values.signbit().any()
    assert zeros.value_scales is not None and zeros.value_scales.tolist() == [0.0]
    one = decode_update(encode_update(torch.tensor([-3.5]), dense_size=1, **kw))
    assert one.values.tolist() == [-3.5]  # the block's maximum is on the grid (3.5 / 7 = 0.5)
    # A short last block gets its own step.
    short = decode_update(
        encode_update(torch.tensor([4.0, 1.0, 0.875]), dense_size=3, value_block=2, **kw)
    )
    assert short.value_scales is not None and short.value_scales.numel() == 2
    assert short.values[2].item() == 0.875
    # float64 input past float32 is an overflow, as for fp32.
    with pytest.raises(ValueError, match=rf"^values: max \|v\| = 1e\+300 overflows {value_dtype}"):
        encode_update(torch.tensor([1e300], dtype=torch.float64), dense_size=1, **kw)


def test_steps_never_overflow_at_the_top_of_float32() -> None:
    """``levels * step`` stays finite for every block maximum up to the float32 maximum."""
    top = [np.float32(F32_MAX)]
    for _ in range(20_000):
        top.append(np.nextafter(top[-1], np.float32(0)))
    for dtype in LOWBIT_DTYPES:
        values = torch.from_numpy(np.array(top, dtype=np.float32))
        out = decode_update(
            encode_update(
                values,
                dense_size=len(top),
                round=0,
                value_dtype=dtype,
                value_block=1,
                rounding=rng(),
            )
        )
        assert out.value_scales is not None
        with np.errstate(over="raise"):
            assert np.isfinite(np.float32(LEVELS[dtype]) * out.value_scales.numpy()).all()
        # Each value is its own block's maximum: on the grid, so it decodes exactly for int2
        # and int1, and within 2 ulps for int4 (7 * step exceeds it by < 1.75 ulp, then rounds).
        if dtype != "int4":
            assert torch.equal(out.values, values)
        else:
            assert bool(((out.values.double() / values.double() - 1).abs() <= 2**-22).all())


def test_subnormal_values_are_exact_on_the_grid() -> None:
    # max 7 * 2**-149: step 2**-149 (7 / 7 exactly), every value a multiple of it.
    v = torch.tensor([7 * TINY, -3 * TINY, TINY, 0.0])
    out = decode_update(encode_update(v, dense_size=4, round=0, value_dtype="int4", rounding=rng()))
    assert out.value_scales is not None and out.value_scales.tolist() == [TINY]
    assert torch.equal(out.values, v)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rounding": None}, r"^rounding=None: value_dtype='int4' rounds at random"),
        ({"rounding": 3}, r"^rounding=3: value_dtype='int4'"),
        ({"value_block": 0}, r"^value_block=0: expected 1 <= value_block < 4294967296"),
        ({"value_block": 2**32}, r"^value_block=4294967296"),
        ({"value_block": 0, "value_dtype": "fp32"}, r"^value_block=0"),
        ({"value_dtype": "int3"}, r"^value_dtype='int3': expected one of"),
    ],
)
def test_encoder_rejects_bad_lowbit_arguments(kwargs: dict[str, Any], match: str) -> None:
    args = {"dense_size": 2, "round": 0, "value_dtype": "int4", **kwargs}
    with pytest.raises(ValueError, match=match):
        encode_update(torch.ones(2), **args)


def test_name_tuples() -> None:
    assert LOWBIT_DTYPES == ("int4", "int2", "int1")
    assert (*VALUE_DTYPES, *LOWBIT_DTYPES) == PAYLOAD_DTYPES


def test_sparse_update_requires_blocks_iff_lowbit() -> None:
    ok: dict[str, Any] = {
        "dense_size": 4,
        "round": 0,
        "values": torch.zeros(3),
        "encoding": "seeded",
    }
    ok["mask_seed"] = 0
    SparseUpdate(value_dtype="int1", value_block=2, value_scales=torch.zeros(2), **ok)
    with pytest.raises(ValueError, match="value_block=None"):
        SparseUpdate(value_dtype="int1", **ok)
    with pytest.raises(ValueError, match="value_block=2"):
        SparseUpdate(value_dtype="fp32", value_block=2, value_scales=torch.zeros(2), **ok)
    with pytest.raises(ValueError, match=r"value_scales: torch.float32 \(3,\), expected"):
        SparseUpdate(value_dtype="int1", value_block=2, value_scales=torch.zeros(3), **ok)


def test_seeded_support_and_to_dense() -> None:
    d, keep, seed = 5000, 321, derive_seed(3, 1)
    values = torch.randn(keep, generator=torch.Generator().manual_seed(2))
    update = decode_update(
        encode_update(
            values, dense_size=d, round=1, mask_seed=seed, value_dtype="int2", rounding=rng()
        )
    )
    mask = sample_mask(d, keep=keep, seed=seed)
    dense = update.to_dense()
    assert torch.equal(dense[mask], update.values) and not bool(dense[~mask].any())


# --- the trust boundary -------------------------------------------------------------------------


def lowbit(**fields: Any) -> bytes:
    """A valid int4 message (keep=5, value_block=2: 3 steps) with ``fields`` overriding."""
    msg = pb.SparseUpdate(
        format_version=2,
        dense_size=5,
        round=1,
        index_encoding=pb.INDEX_ENCODING_DENSE,
        keep=5,
        value_dtype=pb.VALUE_DTYPE_INT4,
        values=bytes([0x17, 0x09, 0x03]),  # codes 7, 1 | -7, 0 | 3 (high nibble unused)
        value_block=2,
        value_scales=np.array([0.5, 1.0, 0.25], "<f4").tobytes(),
    )
    for name, value in fields.items():
        if value is None:
            msg.ClearField(name)
        else:
            setattr(msg, name, value)
    return msg.SerializeToString(deterministic=True)


INT2 = {"value_dtype": pb.VALUE_DTYPE_INT2, "values": bytes([0x31, 0x00])}  # 1, 0, 3=-1, 0 | 0
INT1 = {"value_dtype": pb.VALUE_DTYPE_INT1, "values": bytes([0x15])}  # 1, 0, 1, 0, 1


def test_lowbit_fixtures_decode() -> None:
    assert decode_update(lowbit()).values.tolist() == [3.5, 0.5, -7.0, 0.0, 0.75]
    assert decode_update(lowbit(**INT2)).values.tolist() == [0.5, 0.0, -1.0, 0.0, 0.0]
    assert decode_update(lowbit(**INT1)).values.tolist() == [0.5, -0.5, 1.0, -1.0, 0.25]


F4 = "<f4"
REJECTED: list[tuple[str, bytes, str]] = [
    ("version 1", lowbit(format_version=1), r"^format_version: 1, expected 2 for dense/int4/none"),
    ("no block", lowbit(value_block=None), r"^value_block: 0, expected >= 1 for int4"),
    (
        "fp32 with block",
        lowbit(
            format_version=1, value_dtype=pb.VALUE_DTYPE_FP32, values=bytes(20), value_scales=b""
        ),
        r"^value_block: 2, expected 0 \(absent\) for fp32",
    ),
    (
        "int8 with scales",
        lowbit(value_dtype=pb.VALUE_DTYPE_INT8, values=bytes(5), value_block=None, value_scale=1),
        r"^value_scales: 12 bytes, expected 0 \(absent\) for int8",
    ),
    (
        "int4 with int8 scale",
        lowbit(value_scale=1.0),
        r"^value_scale: 1.0, expected absent for int4",
    ),
    ("scales short", lowbit(value_scales=bytes(8)), r"^value_scales: 8 bytes, expected 12 \(ceil"),
    ("scales long", lowbit(value_scales=bytes(16)), r"^value_scales: 16 bytes, expected 12"),
    ("scales missing", lowbit(value_scales=b""), r"^value_scales: 0 bytes, expected 12"),
    ("block 5 scales 3", lowbit(value_block=5), r"^value_scales: 12 bytes, expected 4"),
    (
        "nan step",
        lowbit(value_scales=np.array([0.5, np.nan, 1], F4).tobytes()),
        r"^value_scales: nan at block 1, expected finite >= 0",
    ),
    (
        "inf step",
        lowbit(value_scales=np.array([np.inf, 1, 1], F4).tobytes()),
        r"^value_scales: inf at block 0",
    ),
    (
        "negative step",
        lowbit(value_scales=np.array([1, 1, -2], F4).tobytes()),
        r"^value_scales: -2.0 at block 2",
    ),
    (
        "-0.0 step",
        lowbit(value_scales=np.array([1, -0.0, 1], F4).tobytes()),
        r"^value_scales: -0.0 at block 1",
    ),
    (
        "zero step, nonzero code",
        lowbit(value_scales=np.array([1, 0, 1], F4).tobytes()),
        r"^values: code 9 at position 2 in block 1 of step 0, expected 0",
    ),
    (
        "int1 zero step, bit set",
        lowbit(**INT1, value_scales=np.array([1, 1, 0], F4).tobytes()),
        r"^values: code 1 at position 4 in block 2 of step 0",
    ),
    (
        "int4 -8",
        lowbit(values=bytes([0x17, 0x08, 0x03])),
        r"^values: -8 at position 2, expected q >= -7",
    ),
    ("int2 -2", lowbit(**{**INT2, "values": bytes([0x21, 0x00])}), r"^values: -2 at position 2"),
    (
        "int4 padding",
        lowbit(values=bytes([0x17, 0x09, 0x13])),
        r"^values: unused high bits of the last byte set \(0x13, keep=5 x 4 bits\), expected 0",
    ),
    (
        "int2 padding",
        lowbit(**{**INT2, "values": bytes([0x31, 0x40])}),
        r"^values: unused high bits",
    ),
    ("int1 padding", lowbit(**{**INT1, "values": bytes([0x35])}), r"^values: unused high bits"),
    (
        "values short",
        lowbit(values=bytes([0x17, 0x09])),
        r"^values: 2 bytes, expected 3 \(ceil\(keep=5 x 4 bits / 8\) packed int4\)",
    ),
    ("values long", lowbit(values=bytes(4)), r"^values: 4 bytes, expected 3"),
    ("int1 values long", lowbit(**{**INT1, "values": bytes(2)}), r"^values: 2 bytes, expected 1"),
    (
        "overflowing step",
        lowbit(value_scales=np.array([F32_MAX, 1, 1], F4).tobytes()),
        r"^values: 1 non-finite \(int4\), first at position 0 \(inf\)",
    ),
    (
        "zstd values size",
        lowbit(compression=pb.COMPRESSION_ZSTD, values=bytes(3)),
        r"^values: not a zstd frame",
    ),
]


@pytest.mark.parametrize(("data", "match"), [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_malformed_lowbit_payloads_are_rejected(data: bytes, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        decode_update(data)


def test_every_truncation_is_rejected() -> None:
    for fields in ({}, INT2, INT1):
        data = lowbit(**fields)
        for cut in range(len(data)):
            with pytest.raises(PayloadError):
                decode_update(data[:cut])


# --- fuzz ---------------------------------------------------------------------------------------

FIELDS = [f.name for f in pb.SparseUpdate.DESCRIPTOR.fields]


@st.composite
def mutated_lowbit(draw: st.DrawFn) -> bytes:
    """A valid low-bit payload, then one field set to anything, some bytes changed, or spliced
    with a payload of another dtype."""
    kwargs = draw(lowbit_args(max_keep=24, max_dense=300))
    kwargs["value_block"] = draw(st.integers(1, 30))
    data = encode(kwargs)
    kind = draw(st.sampled_from(("valid", "field", "bytes", "splice")))
    if kind == "field":
        msg = pb.SparseUpdate.FromString(data)
        name = draw(st.sampled_from(FIELDS))
        field = pb.SparseUpdate.DESCRIPTOR.fields_by_name[name]
        value: Any
        if field.type == field.TYPE_BYTES:
            value = draw(st.binary(max_size=40))
        elif field.type == field.TYPE_FLOAT:
            value = draw(st.floats(width=32))
        elif field.type == field.TYPE_ENUM:
            value = draw(st.integers(0, 8))
        else:
            value = draw(st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1)))
        setattr(msg, name, value)
        return msg.SerializeToString(deterministic=True)
    if kind == "bytes":
        buf = bytearray(data)
        for _ in range(draw(st.integers(1, 3))):
            if buf:
                pos = draw(st.integers(0, len(buf) - 1))
                buf[pos] ^= 1 << draw(st.integers(0, 7))
        return bytes(buf)
    if kind == "splice":
        other_dtype = draw(st.sampled_from(PAYLOAD_DTYPES))
        other = encode_update(
            kwargs["values"].clamp(-6e4, 6e4),
            dense_size=kwargs["dense_size"],
            round=kwargs["round"],
            value_dtype=other_dtype,
            encoding="auto" if "mask_seed" in kwargs or "indices" in kwargs else "dense",
            mask_seed=kwargs.get("mask_seed"),
            indices=kwargs.get("indices"),
            rounding=rng(),
        )
        return data[: draw(st.integers(0, len(data)))] + other[draw(st.integers(0, len(other))) :]
    return data


@settings(
    max_examples=1500,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(mutated_lowbit())
def test_fuzzed_lowbit_payloads_decode_or_raise_payload_error(data: bytes) -> None:
    try:
        update = decode_update(data, max_bytes=1 << 20)
    except PayloadError as exc:
        event(f"rejected: {str(exc).split(':')[0]}")
        return
    event(f"accepted {update.value_dtype}")
    assert len(data) == size_of(update, data)
    assert bool(update.values.isfinite().all())
    if update.value_dtype in LOWBIT_DTYPES:
        assert update.value_block is not None and update.value_scales is not None
        step = update.value_scales[torch.arange(update.keep) // update.value_block]
        bound = LEVELS[update.value_dtype] * step.double() * (1 + 2**-23)
        assert bool((update.values.double().abs() <= bound).all())
