"""Mapping between flat vectors over trainable coordinates and a model's named parameters.

Masks and updates travel as flat vectors over a model's *trainable* parameters, concatenated
in ``named_parameters()`` order. Everything here is keyed by parameter *name*, never by list
position, so frozen parameters, optimizers over subsets and wrappers (Opacus's
``GradSampleModule`` prefixes names with ``_module.``) cannot silently shift a mask.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ParamLayout", "unwrap_name"]

_WRAPPER_PREFIXES = ("_module.",)


def unwrap_name(name: str) -> str:
    """Strips wrapper prefixes (``_module.`` of Opacus's GradSampleModule) from a name."""
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name


@dataclass(frozen=True, kw_only=True)
class ParamLayout:
    """Names, shapes and flat offsets of a model's trainable parameters.

    Attributes:
        names: parameter names (wrapper prefixes stripped), in ``named_parameters()`` order.
        shapes: the matching shapes.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.shapes):
            raise ValueError(f"names has {len(self.names)} entries but shapes {len(self.shapes)}")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"names={self.names}: duplicate parameter names")

    @classmethod
    def from_module(cls, module: nn.Module) -> ParamLayout:
        """Layout of ``module``'s parameters with ``requires_grad=True``."""
        named = [(unwrap_name(n), p) for n, p in module.named_parameters() if p.requires_grad]
        return cls(names=tuple(n for n, _ in named), shapes=tuple(tuple(p.shape) for _, p in named))

    @functools.cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @functools.cached_property
    def numel(self) -> int:
        """Total number of trainable coordinates ``d``."""
        return sum(self.numels)

    def slices(self) -> Iterator[tuple[str, slice, tuple[int, ...]]]:
        """Yields ``(name, slice into the flat vector, shape)`` per parameter."""
        offset = 0
        for name, shape, n in zip(self.names, self.shapes, self.numels, strict=True):
            yield name, slice(offset, offset + n), shape
            offset += n

    def split(self, flat: torch.Tensor, *, field: str = "flat") -> dict[str, torch.Tensor]:
        """Splits a flat vector of length ``numel`` into per-name views shaped like the params.

        Raises:
            ValueError: if ``flat`` is not 1-D of length ``numel``.
        """
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(
                f"{field} has shape {tuple(flat.shape)}: expected ({self.numel},), one entry per "
                f"trainable coordinate of {len(self.names)} parameters"
            )
        return {name: flat[sl].view(shape) for name, sl, shape in self.slices()}

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Concatenates per-name tensors (e.g. a state dict or update) into one flat vector.

        Raises:
            KeyError: if a layout name is missing from ``tensors``.
            ValueError: if a tensor's shape differs from the layout's.
        """
        parts = []
        for name, shape in zip(self.names, self.shapes, strict=True):
            if name not in tensors:
                raise KeyError(f"parameter {name!r} missing (have {sorted(tensors)[:5]}...)")
            t = tensors[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"parameter {name!r} has shape {tuple(t.shape)}: expected {shape}")
            parts.append(t.reshape(-1))
        if not parts:
            return torch.zeros(0)
        return torch.cat(parts)

    def flatten_module(self, module: nn.Module) -> torch.Tensor:
        """Flat copy of ``module``'s trainable parameter values, in layout order."""
        params = {unwrap_name(n): p.detach() for n, p in module.named_parameters()}
        return self.flatten(params)

    def load_flat_(self, module: nn.Module, flat: torch.Tensor) -> None:
        """Writes a flat vector into ``module``'s trainable parameters, in place."""
        views = self.split(flat)
        params = {unwrap_name(n): p for n, p in module.named_parameters()}
        with torch.no_grad():
            for name, value in views.items():
                params[name].copy_(value)
