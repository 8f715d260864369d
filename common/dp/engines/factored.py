"""DP-SGD + RS with per-sample gradients kept in factored form (book-keeping clipping).

``FactoredDPEngine`` is ``dp.SparseDPEngine`` with the per-sample gradients computed from
what a layer sees in one forward and one backward pass: its input ``a`` (the activations) and
the gradient ``b`` of the summed per-example losses with respect to its output (the
backpropagations). The backward pass asks autograd for the ``b``s only, so no summed weight
gradient is formed and thrown away (Opacus's hooks compute both). Per layer:

* ``Linear`` on ``(B, in)`` inputs: example ``i``'s weight gradient is the outer product
  ``b_i a_i^T`` and is never formed. Its masked squared norm is
  ``sum_jk m_jk b_ij^2 a_ik^2 = ((b^2) @ m * a^2).sum(1)``, one matrix product for the batch
  (``||b_i||^2 ||a_i||^2`` without a mask; "ghost" clipping, Goodfellow 2015, Li et al. 2022,
  here with RS's mask inside the norm), and the clipped sum ``sum_i c_i b_i a_i^T =
  (c * b)^T a`` is one more (book-keeping, Bu et al. 2023). ``Linear`` on inputs with more
  dimensions (a sequence) materializes ``g_i = sum_t b_it a_it^T`` with one batched product.
* ``Conv2d`` (zero padding, one group): ``g_i`` is formed, by a convolution backward with
  the examples as groups, a few examples at a time (``_CHUNK``), masked in place while in the
  cache, and its squared norm taken. Where the output has many positions (early layers,
  ``_KEEP_MIN_POSITIONS``) or the gradients are few (a small batch, ``_KEEP_MAX_VALUES``), the
  masked ``g_i`` are kept and the clipped sum is ``c @ g``; elsewhere (late layers, with many
  weights) they are dropped and the sum is one ordinary convolution backward with the
  backpropagations scaled by ``c`` (book-keeping's second product). Ghost norms for
  convolutions, from the positions' Gram matrices, ignore the mask, so they are not used.

The step is then ``dp``'s, in ``dp``'s order::

    sparsify ``m * g_i`` -> clip on the masked norms -> sum -> noise ``m * N(0, sigma^2 C^2)``
    -> scale by ``1 / B`` (Opacus's expected batch size)

with the same ``SparseDPOptimizer.add_noise`` (the same draws from the same generator),
Opacus's Poisson loader, accountant hook and ``BatchMemoryManager``, the ablations
(``mechanism="clipped"``/``"noisy"``) and GIP's step selector included. The privacy argument
of ``dp`` holds unchanged: what changes is only how ``sum_i c_i m * g_i`` and the norms
``||m * g_i||`` are computed, and they equal Opacus's to float32 rounding (the sums run in
other orders; ``tests/common/dp/test_factored_dp.py`` pins the tolerance after an epoch).

An example whose masked squared norm is NaN or inf contributes exactly zero (``dp``'s rule):
its clip factor is 0, and the NaN and infinite entries of the kept gradients, activations and
backpropagations are set to 0 before the products (``0 * inf`` is NaN there), so its terms are
exactly 0. Branch-free, as in ``dp`` and for the same reason (the runtime a node reports must
not say whether such an example was in the batch): the same operations run for every batch,
whatever its values (``dp.zero_non_finite``: in place on the kept gradients, copies of the
factors). The norms come from the factors, so an example can be dropped where another engine
would not: a non-finite factor that reaches only dropped coordinates (``inf * 0`` in the masked
product), or factors whose squares overflow though their product does not. Still a function of
that example alone: sensitivity stays C.

Layers: every layer with trainable parameters must be a ``Linear`` or a ``Conv2d`` (zero
padding, ``groups=1``, numeric padding) whose own ``forward`` is the only use of its
parameters, and no layer may mix the examples of a batch (``BatchNorm``);
``factored_layers.factored_support_error`` names the first layer that breaks a rule and
``select_engine`` falls back to Opacus under ``"auto"``. Parameter-free layers (pooling,
activations, ``GroupNorm(affine=False)``, dropout) are free: only the layers' inputs and output
gradients are used. Checked at every forward pass, each refused naming the layer: a trainable layer
runs exactly once (not twice: its per-sample gradient would be a sum over the uses, which
one layer's factors do not give; not zero times: its parameters would get no gradient), and
its output is not modified in place by a later layer (``ReLU(inplace=True)``: the
backpropagation would be the modified tensor's).

References:
    I. Goodfellow. "Efficient Per-Example Gradient Computations". arXiv:1510.01799, 2015
    (a linear layer's per-example gradient norms from its inputs and output gradients).
    X. Li, F. Tramer, P. Liang, T. Hashimoto. "Large Language Models Can Be Strong
    Differentially Private Learners". ICLR 2022. arXiv:2110.05679 (ghost clipping).
    Z. Bu, Y.-X. Wang, S. Zha, G. Karypis. "Differentially Private Optimization on Large
    Model at Small Cost". ICML 2023. arXiv:2210.00038 (book-keeping: norms and the clipped
    sum from one backward pass).
    Z. Bu, J. Mao, S. Xu. "Scalable and Efficient Training of Large Convolutional Neural
    Networks with Differential Privacy". NeurIPS 2022. arXiv:2205.10683 (mixed ghost
    clipping: per layer, the cheaper of ghost norms and materialized gradients).
    J. Zhu, M. Blaschko. "Improving Differentially Private SGD via Randomly Sparsified
    Gradients". TMLR 2023. arXiv:2112.00845 (the RS mechanism, ``dp``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from opacus.validators.errors import UnsupportedModuleError
from torch import nn

from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.dp.engines.factored_layers import LayerFactors, factored_support_error
from fedsparse.common.dp.optimizer import SparseDPOptimizer
from fedsparse.common.dp.per_sample import PerSampleModule, check_own_wrapping

__all__ = [
    "FactoredDPEngine",
    "FactoredDPOptimizer",
    "FactoredGradSampleModule",
]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class FactoredGradSampleModule(PerSampleModule):
    """Wraps a module; ``backward_per_sample`` records every layer's factors for the step.

    The forward pass is the wrapped module's own (evaluation, ``module(x)``). Training calls
    ``backward_per_sample(x, y, criterion=...)`` instead of ``criterion(module(x), y)
    .backward()``: one forward pass with hooks that keep each trainable layer's input and
    output, then ``torch.autograd.grad`` of the loss w.r.t. those outputs (no parameter
    gradients are computed). ``FactoredDPOptimizer.step`` turns the factors into the masked,
    clipped, summed gradient. The wrapped module is ``_module``, Opacus's name.

    Args:
        module: the model (``factored_support_error`` must accept it).
        loss_reduction: how the criterion reduces the batch, Opacus's argument: ``"mean"``
            (the backpropagations are multiplied by the batch size, as Opacus's hooks do) or
            ``"sum"``.
    """

    def __init__(self, module: nn.Module, *, loss_reduction: str = "mean") -> None:
        error = factored_support_error(module)
        if error is not None:
            raise UnsupportedModuleError(error)  # a ValueError, as Opacus's validator raises
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r}: expected 'mean' or 'sum'")
        super().__init__(module)
        self.loss_reduction = loss_reduction
        self.pending: list[list[LayerFactors]] = []
        self._checked = self._trainable()  # the trainable parameters the check accepted

    def _trainable(self) -> tuple[int, ...]:
        return tuple(id(p) for p in self._module.parameters() if p.requires_grad)

    def _trainable_layers(self) -> list[tuple[str, nn.Module]]:
        """The layers with trainable parameters now (``requires_grad`` may change between
        steps; a change is checked again)."""
        trainable = self._trainable()
        if trainable != self._checked:
            error = factored_support_error(self._module)
            if error is not None:
                raise ValueError(error)
            self._checked = trainable
        return [
            (name, layer)
            for name, layer in self._module.named_modules()
            if any(p.requires_grad for p in layer.parameters(recurse=False))
        ]

    def backward_per_sample(
        self, x: torch.Tensor, y: torch.Tensor, *, criterion: Loss
    ) -> torch.Tensor:
        """Records the batch's factors for the next optimizer step.

        Args:
            x: a batch of inputs (first dimension: examples; may be empty).
            y: the matching targets.
            criterion: the batch loss, reduced as ``loss_reduction`` says.

        Returns:
            The batch loss (detached; NaN for an empty batch), for reporting.

        Raises:
            ValueError: factors of an earlier batch are waiting and accumulation is
                forbidden; a layer ran twice in the forward pass, or its output was modified
                in place.
        """
        self._check_accumulation()
        if len(x) == 0:
            self.pending.append([])
            return torch.tensor(math.nan)
        output, state = self._hooked_forward(x)
        loss = criterion(output, y)
        self._record_factors(x, state, loss)
        return loss.detach()

    def _check_accumulation(self) -> None:
        if self.pending and not self._accumulation_allowed:
            raise ValueError(
                "per-sample gradients of two batches before one step: Poisson sampling forbids "
                "gradient accumulation (call optimizer.zero_grad() between steps)"
            )

    def _record_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if len(x) == 0:
            with torch.no_grad():
                return self._module(x), None
        return self._hooked_forward(x)

    def _backward_recorded(
        self, x: torch.Tensor, y: torch.Tensor, state: Any, loss: torch.Tensor, criterion: Any
    ) -> None:
        self._check_accumulation()
        if len(x) == 0:
            self.pending.append([])
            return
        self._record_factors(x, state, loss)

    def _hooked_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The forward pass with hooks keeping each trainable layer's input and output."""
        layers = self._trainable_layers()
        seen: dict[nn.Module, list[tuple[torch.Tensor, int, torch.Tensor, int]]] = {}

        def keep(layer: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            a = inputs[0].detach()
            seen.setdefault(layer, []).append((a, a._version, output, output._version))

        handles = [layer.register_forward_hook(keep) for _, layer in layers]
        try:
            result = self._module(x)
        finally:
            for handle in handles:
                handle.remove()
        for name, layer in layers:
            if layer not in seen:  # Opacus refuses it too (no grad_sample for its parameters)
                raise ValueError(
                    f"engine='factored': layer {name!r} has trainable parameters but did not "
                    "run in the forward pass (or its weights were used outside it); freeze "
                    "them (requires_grad=False) or use engine='func'"
                )
        for name, layer in layers:
            if len(seen[layer]) > 1:
                raise ValueError(
                    f"engine='factored': layer {name!r} ran {len(seen[layer])} times in one "
                    "forward pass; expected once (its per-sample gradient is a sum of uses)"
                )
            activations, _, output, version = seen[layer][0]
            if activations.shape[:1] != x.shape[:1] or output.shape[:1] != x.shape[:1]:
                raise ValueError(
                    f"engine='factored': layer {name!r} saw input {tuple(activations.shape)} "
                    f"and output {tuple(output.shape)} for a batch of {len(x)}: expected the "
                    "examples along the first dimension"
                )
            if output._version != version:
                raise ValueError(
                    f"engine='factored': the output of layer {name!r} was modified in place "
                    "by a later layer (inplace=True?); expected an out-of-place activation"
                )
        return result, (layers, seen)

    def _record_factors(self, x: torch.Tensor, state: Any, loss: torch.Tensor) -> None:
        """The backpropagations of ``loss`` at the recorded layer outputs, kept as factors."""
        layers, seen = state
        outputs = [seen[layer][0][2] for _, layer in layers]
        # Each example's own loss gradient: a mean-reduced loss times B (Opacus's scaling).
        total = loss * len(x) if self.loss_reduction == "mean" else loss
        backprops = torch.autograd.grad(total, outputs) if outputs else ()
        factors = []
        for (name, layer), b in zip(layers, backprops, strict=True):
            weight = getattr(layer, "weight", None)
            bias = getattr(layer, "bias", None)
            factors.append(
                LayerFactors(
                    name=name,
                    layer=layer,
                    weight=weight if weight is not None and weight.requires_grad else None,
                    bias=bias if bias is not None and bias.requires_grad else None,
                    activations=seen[layer][0][0],
                    backprops=b,
                    version=seen[layer][0][1],
                )
            )
        self.pending.append(factors)


class FactoredDPOptimizer(SparseDPOptimizer):
    """``SparseDPOptimizer`` whose per-sample gradients are a ``FactoredGradSampleModule``'s.

    ``clip_and_accumulate`` computes the masked norms and the clipped sum from the module's
    factors (module docstring); noise, scaling, the accountant hook and skipped steps are
    ``SparseDPOptimizer``'s and Opacus's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        super().__init__(optimizer, **kwargs)
        self.source: FactoredGradSampleModule | None = None
        self._iterations = 0

    def attach(self, source: FactoredGradSampleModule) -> None:
        """The module whose ``backward_per_sample`` feeds this optimizer's steps."""
        self.source = source

    @property
    def accumulated_iterations(self) -> int:
        """Batches recorded since the last ``zero_grad`` (Opacus: per-sample grad lists)."""
        return self._iterations

    def clip_and_accumulate(self) -> None:
        """Sparsify, clip each example's gradient on its masked norm, sum into ``summed_grad``.

        Without autograd: the recorded layer inputs are part of the forward graph, and sums
        built from them would carry it into ``p.grad`` (memory held until the next step, and
        ``zero_grad(set_to_none=False)`` -- Opacus's and torch's default -- fails on such a
        gradient: "Can't detach views in-place")."""
        with torch.no_grad():
            self._clip_and_accumulate()

    def _clip_and_accumulate(self) -> None:
        if self.source is None:
            raise RuntimeError("FactoredDPOptimizer: attach(module) before the first step")
        batches = self.source.pending
        if not batches:
            raise ValueError(
                "no per-sample gradients for this step: call module.backward_per_sample(...) "
                "after optimizer.zero_grad() (or the step has already consumed them)"
            )
        self.source.pending = []
        self._iterations = len(batches)
        masks = self._noise_mask
        for layers in batches:
            sums = self._clipped_sum(layers, masks)
            for p in self.params:
                grad = sums.get(p)
                if grad is None and layers:
                    raise ValueError(
                        f"a trainable parameter of shape {tuple(p.shape)} is not the weight or "
                        "bias of a layer the module ran: the factored engine gives it no "
                        "per-sample gradient (freeze it, or use engine='opacus')"
                    )
                if grad is None:  # an empty batch: a zero sum (the noise comes next)
                    grad = torch.zeros_like(p)
                if p.summed_grad is not None:
                    p.summed_grad += grad
                else:
                    p.summed_grad = grad

    def _clipped_sum(
        self, layers: list[LayerFactors], masks: dict[nn.Parameter, torch.Tensor]
    ) -> dict[nn.Parameter, torch.Tensor]:
        if not layers:  # an empty batch: a zero sum (the noise comes next)
            return {}
        prepared = [f.prepare(masks) for f in layers]
        norms_sq = torch.stack([p.norms_sq for p in prepared]).sum(0)
        if self.clip_per_sample:
            factor = (self.max_grad_norm / (norms_sq.sqrt() + 1e-6)).clamp(max=1.0)
        else:
            factor = torch.ones_like(norms_sq)
        # A non-finite (masked) norm: the example contributes exactly zero, by the same
        # operations whatever the data (``dp``'s docstring).
        factor = torch.where(torch.isfinite(norms_sq), factor, 0.0)
        sums: dict[nn.Parameter, torch.Tensor] = {}
        for p in prepared:
            sums.update(p.clipped_sums(factor))
        return sums

    def pre_step(self, closure: Callable[[], float] | None = None) -> bool:
        """Opacus's ``pre_step`` without its ``p.grad_sample`` look-up."""
        if len(self.params) == 0:
            return True
        self.clip_and_accumulate()
        if self._check_skip_next_step():
            self._is_last_step_skipped = True
            return False
        self.add_noise()
        self.scale_grad()
        if self.step_hook:
            self.step_hook(self)
        self._is_last_step_skipped = False
        return True

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Opacus's ``zero_grad``; also drops factors recorded and not yet stepped on."""
        if self.source is not None:
            self.source.pending = []
        self._iterations = 0
        super().zero_grad(set_to_none)


class FactoredDPEngine(SparseDPEngine):
    """``SparseDPEngine`` with factored per-sample gradients (module docstring).

    ``make_private`` takes and returns what ``SparseDPEngine.make_private`` does; the module
    it returns is a ``FactoredGradSampleModule``, trained with ``backward_per_sample`` in
    place of ``loss.backward()`` (the loop of ``func_dp.FuncDPEngine``'s docstring), or, with
    ``criterion=`` and ``grad_sample_mode="ghost"``, with Opacus's own loop through the
    criterion it returns (``dp.PerSampleCriterion``; the same forward pass, no extra one).
    """

    optimizer_class = FactoredDPOptimizer
    per_sample_criterion = True

    def _prepare_model(
        self,
        module: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
        **kwargs: Any,
    ) -> FactoredGradSampleModule:
        check_own_wrapping(
            "FactoredDPEngine",
            batch_first=batch_first,
            wrap_model=wrap_model,
            grad_sample_mode=grad_sample_mode,
        )
        if isinstance(module, FactoredGradSampleModule):
            if module.loss_reduction != loss_reduction:
                raise ValueError(
                    f"loss_reduction={loss_reduction!r}: the module was wrapped with "
                    f"{module.loss_reduction!r}"
                )
            return module
        return FactoredGradSampleModule(module, loss_reduction=loss_reduction)

    def make_private(self, *, module: nn.Module, noise_multiplier: float, **kwargs: Any) -> Any:
        """Opacus's ``make_private``; returns ``(module, optimizer, data_loader)``, or with
        ``grad_sample_mode="ghost"`` (func and factored engines) ``(module, optimizer,
        criterion, data_loader)`` (``PerSampleCriterion``)."""
        result = super().make_private(module=module, noise_multiplier=noise_multiplier, **kwargs)
        wrapped, optimizer = result[0], result[1]
        optimizer.attach(wrapped)
        return result
