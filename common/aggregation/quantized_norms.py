"""How far a value dtype's rounding can grow an update's norm, with and without error feedback
(plain functions over public parameters, no Flower): the server's DP-derived update bound
(``norm_bounds.HonestClientBound``) applies them to the norm an honest client's values can have.

``quantized_norm``: fp16/bf16 round each value to nearest, growing a norm by at most their unit
roundoff (plus ``sqrt(k) 2^-25`` for fp16 subnormals); int8's symmetric quantization moves each
value by at most half its scale, ``max|v| / 254 <= ||v|| / 254``. The stochastically rounded low-bit
dtypes (``payload.lowbit``) move a value by less than its block's step, or send it as at most its
block's largest magnitude ``m_j``; since a block holds ``B <= min(value-block, k)`` values and the
``m_j`` are distinct values, ``sum_j m_j^2 <= ||v||^2``, which gives ``||v|| (1 + sqrt(B) / 7)``
for int4 and ``||v|| sqrt(B)`` for int2 and int1. These hold for every draw of the rounding, not
just with high probability.

``feedback_norm``: error feedback sends ``Q(v + e)``, ``e`` the rounding error the client carried
over from the rounds that last kept each coordinate. If ``|Q(x)_i - x_i| <= c max|x| + a`` (``c <
1``: ``feedback_contraction``) and every round's values stay under ``V`` (``||v||_inf <= ||v|| <=
V``: the bound of a round keeping every coordinate, the largest), then ``max|e| <= E = (c V + a) /
(1 - c)``, by induction: ``max|x| <= V + E``, so the new error is at most ``c (V + E) + a = E``. The
sent norm is then at most ``quantized_norm(||v|| + sqrt(k) E)``: int4 ``c = 1/7`` (``E = V / 6``),
int8 ``1/254``, fp16/bf16 their unit roundoff; int2 (``c = 1``) and int1 have none. The ``sqrt(k)
E`` term makes int4's bound loose (tens of times the fp32 bound on digits): it still bounds an
update, and ``max-update-norm`` or ``max-norm-ratio`` bound tighter.
"""

from __future__ import annotations

import math

from fedsparse.common.names import PayloadDType
from fedsparse.common.wire.value_formats import LOWBIT_SLACK, value_format

__all__ = ["LOWBIT_SLACK", "feedback_contraction", "feedback_norm", "quantized_norm"]


def quantized_norm(norm: float, *, value_dtype: PayloadDType, keep: int, block: int = 0) -> float:
    """An upper bound on the norm of ``keep`` values of L2 norm ``norm`` once in ``value_dtype``.

    fp16/bf16 round each value to nearest: ``(1 + u) norm`` (``u``: 2^-11, 2^-8), plus ``sqrt(keep)
    2^-25`` for fp16's subnormals. int8 (``payload.values.quantize_int8``) moves each value by at
    most half its scale ``max|v| / 127 <= norm / 127``: ``norm (1 + sqrt(keep) / 254)``. The low-bit
    dtypes (``payload.lowbit``, blocks of ``block`` values, 0: one block), for any rounding draw:
    int4 moves each value by less than its block's step ``s_j``, the smallest float32 with ``7 s_j
    >= m_j`` (``m_j`` the block's largest magnitude), and never above ``7 s_j``; int2 and int1 send
    ``q m_j`` with ``|q| <= 1``. A block holds at most ``B = min(block, keep)`` values and the
    ``m_j`` are distinct values, so ``sum_j m_j^2 <= norm^2``: the change is at most ``sqrt(B) norm
    / 7`` (int4), the values at most ``sqrt(B) norm``, so ``norm min(1 + sqrt(B) / 7, sqrt(B))`` and
    ``norm sqrt(B)``. Those bounds are widened by ``LOWBIT_SLACK`` (relative), which covers the
    step's ulp above ``m_j / 7`` and the float32 product ``q s_j``.
    """
    return value_format(value_dtype).grown_norm(norm, keep=keep, block=block)


def feedback_contraction(value_dtype: PayloadDType) -> tuple[float, float] | None:
    """``(c, a)`` with ``|Q(x)_i - x_i| <= c max|x| + a`` for every value ``x_i`` of a payload
    (``max`` over its block, or the payload for int8), in ``value_dtype``; None where ``c >=
    1``. Error feedback carries that error to the next round, so a residual stays under
    ``(c V + a) / (1 - c)`` when every round's values stay under ``V`` (module docstring).

    int4: a step ``<= m / 7`` (one float32 ulp more at most), stochastic rounding moves a value
    by less than it; int8: half of the scale ``max / 127``, plus a subnormal scale's 2^-149;
    fp16/bf16: to nearest, relative 2^-11 / 2^-8 (``|x_i| <= max``), their subnormals 2^-25 /
    2^-133; fp32: exact. int2 and int1 move a value by up to its block's largest: no contraction.
    """
    return value_format(value_dtype).contraction()


def feedback_norm(
    norm: float, *, peak: float, value_dtype: PayloadDType, keep: int, block: int = 0
) -> float:
    """An upper bound on the norm of ``Q(v + e)`` under error feedback: ``keep`` values ``v``
    of L2 norm ``<= norm``, the residual ``e`` of rounds whose values all stayed under
    ``peak`` in L2 norm (so in each value): ``quantized_norm(norm + sqrt(keep) E)``, ``E = (c
    peak + a) / (1 - c)`` (``feedback_contraction``; module docstring).

    Raises:
        ValueError: ``value_dtype``'s error does not contract (int2, int1).
    """
    contraction = feedback_contraction(value_dtype)
    if contraction is None:
        raise ValueError(f"value_dtype={value_dtype!r}: its error does not contract when fed back")
    c, a = contraction
    residual = (c * peak + a) / (1 - c)
    grown = norm + math.sqrt(keep) * residual
    return quantized_norm(grown, value_dtype=value_dtype, keep=keep, block=block)
