"""The factored engine's per-layer math: what one layer's factors give, per example.

From a trainable layer's input ``a`` and the gradient ``b`` of the summed per-example losses
with respect to its output (``LayerFactors``, recorded by ``factored.FactoredGradSampleModule``),
``LayerFactors.prepare`` computes each example's masked squared gradient norm, and
``clipped_sums`` the clipped sum ``sum_i c_i m * g_i`` per parameter: outer-product formulas
for a ``Linear``, per-sample gradients formed a few examples at a time by a grouped
convolution backward for a ``Conv2d`` (``conv2d_grad_sample``), kept or summed again by one
more backward (``conv2d_weight_grad``) as the constants below decide. ``factored_support_error``
says which layers these formulas cover. The formulas, the non-finite rule and the references
are in ``factored``'s module docstring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import torch
from torch import nn

from fedsparse.common.dp.optimizer import zero_non_finite

__all__ = [
    "LayerFactors",
    "conv2d_grad_sample",
    "conv2d_weight_grad",
    "factored_support_error",
]

#: Layers whose output for one example depends on the rest of the batch (in training mode).
_MIXING: Final = (nn.modules.batchnorm._BatchNorm,)
#: Examples per call of the grouped convolution backward that forms per-sample gradients:
#: small enough for a chunk to stay in the cache while it is masked and its norms taken. On the
#: DP-CNN at batch 256 (2 CPU threads) chunks of 8 were 1.5-2.6x faster than the whole batch
#: at once, and than ``unfold`` + ``bmm`` on every layer but the first (3 input channels).
_CHUNK: Final = 8
#: Output positions (H' x W') from which a convolution's per-sample gradients are kept for the
#: clipped sum (``c @ g``, one pass over memory); below it they are dropped chunk by chunk and
#: the sum is one convolution backward with the backpropagations scaled by ``c`` (its cost,
#: like forming them, grows with the positions; keeping them costs ``B x numel`` memory).
_KEEP_MIN_POSITIONS: Final = 256
#: Per-sample gradients of at most this many values (B x numel) are kept whatever the
#: positions: a second convolution backward costs more than reading them (small batches, as a
#: federated client's on a small partition).
_KEEP_MAX_VALUES: Final = 1 << 20


def factored_support_error(module: nn.Module) -> str | None:
    """Why the factored engine cannot train ``module`` (naming the first such layer), or None."""
    owners: dict[int, str] = {}
    for name, layer in module.named_modules():
        kind = type(layer).__name__
        if isinstance(layer, _MIXING):
            return (
                f"engine='factored': layer {name!r} ({kind}) mixes the examples of a batch, so "
                "it has no per-sample gradient; expected a model without batch statistics "
                "(GroupNorm instead of BatchNorm)"
            )
        own = [p for p in layer.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        if type(layer) not in (nn.Linear, nn.Conv2d):  # a subclass may compute otherwise
            return (
                f"engine='factored': layer {name!r} ({kind}) has trainable parameters; the "
                "factored engine computes per-sample gradients of Linear and Conv2d layers "
                "only (not subclasses): use engine='opacus' or 'func'"
            )
        extra = sorted(set(dict(layer.named_parameters(recurse=False))) - {"weight", "bias"})
        if extra:
            return (
                f"engine='factored': layer {name!r} ({kind}) has parameters {extra} besides "
                "weight and bias: use engine='opacus' or 'func'"
            )
        if isinstance(layer, nn.Conv2d):
            if layer.groups != 1 or layer.padding_mode != "zeros":
                return (
                    f"engine='factored': layer {name!r} (Conv2d) has groups={layer.groups}, "
                    f"padding_mode={layer.padding_mode!r}: expected groups=1 and 'zeros'"
                )
            if isinstance(layer.padding, str) and _numeric_padding(layer) is None:
                return (
                    f"engine='factored': layer {name!r} (Conv2d) has padding="
                    f"{layer.padding!r} with an even kernel: expected numeric padding"
                )
        for p in own:
            if id(p) in owners:
                return (
                    f"engine='factored': layers {owners[id(p)]!r} and {name!r} share a "
                    "parameter; expected every trainable parameter in one layer"
                )
            owners[id(p)] = name
    return None


def _numeric_padding(layer: nn.Conv2d) -> tuple[int, int] | None:
    """``layer.padding`` as two ints (``'valid'``, or ``'same'`` with odd dilated kernels)."""
    padding = layer.padding
    if not isinstance(padding, str):
        return (int(padding[0]), int(padding[1]))
    if padding == "valid":
        return (0, 0)
    spans = [d * (k - 1) for d, k in zip(layer.dilation, layer.kernel_size, strict=True)]
    if any(span % 2 for span in spans):
        return None
    return (spans[0] // 2, spans[1] // 2)


@contextlib.contextmanager
def _exact_cudnn(device: torch.device) -> Iterator[None]:
    """cuDNN without TF32 on CUDA (its default): the norms and the sums must be formed from
    the same float32 values, whichever kernels form them (a no-op on the CPU)."""
    if device.type != "cuda":
        yield
        return
    allowed = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = allowed


def _conv_weight_grad(
    layer: nn.Conv2d,
    activations: torch.Tensor,
    backprops: torch.Tensor,
    weight: torch.Tensor,
    *,
    groups: int,
) -> torch.Tensor:
    """The weight gradient of a convolution shaped like ``layer`` (its stride, padding and
    dilation) with ``groups`` groups: ATen's convolution backward, weight only."""
    padding = _numeric_padding(layer)
    assert padding is not None  # factored_support_error refused the others
    with _exact_cudnn(activations.device):
        _, grad, _ = torch.ops.aten.convolution_backward(
            backprops,
            activations,
            weight,
            None,
            list(layer.stride),
            list(padding),
            list(layer.dilation),
            False,
            [0, 0],
            groups,
            [False, True, False],
        )
    return grad


def conv2d_grad_sample(
    layer: nn.Conv2d, activations: torch.Tensor, backprops: torch.Tensor
) -> torch.Tensor:
    """Per-sample weight gradients of ``layer``, ``(B, out * in * kh * kw)`` (weight order).

    One convolution backward with the examples as groups: example ``i``'s input channels meet
    only its own output channels, so the weight gradient of group ``i`` is ``g_i``.

    Args:
        layer: a ``Conv2d`` with ``groups=1`` and zero padding.
        activations: its input, ``(B, in, H, W)``.
        backprops: the gradient of the summed per-example losses w.r.t. its output,
            ``(B, out, H', W')``.
    """
    batch = activations.shape[0]
    out_ch, in_ch, kh, kw = layer.weight.shape
    grad = _conv_weight_grad(
        layer,
        activations.reshape(1, batch * in_ch, *activations.shape[2:]),
        backprops.reshape(1, batch * out_ch, *backprops.shape[2:]),
        layer.weight.new_empty((batch * out_ch, in_ch, kh, kw)),  # only its shape is read
        groups=batch,
    )
    return grad.reshape(batch, -1)


def conv2d_weight_grad(
    layer: nn.Conv2d, activations: torch.Tensor, backprops: torch.Tensor
) -> torch.Tensor:
    """The weight gradient of ``layer`` summed over the batch (shaped like the weight)."""
    return _conv_weight_grad(layer, activations, backprops, layer.weight, groups=1)


def _conv2d_norms(
    layer: nn.Conv2d,
    activations: torch.Tensor,
    backprops: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    keep: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Squared norms of the masked per-sample weight gradients, ``(B,)``, chunk by chunk;
    with ``keep``, also the masked gradients themselves, ``(B, numel)``."""
    batch, numel = activations.shape[0], layer.weight.numel()
    norms = activations.new_empty(batch)
    kept = activations.new_empty((batch, numel)) if keep else None
    flat_mask = None if mask is None else mask.reshape(1, -1)
    for start in range(0, batch, _CHUNK):
        stop = min(start + _CHUNK, batch)
        chunk = conv2d_grad_sample(layer, activations[start:stop], backprops[start:stop])
        if flat_mask is not None:
            chunk.mul_(flat_mask)
        norms[start:stop] = torch.linalg.vector_norm(chunk, dim=1).square()
        if kept is not None:
            kept[start:stop] = chunk
    return norms, kept


@dataclass(frozen=True, kw_only=True)
class LayerFactors:
    """One layer's factors for one batch: per-sample gradients without forming them all.

    Attributes:
        name: the layer's name in the model.
        layer: the ``Linear`` or ``Conv2d``.
        weight: its weight, if trainable (else None); likewise ``bias``.
        activations: its input (detached: it shares the input's version counter).
        backprops: the gradient of the summed per-example losses w.r.t. its output.
        version: the input's version when it was recorded.
    """

    name: str
    layer: nn.Module
    weight: nn.Parameter | None
    bias: nn.Parameter | None
    activations: torch.Tensor
    backprops: torch.Tensor
    version: int

    def prepare(self, masks: dict[nn.Parameter, torch.Tensor]) -> _Prepared:
        """This layer's masked squared norm per example, and what its clipped sum needs.

        Raises:
            ValueError: the layer's input was modified in place after the forward pass (the
                step would compute another gradient than the loss's).
        """
        a, b = self.activations, self.backprops
        if a._version != self.version:
            raise ValueError(
                f"engine='factored': the input of layer {self.name!r} was modified in place "
                "between backward_per_sample and the optimizer step"
            )
        weight_mask = masks.get(self.weight) if self.weight is not None else None
        norms = a.new_zeros(len(a))
        kept: dict[nn.Parameter, torch.Tensor] = {}
        if self.weight is not None:
            if isinstance(self.layer, nn.Conv2d):
                keep = (
                    b.shape[2] * b.shape[3] >= _KEEP_MIN_POSITIONS
                    or len(a) * self.weight.numel() <= _KEEP_MAX_VALUES
                )
                weight_norms, grad_sample = _conv2d_norms(self.layer, a, b, weight_mask, keep=keep)
                norms += weight_norms
                if grad_sample is not None:
                    kept[self.weight] = grad_sample
            elif a.dim() == 2:  # ||m * (b_i a_i^T)||^2 = sum_jk m_jk b_ij^2 a_ik^2
                if weight_mask is None:
                    norms += (b * b).sum(1) * (a * a).sum(1)
                else:
                    norms += (((b * b) @ weight_mask) * (a * a)).sum(1)
            else:  # a Linear over a sequence: g_i = sum_t b_it a_it^T
                flat_a = a.reshape(len(a), -1, a.shape[-1])
                flat_b = b.reshape(len(b), -1, b.shape[-1])
                grad_sample = torch.bmm(flat_b.transpose(1, 2), flat_a).reshape(len(a), -1)
                if weight_mask is not None:
                    grad_sample.mul_(weight_mask.reshape(1, -1))
                norms += torch.linalg.vector_norm(grad_sample, dim=1).square()
                kept[self.weight] = grad_sample
        if self.bias is not None:
            dims = tuple(range(2, b.dim())) if isinstance(self.layer, nn.Conv2d) else ()
            if not isinstance(self.layer, nn.Conv2d) and b.dim() > 2:
                dims = tuple(range(1, b.dim() - 1))
            grad_sample = b.sum(dims) if dims else b
            bias_mask = masks.get(self.bias)
            if bias_mask is not None:
                grad_sample = grad_sample * bias_mask
            norms += (grad_sample * grad_sample).sum(1)
            kept[self.bias] = grad_sample
        return _Prepared(norms_sq=norms, kept=kept, factors=self, weight_mask=weight_mask)


@dataclass(frozen=True, kw_only=True)
class _Prepared:
    norms_sq: torch.Tensor  # (B,) the layer's masked squared norm per example
    kept: dict[nn.Parameter, torch.Tensor]  # masked per-sample gradients, (B, numel)
    factors: LayerFactors
    weight_mask: torch.Tensor | None  # for a weight summed from the factors

    def clipped_sums(self, factor: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        """``sum_i factor_i * m * g_i`` per parameter, shaped like it.

        ``factor`` is 0 for an example whose masked norm is not finite; since ``0 * inf`` and
        ``0 * NaN`` are NaN, the NaN and infinite entries of the kept gradients (in place) and
        of the factors (copies) are set to 0 first, for every batch whatever its values, so
        that that example's terms are exactly 0 and the others' are untouched."""
        kept = {p: zero_non_finite(g, in_place=True) for p, g in self.kept.items()}
        sums = {p: (factor @ g).view_as(p) for p, g in kept.items()}
        f = self.factors
        if f.weight is not None and f.weight not in sums:  # from the factors
            a, b = zero_non_finite(f.activations), zero_non_finite(f.backprops)
            scale = factor.reshape(-1, *([1] * (b.dim() - 1)))
            if isinstance(f.layer, nn.Conv2d):
                weight = conv2d_weight_grad(f.layer, a, b * scale)
            else:
                weight = (b * scale).t() @ a
            if self.weight_mask is not None:
                weight.mul_(self.weight_mask)
            sums[f.weight] = weight
        return sums
