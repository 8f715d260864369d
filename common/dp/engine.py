"""The DP-SGD + RS privacy engine: Opacus's ``PrivacyEngine`` with a public mask.

``SparseDPEngine`` wraps a model, optimizer and data loader as Opacus does and returns a
``SparseDPOptimizer`` (``optimizer``, whose module docstring states the mechanism and its
privacy argument); ``set_mask`` sets the random-sparsification mask for the following steps,
``set_step_selector`` GIP's step selector, and ``get_epsilon`` adds the selector's epsilon to the
accountant's. ``os_entropy_generator`` seeds its secure mode's generator, and
``flush_denormals`` is the process-wide switch that keeps subnormal floats from timing a step.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import torch
from opacus import PrivacyEngine
from opacus.optimizers import DPOptimizer
from torch import nn

from fedsparse.common.dp.accounting import AccountantName
from fedsparse.common.dp.mechanisms import is_private, mechanism_of
from fedsparse.common.dp.optimizer import MECHANISMS, MechanismName, SparseDPOptimizer
from fedsparse.common.dp.per_sample import PerSampleCriterion, PerSampleModule
from fedsparse.common.layout import ParamLayout, unwrap_name
from fedsparse.common.methods.index_selection import StepSelector

__all__ = [
    "SparseDPEngine",
    "flush_denormals",
    "os_entropy_generator",
]


def flush_denormals() -> bool:
    """Has this process's CPU threads treat subnormal floats as zero; whether it took effect.

    Why: the DP step runs the same operations whatever the data (``optimizer``'s module
    docstring), but the time of one operation still depends on its values when they are
    subnormal (float32 below
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
            clip_per_sample=mechanism_of(self.mechanism).clips,
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
        if not mechanism_of(self.mechanism).noises and noise_multiplier != 0:
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
        if not is_private(self.mechanism):
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
        if not is_private(self.mechanism):
            return math.inf
        if len(self.accountant) == 0:
            return self.index_epsilon
        return float(self.accountant.get_epsilon(delta=delta)) + self.index_epsilon
