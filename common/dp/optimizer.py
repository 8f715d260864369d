"""DP-SGD with random sparsification (RS) on Opacus.

``SparseDPEngine`` (``engine``) is Opacus's ``PrivacyEngine`` plus one method, ``set_mask``.
Its optimizer, ``SparseDPOptimizer``, is a ``DPOptimizer`` whose step is, for a public mask
``m`` (RS paper, Algorithm 1, lines 9-13)::

    g'_i  = m * g_i                                  # 1. sparsify each per-sample gradient
    c_i   = min(1, C / ||g'_i||)                     # 2. clip: norms of the MASKED gradients
    s     = sum_i c_i * g'_i                         # 3. sum
    g~    = (s + m * N(0, sigma^2 C^2 I_d)) / B      # 4. noise on kept coordinates only, 5. scale

Order matters. Clipping after sparsifying bounds the sensitivity of ``s`` by ``C`` on the
kept coordinates, and the Gaussian noise covers exactly those coordinates; the coordinates
off the mask carry no data and no noise. Because ``m`` is drawn from a seed, independent of
the data, it is public and the mechanism is the Gaussian mechanism restricted to a
data-independent subspace: the RDP/PRV accounting of plain DP-SGD for the same sampling
rate ``q``, ``sigma`` and number of steps applies unchanged, so ``get_epsilon`` is Opacus's.
Everything after step 4 (scaling, momentum, the optimizer update, quantizing or encoding the
resulting model delta) is post-processing and costs no privacy.

The noise on kept coordinates is exactly the noise plain Opacus would have drawn there from
the same generator state (full-size noise is drawn, then masked), and ``set_mask(None)``
runs Opacus's own code: with the same seeds, r = 0 reproduces plain Opacus bit for bit.

Momentum and weight decay: with zero momentum state and no weight decay, coordinates off the
mask get exactly zero update. Velocity accumulated under an earlier mask keeps moving
coordinates that a later mask drops (the paper notes this, Sec. 4), and weight decay moves
every coordinate. The federated client builds a fresh optimizer every round, so its updates
stay on the round's mask.

GIP (``common/methods/index_selection.py``) uses the other hook, ``set_step_selector``: no public
mask, the whole per-sample gradients are clipped (Opacus's own ``clip_and_accumulate``), and
between the sum and the noise a selector chooses the step's support ``I`` from the noise-free sum;
the step's gradient is ``(s + N(0, sigma^2 C^2 I_d)) * I / B`` (GIP Alg. 2, line 10), i.e. plain
DP-SGD's step masked, with the same noise draw. Because ``I`` reads the data, ``get_epsilon`` adds
the selector's pure epsilon to the accountant's (basic composition, GIP Thm. 2).

Non-finite per-sample gradients. An example whose (masked) per-sample gradient is not finite
(its norm over the kept coordinates is NaN or inf, as it is when any kept entry is) contributes
exactly zero to ``s``, as if its gradient were zero; so does a finite one whose float32 norm
overflows (above ~1.8e19, where its square does). The choice depends on that example alone, so
the sensitivity of ``s`` stays ``C`` and the step is a finite function of the other examples
plus noise: no failure depends on a single example. (Otherwise ``C / (NaN + 1e-6)`` and
``0 * inf`` are NaN, and a server could craft a model whose non-finite update, or the client's
error, reveals whether one chosen example was in the Poisson batch.) The ablations drop such
examples too.

The handling is branch-free: every step runs the same operations on tensors of the same
shapes whether or not an example is non-finite. One ``isfinite`` over the per-sample norms the
step computes anyway and a ``torch.where`` set those examples' clip factors to 0, and one
``nan_to_num`` over the per-sample gradients (in place, ``zero_non_finite``) sets every NaN
and infinite entry to 0, so that their terms of the sum are exactly 0; nothing reads a value
back to Python to decide (no ``bool(t)``, no ``.item()``). The reason is time: Flower reports
each reply's runtime to the server, and a step that did extra work only for a non-finite
example (zeroing its rows, rerunning Opacus's sum, as this code once did) makes the runtime
the membership oracle that the finite update closed (the crafted model of
``tests/client/test_membership.py``: 0.43 s a round with the example, 0.30 s without).
``tests/common/dp/test_nonfinite.py`` checks with ``torch.profiler`` that a clean batch and a
poisoned one run the same operators on the same shapes, on every engine and path, and
``benchmarks/nonfinite.py`` times them. Without a mask the step is Opacus's
``clip_and_accumulate`` written out with those two operations added: they leave finite
values as they are, so a finite batch is Opacus's step, bit for bit. Equal operations take
equal time only while the values are not slow in themselves; subnormal floats are (x86 runs
them in microcode), and a crafted model can push one example's activations there:
``engine.flush_denormals`` turns them into zeros for the process (a global setting, so the
caller's choice).

Ablations (RS paper, Appendix E), selected with ``mechanism``:
  - ``"dpsgd"``: Algorithm 1 above (private).
  - ``"clipped"``: Algorithm 3, sparsify and clip, no noise (``noise_multiplier`` must be 0).
  - ``"noisy"``: Algorithm 2, sparsify, no per-sample clipping, noise ``m * N(0, (sigma C)^2)``
    (set ``max_grad_norm=1`` for the paper's ``N(0, sigma^2)``).
  The ablations are not differentially private: ``get_epsilon`` returns ``inf`` for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import (
    _check_processed_flag,
    _generate_noise,
    _mark_as_processed,
)
from torch import nn

from fedsparse.common.names import MECHANISMS, MechanismName

__all__ = [
    "MECHANISMS",
    "MechanismName",
    "SparseDPOptimizer",
    "zero_non_finite",
]


def zero_non_finite(x: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """``x`` with its NaN and infinite entries set to 0, its finite ones untouched (bit for bit).

    With the clip factor of a non-finite example set to 0, its terms of a clipped sum are then
    exactly 0 (``0 * NaN`` and ``0 * inf`` are NaN): one vectorized pass (``nan_to_num``) whose
    work is the same whatever the values (module docstring, "Non-finite per-sample
    gradients"). In place it costs about what the clipped sum's ``einsum`` does (256 x 38,282
    float32 on one CPU thread: 1.2 ms against 1.4 ms); ``torch.where`` over broadcast rows, into
    a new tensor, took 20 times as long.

    Args:
        x: any tensor.
        in_place: overwrite ``x`` (per-sample gradients the step owns) when its layout allows
            it (contiguous: no two entries share memory); else, or when False, a copy.
    """
    if in_place and x.is_contiguous():  # its layout, not its values
        return x.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


class SparseDPOptimizer(DPOptimizer):
    """A ``DPOptimizer`` that sparsifies per-sample gradients and noise with a public mask.

    Masks are set per parameter with ``set_param_masks``; parameters without a mask are kept
    whole. With no masks and ``clip_per_sample=True`` every method is Opacus's own.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, *, clip_per_sample: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(optimizer, **kwargs)
        self.clip_per_sample = clip_per_sample
        self._noise_mask: dict[nn.Parameter, torch.Tensor] = {}  # float masks, partial only
        self._kept_index: dict[nn.Parameter, torch.Tensor] = {}  # their flat indices, lazily
        self._selector: Callable[[torch.Tensor], torch.Tensor] | None = None

    def set_step_selector(self, selector: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Chooses every step's support from the clipped sum (GIP,
        ``common/methods/index_selection.py``).

        ``selector`` gets the flat, clipped, summed, noise-free gradient (parameters
        concatenated in ``self.params`` order) and returns a flat bool mask; the step's
        gradient is ``(sum + noise) * mask``. Exclusive with the public masks of
        ``set_param_masks`` (GIP clips the whole gradient). None: no selection.
        """
        if selector is not None and self._noise_mask:
            raise ValueError("set_step_selector: a public mask is set; GIP clips the whole grad")
        self._selector = selector

    def set_param_masks(self, masks: dict[nn.Parameter, torch.Tensor | None]) -> None:
        """Sets boolean masks (shaped like each parameter); ``None`` or all-True keeps all."""
        params = set(self.params)
        self._noise_mask, self._kept_index = {}, {}
        for p, mask in masks.items():
            if p not in params:
                raise ValueError(
                    "set_param_masks: a masked tensor is not one of this optimizer's params"
                )
            if mask is None:
                continue
            if mask.dtype != torch.bool or tuple(mask.shape) != tuple(p.shape):
                raise ValueError(
                    f"mask has dtype {mask.dtype} and shape {tuple(mask.shape)}: expected "
                    f"torch.bool with the parameter's shape {tuple(p.shape)}"
                )
            if bool(mask.all()):
                continue
            if self._selector is not None:
                raise ValueError("set_param_masks: a step selector is set (GIP clips it all)")
            self._noise_mask[p] = mask.to(device=p.device, dtype=p.dtype)

    @property
    def is_masked(self) -> bool:
        """Whether any parameter currently has a partial mask."""
        return bool(self._noise_mask)

    def _kept_grad_sample(self, p: nn.Parameter) -> torch.Tensor:
        """Per-sample gradients of ``p`` on its kept coordinates, shape ``(B, keep_p)``."""
        grad_sample = self._get_flat_grad_sample(p).to(p.dtype)
        flat = grad_sample.reshape(len(grad_sample), p.numel())
        index = self._kept(p)
        return flat if index is None else flat.index_select(1, index)

    def _kept(self, p: nn.Parameter) -> torch.Tensor | None:
        """The flat indices of ``p``'s kept coordinates (None: no partial mask)."""
        mask = self._noise_mask.get(p)
        if mask is None:
            return None
        if p not in self._kept_index:
            self._kept_index[p] = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
        return self._kept_index[p]

    def clip_and_accumulate(self) -> None:
        """Sparsify, then clip each per-sample gradient, then sum into ``p.summed_grad``.

        An example whose (kept) per-sample gradient has a NaN or infinite norm contributes
        exactly zero, by the same operations whatever the data (module docstring,
        "Non-finite per-sample gradients"). The NaN and infinite entries of ``p.grad_sample``
        (or of the copies of its kept coordinates) are overwritten with 0."""
        if not self._noise_mask and self.clip_per_sample:
            self._opacus_clip_and_accumulate()
            return
        kept = [self._kept_grad_sample(p) for p in self.params]
        batch = len(kept[0])
        factor = torch.ones(batch, device=kept[0].device)
        if batch > 0:  # the batch's size, not its values
            norms = torch.stack([k.norm(2, dim=-1) for k in kept], dim=1).norm(2, dim=1)
            if self.clip_per_sample:
                factor = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            factor = torch.where(torch.isfinite(norms), factor, 0.0)
        for p, k in zip(self.params, kept, strict=True):
            _check_processed_flag(p.grad_sample)
            # Per-sample gradients (or copies of their kept coordinates): 0 * NaN is NaN.
            k = zero_non_finite(k, in_place=True)
            summed = factor.to(device=k.device, dtype=k.dtype) @ k
            index = self._kept(p)
            if index is not None:
                full = torch.zeros(p.numel(), device=k.device, dtype=k.dtype)
                summed = full.index_copy_(0, index, summed)
            grad = summed.view_as(p)
            if p.summed_grad is not None:
                p.summed_grad += grad
            else:
                p.summed_grad = grad
            _mark_as_processed(p.grad_sample)

    def _opacus_clip_and_accumulate(self) -> None:
        """Opacus's ``DPOptimizer.clip_and_accumulate``, with non-finite examples dropped.

        Opacus's operations in Opacus's order (its norms, clip factors and ``einsum``; the
        sum added to the physical batches accumulated before, ``p.summed_grad``), with two
        more, run whatever the data: the clip factor of an example whose norm is not finite
        is set to 0, and the per-sample gradients' non-finite entries are set to 0 (in place)
        before the sum (``zero_non_finite``). Both leave every finite value as it was, so a
        finite batch is Opacus's step, bit for bit.
        """
        grad_samples = self.grad_samples
        if len(grad_samples[0]) == 0:  # an empty batch (its size, not its values)
            factor = torch.zeros((0,), device=grad_samples[0].device)
        else:
            per_param_norms = [g.reshape(len(g), -1).norm(2, dim=-1) for g in grad_samples]
            target_device = per_param_norms[0].device
            per_param_norms = [norm.to(target_device) for norm in per_param_norms]
            norms = torch.stack(per_param_norms, dim=1).norm(2, dim=1)
            factor = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            factor = torch.where(torch.isfinite(norms), factor, 0.0)
        for p, grad_sample in zip(self.params, grad_samples, strict=True):
            _check_processed_flag(p.grad_sample)
            # Opacus: the per-sample gradients in the parameter's dtype (mixed precision).
            grad_sample = zero_non_finite(grad_sample.to(p.dtype), in_place=True)
            clip_factor_on_device = factor.to(grad_sample.device).to(p.dtype)
            grad = torch.einsum("i,i...", clip_factor_on_device, grad_sample)
            if p.summed_grad is not None:
                p.summed_grad += grad
            else:
                p.summed_grad = grad
            _mark_as_processed(p.grad_sample)

    def add_noise(self) -> None:
        """Adds ``m * N(0, (sigma C)^2)`` to ``p.summed_grad``; the result goes to ``p.grad``."""
        if self._selector is not None:
            self._add_noise_selected(self._selector)
            return
        if not self._noise_mask:
            super().add_noise()
            return
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            noise = _generate_noise(
                std=self.noise_multiplier * self.max_grad_norm,
                reference=p.summed_grad,
                generator=self.generator,
                secure_mode=self.secure_mode,
            )
            mask = self._noise_mask.get(p)
            if mask is not None:
                noise.mul_(mask)
            p.grad = (p.summed_grad + noise).view_as(p)
            _mark_as_processed(p.summed_grad)

    def _add_noise_selected(self, selector: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """GIP, Alg. 2 lines 9-10: ``I`` from the noise-free sum, then ``(sum + Z) * I``."""
        for p in self.params:
            _check_processed_flag(p.summed_grad)
        flat = torch.cat([p.summed_grad.reshape(-1) for p in self.params])
        mask = selector(flat.detach())
        if mask.dtype != torch.bool or mask.numel() != flat.numel():
            raise ValueError(
                f"step selector returned {mask.dtype} x {mask.numel()}: expected torch.bool x "
                f"{flat.numel()}"
            )
        start = 0
        for p in self.params:
            noise = _generate_noise(
                std=self.noise_multiplier * self.max_grad_norm,
                reference=p.summed_grad,
                generator=self.generator,
                secure_mode=self.secure_mode,
            )
            keep = mask[start : start + p.numel()].view_as(p.summed_grad).to(p.summed_grad)
            start += p.numel()
            p.grad = ((p.summed_grad + noise) * keep).view_as(p)
            _mark_as_processed(p.summed_grad)
