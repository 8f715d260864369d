"""The modules that compute their own per-sample gradients, and Opacus's criterion convention.

``PerSampleModule`` is what the func and factored engines' wrapped modules share (the wrapped
module as ``_module``, evaluation through its own forward pass, Opacus's accumulation switch);
``PerSampleCriterion`` and ``PerSampleLoss`` let Opacus's own loop (``criterion(module(x),
y).backward()``, its convention for fast gradient clipping, ``grad_sample_mode="ghost"``) drive
their per-sample work; ``check_own_wrapping`` refuses the Opacus wrapping arguments such an
engine cannot honour.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "PerSampleCriterion",
    "PerSampleLoss",
    "PerSampleModule",
    "check_own_wrapping",
]


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

    def backward_per_sample(self, x: torch.Tensor, y: torch.Tensor, *, criterion: Any) -> Any:
        """The batch's per-sample work for the next optimizer step, in place of
        ``criterion(module(x), y).backward()``; returns the batch loss (detached)."""
        raise NotImplementedError

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
