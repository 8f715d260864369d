"""``robust.quantized_norm`` for the low-bit dtypes: it bounds every decoded norm, for any
rounding draw, and is tight where the codec attains it (so an honest update is never
rejected, and the bound is not looser than it needs to be)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsparse.common.aggregation.norm_bounds import HonestClientBound
from fedsparse.common.aggregation.quantized_norms import LOWBIT_SLACK, quantized_norm
from fedsparse.common.aggregation.robust import l2_norm
from fedsparse.common.wire.payload import decode_update, encode_update

F32_MAX = float(np.finfo(np.float32).max)


def _decoded(values: torch.Tensor, value_dtype: str, block: int, seed: int) -> torch.Tensor:
    raw = encode_update(
        values,
        dense_size=values.numel(),
        round=1,
        value_dtype=value_dtype,  # type: ignore[arg-type]
        value_block=block,
        rounding=np.random.default_rng(seed),
    )
    return decode_update(raw).values


def _cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    spike = torch.zeros(1000)
    spike[17] = 3.0
    tiny = torch.full((700,), 1e-3)
    tiny[0] = 1.0
    return [
        torch.randn(5000, generator=gen),
        torch.randn(777, generator=gen) * 1e-30,
        torch.randn(300, generator=gen) * 1e37,
        spike,  # int1: every zero goes out as +-m
        tiny,  # int4: the small values round up to one step m / 7
        torch.tensor([F32_MAX, -F32_MAX, 1.0]),
        torch.tensor([0.25]),
        torch.zeros(10),
    ]


@pytest.mark.parametrize("value_dtype", ["int4", "int2", "int1"])
@pytest.mark.parametrize("block", [1, 7, 64, 256, 100_000])
def test_quantized_norm_bounds_every_decoded_norm(value_dtype: str, block: int) -> None:
    for values in _cases():
        norm, keep = l2_norm(values), values.numel()
        bound = quantized_norm(norm, value_dtype=value_dtype, keep=keep, block=block)  # type: ignore[arg-type]
        assert bound <= quantized_norm(norm, value_dtype=value_dtype, keep=keep)  # type: ignore[arg-type]
        for seed in range(5):
            assert l2_norm(_decoded(values, value_dtype, block, seed)) <= bound


@pytest.mark.parametrize("value_dtype", ["int2", "int1"])
def test_the_sign_bound_is_attained(value_dtype: str) -> None:
    """``norm sqrt(keep)`` is reached: int1 sends a spike of 3 among 999 zeros as 1000 values
    of +-3; int2 only with every value at +-m already (its rounding is then exact)."""
    if value_dtype == "int1":
        values = torch.zeros(1000)
        values[17] = 3.0
    else:
        values = torch.full((1000,), 3.0) * (-1) ** torch.arange(1000)
    bound = quantized_norm(l2_norm(values), value_dtype=value_dtype, keep=1000)  # type: ignore[arg-type]
    reached = 3.0 * math.sqrt(1000)
    assert l2_norm(_decoded(values, value_dtype, 1000, 0)) == pytest.approx(reached, rel=1e-12)
    if value_dtype == "int1":
        assert bound == pytest.approx(reached * (1 + LOWBIT_SLACK), rel=1e-12)


def test_the_block_bound_is_attained() -> None:
    """``norm sqrt(B)``: int1 sends one spike per block of 64 among zeros as 64 values of
    +-the spike each (block norm sqrt(64) times the spike's)."""
    values = torch.zeros(64 * 20)
    values[::64] = torch.linspace(1.0, 3.0, 20)
    bound = quantized_norm(l2_norm(values), value_dtype="int1", keep=values.numel(), block=64)
    reached = 8.0 * l2_norm(values)
    assert l2_norm(_decoded(values, "int1", 64, 0)) == pytest.approx(reached, rel=1e-6)
    assert bound == pytest.approx(reached * (1 + LOWBIT_SLACK), rel=1e-6)
    # a block larger than the payload: the payload is the block
    assert quantized_norm(1.0, value_dtype="int1", keep=9, block=64) == 3 * (1 + LOWBIT_SLACK)


def test_int4_is_tighter_than_the_sign_and_both_grow_with_keep() -> None:
    for keep in (1, 2, 49, 10_000):
        int4 = quantized_norm(1.0, value_dtype="int4", keep=keep)
        sign = quantized_norm(1.0, value_dtype="int1", keep=keep)
        assert int4 == pytest.approx(
            min(1 + math.sqrt(keep) / 7, math.sqrt(keep)) * (1 + LOWBIT_SLACK)
        )
        assert int4 <= sign
        assert quantized_norm(1.0, value_dtype="int2", keep=keep) == sign
    assert quantized_norm(1.0, value_dtype="int4", keep=1) == 1 + LOWBIT_SLACK  # |q| <= 7: 7 s = m


def test_an_unknown_dtype_is_named() -> None:
    with pytest.raises(ValueError, match=r"value_dtype='int3': expected one of fp32, .*, int1$"):
        quantized_norm(1.0, value_dtype="int3", keep=1)  # type: ignore[arg-type]


def test_the_honest_bound_quantizes_the_values_sent() -> None:
    caps = HonestClientBound(
        lr=0.25,
        momentum=0.0,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        batch_size=32,
        local_epochs=1,
        max_examples=1437,
        value_dtype="int1",
    )
    blocked = HonestClientBound(**{**caps.__dict__, "value_block": 64})
    assert blocked.bound(100) == quantized_norm(
        HonestClientBound(**{**caps.__dict__, "value_dtype": "fp32"}).bound(100),
        value_dtype="int1",
        keep=100,
        block=64,
    )
    assert blocked.bound(100) < caps.bound(100)
    fp32 = HonestClientBound(**{**caps.__dict__, "value_dtype": "fp32"})
    raw = fp32.bound(100)
    assert caps.bound(100) == quantized_norm(raw, value_dtype="int1", keep=100)
    assert caps.bound(100, sent=100) == caps.bound(100)
    # gip and random-k send a union of supports: quantized at its size, not the step's keep
    assert caps.bound(100, sent=10_000) == quantized_norm(raw, value_dtype="int1", keep=10_000)
    assert fp32.bound(100, sent=10_000) == raw
    # which clients the bound covers does not depend on how the values travel
    assert caps.smallest_covered_examples(100) == fp32.smallest_covered_examples(100)
