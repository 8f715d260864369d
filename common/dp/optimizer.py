"""DP-SGD with random sparsification (RS) on Opacus.

``SparseDPEngine`` is Opacus's ``PrivacyEngine`` plus one method, ``set_mask``. Its
optimizer, ``SparseDPOptimizer``, is a ``DPOptimizer`` whose step is, for a public mask ``m``
(RS paper, Algorithm 1, lines 9-13)::

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
``flush_denormals`` turns them into zeros for the process (a global setting, so the caller's
choice).

Ablations (RS paper, Appendix E), selected with ``mechanism``:
  - ``"dpsgd"``: Algorithm 1 above (private).
  - ``"clipped"``: Algorithm 3, sparsify and clip, no noise (``noise_multiplier`` must be 0).
  - ``"noisy"``: Algorithm 2, sparsify, no per-sample clipping, noise ``m * N(0, (sigma C)^2)``
    (set ``max_grad_norm=1`` for the paper's ``N(0, sigma^2)``).
  The ablations are not differentially private: ``get_epsilon`` returns ``inf`` for them.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from typing import Any, Final, Literal, get_args

import torch
from opacus import PrivacyEngine
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import (
    _check_processed_flag,
    _generate_noise,
    _mark_as_processed,
)
from torch import nn

from fedsparse.common.dp.accounting import AccountantName
from fedsparse.common.layout import ParamLayout, unwrap_name
from fedsparse.common.methods.index_selection import StepSelector

__all__ = [
    "MECHANISMS",
    "MechanismName",
    "PerSampleCriterion",
    "PerSampleLoss",
    "PerSampleModule",
    "SparseDPEngine",
    "SparseDPOptimizer",
    "check_own_wrapping",
    "flush_denormals",
    "os_entropy_generator",
    "zero_non_finite",
]

MechanismName = Literal["dpsgd", "clipped", "noisy"]
"""Algorithm 1 (private) and the non-private ablations (module docstring)."""

MECHANISMS: Final[tuple[MechanismName, ...]] = get_args(MechanismName)


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


class PerSampleModule(nn.Module):
    """What the engines whose module computes its own per-sample gradients share (``func_dp``,
    ``factored_dp``): the wrapped module as ``_module`` (Opacus's name, so parameter names
    unwrap alike), its own forward pass for evaluation, and Opacus's accumulation switch
    (``make_private`` forbids accumulating two batches under Poisson sampling).

    Subclasses add ``backward_per_sample(x, y, *, criterion)``, called instead of
    ``criterion(module(x), y).backward()``, and the two halves of it that Opacus's loop needs
    (``_record_forward``, ``_backward_recorded``): with ``make_private(...,
    grad_sample_mode="ghost")`` the engine returns a ``PerSampleCriterion`` and the module
    records each training forward pass, so that ``criterion(module(x), y).backward()`` does
    the per-sample work (Opacus's convention for fast gradient clipping).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._module = module
        self._accumulation_allowed = True
        #: Set by the engine's criterion (``grad_sample_mode="ghost"``): training forward
        #: passes are recorded for ``PerSampleLoss.backward``.
        self._record = False
        self._recorded: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward pass; recorded for the criterion's ``backward`` when
        training under ``grad_sample_mode="ghost"`` (no per-sample work yet)."""
        if self._record and self.training and torch.is_grad_enabled():
            if len(args) != 1 or kwargs:
                raise ValueError(
                    f"module({len(args)} positional, {len(kwargs)} keyword arguments): "
                    "expected one batch of inputs (examples along the first dimension)"
                )
            output, state = self._record_forward(args[0])
            self._recorded = (output, args[0], state)
            return output
        return self._module(*args, **kwargs)

    def _record_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The output for ``x`` and what ``_backward_recorded`` needs of this pass."""
        raise NotImplementedError

    def _loss(self, output: torch.Tensor, y: torch.Tensor, criterion: Any) -> torch.Tensor:
        """The batch loss the criterion reports (and ``_backward_recorded`` may use)."""
        return criterion(output, y)

    def _backward_recorded(
        self, x: torch.Tensor, y: torch.Tensor, state: Any, loss: torch.Tensor, criterion: Any
    ) -> None:
        """``backward_per_sample``'s work for the recorded forward pass of ``x``."""
        raise NotImplementedError

    def _take_recorded(self, output: torch.Tensor) -> tuple[torch.Tensor, Any]:
        recorded = self._recorded
        if recorded is None or recorded[0] is not output:
            raise ValueError(
                "loss.backward(): expected the loss of the module's last training forward "
                "pass, once: call output = module(x), then criterion(output, y).backward() "
                "for each batch"
            )
        self._recorded = None
        return recorded[1], recorded[2]

    def forbid_grad_accumulation(self) -> None:
        """Poisson sampling: every step's per-sample gradients must come from one batch."""
        self._accumulation_allowed = False

    def allow_grad_accumulation(self) -> None:
        """Lets two batches' per-sample gradients accumulate before a step (Opacus's list)."""
        self._accumulation_allowed = True


class PerSampleLoss:
    """The loss a ``PerSampleCriterion`` returns: ``backward()`` computes the batch's
    per-sample gradients (the module's ``backward_per_sample``) for the optimizer's next step.

    ``item()`` and ``detach()`` give the batch loss, reduced as the criterion says. Unlike a
    tensor it has no arithmetic: each example's gradient must be that of its own loss, so the
    loss cannot be rescaled or combined before ``backward()`` (Opacus's fast-clipping loss
    allows it because it clips the gradient of whatever per-sample loss it is given).
    """

    def __init__(
        self,
        module: PerSampleModule,
        criterion: Any,
        output: torch.Tensor,
        target: torch.Tensor,
    ) -> None:
        self._module = module
        self._criterion = criterion
        self._output = output
        self._target = target
        self._loss = module._loss(output, target, criterion)

    def backward(self) -> None:
        """The per-sample gradients of this batch, stored for ``optimizer.step()``.

        Raises:
            ValueError: the loss is not of the module's last training forward pass, or its
                ``backward`` already ran.
        """
        x, state = self._module._take_recorded(self._output)
        self._module._backward_recorded(x, self._target, state, self._loss, self._criterion)

    def detach(self) -> torch.Tensor:
        return self._loss.detach()

    def item(self) -> float:
        return float(self._loss.detach())

    def __repr__(self) -> str:
        return f"PerSampleLoss({float(self._loss.detach()):.4f})"


class PerSampleCriterion:
    """Wraps the loss function for ``make_private(..., criterion=..., grad_sample_mode=
    "ghost")`` on the func and factored engines: ``criterion(module(x), y)`` is a
    ``PerSampleLoss`` whose ``backward()`` does the per-sample work, so Opacus's own loop::

        module, optimizer, criterion, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, criterion=nn.CrossEntropyLoss(),
            noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost")
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(module(x), y)
            loss.backward()
            optimizer.step()

    runs unchanged, with the same steps as ``module.backward_per_sample(x, y, criterion=...)``.

    Raises:
        ValueError: a criterion without reduction ``"mean"`` or ``"sum"``, or one that
            disagrees with ``loss_reduction``.
    """

    def __init__(self, module: PerSampleModule, criterion: Any, *, loss_reduction: str) -> None:
        reduction = getattr(criterion, "reduction", loss_reduction)
        if reduction != loss_reduction:
            raise ValueError(
                f"criterion.reduction={reduction!r}: expected loss_reduction={loss_reduction!r} "
                "(make_private's argument)"
            )
        if reduction not in ("mean", "sum"):
            raise ValueError(f"criterion.reduction={reduction!r}: expected 'mean' or 'sum'")
        self.module = module
        self.criterion = criterion
        self.loss_reduction = reduction
        module._record = True

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> PerSampleLoss:
        return PerSampleLoss(self.module, self.criterion, output, target)


def check_own_wrapping(
    engine: str, *, batch_first: bool, wrap_model: bool, grad_sample_mode: str
) -> None:
    """An engine that wraps the module itself takes Opacus's wrapping arguments at their
    defaults only, and ``grad_sample_mode`` ``"hooks"`` (call ``backward_per_sample``) or
    ``"ghost"`` (Opacus's criterion convention: ``PerSampleCriterion``).

    Raises:
        NotImplementedError: another value, named.
    """
    if not batch_first or not wrap_model or grad_sample_mode not in ("hooks", "ghost"):
        raise NotImplementedError(
            f"batch_first={batch_first}, wrap_model={wrap_model}, "
            f"grad_sample_mode={grad_sample_mode!r}: {engine} computes per-sample "
            "gradients itself (batch first, wrapped module); leave these at their defaults "
            "(grad_sample_mode 'hooks', or 'ghost' for the criterion convention)"
        )


def flush_denormals() -> bool:
    """Has this process's CPU threads treat subnormal floats as zero; whether it took effect.

    Why: the DP step runs the same operations whatever the data (module docstring), but the
    time of one operation still depends on its values when they are subnormal (float32 below
    ~1.2e-38): x86 CPUs compute those in microcode, many times slower. A server can craft a
    model that drives one chosen example's activations or gradients there, and Flower reports
    each reply's runtime to the server: a slower round would say that the example was in the
    batch. With the CPU's flush-to-zero and denormals-are-zero modes
    (``torch.set_flush_denormal(True)``) subnormal inputs and results are 0, at full speed.
    Results that would have been subnormal become 0, in every example's computation alike;
    each per-sample gradient is still a function of its own example, clipped to ``C``, so the
    privacy argument is unchanged.

    Global state, so ``common`` never sets it itself: the caller (the client, at start-up)
    decides. The mode is a register of each thread (x86's MXCSR), copied to a thread when it is
    created: call this at process start, from the thread that trains (or creates the one that
    does), before torch's first parallel operation starts its intra-op threads; threads that
    exist already keep computing subnormals. The result is checked, not assumed: a product
    whose value is subnormal, over a tensor every intra-op thread takes a part of, must come out
    0 everywhere.

    Returns:
        True if subnormal results are flushed on this thread and every intra-op thread; False
        where the CPU has no such mode (``torch.set_flush_denormal`` returns False: not x86
        with SSE3) or some thread was created before the call (the mode stays on where it is).
    """
    if not torch.set_flush_denormal(True):
        return False
    # Large enough that ATen's parallel_for (grain 32,768) gives every thread a share.
    size = 4 * 32_768 * max(1, torch.get_num_threads())
    tiny = torch.full((size,), 1e-30, dtype=torch.float32)
    product = tiny * 1e-10  # 1e-40: subnormal unless flushed
    return bool((product == 0).all())


def os_entropy_generator() -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from 63 bits of OS entropy (``secrets``).

    The seed is never stored or sent, so no other party can regenerate its stream. torch's CPU
    generator is MT19937, not a cryptographic generator: recovering its state from the
    (hardened, rounded, clipped-gradient-masked) noise of a released update is the remaining
    attack surface, as with Opacus's ``secure_mode`` before ``torchcsprng``.
    """
    return torch.Generator().manual_seed(secrets.randbits(63))


class SparseDPEngine(PrivacyEngine):
    """Opacus's ``PrivacyEngine`` with random sparsification.

    Usage mirrors Opacus::

        engine = SparseDPEngine(accountant="rdp", secure_mode=False)
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0)
        engine.set_mask(mask)   # flat bool over trainable params, named_parameters() order
        ...train...
        engine.get_epsilon(delta=1e-5)

    ``make_private``/``make_private_with_epsilon`` take Opacus's keyword arguments and return
    Opacus's kinds of objects; the optimizer is a ``SparseDPOptimizer``. Supported: flat
    clipping, non-distributed, per-sample-gradient modes ``hooks``, ``functorch``, ``ew``.

    Args:
        accountant: ``"rdp"``, ``"prv"`` or ``"gdp"`` (Opacus accountants).
        secure_mode: Opacus's secure mode (cryptographically secure noise, no user seeds).
        mechanism: ``"dpsgd"`` (private), or the non-private ablations ``"clipped"``/``"noisy"``.
    """

    #: The optimizer ``make_private`` returns (a ``SparseDPOptimizer``).
    optimizer_class: type[SparseDPOptimizer] = SparseDPOptimizer
    #: Whether ``grad_sample_mode="ghost"`` returns a ``PerSampleCriterion`` (func, factored).
    per_sample_criterion: bool = False

    def __init__(
        self,
        *,
        accountant: AccountantName = "rdp",
        secure_mode: bool = False,
        mechanism: MechanismName = "dpsgd",
    ) -> None:
        if mechanism not in MECHANISMS:
            raise ValueError(f"mechanism={mechanism!r}: expected one of {', '.join(MECHANISMS)}")
        # Opacus's own secure mode needs torchcsprng (no wheel for Python 3.11 / torch 2.13).
        # Its hardened noise (``_generate_noise(secure_mode=True)``: 2n Gaussian draws against
        # floating-point attacks) works with any generator, so the engine supplies one seeded
        # from 63 bits of OS entropy, used for the noise and the Poisson sampling alike.
        super().__init__(accountant=accountant, secure_mode=False)
        if secure_mode:
            self.secure_mode = True
            self.secure_rng = os_entropy_generator()
        self.mechanism = mechanism
        self._layout: ParamLayout | None = None
        self._params: dict[str, nn.Parameter] = {}
        self._optimizer: SparseDPOptimizer | None = None
        self._mask: torch.Tensor | None = None
        self._selector: StepSelector | None = None

    def _prepare_criterion(
        self, *, module: nn.Module, criterion: Any, loss_reduction: str = "mean", **kwargs: Any
    ) -> PerSampleCriterion:
        """``grad_sample_mode="ghost"``: the criterion whose ``loss.backward()`` does the
        per-sample work (``PerSampleCriterion``; func and factored engines only)."""
        if not isinstance(module, PerSampleModule):  # _prepare_optimizer refused it first
            raise NotImplementedError(f"{type(self).__name__}: no per-sample criterion")
        return PerSampleCriterion(module, criterion, loss_reduction=loss_reduction)

    def _prepare_optimizer(
        self,
        *,
        optimizer: torch.optim.Optimizer,
        clipping: str = "flat",
        distributed: bool = False,
        grad_sample_mode: str = "hooks",
        **kwargs: Any,
    ) -> DPOptimizer:
        ghost = "ghost" in grad_sample_mode and not self.per_sample_criterion
        if clipping != "flat" or distributed or ghost:
            raise NotImplementedError(
                f"clipping={clipping!r}, distributed={distributed}, "
                f"grad_sample_mode={grad_sample_mode!r}: SparseDPEngine supports flat clipping, "
                "one process, and grad_sample_mode in ('hooks', 'functorch', 'ew') (ghost "
                "clipping computes norms that ignore the mask)"
            )
        if isinstance(optimizer, DPOptimizer):
            optimizer = optimizer.original_optimizer
        noise_generator = kwargs.pop("noise_generator", None)
        generator = self.secure_rng if self.secure_mode else noise_generator
        sparse = self.optimizer_class(
            optimizer,
            clip_per_sample=self.mechanism != "noisy",
            generator=generator,
            secure_mode=self.secure_mode,
            **kwargs,
        )
        self._optimizer = sparse
        return sparse

    def make_private(self, *, module: nn.Module, noise_multiplier: float, **kwargs: Any) -> Any:
        """Opacus's ``make_private``; returns ``(module, optimizer, data_loader)``, or with
        ``grad_sample_mode="ghost"`` (func and factored engines) ``(module, optimizer,
        criterion, data_loader)`` (``PerSampleCriterion``)."""
        if self.mechanism == "clipped" and noise_multiplier != 0:
            raise ValueError(
                f"noise_multiplier={noise_multiplier}: mechanism='clipped' adds no noise, "
                "expected 0"
            )
        if not math.isfinite(noise_multiplier) or noise_multiplier < 0:
            raise ValueError(f"noise_multiplier={noise_multiplier}: expected a finite value >= 0")
        max_grad_norm = kwargs.get("max_grad_norm")
        if isinstance(max_grad_norm, (int, float)) and not (
            math.isfinite(max_grad_norm) and max_grad_norm > 0
        ):
            raise ValueError(f"max_grad_norm={max_grad_norm}: expected a finite value > 0")
        self._layout = ParamLayout.from_module(module)
        self._params = {unwrap_name(n): p for n, p in module.named_parameters() if p.requires_grad}
        self._mask = None
        result = super().make_private(module=module, noise_multiplier=noise_multiplier, **kwargs)
        return result

    def make_private_with_epsilon(self, **kwargs: Any) -> Any:
        """Opacus's ``make_private_with_epsilon`` (calibrates sigma for the target epsilon)."""
        if self.mechanism != "dpsgd":
            raise ValueError(
                f"mechanism={self.mechanism!r} is not private: make_private_with_epsilon "
                "needs mechanism='dpsgd'"
            )
        return super().make_private_with_epsilon(**kwargs)

    @property
    def layout(self) -> ParamLayout:
        """Layout of the trainable parameters the masks refer to."""
        if self._layout is None:
            raise RuntimeError("call make_private(...) before using the mask layout")
        return self._layout

    @property
    def optimizer(self) -> SparseDPOptimizer:
        if self._optimizer is None:
            raise RuntimeError("call make_private(...) first")
        return self._optimizer

    @property
    def mask(self) -> torch.Tensor | None:
        """The current flat mask (``None``: no sparsification)."""
        return self._mask

    @property
    def keep_fraction(self) -> float:
        """Fraction of trainable coordinates currently kept (1.0 without a mask)."""
        if self._mask is None or self._mask.numel() == 0:
            return 1.0
        return float(self._mask.sum()) / self._mask.numel()

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters the mask covers, by unwrapped name, in layout order."""
        return dict(self._params)

    def set_mask(self, mask: torch.Tensor | None) -> None:
        """Sets the RS mask for the following steps.

        Args:
            mask: flat ``torch.bool`` tensor over the trainable parameters (those with
                ``requires_grad``), concatenated in ``named_parameters()`` order, as from
                ``fedsparse.common.masks.sample_mask(layout.numel, keep=..., seed=...)``;
                ``None`` turns sparsification off (plain DP-SGD). It must not depend on the
                private data: it is treated as public by the accounting.

        Raises:
            ValueError: wrong dtype or length.
        """
        layout = self.layout
        if mask is None:
            self._mask = None
            self.optimizer.set_param_masks({p: None for p in self._params.values()})
            return
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise ValueError(
                f"mask has type {type(mask).__name__}"
                f"{'/' + str(mask.dtype) if isinstance(mask, torch.Tensor) else ''}: "
                "expected a flat torch.bool tensor"
            )
        views = layout.split(mask, field="mask")
        self._mask = mask
        self.optimizer.set_param_masks({self._params[n]: v for n, v in views.items()})

    def set_step_selector(self, selector: StepSelector | None) -> None:
        """Chooses each step's support from the clipped sum (GIP / random-k,
        ``common/methods/index_selection.py``).

        The selector sees the flat gradient in the layout's order (``named_parameters()``
        order of the trainable parameters, as ``set_mask``). Exclusive with ``set_mask``;
        GIP's index epsilon (``selector.spent``) is added by ``get_epsilon`` (Thm. 2).
        """
        if selector is not None and selector.numel != self.layout.numel:
            raise ValueError(
                f"selector covers {selector.numel} coordinates: expected {self.layout.numel}"
            )
        self.optimizer.set_step_selector(selector)
        self._selector = selector

    @property
    def index_epsilon(self) -> float:
        """The pure-DP epsilon GIP's index selection has spent (0 without one)."""
        return 0.0 if self._selector is None else self._selector.spent

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta``; ``inf`` for the non-private ablations.

        With a GIP selector: the accountant's epsilon of the Gaussian mechanism plus the
        index selection's pure epsilon (basic composition, GIP Thm. 2)."""
        if self.mechanism != "dpsgd":
            return math.inf
        if len(self.accountant) == 0:
            return self.index_epsilon
        return float(self.accountant.get_epsilon(delta=delta)) + self.index_epsilon
