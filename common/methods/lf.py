"""``lf``: DP-SGD with layer freezing (DPSGD-LF, Algorithm 1).

Plain DP-SGD until step ``t_f`` (``freeze-after``), then the first ``m_f`` layers
(``freeze-layers``, closest to the input) are frozen: their gradients are zeroed before
clipping and get no noise, so they move by exactly 0. The sparsification rate does not apply.
A layer is a module that owns parameters (a convolution's weight and bias are one layer), in
``named_parameters()`` order (``selection.layer_ranges``). The frozen layers are a prefix of
the flat coordinates, ``[0, s)``: in the federation a client sends the values of ``[s, d)``
only, as a dense vector of ``d - s`` values, so the frozen layers cost no uplink byte.

Steps are 0-based: epoch ``e`` in ``0..E-1``, or round ``r - 1``; ``lf`` freezes from step
``t_f`` on (``t > t_f`` in the paper's 1-based count).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from fedsparse.common.methods.base import EpochContext, Method, RoundPlan
from fedsparse.common.methods.selection import frozen_prefix, suffix_mask
from fedsparse.common.wire.protocol import ProtocolError, TrainInstruction

if TYPE_CHECKING:
    from fedsparse.common.layout import ParamLayout
    from fedsparse.common.methods.schedules import RateSchedule

__all__ = ["LayerFreezing"]


class LayerFreezing(Method):
    """``lf``: the first ``freeze-layers`` layers frozen from step ``freeze-after`` on."""

    name: ClassVar[str] = "lf"

    def frozen(self, layout: ParamLayout, step: int) -> int:
        """``s``: the frozen coordinate prefix at 0-based ``step`` (0: nothing frozen).

        Raises:
            ValueError: ``freeze-layers`` leaves no layer to train (``frozen_prefix``).
        """
        s = frozen_prefix(layout, self.config.freeze_layers)
        return s if step >= self.config.freeze_after else 0

    def check_layout(self, layout: ParamLayout) -> None:
        """Raises ``ValueError`` if the model has too few layers to freeze ``m_f``."""
        frozen_prefix(layout, self.config.freeze_layers)

    def frozen_prefix(self, layout: ParamLayout) -> int:
        """The coordinates of the first ``freeze-layers`` layers (a bad count fails here)."""
        return frozen_prefix(layout, self.config.freeze_layers)

    def accept_frozen_prefix(self, frozen_prefix: int, numel: int) -> int:
        """``frozen_prefix``, which must leave something frozen and something to train.

        Raises:
            ValueError: not ``0 < s < d``.
        """
        if not 0 < frozen_prefix < numel:
            raise ValueError(
                f"frozen_prefix={frozen_prefix}: method='lf' needs 0 < s < d={numel} "
                "(common/methods/selection.py: frozen_prefix)"
            )
        return frozen_prefix

    def frozen_at(self, step: int, frozen_prefix: int) -> int:
        """``frozen_prefix`` from step ``freeze-after`` on, else 0."""
        return frozen_prefix if step >= self.config.freeze_after else 0

    def plan_round(
        self,
        *,
        server_round: int,
        weights: torch.Tensor,
        schedule: RateSchedule,
        frozen: int,
        layout: ParamLayout | None,
        seed: int,
    ) -> RoundPlan:
        """No random mask: the frozen layers are dropped, nothing else."""
        d = weights.numel()
        return RoundPlan(rate=frozen / d, keep=d - frozen, frozen=frozen)

    def client_frozen(self, task: TrainInstruction, layout: ParamLayout) -> int:
        """The frozen prefix this round; the instruction's ``keep`` must be ``d - s``.

        Raises:
            ProtocolError: another ``keep``, or a model with too few layers.
        """
        try:
            frozen = self.frozen(layout, task.server_round - 1)
        except ValueError as err:
            raise ProtocolError(f"run config: {err}") from None
        if task.keep != layout.numel - frozen:
            raise ProtocolError(
                f"train instruction: keep={task.keep}: expected {layout.numel - frozen} "
                f"(method='lf', freeze-layers={self.config.freeze_layers}, "
                f"freeze-after={self.config.freeze_after}, round {task.server_round})"
            )
        return frozen

    def epoch_mask(self, ctx: EpochContext) -> tuple[float, torch.Tensor | None, bool]:
        """``[s, d)`` from epoch ``freeze-after`` on; the frozen layers' momentum cleared."""
        numel = ctx.layout.numel
        frozen = self.frozen(ctx.layout, ctx.epoch)
        return frozen / numel, suffix_mask(numel, frozen), True
