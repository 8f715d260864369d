"""``SparseUpdate``: a decoded payload, values on a support of a ``dense_size`` vector."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsparse.common.masks import sample_mask
from fedsparse.common.payload.schema import (
    EXPLICIT_ENCODINGS,
    Compression,
    Encoding,
    ValueDType,
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
            (dequantized for ``"int8"``).
        encoding: one of ``ENCODINGS`` (see the package docstring).
        mask_seed: the public mask's seed for ``"seeded"``, else None.
        indices: int64 1-D sorted support for the explicit encodings, else None.
        value_dtype: the wire dtype the values travelled in (one of ``VALUE_DTYPES``).
        compression: ``"none"`` or ``"zstd"``.
        value_scale: the int8 scale, else None.
    """

    dense_size: int
    round: int
    values: torch.Tensor
    encoding: Encoding
    mask_seed: int | None = None
    indices: torch.Tensor | None = None
    value_dtype: ValueDType = "fp32"
    compression: Compression = "none"
    value_scale: float | None = None

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
        if self.keep > self.dense_size or (
            self.encoding == "dense" and self.keep != self.dense_size
        ):
            raise ValueError(
                f"values: {self.keep} values for dense_size={self.dense_size} ({self.encoding})"
            )

    @property
    def keep(self) -> int:
        """Number of transmitted values."""
        return int(self.values.numel())

    def support(self) -> torch.Tensor | None:
        """The int64 sorted coordinates of ``values``, or None for ``"dense"`` (all of them).

        For ``"seeded"`` this regenerates the public mask (``O(dense_size)`` time and memory).
        """
        if self.encoding == "dense":
            return None
        if self.indices is not None:
            return self.indices
        assert self.mask_seed is not None  # __post_init__
        mask = sample_mask(self.dense_size, keep=self.keep, seed=self.mask_seed)
        return torch.nonzero(mask).flatten()

    def to_dense(self) -> torch.Tensor:
        """A float32 vector of length ``dense_size``: ``values`` on the support, zeros elsewhere."""
        support = self.support()
        if support is None:
            return self.values.clone()
        out = torch.zeros(self.dense_size, dtype=torch.float32)
        out[support] = self.values
        return out
