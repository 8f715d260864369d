"""The value codecs (fp32, fp16, bf16, int8): rounding, int8's error bound, decoder checks.

The low-bit dtypes (int4, int2, int1) are tested in test_lowbit.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsparse.common.wire.payload import PayloadError, decode_update, encode_update
from tests.common.wire.payload.helpers import F32_MAX, message, serialize, v2


def test_bf16_and_fp16_round_to_nearest_even() -> None:
    # 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one (1).
    # 1 + 3*2^-8 ties between 1 + 2^-7 and 1 + 2^-6 and goes up; 1 + 2^-11 is an fp16 tie.
    v = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 65504.0, -6e-8])
    bf = decode_update(encode_update(v, dense_size=5, round=0, value_dtype="bf16")).values
    assert bf[:2].tolist() == [1.0, 1 + 2**-6]
    half = decode_update(encode_update(v, dense_size=5, round=0, value_dtype="fp16")).values
    assert half[2:4].tolist() == [1.0, 65504.0]
    assert half[4].item() == -(2**-24)  # the smallest fp16 subnormal, sign kept


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


def test_int8_edge_cases() -> None:
    zeros = decode_update(encode_update(torch.zeros(5), dense_size=5, round=0, value_dtype="int8"))
    assert zeros.value_scale == 0.0 and zeros.values.tolist() == [0.0] * 5
    empty = decode_update(
        encode_update(torch.zeros(0), dense_size=9, round=0, mask_seed=1, value_dtype="int8")
    )
    assert empty.keep == 0 and empty.value_scale == 0.0
    tiny = torch.tensor([1e-44, -1e-45, 0.0])  # subnormals: the scale must not underflow to 0
    out = decode_update(encode_update(tiny, dense_size=3, round=0, value_dtype="int8"))
    assert out.value_scale is not None and out.value_scale > 0
    assert float((out.values - tiny).abs().max()) <= out.value_scale
    big = torch.tensor([3e38, -3e38, 1.0])
    assert (
        decode_update(encode_update(big, dense_size=3, round=0, value_dtype="int8"))
        .values.isfinite()
        .all()
    )


@pytest.mark.parametrize(
    "max_abs",
    [
        # max|v| / 127 rounds DOWN to a coarse subnormal scale (150 / 127 -> 1 * 2**-149): the
        # encoder steps the scale up, else q = 150 would clip to 127 (error 23 scales).
        150 * 2.0**-149,
        1.1827e-41,  # found by a random run: same rounding, a coarser subnormal
        # float32(F32_MAX / 127) * 127 rounds past F32_MAX: the encoder steps the scale down,
        # else the decoded maximum would be inf (which decode_update rejects).
        F32_MAX,
        -F32_MAX,
    ],
)
def test_int8_documented_error_bound_at_the_float32_extremes(max_abs: float) -> None:
    values = torch.tensor([max_abs, -max_abs / 3])
    out = decode_update(encode_update(values, dense_size=2, round=0, value_dtype="int8"))
    assert out.value_scale is not None
    assert float((out.values.double() - values.double()).abs().max()) <= out.value_scale / 2


def test_int8_quantization_error_is_unbiased_in_aggregate() -> None:
    """Round-to-nearest errors are within s/2 and average out over many noisy coordinates."""
    noise = torch.randn(200_000, generator=torch.Generator().manual_seed(4))
    out = decode_update(encode_update(noise, dense_size=200_000, round=0, value_dtype="int8"))
    err = (out.values - noise).double()
    scale = out.value_scale
    assert scale is not None and float(err.abs().max()) <= scale / 2 * (1 + 1e-6)
    # Uniform(-s/2, s/2) errors: sd s/sqrt(12); the mean of n is within 5 standard errors of 0.
    assert abs(float(err.mean())) < 5 * scale / math.sqrt(12) / math.sqrt(len(noise))


# --- the decoder's checks of int8 values ----------------------------------------------------------


REJECTED: list[tuple[str, bytes, str]] = [
    ("int8 -128", v2(values=bytes([1, 0x80, 2])), r"^values: -128 at position 1"),
    ("int8 zero scale", v2(value_scale=0.0), r"^values: 3 nonzero q with value_scale 0"),
]


@pytest.mark.parametrize(("data", "match"), [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_malformed_version_2_payloads_are_rejected(data: bytes, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        decode_update(data)
