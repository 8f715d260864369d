"""Value codecs: float tensors to little-endian fp32/fp16/bf16/int8 bytes and back.

The float casts are torch's round-to-nearest-even; a value that overflows the wire dtype is an
error, never a silent infinity. ``"int8"`` is symmetric quantization with one float32 scale per
update (``quantize_int8``). Decoding widens to float32 and rejects anything non-finite. The
blocked low-bit dtypes (int4/int2/int1) are in ``lowbit``; ``check_values`` serves both.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsparse.common.finite import all_finite
from fedsparse.common.wire.payload.schema import PayloadDType, PayloadError, ValueDType, first_bad

__all__ = [
    "DTYPE_BITS",
    "DTYPE_BYTES",
    "check_values",
    "quantize_int8",
    "value_section_size",
    "values_from_bytes",
    "values_to_bytes",
]

DTYPE_BYTES: dict[ValueDType, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
DTYPE_BITS: dict[PayloadDType, int] = {
    **{name: 8 * n for name, n in DTYPE_BYTES.items()},
    "int4": 4,
    "int2": 2,
    "int1": 1,
}


def value_section_size(keep: int, value_dtype: PayloadDType) -> int:
    """Bytes of ``keep`` values in ``value_dtype``, packed: ``ceil(keep * bits / 8)``."""
    return -(-keep * DTYPE_BITS[value_dtype] // 8)


_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def values_to_bytes(values: torch.Tensor, value_dtype: ValueDType) -> tuple[bytes, float | None]:
    """(little-endian bytes in ``value_dtype``, int8 scale or None); checks finiteness.

    Raises:
        ValueError: if ``values`` is not a 1-D float tensor, has a non-finite entry, or has one
            that overflows ``value_dtype`` (e.g. ``|v| > 65504`` for fp16).
    """
    values = check_values(values)
    if value_dtype == "int8":
        return quantize_int8(values.to(torch.float32).numpy())
    cast = values.to(_TORCH_DTYPES[value_dtype]).contiguous()
    if cast.dtype != values.dtype and not all_finite(cast):  # the same dtype: checked above
        max_abs = float(values.abs().max())
        limit = float(torch.finfo(cast.dtype).max)
        raise ValueError(
            f"values: max |v| = {max_abs:.6g} overflows {value_dtype} (max {limit:.6g})"
        )
    if value_dtype == "bf16":  # numpy has no bfloat16: ship the raw 16-bit patterns
        return cast.view(torch.int16).numpy().astype("<i2", copy=False).tobytes(), None
    fmt = "<f4" if value_dtype == "fp32" else "<f2"
    return cast.numpy().astype(fmt, copy=False).tobytes(), None


def check_values(values: torch.Tensor) -> torch.Tensor:
    """``values`` detached on the CPU if it is a 1-D float tensor of finite values.

    Raises:
        ValueError: naming the shape and dtype, or the count and first non-finite entry.
    """
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or not values.is_floating_point():
        shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(
            f"values: {getattr(values, 'dtype', '')} {shape}, expected a 1-D float tensor"
        )
    values = values.detach().cpu()
    if not all_finite(values):
        bad = (~torch.isfinite(values)).numpy()
        raise ValueError(
            f"values: {int(bad.sum())} non-finite, first at position {first_bad(bad)} "
            f"({float(values[first_bad(bad)])})"
        )
    return values


def quantize_int8(values: np.ndarray) -> tuple[bytes, float]:
    """Symmetric int8: scale ``max|v| / 127`` in float32, q = round-half-even(v / scale).

    Edge cases: no values or all zeros give scale 0 and q = 0. When ``max|v|`` is a nonzero
    subnormal below ``127 * 2**-149``, ``max|v| / 127`` underflows to 0 and the scale is the
    smallest subnormal ``2**-149`` instead: every such value is an exact multiple of it, so
    q = v / 2**-149 (|q| <= 126) and the round trip is exact.

    Two roundings are corrected so that the error stays <= scale/2 and the decoder accepts
    every payload: a subnormal scale that rounds down so far that ``max|v| / scale > 127.5``
    is stepped up, and a scale whose ``127 * scale`` overflows float32 (``max|v|`` at the
    float32 maximum) is stepped down.
    """
    max_abs = np.float32(np.abs(values).max()) if values.size else np.float32(0)
    scale = np.float32(max_abs / np.float32(127))
    if scale == 0 and max_abs > 0:  # max|v| below 127 * the smallest subnormal
        scale = np.nextafter(np.float32(0), np.float32(1))
    if scale == 0:
        return np.zeros(values.size, dtype=np.int8).tobytes(), 0.0
    while float(max_abs) / float(scale) > 127.5:  # coarse subnormal scales: a few steps
        scale = np.nextafter(scale, np.float32(np.inf))
    with np.errstate(over="ignore"):
        while not np.isfinite(np.float32(127) * scale):
            scale = np.nextafter(scale, np.float32(0))
    if scale == 0:
        return np.zeros(values.size, dtype=np.int8).tobytes(), 0.0
    with np.errstate(over="ignore"):
        q = np.clip(np.rint(values / scale), -127, 127).astype(np.int8)
    return q.tobytes(), float(scale)


def values_from_bytes(raw: bytes, value_dtype: ValueDType, scale: float | None) -> torch.Tensor:
    """Little-endian ``value_dtype`` bytes widened to a finite float32 tensor.

    ``raw`` must hold a whole number of values and ``scale`` is the validated int8 scale (None
    for the float dtypes). Raises PayloadError on int8 -128, nonzero q with scale 0, or a
    non-finite value.
    """
    if value_dtype == "int8":
        q = np.frombuffer(raw, dtype=np.int8)
        if (q == -128).any():
            raise PayloadError(
                f"values: -128 at position {first_bad(q == -128)}, expected q >= -127"
            )
        assert scale is not None  # schema.check_scale
        if scale == 0 and q.any():
            raise PayloadError(f"values: {int(np.count_nonzero(q))} nonzero q with value_scale 0")
        with np.errstate(over="ignore"):  # a hostile scale may overflow: rejected below
            wide = q.astype(np.float32) * np.float32(scale)
    elif value_dtype == "bf16":  # bf16 is the top half of a binary32
        wide = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        fmt = "<f4" if value_dtype == "fp32" else "<f2"
        wide = np.frombuffer(raw, dtype=fmt).astype(np.float32)
    bad = ~np.isfinite(wide)
    if bad.any():
        first = first_bad(bad)
        raise PayloadError(
            f"values: {int(bad.sum())} non-finite ({value_dtype}), first at position {first} "
            f"({float(wide[first])})"
        )
    return torch.from_numpy(np.ascontiguousarray(wide))
