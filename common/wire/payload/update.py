"""``SparseUpdate``: a decoded payload, values on a support of a ``dense_size`` vector."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsparse.common.masks import seeded_support
from fedsparse.common.wire.payload.schema import (
    EXPLICIT_ENCODINGS,
    LOWBIT_DTYPES,
    Compression,
    Encoding,
    PayloadDType,
    check_compression,
    check_encoding,
    check_value_dtype,
)

__all__ = ["SparseUpdate"]


@dataclass(frozen=True, kw_only=True, eq=False)
class SparseUpdate:
    """A decoded sparse update: ``values`` on a support of a ``dense_size`` vector.

    Attributes:
        dense_size: length of the dense vector, ``> 0``.
        round: federated round the update belongs to.
        values: float32 1-D tensor of the kept values, in increasing coordinate order
            (dequantized for the integer dtypes).
        encoding: one of ``ENCODINGS`` (see the package docstring).
        mask_seed: the public mask's seed for ``"seeded"``, else None.
        indices: int64 1-D sorted support for the explicit encodings, else None.
        value_dtype: the wire dtype the values travelled in (one of ``PAYLOAD_DTYPES``).
        compression: ``"none"`` or ``"zstd"``.
        value_scale: the int8 scale, else None.
        value_block: int4/int2/int1: the number of consecutive values per step, else None.
        value_scales: int4/int2/int1: the float32 step of each block (``ceil(keep /
            value_block)`` of them), else None.
    """

    dense_size: int
    round: int
    values: torch.Tensor
    encoding: Encoding
    mask_seed: int | None = None
    indices: torch.Tensor | None = None
    value_dtype: PayloadDType = "fp32"
    compression: Compression = "none"
    value_scale: float | None = None
    value_block: int | None = None
    value_scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_encoding(self.encoding)
        check_value_dtype(self.value_dtype)
        check_compression(self.compression)
        if self.values.dtype != torch.float32 or self.values.dim() != 1:
            raise ValueError(
                f"values: {self.values.dtype} {tuple(self.values.shape)}, expected 1-D float32"
            )
        if (self.mask_seed is None) != (self.encoding != "seeded"):
            raise ValueError(f"mask_seed={self.mask_seed}: required iff encoding='seeded'")
        if (self.indices is None) != (self.encoding not in EXPLICIT_ENCODINGS):
            raise ValueError(f"indices: required iff encoding is one of {EXPLICIT_ENCODINGS}")
        if self.indices is not None and self.indices.shape != self.values.shape:
            raise ValueError(f"indices: {len(self.indices)} entries for {self.keep} values")
        if (self.value_scale is None) != (self.value_dtype != "int8"):
            raise ValueError(f"value_scale={self.value_scale}: required iff value_dtype='int8'")
        self._check_blocks()
        if self.keep > self.dense_size or (
            self.encoding == "dense" and self.keep != self.dense_size
        ):
            raise ValueError(
                f"values: {self.keep} values for dense_size={self.dense_size} ({self.encoding})"
            )

    def _check_blocks(self) -> None:
        blocked = self.value_dtype in LOWBIT_DTYPES
        if (self.value_block is None) == blocked or (self.value_scales is None) == blocked:
            raise ValueError(
                f"value_block={self.value_block}, value_scales: required iff value_dtype is "
                f"one of {LOWBIT_DTYPES}"
            )
        if self.value_block is not None and self.value_scales is not None:
            blocks = -(-self.keep // self.value_block) if self.value_block >= 1 else -1
            if self.value_scales.dtype != torch.float32 or self.value_scales.shape != (blocks,):
                raise ValueError(
                    f"value_scales: {self.value_scales.dtype} {tuple(self.value_scales.shape)}, "
                    f"expected float32 ({blocks},) for keep={self.keep} and "
                    f"value_block={self.value_block}"
                )

    @property
    def keep(self) -> int:
        """Number of transmitted values."""
        return int(self.values.numel())

    def support(self, *, shared: bool = False) -> torch.Tensor | None:
        """The int64 sorted coordinates of ``values``, or None for ``"dense"`` (all of them).

        For ``"seeded"`` this is the public mask's support, regenerated once per process
        (``masks.seeded_support``). A copy by default; ``shared=True`` returns the process's
        own tensor, for callers that only read it (the server's validation and aggregation,
        the node's downlink patch): a write into it would change every later decode of the
        same mask.
        """
        if self.encoding == "dense":
            return None
        if self.indices is not None:
            return self.indices
        assert self.mask_seed is not None  # __post_init__
        support = seeded_support(self.dense_size, self.keep, self.mask_seed)
        return support if shared else support.clone()

    def to_dense(self) -> torch.Tensor:
        """A float32 vector of length ``dense_size``: ``values`` on the support, zeros elsewhere."""
        support = self.support(shared=True)  # read only
        if support is None:
            return self.values.clone()
        out = torch.zeros(self.dense_size, dtype=torch.float32)
        out[support] = self.values
        return out
