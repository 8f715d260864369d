"""payload_size and friends: exact analytic sizes, header overhead, choose_encoding ("auto")."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsparse.common.masks import derive_seed, keep_count, sample_mask
from fedsparse.common.wire.payload import (
    EXPLICIT_ENCODINGS,
    choose_encoding,
    decode_update,
    encode_update,
    index_section_size,
    information_limit,
    payload_size,
)
from fedsparse.v1 import payload_pb2 as pb
from tests.common.wire.payload.helpers import (
    LOWBIT_DTYPES,
    U32,
    U64,
    V1_ENCODINGS,
    V1_VALUE_DTYPES,
    size_of,
)

BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int4": 4, "int2": 2, "int1": 1}


@settings(max_examples=400, deadline=None)
@given(
    keep=st.integers(0, 300),
    dense_size=st.integers(1, U64 - 1),
    round_=st.integers(0, U32 - 1),
    encoding=st.sampled_from(V1_ENCODINGS),
    value_dtype=st.sampled_from((*V1_VALUE_DTYPES, *LOWBIT_DTYPES)),
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
    value_dtype=st.sampled_from(V1_VALUE_DTYPES),
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


def test_information_limit_and_index_sections() -> None:
    d, keep = 550_570, keep_count(550_570, rate=0.9)
    idx = torch.nonzero(sample_mask(d, keep=keep, seed=3)).flatten()
    assert information_limit(keep=keep, value_dtype="int8") == keep
    assert index_section_size("coo", keep=keep, dense_size=d) == 4 * keep
    assert index_section_size("bitmap", keep=keep, dense_size=d) == math.ceil(d / 8)
    # Mean gap 9 < 128: one varint byte per index, except for the rare gaps >= 128.
    delta = index_section_size("delta", keep=keep, dense_size=d, indices=idx)
    assert delta == keep + int((torch.diff(idx) - 1 >= 128).sum()) + int(idx[0] >= 128)
    with pytest.raises(ValueError, match="indices: required"):
        index_section_size("delta", keep=keep, dense_size=d)


@pytest.mark.parametrize(
    ("rate", "expected"), [(0.0, "dense"), (0.5, "bitmap"), (0.9, "delta"), (0.999, "delta")]
)
def test_auto_picks_the_smallest_explicit_support(rate: float, expected: str) -> None:
    d = 550_570
    keep = keep_count(d, rate=rate)
    idx = torch.nonzero(sample_mask(d, keep=keep, seed=11)).flatten()
    values = torch.randn(keep, generator=torch.Generator().manual_seed(0))
    sizes = {
        e: len(encode_update(values, dense_size=d, round=1, indices=idx, encoding=e))
        for e in (*EXPLICIT_ENCODINGS, *(["dense"] if keep == d else []))
    }
    auto = encode_update(values, dense_size=d, round=1, indices=idx)
    assert len(auto) == min(sizes.values())
    assert decode_update(auto).encoding == expected == min(sizes, key=sizes.__getitem__)
    assert choose_encoding(keep=keep, dense_size=d, indices=idx) == expected
    # With the seed known, values-only wins whenever the support is sparse.
    seeded = choose_encoding(keep=keep, dense_size=d, mask_seed=2**63 + 5)
    assert seeded == ("dense" if keep == d else "seeded")


def test_the_memoized_choice_still_refuses_what_the_plain_one_refuses() -> None:
    """A reviewer's case: True, 1 and 1.0 hash alike; an int's cached answer must not let a
    bool or a float through."""
    assert choose_encoding(keep=1, dense_size=100, mask_seed=7) == "seeded"
    for bad in ({"keep": True}, {"keep": 1.0}, {"dense_size": 100.0}, {"mask_seed": 7.0}):
        kwargs = {"keep": 1, "dense_size": 100, "mask_seed": 7, **bad}
        with pytest.raises((TypeError, ValueError)):
            choose_encoding(**kwargs)
