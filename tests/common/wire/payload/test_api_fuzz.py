"""Fuzzes of decode_update, the trust boundary: any bytes decode or raise PayloadError.

Mutated version-1 payloads (incl. the low-bit dtypes), then at least 10,000 random and mutated
payloads of every codec: only PayloadError, no crash, no hang; what is accepted has the exact
analytic size and, uncompressed, re-encodes byte for byte.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fedsparse.common.wire.payload import (
    COMPRESSIONS,
    ENCODINGS,
    VALUE_DTYPES,
    PayloadError,
    SparseUpdate,
    decode_update,
    encode_update,
)
from fedsparse.v1 import payload_pb2 as pb
from tests.common.wire.payload.helpers import LOWBIT_DTYPES, encode, size_for, size_of, update_args

FUZZ_EXAMPLES = 10_000


# --- version 1 (and low-bit) payloads, mutated ----------------------------------------------------


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


# --- fuzz: >= 10,000 random and mutated payloads of every codec -----------------------------------


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fails the example (instead of hanging the suite) if decoding takes ``seconds``."""

    def alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"decode_update took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


FIELDS = [f.name for f in pb.SparseUpdate.DESCRIPTOR.fields]


@st.composite
def fuzz_codec_args(draw: st.DrawFn, *, max_keep: int = 24, max_dense: int = 600) -> dict[str, Any]:
    """``codec_args`` for the 10,000-case fuzz: a handful of draws instead of one per element.

    The header fields are drawn as in ``codec_args``; the values and the support come from a
    numpy generator seeded by one draw. Hypothesis's per-value and per-index draws were most of
    the fuzz's run time, and shrinking the values of a payload that is then mutated buys
    nothing. The values mix random float32 bit patterns (subnormals, huge magnitudes, -0.0),
    standard normals and exact zeros.
    """
    encoding = draw(st.sampled_from((*ENCODINGS, "auto")))
    value_dtype = draw(st.sampled_from(VALUE_DTYPES))
    if encoding == "dense":
        dense_size = keep = draw(st.integers(1, max_keep))
    else:
        dense_size = draw(st.integers(1, max_dense))
        keep = draw(st.integers(0, min(dense_size, max_keep)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bound = 1e4 if value_dtype == "fp16" else 1e30
    bits = rng.integers(0, 2**32, size=keep, dtype=np.uint32).view(np.float32)
    usable = np.isfinite(bits) & (np.abs(bits) <= bound) & (rng.random(keep) < 0.5)
    values = np.where(usable, bits, rng.standard_normal(keep).astype(np.float32))
    values[rng.random(keep) < 0.1] = 0.0
    kwargs: dict[str, Any] = {
        "values": torch.from_numpy(values),
        "dense_size": dense_size,
        "round": draw(st.integers(0, 2**32 - 1)),
        "encoding": encoding,
        "value_dtype": value_dtype,
        "compression": draw(st.sampled_from(COMPRESSIONS)),
    }
    if encoding == "seeded" or (encoding == "auto" and draw(st.booleans())):
        kwargs["mask_seed"] = draw(st.integers(0, 2**64 - 1))
    elif encoding != "dense":
        idx = np.sort(rng.choice(dense_size, size=keep, replace=False))
        kwargs["indices"] = torch.from_numpy(idx.astype(np.int64))
    return kwargs


@st.composite
def fuzz_payloads(draw: st.DrawFn) -> bytes:
    """A valid payload of any codec, then mutated (or not), or random bytes."""
    kind = draw(st.sampled_from(("valid", "bytes", "field", "splice", "random")))
    if kind == "random":
        return draw(st.binary(max_size=200))
    data = encode(draw(fuzz_codec_args()))
    if kind == "bytes":  # flip, insert, delete or truncate at a few positions
        buf = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(("flip", "insert", "delete", "truncate")))
            pos = draw(st.integers(0, max(len(buf) - 1, 0)))
            if op == "flip" and buf:
                buf[pos] ^= 1 << draw(st.integers(0, 7))
            elif op == "insert":
                buf[pos:pos] = draw(st.binary(min_size=1, max_size=4))
            elif op == "delete" and buf:
                del buf[pos]
            elif op == "truncate":
                del buf[pos:]
        return bytes(buf)
    if kind == "field":  # set one field to an arbitrary value of its type
        msg = pb.SparseUpdate.FromString(data)
        name = draw(st.sampled_from(FIELDS))
        field = pb.SparseUpdate.DESCRIPTOR.fields_by_name[name]
        if field.type == field.TYPE_BYTES:
            value: Any = draw(st.binary(max_size=64))
        elif field.type == field.TYPE_FLOAT:
            value = draw(st.floats(width=32))
        elif field.type == field.TYPE_ENUM:
            value = draw(st.integers(0, 8))
        else:
            bits = 32 if field.type == field.TYPE_UINT32 else 64
            value = draw(st.one_of(st.integers(0, 5000), st.integers(0, 2**bits - 1)))
        setattr(msg, name, value)
        return msg.SerializeToString(deterministic=draw(st.booleans()))
    if kind == "splice":  # a valid payload's head with another payload's tail
        other = encode(draw(fuzz_codec_args()))
        cut_a = draw(st.integers(0, len(data)))
        cut_b = draw(st.integers(0, len(other)))
        return data[:cut_a] + other[cut_b:]
    return data


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,  # a fixed, reproducible set of examples
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(fuzz_payloads())
def test_fuzz_decoder_returns_a_valid_update_or_raises_payload_error(data: bytes) -> None:
    try:
        with deadline(5.0):
            update = decode_update(data, max_bytes=1 << 20)
    except PayloadError as exc:
        event(f"rejected: {str(exc).split(':')[0]}")
        return
    event(f"accepted {update.encoding}/{update.value_dtype}/{update.compression}")
    assert len(data) == size_for(update, data)  # accepted payloads have the analytic size
    assert bool(update.values.isfinite().all())
    support = update.support() if update.dense_size <= 10**6 else update.indices
    if support is not None:
        assert len(support) == update.keep
        assert bool((support[1:] > support[:-1]).all()) and bool((support >= 0).all())
    if update.compression == "none":  # canonical: re-encoding gives the same bytes
        kwargs: dict[str, Any] = {
            "values": update.values,
            "dense_size": update.dense_size,
            "round": update.round,
            "encoding": update.encoding,
            "value_dtype": update.value_dtype,
        }
        if update.mask_seed is not None:
            kwargs["mask_seed"] = update.mask_seed
        if update.indices is not None:
            kwargs["indices"] = update.indices
        if update.value_dtype != "int8" or update.value_scale == _encoder_scale(update):
            assert encode(kwargs) == data


def _encoder_scale(update: SparseUpdate) -> float:
    """The scale our encoder would pick for the decoded int8 values (peers may pick others)."""
    if update.keep == 0:
        return 0.0
    return float(np.float32(np.float32(update.values.abs().max()) / np.float32(127)))
