"""Blocked low-bit value codecs with unbiased stochastic rounding: ``int4``, ``int2``, ``int1``.

The values are cut into blocks of ``block`` consecutive values (the last one shorter when
``block`` does not divide their number). Each block ``j`` gets one float32 step ``s_j`` from
its largest magnitude ``m_j = max |v|``, and each value is rounded at random to one of the two
neighbouring multiples of its block's step, with the probabilities that make the rounding
unbiased: with ``x = v / s`` and ``l = floor(x)``, the code is ``q = l + 1`` with probability
``x - l`` and ``q = l`` otherwise, so ``E[q s] = v``. The variance is ``s^2 p (1 - p)`` with
``p = x - l``: at most ``s^2 / 4`` per value, 0 for a value on the grid.

- ``"int4"``: ``q`` in ``[-7, 7]``, step ``s >= m / 7`` (the smallest float32 that keeps
  ``|x| <= 7``): 15 levels, variance at most ``m^2 / 196``. Stochastic rounding onto uniform
  levels scaled per bucket is QSGD's quantizer (Alistarh et al. 2017, "QSGD:
  Communication-Efficient SGD via Gradient Quantization and Encoding", arXiv:1610.02132)
  with the bucket's max-norm in place of its 2-norm, which lowers the variance; stochastic
  rounding itself: Gupta et al. 2015, "Deep Learning with Limited Numerical Precision",
  arXiv:1502.02551.
- ``"int2"``: ``q`` in ``{-1, 0, 1}``, ``s = m``: ternary, ``P(q = sign(v)) = |v| / m``,
  variance ``|v| (m - |v|) <= m^2 / 4``. This is TernGrad (Wen et al. 2017, "TernGrad:
  Ternary Gradients to Reduce Communication in Distributed Deep Learning", arXiv:1705.07878)
  with one scale per block; the fourth 2-bit code is unused (rejected).
- ``"int1"``: the stochastic sign, value ``s b`` with ``b`` in ``{-1, +1}``, ``s = m``,
  ``P(b = +1) = (1 + v / m) / 2``; variance ``m^2 - v^2`` (``m^2`` for ``v = 0``: with no
  zero level, a zero is sent as ``+-m``). This is the stochastic sign compressor of Jin et al.
  2020, "Stochastic-Sign SGD for Federated Learning with Theoretical Guarantees",
  arXiv:2002.10940; its deterministic, biased form is signSGD (Bernstein et al. 2018,
  "signSGD: Compressed Optimisation for Non-Convex Problems", arXiv:1802.04434).

A block whose values are all zero has step 0 and every code 0 (decoded +0.0). Decoding
computes ``q * s`` in float32: unbiased up to that product's rounding (relative ``2^-24``;
exact for int2/int1 and for ``|q|`` a power of two), far below the rounding's own standard
deviation.

Why a block of 256 by default (``schema.DEFAULT_VALUE_BLOCK``): the float32 steps cost
``32 / block`` bits per value, 0.125 at 256 (1.125 bits per value for int1, 4.125 for int4).
Smaller blocks track the magnitudes better but pay more for steps (int1 at 64: 1.5 bits);
larger ones save little (1.03 bits at 1024) while the step, the maximum of the block, grows:
for Gaussian values (a DP update is mostly its Gaussian noise) ``E[max |v|]`` is about
``2.6 sigma`` over 64 values, ``3.05 sigma`` over 256 and ``3.4 sigma`` over 1024, and every
scheme's variance scales with the step squared (int1's variance per value,
``E[m^2] - sigma^2``, is about 6.0, 8.4 and 10.9 sigma^2). ``benchmarks/codecs.py`` prints
the measured trade-off (int1 at 64 / 256 / 1024: 1.51 / 1.13 / 1.04 bits per value, rms error
2.43 / 2.90 / 3.37 sd). QSGD used buckets of 512.

Randomness: ``quantize_blocks`` draws one uniform per value from the ``numpy.random.Generator``
it is given and from nothing else (no global RNG). The rounding is applied to the already
noised update, so it is post-processing (no privacy cost) whatever its randomness; its only
requirements are independence from the values (for unbiasedness) and independence between
clients (so that the rounding errors average out in the sum). A deployed node passes
``numpy.random.default_rng()`` (seeded from OS entropy), a simulation a stream seeded from the
run's seed registry, which makes the bytes reproducible.

Wire layout (``payload.proto``): codes packed least significant first, ``8 / bits`` per byte,
``ceil(keep * bits / 8)`` bytes with the unused high bits of the last byte zero; int4/int2
codes in two's complement (the most negative pattern rejected), int1 bit 1 for ``+1``; the
steps as ``ceil(keep / block)`` little-endian float32, finite and ``>= 0``.
"""

from __future__ import annotations

import numpy as np

from fedsparse.common.wire.payload.schema import LowBitDType, PayloadError, first_bad

__all__ = [
    "BITS",
    "LEVELS",
    "dequantize_blocks",
    "pack_codes",
    "per_value",
    "quantize_blocks",
    "unpack_codes",
]

BITS: dict[LowBitDType, int] = {"int4": 4, "int2": 2, "int1": 1}
LEVELS: dict[LowBitDType, int] = {"int4": 7, "int2": 1, "int1": 1}
"""The largest code magnitude: the step is at least ``max |v| / LEVELS``."""


def quantize_blocks(
    values: np.ndarray, value_dtype: LowBitDType, *, block: int, generator: np.random.Generator
) -> tuple[bytes, bytes]:
    """(packed codes, float32 steps) of finite float32 ``values``; see the module docstring.

    Draws exactly ``len(values)`` uniforms from ``generator`` (none when there are no values).
    Every finite float32 block maximum gets a step whose ``levels * step`` is a finite float32
    (for int4 the excess ``7 s - m`` stays below half an ulp of the float32 maximum; the
    tests check the top of the range exhaustively), so decoded values are always finite.
    """
    keep = values.size
    if keep == 0:
        return b"", b""
    v = values.astype(np.float64)
    starts = np.arange(0, keep, block, dtype=np.int64)
    steps = _steps(np.maximum.reduceat(np.abs(values), starts), LEVELS[value_dtype])
    step = per_value(steps, keep, block).astype(np.float64)
    nonzero = step > 0
    x = np.divide(v, step, out=np.zeros(keep), where=nonzero)
    u = generator.random(keep)
    if value_dtype == "int1":  # P(b = +1) = (1 + x) / 2; code 1 is +1
        codes = ((u < (1 + x) / 2) & nonzero).astype(np.uint8)
    else:
        low = np.floor(x)
        q = (low + (u < x - low)).astype(np.int8)
        codes = q.view(np.uint8) & np.uint8((1 << BITS[value_dtype]) - 1)
    return pack_codes(codes, BITS[value_dtype]), steps.astype("<f4").tobytes()


def _steps(max_abs: np.ndarray, levels: int) -> np.ndarray:
    """The smallest float32 ``s`` with ``levels * s >= m`` for each block maximum ``m``."""
    m = max_abs.astype(np.float64)
    steps = (m / levels).astype(np.float32)  # within one float32 ulp of m / levels
    low = steps.astype(np.float64) * levels < m  # exact: 24 + 3 bits fit a float64
    steps[low] = np.nextafter(steps[low], np.float32(np.inf))
    return steps


def per_value(steps: np.ndarray, keep: int, block: int) -> np.ndarray:
    """Each of the ``keep`` values' block step (``keep`` entries, no index array)."""
    counts = np.full(steps.size, block, dtype=np.int64)
    if steps.size:
        counts[-1] = keep - block * (steps.size - 1)
    return np.repeat(steps, counts)


def pack_codes(codes: np.ndarray, bits: int) -> bytes:
    """``bits``-bit codes (uint8, high bits clear) packed least significant first."""
    per = 8 // bits
    padded = np.zeros(-(-codes.size // per) * per, dtype=np.uint8)
    padded[: codes.size] = codes
    grid = padded.reshape(-1, per)
    out = np.zeros(grid.shape[0], dtype=np.uint8)
    for j in range(per):
        out |= grid[:, j] << np.uint8(bits * j)
    return out.tobytes()


def unpack_codes(raw: bytes, bits: int, keep: int) -> np.ndarray:
    """The first ``keep`` codes of ``raw`` (``ceil(keep * bits / 8)`` bytes, checked by the
    caller); PayloadError if any unused bit of the last byte is set."""
    per = 8 // bits
    b = np.frombuffer(raw, dtype=np.uint8)
    grid = np.empty((b.size, per), dtype=np.uint8)
    for j in range(per):
        grid[:, j] = (b >> np.uint8(bits * j)) & np.uint8((1 << bits) - 1)
    codes = grid.reshape(-1)
    if codes[keep:].any():
        raise PayloadError(
            f"values: unused high bits of the last byte set (0x{int(b[-1]):02x}, keep={keep} "
            f"x {bits} bits), expected 0"
        )
    return codes[:keep]


def dequantize_blocks(
    raw: bytes, raw_steps: bytes, value_dtype: LowBitDType, *, keep: int, block: int
) -> tuple[np.ndarray, np.ndarray]:
    """(float32 values, float32 steps) of a validated section pair, or PayloadError.

    The caller has checked the byte counts (``ceil(keep * bits / 8)`` and ``4 * ceil(keep /
    block)``); this checks the steps (finite, ``>= 0``, not -0.0), the padding bits, the codes
    (no most negative pattern; all 0 in a block of step 0) and that every value is finite.
    """
    steps = np.frombuffer(raw_steps, dtype="<f4").astype(np.float32)
    bad = ~np.isfinite(steps) | np.signbit(steps)
    if bad.any():
        i = first_bad(bad)
        raise PayloadError(f"value_scales: {float(steps[i])} at block {i}, expected finite >= 0")
    bits = BITS[value_dtype]
    codes = unpack_codes(raw, bits, keep)
    step = per_value(steps, keep, block)
    stray = (codes != 0) & (step == 0)
    if stray.any():
        i = first_bad(stray)
        raise PayloadError(
            f"values: code {int(codes[i])} at position {i} in block {i // block} of step 0, "
            "expected 0"
        )
    if value_dtype == "int1":
        q = codes.astype(np.float32) * 2 - 1
    else:
        sign = np.uint8(1 << (bits - 1))
        if (codes == sign).any():
            i = first_bad(codes == sign)
            raise PayloadError(
                f"values: {-int(sign)} at position {i}, expected q >= {-int(sign) + 1} "
                f"({value_dtype})"
            )
        q = codes.astype(np.float32) - np.where(codes & sign, np.float32(1 << bits), 0)
    with np.errstate(over="ignore"):  # a hostile step may overflow: rejected below
        wide = (q * step + np.float32(0)).astype(np.float32)  # + 0: -1 * 0.0 is +0.0
    if not np.isfinite(wide).all():
        i = first_bad(~np.isfinite(wide))
        raise PayloadError(
            f"values: {int((~np.isfinite(wide)).sum())} non-finite ({value_dtype}), first at "
            f"position {i} ({float(wide[i])})"
        )
    return wide, steps
