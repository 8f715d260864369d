"""What each value dtype does to an update's values: the one place their names are compared.

A ``ValueFormat`` answers, for its dtype, how far its rounding can grow an update's L2 norm
(``grown_norm``) and how its rounding error contracts when fed back (``contraction``); the
derivations are ``common/aggregation/quantized_norms.py``'s, which applies them. The codec's
encodings are chosen here too (``wire_encoding``, ``explicit_encoding``), so that nothing
outside ``common/wire/`` compares a codec's or a dtype's name (``tests/test_layout.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Final

from fedsparse.common.names import (
    CODECS,
    LOWBIT_DTYPES,
    PAYLOAD_DTYPES,
    CodecName,
    PayloadDType,
)

if TYPE_CHECKING:  # the payload package loads torch; this module stays light (config checks)
    from fedsparse.common.wire.payload.api import IndexEncoding

__all__ = [
    "LOWBIT_SLACK",
    "VALUE_FORMATS",
    "ValueFormat",
    "explicit_encoding",
    "is_exact",
    "value_format",
    "wire_encoding",
]

#: The low-bit bounds' relative widening: one float32 ulp of the int4 step (2^-23), the
#: float32 product ``q s`` (2^-24), and the server's own float32 norm, with room to spare.
LOWBIT_SLACK: Final = 2.0**-16


@dataclasses.dataclass(frozen=True)
class ValueFormat:
    """A value dtype's rounding, as bounds over public parameters.

    Attributes:
        name: the run config's ``value-dtype``.
        relative: round-to-nearest floats: the unit roundoff (fp32: 0).
        subnormal: round-to-nearest floats: the absolute error of a subnormal.
        kind: ``float`` (fp32, fp16, bf16), ``int8`` (one symmetric scale a payload) or
            ``lowbit`` (int4/int2/int1: stochastic rounding in blocks).
    """

    name: PayloadDType
    kind: str
    relative: float = 0.0
    subnormal: float = 0.0

    @property
    def exact(self) -> bool:
        """Every float32 value travels unchanged (fp32)."""
        return self.kind == "float" and self.relative == 0.0

    @property
    def lowbit(self) -> bool:
        """Stochastically rounded in blocks (``payload/lowbit.py``)."""
        return self.kind == "lowbit"

    def grown_norm(self, norm: float, *, keep: int, block: int = 0) -> float:
        """An upper bound on the norm of ``keep`` values of L2 norm ``norm`` once in this
        dtype (``quantized_norms.quantized_norm`` derives each case)."""
        if self.kind == "int8":
            return norm * (1 + math.sqrt(keep) / 254)
        if self.kind == "lowbit":
            root = math.sqrt(min(block, keep) if block > 0 else keep)
            growth = min(1 + root / 7, root) if self.name == "int4" else root
            return norm * growth * (1 + LOWBIT_SLACK)
        return norm * (1 + self.relative) + math.sqrt(keep) * self.subnormal_norm

    @property
    def subnormal_norm(self) -> float:
        """A float's subnormal error per value in the norm bound (fp16 only: 2^-25)."""
        return 2.0**-25 if self.name == "fp16" else 0.0

    def contraction(self) -> tuple[float, float] | None:
        """``(c, a)`` with ``|Q(x)_i - x_i| <= c max|x| + a``; None where ``c >= 1``
        (``quantized_norms.feedback_contraction`` derives each case)."""
        if self.name == "int4":
            return (1 + LOWBIT_SLACK) / 7, 0.0
        if self.kind == "int8":  # float32's division, scale and product: a few 2^-24 of max
            return (1 + 2.0**-13) / 254, 2.0**-149
        if self.kind == "float":  # and the subnormals' absolute error
            return self.relative * (1 + LOWBIT_SLACK), self.subnormal
        return None


VALUE_FORMATS: Final[dict[str, ValueFormat]] = {
    "fp32": ValueFormat("fp32", "float"),
    "fp16": ValueFormat("fp16", "float", relative=2.0**-11, subnormal=2.0**-25),
    "bf16": ValueFormat("bf16", "float", relative=2.0**-8, subnormal=2.0**-133),
    "int8": ValueFormat("int8", "int8"),
    **{name: ValueFormat(name, "lowbit") for name in LOWBIT_DTYPES},
}
assert tuple(VALUE_FORMATS) == PAYLOAD_DTYPES


def value_format(name: str) -> ValueFormat:
    """The value dtype named ``name``.

    Raises:
        ValueError: an unknown dtype, naming it and the known ones.
    """
    try:
        return VALUE_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"value_dtype={name!r}: expected one of {', '.join(PAYLOAD_DTYPES)}"
        ) from None


def is_exact(name: str) -> bool:
    """Whether ``name`` is a value dtype of the registry that sends values unchanged."""
    found = VALUE_FORMATS.get(name)
    return found is not None and found.exact


def wire_encoding(codec: CodecName, *, sparse: bool) -> IndexEncoding:
    """The ``payload.encode_update`` encoding for a run-config ``codec``.

    A full update (``sparse=False``: rate 0, or the first dense download) always travels
    ``"dense"``: every codec agrees that no indices are needed.
    """
    if codec not in CODECS:
        raise ValueError(f"codec={codec!r}: expected one of {', '.join(CODECS)}")
    if not sparse:
        return "dense"
    if codec == "values":
        return "seeded"
    return codec


def explicit_encoding(codec: CodecName) -> IndexEncoding:
    """The encoding of a support that must travel (gip, random-k: no seed gives it): the
    codec's own, or for ``values``/``auto`` the smallest of coo, delta and bitmap."""
    if codec not in CODECS:
        raise ValueError(f"codec={codec!r}: expected one of {', '.join(CODECS)}")
    if codec == "values":
        return "auto"
    return codec
