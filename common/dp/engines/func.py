"""DP-SGD + RS with per-sample gradients from ``torch.func`` instead of Opacus's hooks.

``FuncDPEngine`` is ``dp.SparseDPEngine`` with one part replaced: the per-sample gradients.
Opacus's hooks engine computes them layer by layer from captured activations and
backpropagations, in a backward pass that also computes (and then discards) the summed
gradient. Here one call of ``torch.func.vmap(torch.func.grad(loss_i))`` over
``functional_call`` computes ``g_i = grad l_i(theta)`` for every example ``i`` of the batch,
and nothing else. Everything after that is the same object as in ``dp``: the
``SparseDPOptimizer`` runs the step in the order of ``dp``'s docstring,

    sparsify ``m * g_i`` -> clip on the masked norms -> sum -> noise ``m * N(0, sigma^2 C^2)``
    -> scale by ``1 / B`` (Opacus's expected batch size),

the ablations (``mechanism="clipped"``/``"noisy"``) included; Opacus's ``make_private`` builds
the Poisson data loader (the same sampler, so the same batches for the same generator), the
noise generator and the accountant's step hook. The privacy argument of ``dp`` therefore
holds unchanged, and with the same ``q``, ``sigma`` and steps ``get_epsilon`` is the same;
so does ``dp``'s rule that an example whose (masked) per-sample gradient is not finite
contributes exactly zero (``vmap`` keeps each example's NaN or inf in its own row).

Equivalence with the Opacus engine. Batches, masks and noise are identical draws. The
per-sample gradients agree to float32 rounding, not bit for bit: Opacus scales the
backpropagated gradient of the batch-mean loss by ``B`` and forms convolution gradients as
``unfold`` + ``einsum``, while here each example's own loss is differentiated and the
convolution's weight gradient comes from ATen's convolution backward; the sums run in other
orders. The difference is a few ulps per step and grows only as the training dynamics
amplify it (``tests/common/dp/test_func_dp.py`` pins the tolerance after an epoch).

Layers. ``vmap`` runs the model on one example at a time (``batch of 1``), so a layer whose
output for one example depends on the others (``BatchNorm`` in training mode, which Opacus
refuses too) has no per-sample gradient, and a layer that draws randomness per example
(``Dropout``) cannot run under ``vmap``'s default ``randomness="error"``; both are refused
with an error that names the layer (``func_support_error``). Every model of
``models.MODEL_NAMES`` is supported.

Speed (``engines.select_engine`` picks the engine under ``"auto"``): on 2 CPU threads (DP-CNN,
batch 256, ``benchmarks/engine.py``) the func engine ran at 0.54x of non-private SGD's
throughput with glibc's default allocator and 0.78x with freed buffers retained, against
Opacus's 0.28x and 0.56x; the factored engine (``factored_dp``) matched or beat it on every
model and batch measured there, so ``"auto"`` takes the factored engine on the CPU. CUDA
keeps the func engine under ``"auto"``, on the strength of per-sample gradients as batched
cuDNN kernels with no hooks and no discarded summed gradient, not of a measurement.

References:
    P. Subramani, N. Vadivelu, G. Kamath. "Enabling Fast Differentially Private SGD via
    Just-in-Time Compilation and Vectorization". NeurIPS 2021. arXiv:2010.09063 (per-sample
    gradients by vectorizing the per-example gradient function, as ``vmap(grad)`` does here).
    J. Zhu, M. Blaschko. "Improving Differentially Private SGD via Randomly Sparsified
    Gradients". TMLR 2023. arXiv:2112.00845 (the RS mechanism, ``dp``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch
from opacus.validators.errors import UnsupportedModuleError
from torch import nn
from torch.func import functional_call, grad, vmap

from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.dp.per_sample import PerSampleModule, check_own_wrapping

__all__ = [
    "FuncDPEngine",
    "FuncGradSampleModule",
    "func_support_error",
]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: Layers whose output for one example depends on the rest of the batch (in training mode).
_MIXING: Final = (nn.modules.batchnorm._BatchNorm,)
#: Layers that draw randomness per example (``vmap(randomness="error")`` refuses them).
_RANDOM: Final = (nn.modules.dropout._DropoutNd, nn.AlphaDropout, nn.FeatureAlphaDropout)


def func_support_error(module: nn.Module) -> str | None:
    """Why the func engine cannot train ``module`` (naming the first such layer), or None."""
    for name, layer in module.named_modules():
        kind = type(layer).__name__
        if isinstance(layer, _MIXING):
            return (
                f"engine='func': layer {name!r} ({kind}) mixes the examples of a batch, so it "
                "has no per-sample gradient; expected a model without batch statistics "
                "(GroupNorm instead of BatchNorm)"
            )
        if isinstance(layer, _RANDOM):
            return (
                f"engine='func': layer {name!r} ({kind}) draws randomness per example, which "
                "torch.func.vmap does not run; use engine='opacus'"
            )
        norm = isinstance(layer, nn.modules.instancenorm._InstanceNorm)
        if norm and layer.track_running_stats:
            return (
                f"engine='func': layer {name!r} ({kind}) updates running statistics in place "
                "under vmap; expected track_running_stats=False"
            )
    return None


class FuncGradSampleModule(PerSampleModule):
    """Wraps a module; ``backward_per_sample`` stores ``p.grad_sample`` like Opacus's hooks.

    The forward pass is the wrapped module's own (evaluation, ``module(x)``). Training calls
    ``backward_per_sample(x, y, criterion=...)`` instead of ``criterion(module(x), y)
    .backward()``: it sets, for every trainable parameter ``p``, ``p.grad_sample[i]`` =
    gradient of ``criterion`` on example ``i`` alone (Opacus's convention for either loss
    reduction), which ``SparseDPOptimizer.step`` then sparsifies, clips, sums and noises. The
    wrapped module is ``_module``, Opacus's name, so parameter names unwrap alike.
    """

    def __init__(self, module: nn.Module) -> None:
        error = func_support_error(module)
        if error is not None:
            raise UnsupportedModuleError(error)  # a ValueError, as Opacus's validator raises
        super().__init__(module)

    def backward_per_sample(
        self, x: torch.Tensor, y: torch.Tensor, *, criterion: Loss
    ) -> torch.Tensor:
        """Per-sample gradients of ``criterion(module(x_i), y_i)`` into ``p.grad_sample``.

        Args:
            x: a batch of inputs (first dimension: examples; may be empty).
            y: the matching targets.
            criterion: the loss of a batch of one example (e.g. ``nn.CrossEntropyLoss()``).

        Returns:
            The mean loss over the batch (detached; NaN for an empty batch), for reporting.

        Raises:
            ValueError: per-sample gradients are already stored and accumulation is forbidden.
        """
        named = dict(self._module.named_parameters())
        trainable = {n: p for n, p in named.items() if p.requires_grad}
        params = {n: p.detach() for n, p in trainable.items()}
        fixed = {n: p.detach() for n, p in named.items() if not p.requires_grad}
        fixed.update(dict(self._module.named_buffers()))

        def example_loss(
            theta: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            out = functional_call(self._module, (theta, fixed), (xi.unsqueeze(0),))
            loss = criterion(out, yi.unsqueeze(0))
            return loss, loss.detach()

        per_sample = vmap(grad(example_loss, has_aux=True), in_dims=(None, 0, 0))
        grads, losses = per_sample(params, x, y)
        for name, p in trainable.items():
            self._store(p, grads[name])
        return losses.mean()

    def _record_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        # The output only reports the loss: vmap recomputes each example's forward pass.
        with torch.no_grad():
            return self._module(x), None

    def _backward_recorded(
        self, x: torch.Tensor, y: torch.Tensor, state: Any, loss: torch.Tensor, criterion: Any
    ) -> None:
        self.backward_per_sample(x, y, criterion=criterion)

    def _store(self, p: nn.Parameter, grad_sample: torch.Tensor) -> None:
        previous = getattr(p, "grad_sample", None)
        if previous is None:
            p.grad_sample = grad_sample  # type: ignore[attr-defined]
            return
        if not self._accumulation_allowed:
            raise ValueError(
                "per-sample gradients of two batches before one step: Poisson sampling forbids "
                "gradient accumulation (call optimizer.zero_grad() between steps)"
            )
        stored = previous if isinstance(previous, list) else [previous]
        p.grad_sample = [*stored, grad_sample]  # type: ignore[attr-defined]


class FuncDPEngine(SparseDPEngine):
    """``SparseDPEngine`` whose per-sample gradients come from ``torch.func`` (module doc).

    ``make_private`` takes and returns what ``SparseDPEngine.make_private`` does; the module
    it returns is a ``FuncGradSampleModule``, trained with ``backward_per_sample``::

        engine = FuncDPEngine(accountant="rdp")
        module, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0)
        engine.set_mask(mask)
        for x, y in loader:
            optimizer.zero_grad()
            module.backward_per_sample(x, y, criterion=nn.CrossEntropyLoss())
            optimizer.step()

    With ``criterion=`` and ``grad_sample_mode="ghost"`` it returns ``(module, optimizer,
    criterion, loader)`` and Opacus's loop, ``criterion(module(x), y).backward()``, does the
    same (``dp.PerSampleCriterion``; one extra forward pass per step, for the loss it reports).
    """

    per_sample_criterion = True

    def _prepare_model(
        self,
        module: nn.Module,
        *,
        batch_first: bool = True,
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
        **kwargs: Any,
    ) -> FuncGradSampleModule:
        check_own_wrapping(
            "FuncDPEngine",
            batch_first=batch_first,
            wrap_model=wrap_model,
            grad_sample_mode=grad_sample_mode,
        )
        if isinstance(module, FuncGradSampleModule):
            return module
        return FuncGradSampleModule(module)
